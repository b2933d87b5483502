"""Paged latent decode (absorbed MQA) with split-KV: the dispatch.

Stage 1 takes BLOCK_H query rows of a request per program and one slice of its
positions (a split), and writes the request's output where it is one split, float32
partials and their lse where it is cut in several; stage 2 (`combine`) folds the
partials of each (token, head) by log-sum-exp. Stage 1 is the portable Triton kernel
(`decode_triton`) or, on a Hopper GPU, a warp-specialized Gluon kernel that supports the
call (the decode table of `selection`): `decode_hopper` for at most 16 query rows per
request (the memory-bound regime; `decode_hopper_fp8` with an fp8 cache, up to 32 rows
in two head groups), `decode_hopper_heads` for more (64 rows per program). A producer
warp streams the tiles while warpgroups compute, which plain Triton's software pipeline
cannot express (see those modules).

How each request is cut into splits (split-KV) is planned on the device from the
actual lengths (`split_plan`): one tiny kernel, no value read back, so a decode step never
synchronises and can be captured in a CUDA graph, and the plan follows the lengths of
every replay. Stage 1's grid is (head groups, programs), each program's splits given by
the plan; a request left whole gets its final output from stage 1, and the combine
skips it.
"""

from __future__ import annotations

import torch

from pagedmla.ops.triton import combine
from pagedmla.ops.triton._utils import (
    GRID_YZ_MAX,
    cdiv,
    check_cache_rows,
    check_device,
    last_dim_contiguous,
    multiprocessor_count,
)
from pagedmla.ops.triton.decode_triton import DecodeConfig, pick_config, quantized
from pagedmla.ops.triton.selection import decode_kernel, triton_decode_kernel
from pagedmla.ops.triton.split_plan import plan_splits
from pagedmla.validation import positive_finite


def mla_decode(
    q: torch.Tensor,
    data: torch.Tensor,
    scale: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    kv_lora_rank: int,
    softmax_scale: float,
    *,
    num_splits: int | None = None,
    config: DecodeConfig | None = None,
    plans: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MQA over the paged latent cache (as `reference.mla_decode`).

    q [T, N, L + R]; data [num_blocks, block_size, L + R] (q's dtype or fp8, scaled by
    `scale` [] float32 in the kernel: finite and positive, as `LatentKVCache` makes it
    and the 64-row kernel's softmax needs; a device value, so not checked here, which
    would cost a host sync), or an fp8_ds_mla cache, uint8 [num_blocks, block_size,
    656] with L = 512, R = 64 (`scale` unused); block_table int32 [B, max_blocks]; seq_lens int32
    [B]; query_start_loc int32 [B + 1]. Token i of request b sees positions
    < seq_lens[b] - q_len_b + i + 1. Returns out [T, N, L] (q dtype), lse [N, T] float32.

    max_query_len / max_seq_len are host ints bounding the batch: they size the grid
    and must not be smaller than the true values (for CUDA graphs pass the largest
    seq_len the graph will see, e.g. the model's max length). The split plan is made on
    the device from seq_lens (`split_plan`); `plans`, a dict the caller keeps for calls
    on the same seq_lens contents (the layers of one forward), holds it so that it is
    made once; a CUDA graph captured with the plan already in `plans` reads the plan's
    tensors at every replay, so the dict must outlive the graph. Stage 1 is the first
    kernel of the decode table (`selection`) that supports the call; `config` runs the
    portable Triton kernel with those launch parameters instead, and num_splits (splits
    of the longest request) overrides the plan (tuning, tests).
    """
    check_device(q, data)
    # (Positive: the 64-row kernel scales row maxima.)
    softmax_scale = positive_finite("softmax_scale", softmax_scale)
    num_tokens, num_heads, width = q.shape
    L = kv_lora_rank
    check_cache_rows(data, L, width)
    if data.shape[0] * data.shape[1] == 0:  # (nor could the copy engine describe it)
        raise ValueError(f"data: a cache of shape {tuple(data.shape)} holds no position")
    num_reqs = seq_lens.shape[0]
    out = torch.empty(num_tokens, num_heads, L, dtype=q.dtype, device=q.device)
    lse = torch.empty(num_heads, num_tokens, dtype=torch.float32, device=q.device)
    if num_tokens == 0 or num_reqs == 0 or max_query_len <= 0:
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    q = last_dim_contiguous(q)
    data = last_dim_contiguous(data)

    # Query rows per request (token x N + head): what stage 1's programs split in groups.
    rows_per_req = num_heads * max_query_len
    # The regime's config bounds the split plan whichever kernel runs; `config` runs the
    # portable kernel with it.
    cfg = config or pick_config(rows_per_req, q.dtype, quantized(data))
    kernel = (triton_decode_kernel(config, rows_per_req) if config is not None
              else decode_kernel(q, data, rows_per_req, L, cfg))
    # Splits are whole tiles of the kernel that runs.
    block_h, block_n = kernel.block_h, kernel.block_n
    head_groups = cdiv(rows_per_req, block_h)
    num_sms = multiprocessor_count(q.device)
    slots = num_sms * cfg.programs_per_sm
    min_chunk = cfg.min_chunk_for(num_reqs)
    persistent = kernel.persistent
    past_wave_tiles, tail_wave = kernel.past_wave_tiles, kernel.tail_wave
    key = (seq_lens.data_ptr(), num_reqs, head_groups, max_seq_len, slots, block_n,
           min_chunk, block_h, num_splits, persistent, past_wave_tiles, tail_wave)
    plan = plans.get(key) if plans is not None else None
    if plan is None:
        plan = plan_splits(seq_lens, query_start_loc, head_groups, max_seq_len, slots,
                           block_n, min_chunk, block_h, num_splits, persistent, past_wave_tiles,
                           tail_wave)
        if plans is not None:
            plans[key] = plan
    if plan.programs > GRID_YZ_MAX:  # stage 1's splits are its grid's second axis
        raise ValueError(f"seq_lens: a batch of {num_reqs} requests takes {plan.programs} "
                         f"stage-1 programs, more than the {GRID_YZ_MAX} a launch allows; "
                         "split the batch")
    # Partials of cut requests [token, head, split, ..]: a row's splits are adjacent, so
    # the combine reads each row's in one contiguous stretch.
    cut = plan.max_splits > 1
    part_out = (torch.empty(max_query_len, num_heads, plan.rows, L, dtype=torch.float32,
                            device=q.device) if cut else out)
    part_lse = (torch.empty(max_query_len, num_heads, plan.rows, dtype=torch.float32,
                            device=q.device) if cut else lse)
    kernel.launch(q, data, scale, block_table, plan, out, lse, part_out, part_lse,
                  head_groups, softmax_scale, L)
    if not cut:
        return out, lse
    # A kernel with pdl lets the combine launch once its tiles are done (programmatic
    # dependent launch); the combine waits for stage 1 before reading the partials.
    combine.combine_splits(part_out, part_lse, plan, out, lse, rows_per_req, L, num_sms,
                           pdl=kernel.pdl)
    return out, lse

"""The lightning indexer's scores and top-k on the GPU (`ops/reference_indexer.py` is the
specification: cache layouts, causal rule, query preparation for the fp8 cache).

Two steps per chunk of query rows:

* `indexer_logits`: one kernel writes logits [rows, P] float32, P = block_table.shape[1]
  x block_size (a shape, so that a CUDA graph captured once stays right as seq_lens
  grow): logits[t, s] = sum_h w[t, h] relu(q[t, h] . k[s]) where token t sees position
  s, -inf elsewhere. A program takes up to `block_m` query tokens of one request (their
  [block_m x H, D] queries are one dot operand) and a span of key positions, which it
  walks in tiles of `block_n` keys read through the request's block table; tiles past
  the tokens' visible count are only filled with -inf (never read). The fp8 cache
  multiplies e4m3 codes (queries rotated and rounded as the reference's
  `prepare_queries`, their per-(token, head) scales folded into the weights, as DeepSeek
  does) and scales each key's sum by its own scale after the ReLU and the head sum (both
  scales are positive, so this is the same number). The float cache multiplies in its
  dtype (IEEE float32 for float32), accumulating in float32.
* `torch.topk` over each row; a -inf pick (fewer than topk visible positions) becomes
  -1.

Result contract as `reference_indexer.indexer_topk` (int32 [T, topk], -1 past a token's
visible count), but for order: a row's positions come in any order (the -1 entries
anywhere in it), and equal scores may pick other positions than the reference's
lowest-position-first rule.

Memory: query rows are processed in chunks of max(1, budget // P) rows, so logits never
hold more than `budget` float32 values (one row at least) whatever the context; a decode
batch fits in one chunk. Nothing reads a device value on the host (the token -> request
map is computed per program from query_start_loc): graph-safe.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedmla.ops.reference_indexer import (
    LOGITS_BUDGET,
    cache_head_dim,
    fp8_cache_views,
    hadamard_rotate,
    is_fp8_cache,
    quantize_rows,
)
from pagedmla.ops.triton._utils import (
    cdiv,
    check_device,
    dot_precision,
    last_dim_contiguous,
    multiprocessor_count,
    next_pow2,
)
from pagedmla.ops.triton.fp8_quant import fp8_dot_runs

# Programs per multiprocessor the key spans aim for before a program takes more tiles.
_WAVES = 4
_MAX_TILES = 8


@dataclass(frozen=True)
class LogitsConfig:
    """Launch parameters of the logits kernel: block_m query tokens (of one request) per
    program, block_n key positions per tile, at most max_tiles tiles per program (fewer
    where the grid would not fill the GPU `_WAVES` times over); swap_ab: the scores'
    product as keys x queries (`_head_sums`)."""

    block_m: int
    block_n: int
    max_tiles: int
    num_warps: int
    num_stages: int
    swap_ab: bool = True


def pick_config(num_tokens: int, num_reqs: int, num_heads: int) -> LogitsConfig:
    """Decode (at most two tokens per request on average: a request's tokens share one
    read of its keys) or prefill (block_m x heads = 128 product columns, 64-key tiles,
    which keep the kernel near 110 registers a thread on sm_90)."""
    block_h = max(16, next_pow2(num_heads))
    tokens_per_128 = max(1, 128 // block_h)
    per_req = cdiv(num_tokens, max(num_reqs, 1))
    if per_req <= 2:
        return LogitsConfig(min(next_pow2(per_req), tokens_per_128), 128, _MAX_TILES, 8, 3)
    return LogitsConfig(tokens_per_128, 64, _MAX_TILES, 8, 3)


@triton.jit
def _token_block(qsl_ptr, num_reqs, row_start, row_end, block,
                 BLOCK_M: tl.constexpr, REQS: tl.constexpr):
    """The block-th (request, run of <= BLOCK_M consecutive tokens) of the rows row_start
    .. row_end - 1, requests in order: (request, first token, end token), end == first
    past the last block. O(requests) per program, no host sync."""
    b = tl.arange(0, REQS)
    ok = b < num_reqs
    lo = tl.load(qsl_ptr + b, mask=ok, other=0)
    hi = tl.load(qsl_ptr + b + 1, mask=ok, other=0)
    lo = tl.minimum(tl.maximum(lo, row_start), row_end)
    hi = tl.minimum(tl.maximum(hi, lo), row_end)
    blocks = tl.where(ok, (hi - lo + BLOCK_M - 1) // BLOCK_M, 0)
    ends = tl.cumsum(blocks, 0)
    req = tl.sum((ends <= block).to(tl.int32), 0)  # first request whose blocks pass it
    mine = b == req
    first = tl.sum(tl.where(mine, lo + (block - (ends - blocks)) * BLOCK_M, 0), 0)
    last = tl.minimum(first + BLOCK_M, tl.sum(tl.where(mine, hi, 0), 0))
    req = tl.minimum(req, num_reqs - 1)
    return req, first, tl.where(block < tl.max(ends, 0), last, first)


@triton.jit
def _head_sums(q, k, w, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SWAP_AB: tl.constexpr):
    """[BLOCK_M, BLOCK_N]: sum_h w[m, h] relu(q[m, h] . k[n]) for q [BLOCK_M x BLOCK_H,
    D] (token-major rows), k [BLOCK_N, D], w [BLOCK_M x BLOCK_H]. SWAP_AB: the product
    as k q^T, keys on the MMA's rows, so that the head sum runs along each thread's
    columns (and a quad's shuffles) rather than across warps."""
    if SWAP_AB:
        s = tl.dot(k, tl.trans(q), input_precision=PRECISION)
        s = tl.maximum(s, 0.0, propagate_nan=tl.PropagateNan.ALL) * w[None, :]
        if BLOCK_M == 1:
            return tl.sum(s, 1)[None, :]
        return tl.trans(tl.sum(tl.reshape(s, (BLOCK_N, BLOCK_M, BLOCK_H)), 2))
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    s = tl.maximum(s, 0.0, propagate_nan=tl.PropagateNan.ALL) * w[:, None]
    if BLOCK_M == 1:
        return tl.sum(s, 0)[None, :]
    return tl.sum(tl.reshape(s, (BLOCK_M, BLOCK_H, BLOCK_N)), 1)


@triton.jit(  # batch-dependent: no variant per value (engine/warmup.py)
    do_not_specialize=["num_reqs", "row_start", "row_end", "num_positions", "span", "stride_bt",
                       "stride_ot"],
    do_not_specialize_on_alignment=["table_ptr", "seq_lens_ptr", "qsl_ptr"])
def _logits_kernel(
    q_ptr, w_ptr, keys_ptr, scales_ptr, table_ptr, seq_lens_ptr, qsl_ptr, out_ptr,
    num_reqs, row_start, row_end, num_positions, span, num_heads,
    stride_qt, stride_qh, stride_wt, stride_kb, stride_kp, stride_sb, stride_bt, stride_ot,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, FP8: tl.constexpr, FP8_DOT: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SWAP_AB: tl.constexpr,
    REQS: tl.constexpr,
):
    """Logits of one token block (program_id(0), `_token_block`) over the key span
    program_id(1): rows t - row_start of out [rows, num_positions] (row stride
    stride_ot), q and w indexed from row_start too. FP8: keys are e4m3 codes with one
    float32 scale per position (scales_ptr); otherwise keys in q's dtype."""
    req, t0, t1 = _token_block(qsl_ptr, num_reqs, row_start, row_end, tl.program_id(0),
                               BLOCK_M, REQS)
    tok = t0 + tl.arange(0, BLOCK_M)
    tok_ok = tok < t1
    # Bottom-right causal: token t of a request sees seq_len - (q_end - t) + 1 positions.
    q_end = tl.load(qsl_ptr + req + 1)
    visible = tl.load(seq_lens_ptr + req) - (q_end - tok) + 1
    visible = tl.minimum(tl.where(tok_ok, visible, 0), num_positions)
    last_seen = tl.max(visible, 0)
    span_lo = tl.program_id(1) * span
    span_hi = tl.where(t1 > t0, tl.minimum(span_lo + span, num_positions), span_lo)
    work_hi = tl.maximum(tl.minimum(span_hi, last_seen), span_lo)

    # -- the block's queries [BLOCK_M x BLOCK_H, BLOCK_D] and head weights --
    rows = tl.arange(0, BLOCK_M * BLOCK_H)
    row_tok = t0 + rows // BLOCK_H
    head = rows % BLOCK_H
    row_ok = (row_tok < t1) & (head < num_heads)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM  # all true (no mask, full-width vector loads) for D = BLOCK_D
    local = (row_tok - row_start).to(tl.int64)
    q = tl.load(q_ptr + local[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    w = tl.load(w_ptr + local * stride_wt + head, mask=row_ok, other=0.0)
    if FP8 and not FP8_DOT:
        q = q.to(tl.float16)  # e4m3 is exact in float16

    table_row = table_ptr + req.to(tl.int64) * stride_bt
    out_rows = out_ptr + (tok - row_start).to(tl.int64)[:, None] * stride_ot
    n = tl.arange(0, BLOCK_N)
    for start in range(span_lo, work_hi, BLOCK_N):
        # -- gather the tile's keys through the block table (only positions seen) --
        pos = start + n
        pos_ok = pos < last_seen
        page = tl.load(table_row + pos // PAGE, mask=pos_ok, other=0).to(tl.int64)
        offset = pos % PAGE
        keys = keys_ptr + page[:, None] * stride_kb + offset[:, None] * stride_kp + d[None, :]
        if BLOCK_D == HEAD_DIM:
            k = tl.load(keys, mask=pos_ok[:, None], other=0.0)
        else:
            k = tl.load(keys, mask=pos_ok[:, None] & d_ok[None, :], other=0.0)
        # -- weighted ReLU scores, summed over heads --
        if FP8 and not FP8_DOT:
            k = k.to(tl.float16)
        logits = _head_sums(q, k, w, PRECISION, BLOCK_M, BLOCK_H, BLOCK_N, SWAP_AB)
        if FP8:
            logits = logits * tl.load(scales_ptr + page * stride_sb + offset, mask=pos_ok,
                                      other=0.0)[None, :]
        logits = tl.where(pos[None, :] < visible[:, None], logits, float("-inf"))
        tl.store(out_rows + pos[None, :], logits,
                 mask=tok_ok[:, None] & (pos[None, :] < span_hi))
    # -- tiles no token of the block sees --
    unseen = tl.full((BLOCK_M, BLOCK_N), float("-inf"), tl.float32)
    for start in range(span_lo + tl.cdiv(work_hi - span_lo, BLOCK_N) * BLOCK_N, span_hi,
                       BLOCK_N):
        pos = start + n
        tl.store(out_rows + pos[None, :], unseen,
                 mask=tok_ok[:, None] & (pos[None, :] < span_hi))


def _check(q: torch.Tensor, weights: torch.Tensor, data: torch.Tensor,
           block_table: torch.Tensor, seq_lens: torch.Tensor,
           query_start_loc: torch.Tensor, topk: int | None = None) -> None:
    """Shapes and dtypes of one call (shapes only: no device value is read)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [T, H, D], got shape {tuple(q.shape)}")
    T, H, D = q.shape
    if tuple(weights.shape) != (T, H):
        raise ValueError(f"weights must be [T, H] = {[T, H]}, got {list(weights.shape)}")
    if data.dim() != 3 or cache_head_dim(data) != D:
        raise ValueError(f"data must be a key cache of head dim D = {D}, got "
                         f"{data.dtype} of shape {tuple(data.shape)}")
    if block_table.dim() != 2 or block_table.dtype != torch.int32:
        raise TypeError(f"block_table must be 2-d int32, got {block_table.dtype} of shape "
                        f"{tuple(block_table.shape)}")
    B = seq_lens.shape[0]
    if tuple(query_start_loc.shape) != (B + 1,) or block_table.shape[0] < B:
        raise ValueError(f"query_start_loc must be [B + 1] = [{B + 1}] and block_table "
                         f"[>= B, ...] for B = {B} requests, got {tuple(query_start_loc.shape)}"
                         f" and {tuple(block_table.shape)}")
    if topk is not None and topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")
    check_device(q, data)


def _prepared(q: torch.Tensor, weights: torch.Tensor,
              data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(queries, weights) as the kernel multiplies them: against an fp8 cache the
    reference's rotation and e4m3 rounding (`prepare_queries`), as codes, with their
    per-(token, head) scales folded into the float32 weights; else q in the cache's dtype."""
    if is_fp8_cache(data):
        codes, scales = quantize_rows(hadamard_rotate(q))
        return codes, weights.float() * scales
    return last_dim_contiguous(q.to(data.dtype)), last_dim_contiguous(weights.float())


def _launch(q: torch.Tensor, weights: torch.Tensor, data: torch.Tensor,
            block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
            out: torch.Tensor, row_start: int, config: LogitsConfig) -> None:
    """Logits of rows row_start .. row_start + len(out) - 1 into out [rows, P]; q and
    weights are those rows, already `_prepared`."""
    num_rows, num_positions = out.shape
    num_heads, head_dim = q.shape[1], q.shape[2]
    fp8 = is_fp8_cache(data)
    keys, scales = fp8_cache_views(data) if fp8 else (data, data)
    num_reqs = seq_lens.shape[0]
    block_m, block_n = config.block_m, config.block_n
    blocks = min(num_rows, cdiv(num_rows, block_m) + num_reqs)  # >= the token blocks
    tiles = cdiv(num_positions, block_n)
    waves = _WAVES * multiprocessor_count(q.device)
    per_program = max(1, min(config.max_tiles, blocks * tiles // waves))
    span = per_program * block_n
    block_d = max(32 if fp8 else 16, next_pow2(head_dim))
    _logits_kernel[(blocks, cdiv(num_positions, span))](
        q, weights, keys, scales, block_table, seq_lens, query_start_loc, out,
        num_reqs, row_start, row_start + num_rows, num_positions, span, num_heads,
        q.stride(0), q.stride(1), weights.stride(0), keys.stride(0), keys.stride(1),
        scales.stride(0), block_table.stride(0), out.stride(0),
        HEAD_DIM=head_dim, PAGE=data.shape[1], FP8=fp8, FP8_DOT=fp8 and fp8_dot_runs(q.device),
        PRECISION=dot_precision(q.dtype), BLOCK_M=block_m,
        BLOCK_H=max(16, next_pow2(num_heads)), BLOCK_D=block_d, BLOCK_N=block_n,
        SWAP_AB=config.swap_ab, REQS=max(2, next_pow2(num_reqs)), num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def _row_chunk(num_positions: int, budget: int) -> int:
    """Query rows per chunk: logits [rows, P] within `budget` elements, at least one."""
    return max(1, budget // max(num_positions, 1))


def indexer_logits(
    q: torch.Tensor, weights: torch.Tensor, data: torch.Tensor, block_table: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, *,
    config: LogitsConfig | None = None,
) -> torch.Tensor:
    """Every token's logits over the positions its request's block table can hold, float32
    [T, block_table.shape[1] * block_size]: -inf where the token does not see the
    position (arguments as `indexer_topk`; all rows in one launch)."""
    _check(q, weights, data, block_table, seq_lens, query_start_loc)
    num_tokens = q.shape[0]
    out = torch.empty(num_tokens, block_table.shape[1] * data.shape[1], device=q.device)
    if out.numel() == 0:
        return out
    config = config or pick_config(num_tokens, seq_lens.shape[0], q.shape[1])
    _launch(*_prepared(q, weights, data), data, last_dim_contiguous(block_table), seq_lens,
            query_start_loc, out, 0, config)
    return out


def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    data: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_seq_len: int,
    topk: int,
    *,
    budget: int = LOGITS_BUDGET,
    config: LogitsConfig | None = None,
) -> torch.Tensor:
    """Top-k key positions per query token, int32 [T, topk], as
    `reference_indexer.indexer_topk` (same arguments) but for the order of a row's
    entries and ties (module docstring). max_seq_len is not used: the logits cover the
    block table's positions, so that the launch depends on shapes alone."""
    del max_seq_len
    _check(q, weights, data, block_table, seq_lens, query_start_loc, topk)
    num_tokens = q.shape[0]
    num_positions = block_table.shape[1] * data.shape[1]
    out = torch.full((num_tokens, topk), -1, dtype=torch.int32, device=q.device)
    picks = min(topk, num_positions)
    if num_tokens == 0 or picks == 0:
        return out
    config = config or pick_config(num_tokens, seq_lens.shape[0], q.shape[1])
    block_table = last_dim_contiguous(block_table)
    chunk = _row_chunk(num_positions, budget)
    logits = torch.empty(min(chunk, num_tokens), num_positions, device=q.device)
    for r0 in range(0, num_tokens, chunk):
        r1 = min(num_tokens, r0 + chunk)
        rows = logits[: r1 - r0]
        _launch(*_prepared(q[r0:r1], weights[r0:r1], data), data, block_table, seq_lens,
                query_start_loc, rows, r0, config)
        values, positions = rows.topk(picks, dim=1, sorted=False)
        out[r0:r1, :picks] = torch.where(values == float("-inf"), -1, positions.int())
    return out

"""Sparse MLA attention (DeepSeek Sparse Attention) as a portable Triton kernel.

The GPU counterpart of `ops/reference_sparse.sparse_mla_attention`, whose docstring
states the index contract: each query token attends, by absorbed MQA, only to the cache
positions of its own request that its indexer selected (`indices` [T, topk], -1
unused, a position past the query's causal limit masked like -1).

Grid: one program per (query token, group of BLOCK_H heads), head groups of a token
adjacent in launch order so that they read its rows while L2 still holds them. A program
finds its request by a binary search of query_start_loc (no host-side map, no extra
launch), then walks the token's topk entries in tiles of BLOCK_K: each entry's slot
comes from the block table, its row is gathered (any page size; masked entries are
never read, so a NaN in an unselected row is never seen) and used by every head of the
program, as keys over all L + R columns and, its first L, as values. The products and
the online softmax (base 2) are dense decode's (`decode_triton._attend_tile`), as are
the row loaders (`decode_triton.load_rows`, `load_ds_mla_rows`): an fp8 cache widens to
float16 (its per-tensor scale folded into the scores and the output), an fp8_ds_mla
entry is dequantized in registers (four group scales per row) and multiplied in q's
dtype. Launch parameters are dense decode's for N query rows per request
(`decode_triton.pick_config`: the tile, warps, stages and product form); the split
plan's fields are unused, as every program sees at most topk rows.

Graph safe: no value is read back on the host and nothing is sized by device values.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from pagedmla.cache import DS_MLA_DTYPE, FP8_DTYPE
from pagedmla.ops.triton._utils import (
    cdiv,
    check_cache_rows,
    check_device,
    dot_precision,
    last_dim_contiguous,
    next_pow2,
)
from pagedmla.ops.triton.cache_ops import ds_mla_views
from pagedmla.ops.triton.decode_triton import (
    _TL_DTYPES,
    DecodeConfig,
    _attend_tile,
    _to_compute,
    load_ds_mla_rows,
    load_rows,
    pick_config,
    quantized,
)


@triton.jit
def _request_of(query_start_loc_ptr, token, num_reqs):
    """The request that owns query row `token`: the last b < num_reqs with
    query_start_loc[b] <= token (requests without query rows are passed over)."""
    lo = 0
    hi = num_reqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        below = tl.load(query_start_loc_ptr + mid) <= token
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid)
    return lo


@triton.jit(  # batch-dependent: no variant per value (engine/warmup.py)
    do_not_specialize=["stride_bt", "stride_lh", "num_reqs"],
    do_not_specialize_on_alignment=["block_table_ptr", "seq_lens_ptr", "query_start_loc_ptr"])
def _sparse_kernel(
    q_ptr, data_ptr, scale_ptr, ds_scales_ptr, ds_rope_ptr, block_table_ptr, seq_lens_ptr,
    query_start_loc_ptr, indices_ptr, out_ptr, lse_ptr,
    stride_qt, stride_qh, stride_db, stride_dp, stride_bt, stride_it, stride_ot, stride_oh,
    stride_lh, num_heads, num_reqs, topk, head_groups, softmax_scale,
    L: tl.constexpr, R: tl.constexpr, PAGE: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr, HALF_L: tl.constexpr, BLOCK_R: tl.constexpr,
    IS_FP8: tl.constexpr, DS_MLA: tl.constexpr, PRECISION: tl.constexpr,
    SWAP_AB: tl.constexpr, COMPUTE: tl.constexpr,
):
    """Heads [group * BLOCK_H, +BLOCK_H) of query row `token` (program_id(0) = token x
    head_groups + group) over its selected positions: out [T, N, L] (q's dtype) through
    (stride_ot, stride_oh), lse [N, T] (natural log) through (stride_lh, 1). DS_MLA:
    fp8_ds_mla entries, their scales and rope values through ds_scales_ptr and
    ds_rope_ptr (views of the same bytes; strides in bytes)."""
    pid = tl.program_id(0)
    token = pid // head_groups
    group = pid % head_groups
    req = _request_of(query_start_loc_ptr, token, num_reqs)
    # Query `token` of its request is at position seq_len - (query end - token) and sees
    # the positions up to it.
    limit = (tl.load(seq_lens_ptr + req) - tl.load(query_start_loc_ptr + req + 1)) + token
    table_row = block_table_ptr + req.to(tl.int64) * stride_bt

    # -- load the heads' queries --
    head = group * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = head < num_heads
    cols = tl.arange(0, HALF_L)
    q_rows = q_ptr + token.to(tl.int64) * stride_qt + head.to(tl.int64) * stride_qh
    q_a, q_b, q_pe = load_rows(q_rows, head_ok, q_ptr.dtype.element_ty, L, R, HALF_L,
                               BLOCK_R)
    q_a = _to_compute(q_a, COMPUTE)
    q_b = _to_compute(q_b, COMPUTE)
    q_pe = _to_compute(q_pe, COMPUTE)
    if SWAP_AB:
        q_a = tl.trans(q_a)
        q_b = tl.trans(q_b)
        q_pe = tl.trans(q_pe)
        acc_a = tl.zeros([HALF_L, BLOCK_H], tl.float32)
    else:
        acc_a = tl.zeros([BLOCK_H, HALF_L], tl.float32)
    acc_b = tl.zeros_like(acc_a)

    # Scores in base 2; an fp8 cache stores x / scale: the scale multiplies the scores
    # here and the output at the end.
    qk_scale = softmax_scale * 1.4426950408889634
    if IS_FP8:
        kv_scale = tl.load(scale_ptr)
        qk_scale = qk_scale * kv_scale
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)

    index_row = indices_ptr + token.to(tl.int64) * stride_it
    for k0 in range(0, topk, BLOCK_K):
        # -- the tile's positions, and their rows through the block table --
        entry = k0 + tl.arange(0, BLOCK_K)
        pos = tl.load(index_row + entry, mask=entry < topk, other=-1)
        ok = (pos >= 0) & (pos <= limit)
        block = tl.load(table_row + pos // PAGE, mask=ok, other=0).to(tl.int64)
        row = block * stride_db + (pos % PAGE).to(tl.int64) * stride_dp
        if DS_MLA:
            kv_a, kv_b, k_pe = load_ds_mla_rows(data_ptr, ds_scales_ptr, ds_rope_ptr, row, ok,
                                                COMPUTE, HALF_L, BLOCK_R)
        else:
            kv_a, kv_b, k_pe = load_rows(data_ptr + row, ok, COMPUTE, L, R, HALF_L, BLOCK_R)
        # -- scores, online softmax, P @ V --
        visible = ok[:, None] if SWAP_AB else ok[None, :]
        acc_a, acc_b, m_i, l_i = _attend_tile(
            acc_a, acc_b, m_i, l_i, kv_a, kv_b, k_pe, q_a, q_b, q_pe, visible, qk_scale, R,
            PRECISION, SWAP_AB)
    if SWAP_AB:
        acc_a = tl.trans(acc_a)
        acc_b = tl.trans(acc_b)

    # -- normalize; no selected position: l = 0, out 0 and lse -inf (a NaN l, from a
    # NaN in a selected row, is not "no key": it reaches out and lse) --
    has_key = l_i != 0.0
    norm = 1.0 / tl.where(has_key, l_i, 1.0)
    if IS_FP8:
        norm = norm * kv_scale
    log_l = tl.math.log2(tl.where(has_key, l_i, 1.0))
    lse = tl.where(has_key, (m_i + log_l) * 0.6931471805599453, float("-inf"))
    out_rows = out_ptr + token.to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
    tl.store(out_rows[:, None] + cols[None, :],
             (acc_a * norm[:, None]).to(out_ptr.dtype.element_ty),
             mask=head_ok[:, None] & (cols[None, :] < L))
    tl.store(out_rows[:, None] + HALF_L + cols[None, :],
             (acc_b * norm[:, None]).to(out_ptr.dtype.element_ty),
             mask=head_ok[:, None] & (cols[None, :] + HALF_L < L))
    tl.store(lse_ptr + head.to(tl.int64) * stride_lh + token, lse, mask=head_ok)


def sparse_config(num_heads: int, q_dtype: torch.dtype, data: torch.Tensor) -> DecodeConfig:
    """The launch parameters for N = num_heads query rows per program: dense decode's
    regime for as many rows (`decode_triton.pick_config`), its block_h cut to the rows
    the heads need (at least 16, tl.dot's smallest)."""
    config = pick_config(num_heads, q_dtype, quantized(data))
    return replace(config, block_h=min(config.block_h, max(16, next_pow2(num_heads))))


def sparse_attention(
    q: torch.Tensor,
    data: torch.Tensor,
    scale: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    indices: torch.Tensor,
    kv_lora_rank: int,
    softmax_scale: float,
    *,
    config: DecodeConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MQA of each query over its selected positions of the paged latent cache
    (as `reference_sparse.sparse_mla_attention`, whose docstring gives the contract).

    q [T, N, L + R] absorbed queries; data [num_blocks, block_size, L + R] (q's dtype, or
    fp8 scaled by `scale` [] float32), or fp8_ds_mla entries uint8 [num_blocks,
    block_size, 656] with L = 512, R = 64 (`scale` unused); block_table [B, max_blocks],
    seq_lens [B], query_start_loc [B + 1] and indices [T, topk] int32 (positions within
    the query's request, -1 unused). Returns out [T, N, L] in q's dtype and lse [N, T]
    float32 (natural log); a query with no selected position gets out 0 and lse -inf.
    config: other launch parameters (block_h rows per program, block_n positions per
    tile, warps, stages, swap_ab; tuning, tests); default `sparse_config`'s.
    """
    check_device(q, data)
    num_tokens, num_heads, width = q.shape
    L = kv_lora_rank
    ds_mla = data.dtype == DS_MLA_DTYPE
    check_cache_rows(data, L, width)
    if indices.dim() != 2 or indices.shape[0] != num_tokens:
        raise ValueError(f"indices must have shape [{num_tokens}, topk], got "
                         f"{list(indices.shape)}")
    R = width - L
    out = torch.empty(num_tokens, num_heads, L, dtype=q.dtype, device=q.device)
    lse = torch.empty(num_heads, num_tokens, dtype=torch.float32, device=q.device)
    if num_tokens == 0:
        return out, lse
    q = last_dim_contiguous(q)
    data = last_dim_contiguous(data)
    indices = last_dim_contiguous(indices)
    config = config or sparse_config(num_heads, q.dtype, data)
    is_fp8 = data.dtype == FP8_DTYPE
    # As dense decode: fp8 widens to float16 (e4m3 is exact there; a 16-bit q is rounded
    # to float16), fp8_ds_mla's values (e4m3 x powers of two up to 2^127) need q's range.
    compute = _TL_DTYPES[torch.float16 if is_fp8 and q.dtype != torch.float32 else q.dtype]
    ds_views = ds_mla_views(data) if ds_mla else (data, data)
    head_groups = cdiv(num_heads, config.block_h)
    _sparse_kernel[(num_tokens * head_groups,)](
        q, data, scale, *ds_views, block_table, seq_lens, query_start_loc, indices, out, lse,
        q.stride(0), q.stride(1), data.stride(0), data.stride(1), block_table.stride(0),
        indices.stride(0), out.stride(0), out.stride(1), lse.stride(0),
        num_heads, seq_lens.shape[0], indices.shape[1], head_groups, float(softmax_scale),
        L=L, R=R, PAGE=data.shape[1], BLOCK_H=config.block_h, BLOCK_K=config.block_n,
        HALF_L=max(32, next_pow2(L)) // 2, BLOCK_R=max(16, next_pow2(R)) if R > 0 else 16,
        IS_FP8=is_fp8, DS_MLA=ds_mla, PRECISION=dot_precision(q.dtype),
        SWAP_AB=config.swap_ab, COMPUTE=compute,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out, lse

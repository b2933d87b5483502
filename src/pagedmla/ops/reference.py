"""The executable specification of every kernel: plain PyTorch, CPU and CUDA.

Each function computes in float32 (whatever the input dtype) and writes results in
the caller's dtype. Shapes use the symbols of docs/design.md; lse is natural-log, float32,
heads first ([N, T]); a query row that sees no key gets output 0 and lse -inf.
"""

from __future__ import annotations

import torch

from pagedmla.cache import (
    DS_MLA_BYTES,
    DS_MLA_DTYPE,
    DS_MLA_GROUP,
    DS_MLA_GROUPS,
    DS_MLA_LATENT,
    DS_MLA_MAX_EXP,
    DS_MLA_MIN_EXP,
    DS_MLA_ROPE_AT,
    DS_MLA_SCALES_AT,
    FP8_DTYPE,
)
from pagedmla.ops.block_fp8 import dequantize_blocks, dequantize_w13

# Query rows per attention block: bounds the [N, rows, S] score matrix in memory.
_SCORE_ELEMENTS = 1 << 26


def ds_mla_scales(latent: torch.Tensor) -> torch.Tensor:
    """The fp8_ds_mla scales of latent [K, 512] (float32): [K, 4] float32, scale g the
    smallest power of two >= amax / 448 over values [128 g, 128 g + 128), clamped to
    [2^-126, 2^127], NaN where the group holds a NaN (`pagedmla.cache`)."""
    amax = latent.view(-1, DS_MLA_GROUPS, DS_MLA_GROUP).abs().amax(dim=-1)  # NaN wins
    ratio = amax / torch.finfo(FP8_DTYPE).max
    bits = ratio.view(torch.int32)  # >= 0: exponent field, then mantissa
    exponent = (bits >> 23) - 127 + ((bits & 0x7FFFFF) != 0).int()  # ceil(log2)
    exponent = exponent.clamp(DS_MLA_MIN_EXP, DS_MLA_MAX_EXP)
    scales = ((exponent + 127) << 23).view(torch.float32)
    return torch.where(torch.isnan(amax), float("nan"), scales)


def ds_mla_encode(kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """fp8_ds_mla entries uint8 [K, 656] of kv_c [K, 512] and k_pe [K, 64]: e4m3 codes
    of kv_c / scale (round to nearest even, saturated to +-448), the four float32
    scales (`ds_mla_scales`), k_pe in bfloat16 (round to nearest even)."""
    latent = kv_c.float()
    scales = ds_mla_scales(latent)
    limit = torch.finfo(FP8_DTYPE).max
    groups = latent.view(-1, DS_MLA_GROUPS, DS_MLA_GROUP) / scales.unsqueeze(-1)
    codes = groups.clamp(-limit, limit).to(FP8_DTYPE).view(-1, DS_MLA_LATENT)
    rope = k_pe.to(torch.bfloat16)
    return torch.cat([codes.view(torch.uint8), scales.view(torch.uint8),
                      rope.view(torch.uint8)], dim=-1)


def ds_mla_decode(entries: torch.Tensor) -> torch.Tensor:
    """fp8_ds_mla entries uint8 [..., 656] -> rows [..., 576] float32: the latent
    (codes x their group's scale), then the rope values."""
    lead = entries.shape[:-1]
    flat = entries.reshape(-1, DS_MLA_BYTES)
    codes = flat[:, :DS_MLA_SCALES_AT].view(FP8_DTYPE).float()
    scales = flat[:, DS_MLA_SCALES_AT:DS_MLA_ROPE_AT].view(torch.float32)
    latent = codes.view(-1, DS_MLA_GROUPS, DS_MLA_GROUP) * scales.unsqueeze(-1)
    rope = flat[:, DS_MLA_ROPE_AT:].view(torch.bfloat16).float()
    rows = torch.cat([latent.view(-1, DS_MLA_LATENT), rope], dim=-1)
    return rows.view(*lead, rows.shape[-1])


def _read_rows(data: torch.Tensor, slots: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Cache rows [..., L + R] at `slots` [...] as float32, dequantized when the cache is
    fp8 (per-tensor `scale`) or fp8_ds_mla (the entries' own scales)."""
    entries = data.view(-1, data.shape[-1])[slots]
    if data.dtype == DS_MLA_DTYPE:
        return ds_mla_decode(entries)
    rows = entries.float()
    if data.dtype == FP8_DTYPE:
        rows = rows * scale
    return rows


def token_requests(
    query_start_loc: torch.Tensor, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """For each of the batch's T query tokens (request after request, query_start_loc
    [B + 1] their offsets): its request [T] and its index among the request's new tokens
    [T], int64. Shapes only: no value is read on the host."""
    qsl = query_start_loc.long()
    device = query_start_loc.device
    token_req = torch.repeat_interleave(
        torch.arange(qsl.shape[0] - 1, device=device), qsl[1:] - qsl[:-1],
        output_size=num_tokens)
    return token_req, torch.arange(num_tokens, device=device) - qsl[token_req]


def write_cache(
    data: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale: torch.Tensor,
) -> None:
    """Store [kv_c | k_pe] ([T, L], [T, R]) at the slots of slot_mapping [T] (-1: skip):
    as they are, as fp8 x / scale, or as fp8_ds_mla entries (`ds_mla_encode`)."""
    keep = slot_mapping >= 0
    if data.dtype == DS_MLA_DTYPE:
        entries = ds_mla_encode(kv_c[keep], k_pe[keep])
        data.view(-1, data.shape[-1])[slot_mapping[keep]] = entries
        return
    rows = torch.cat([kv_c, k_pe], dim=-1)[keep]
    if data.dtype == FP8_DTYPE:
        limit = torch.finfo(FP8_DTYPE).max
        rows = (rows.float() / scale).clamp(-limit, limit)
    data.view(-1, data.shape[-1])[slot_mapping[keep]] = rows.to(data.dtype)


def gather_cache(
    data: torch.Tensor,
    scale: torch.Tensor,
    block_table: torch.Tensor,
    starts: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    token_to_seq: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """Copy context rows of a chunk into `out` [rows, L + R], dequantizing fp8 and
    fp8_ds_mla.

    Request j of the chunk contributes positions [starts[j], starts[j] + n_j) of its
    context (block_table[j]) to out rows [cu_seq_lens[j], cu_seq_lens[j + 1]).
    """
    seq = token_to_seq.long()
    row = torch.arange(out.shape[0], device=out.device)
    position = starts.long()[seq] + row - cu_seq_lens.long()[seq]
    block_size = data.shape[1]
    blocks = block_table.long()[seq, position // block_size]
    out.copy_(_read_rows(data, blocks * block_size + position % block_size, scale))


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax attention of float32 q [..., M, D] against k [..., S, D].

    allowed [..., M, S] (broadcastable); returns out [..., M, Dv] and lse [..., M].
    """
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    safe_lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    probs = torch.exp(scores - safe_lse.unsqueeze(-1))
    return torch.matmul(probs, v), lse


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
    plans: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MQA over the paged latent cache.

    q [T, N, L + R]; the keys are whole cache rows [L + R] as read (`_read_rows`), the
    values their first L columns. Token i of request b (q_len_b tokens) sees positions
    < seq_lens[b] - q_len_b + i + 1. Returns out [T, N, L] in q's dtype, lse [N, T].
    `plans` (the per-forward store of kernel backends' split plans) is not used: the
    reference attends over whole requests.
    """
    num_tokens, num_heads, width = q.shape
    num_reqs = seq_lens.shape[0]
    block_size = data.shape[1]
    token_req, token_idx = token_requests(query_start_loc, num_tokens)
    q_lens = query_start_loc.long().diff()

    # Pad every request to [max_query_len] queries and [max_seq_len] keys.
    q_pad = q.new_zeros(num_reqs, max_query_len, num_heads, width, dtype=torch.float32)
    q_pad[token_req, token_idx] = q.float()
    position = torch.arange(max_seq_len, device=q.device)
    valid = position.unsqueeze(0) < seq_lens.long().unsqueeze(1)  # [B, S]
    blocks = block_table.long()[:, position // block_size]
    slots = (blocks * block_size + position % block_size).clamp(0, data.shape[0] * block_size - 1)
    # Rows past a request's length may hold anything (NaN included): zero them.
    kv = torch.where(valid.unsqueeze(-1), _read_rows(data, slots, scale), 0.0)  # [B, S, L+R]

    query_pos = seq_lens.long().view(-1, 1) - q_lens.view(-1, 1) + torch.arange(
        max_query_len, device=q.device
    )  # [B, Q]: the position of each query token
    allowed = (position.view(1, 1, -1) <= query_pos.unsqueeze(-1)) & valid.unsqueeze(1)
    # One key set for all heads: the heads join the query rows, [B, Q x N, ...], so that
    # the products do not broadcast kv over N (matmul would materialise [B, N, S, L+R]).
    q_rows = q_pad.view(num_reqs, max_query_len * num_heads, width)
    out, lse = _attend(
        q_rows,
        kv,
        kv[..., :kv_lora_rank],
        allowed.repeat_interleave(num_heads, dim=1),
        softmax_scale,
    )  # out [B, Q x N, L], lse [B, Q x N]
    out = out.view(num_reqs, max_query_len, num_heads, -1)[token_req, token_idx].to(q.dtype)
    lse = lse.view(num_reqs, max_query_len, num_heads)[token_req, token_idx]
    return out, lse.transpose(0, 1).contiguous()


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Variable-length MHA with log-sum-exp.

    q [Tq, N, Dqk], k [Tk, N, Dqk], v [Tk, N, Dv]; sequence j has queries
    cu_seqlens_q[j]:cu_seqlens_q[j+1] and keys cu_seqlens_k[j]:cu_seqlens_k[j+1].
    causal: bottom-right aligned (query i of q_len sees keys < k_len - q_len + i + 1).
    Returns out [Tq, N, Dv] in q's dtype and lse [N, Tq] float32.
    """
    num_heads = q.shape[1]
    out = q.new_empty(q.shape[0], num_heads, v.shape[-1])
    lse = torch.empty(num_heads, q.shape[0], dtype=torch.float32, device=q.device)
    bounds_q = cu_seqlens_q.tolist()
    bounds_k = cu_seqlens_k.tolist()
    for j in range(len(bounds_q) - 1):
        q0, q1, k0, k1 = bounds_q[j], bounds_q[j + 1], bounds_k[j], bounds_k[j + 1]
        keys = k[k0:k1].float().transpose(0, 1)  # [N, Sk, D]
        values = v[k0:k1].float().transpose(0, 1)
        step = max(1, _SCORE_ELEMENTS // max(1, num_heads * (k1 - k0)))
        for r0 in range(q0, q1, step):
            r1 = min(q1, r0 + step)
            rows = torch.arange(r0 - q0, r1 - q0, device=q.device)
            allowed = torch.ones(r1 - r0, k1 - k0, dtype=torch.bool, device=q.device)
            if causal:
                limit = (k1 - k0) - (q1 - q0) + rows + 1
                allowed = torch.arange(k1 - k0, device=q.device) < limit.unsqueeze(1)
            block_out, block_lse = _attend(
                q[r0:r1].float().transpose(0, 1), keys, values, allowed, softmax_scale
            )
            out[r0:r1] = block_out.transpose(0, 1).to(out.dtype)
            lse[:, r0:r1] = block_lse
    return out, lse


def merge_attn_states(
    prefix_output: torch.Tensor,
    prefix_lse: torch.Tensor,
    suffix_output: torch.Tensor,
    suffix_lse: torch.Tensor,
    output: torch.Tensor,
    output_lse: torch.Tensor | None,
) -> None:
    """Combine two partial softmax results over disjoint key sets into `output`.

    outputs [T, N, D], lse [N, T]. An lse of -inf or +inf marks an empty partial
    (output 0); two empties give (0, -inf). A NaN lse is not empty: it makes the row's
    output and lse NaN. `output` may alias either input.
    """
    lse_p = prefix_lse.float().transpose(0, 1).unsqueeze(-1)  # [T, N, 1]
    lse_s = suffix_lse.float().transpose(0, 1).unsqueeze(-1)
    neg_inf = torch.tensor(float("-inf"), device=lse_p.device)
    lse_p = torch.where(lse_p == float("inf"), neg_inf, lse_p)
    lse_s = torch.where(lse_s == float("inf"), neg_inf, lse_s)
    peak = torch.maximum(lse_p, lse_s)
    safe_peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    w_p = torch.exp(lse_p - safe_peak)
    w_s = torch.exp(lse_s - safe_peak)
    total = w_p + w_s
    denom = torch.where(total > 0, total, torch.ones_like(total))
    # where() rather than multiplication: an empty partial's output is not trusted.
    merged = torch.where(w_p > 0, prefix_output.float() * w_p, 0.0) + torch.where(
        w_s > 0, suffix_output.float() * w_s, 0.0
    )
    merged = merged / denom
    merged_lse = torch.where(total > 0, safe_peak + torch.log(denom), neg_inf)
    nan = torch.isnan(lse_p) | torch.isnan(lse_s)  # [T, N, 1]
    merged = torch.where(nan, float("nan"), merged)
    merged_lse = torch.where(nan, float("nan"), merged_lse)
    output.copy_(merged.to(output.dtype))
    if output_lse is not None:
        output_lse.copy_(merged_lse.squeeze(-1).transpose(0, 1))


def merge_partials(out: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Merge D softmax partials over disjoint keys: out [D, T, N, L], lse [D, T, N] ->
    [T, N, L] in dtype.

    As merge_attn_states for D inputs: an lse of -inf (or +inf) is an empty partial,
    whose output is not read; rows where every partial is empty come out 0, rows with a
    NaN lse NaN.
    """
    lse = torch.where(lse == float("inf"), float("-inf"), lse.float())
    peak = lse.amax(dim=0)
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    weights = torch.exp(lse - peak).unsqueeze(-1)  # [D, T, N, 1]; 0 for empty partials
    total = weights.sum(dim=0)
    merged = torch.where(weights > 0, out.float() * weights, 0.0).sum(dim=0)
    merged = merged / torch.where(total > 0, total, torch.ones_like(total))
    nan = torch.isnan(lse).any(dim=0).unsqueeze(-1)  # [T, N, 1]
    return torch.where(nan, float("nan"), merged).to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, D] (rows may be strided) -> weight * x / rms(x) [T, D].

    The normalisation is computed in float32 and rounded to x's dtype before the weight
    multiplies it, as in the Hugging Face DeepSeek models.
    """
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) for x, residual [T, D]; the sum is rounded
    to x's dtype first, as a residual stream in that dtype is."""
    total = x + residual
    return rms_norm(total, weight, eps), total


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """Rotate x [T, ..., R] by per-token cos/sin [T, R/2]; returns [T, ..., R] in x's
    dtype, the rotated pairs as [first members | second members] (pairs are (2i, 2i+1)
    when interleaved, else (i, i + R/2))."""
    half = x.shape[-1] // 2
    xf = x.float()
    if interleaved:
        first, second = xf[..., 0::2], xf[..., 1::2]
    else:
        first, second = xf[..., :half], xf[..., half:]
    # Broadcast the per-token tables over any head dims between T and R.
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = cos.view(shape), sin.view(shape)
    rotated = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
    return rotated.to(x.dtype)


def rotary(
    q: torch.Tensor, k_pe: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    interleaved: bool,
) -> torch.Tensor:
    """Rotary embedding of one MLA step: rotates the last R dims of q [T, N, P + R] in
    place and returns k_pe [T, R] (rows may be strided) rotated, as a new contiguous
    tensor; cos/sin [T, R/2] float32 (see `apply_rope`)."""
    R = k_pe.shape[-1]
    q[..., q.shape[-1] - R :] = apply_rope(q[..., q.shape[-1] - R :], cos, sin, interleaved)
    return apply_rope(k_pe, cos, sin, interleaved)


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int]
) -> torch.Tensor:
    """x [M, K] @ W.T -> [M, N] in x's dtype, W [N, K] a block-scaled fp8 weight with
    scale_inv [ceil(N / bn), ceil(K / bk)] float32 (`ops/block_fp8.py`).

    W is dequantized on every call, to float32 and then to x's dtype, and x is not
    quantized: exactly a linear layer on the dequantized checkpoint in x's dtype.
    """
    w = dequantize_blocks(weight, scale_inv, block_size, x.dtype)
    return torch.nn.functional.linear(x, w)


def fused_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
    ids: torch.Tensor, w13_scale_inv: torch.Tensor | None = None,
    w2_scale_inv: torch.Tensor | None = None, block_size: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Routed SwiGLU experts: sum over each token's k experts e = ids[t, j] of weights[t, j]
    * w2[e] (silu(gate) * up), [gate | up] = w13[e] x[t]; x [T, H], w13 [E, 2I, H] (gate
    rows, then up rows), w2 [E, H, I], weights [T, k] float32, ids [T, k] -> [T, H] in
    x's dtype. Ids >= E (another rank's experts) contribute nothing.

    Block-fp8 experts pass w13 and w2 in float8_e4m3fn with w13_scale_inv [E, 2,
    ceil(I / bn), ceil(H / bk)], w2_scale_inv [E, ceil(H / bn), ceil(I / bk)] and
    block_size (bn, bk) (`ops/block_fp8.py`): each expert that runs is dequantized to
    x's dtype on the call, as `fp8_linear` does.

    The pairs are sorted by expert and each expert that got tokens runs one matmul over
    them (the expert counts are read on the host: this op synchronises).
    """
    T, k = ids.shape
    num_experts = w13.shape[0]
    flat_ids = ids.reshape(-1)
    order = flat_ids.argsort(stable=True)
    tokens = order // k  # pair p belongs to token p // k
    pair_weights = weights.reshape(-1)[order]
    counts = torch.bincount(flat_ids, minlength=num_experts)[:num_experts].tolist()
    gathered = x[tokens]
    out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        end = start + count
        up_w, down_w = w13[expert], w2[expert]
        if w13_scale_inv is not None:
            assert w2_scale_inv is not None and block_size is not None
            up_w = dequantize_w13(up_w, w13_scale_inv[expert], block_size, x.dtype)
            down_w = dequantize_blocks(down_w, w2_scale_inv[expert], block_size, x.dtype)
        gate, up = torch.nn.functional.linear(gathered[start:end], up_w).chunk(2, dim=-1)
        y = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, down_w)
        # Weights are float32: scale and accumulate in float32, cast once at the end.
        out.index_add_(0, tokens[start:end], y.float() * pair_weights[start:end, None])
        start = end
    return out.to(x.dtype)

"""The lightning indexer of DeepSeek Sparse Attention: its paged key cache and the
top-k selection, as the executable specification (plain PyTorch, CPU and CUDA).

Shapes: T query tokens (all requests of a step, request after request), H indexer
heads (`index_n_heads`), D their width (`index_head_dim`), S a request's seq_len.

Scores. Query token t of request b (q_len_b new tokens, the last of its seq_len_b) sees
positions s < seq_len_b - q_len_b + i + 1 (bottom-right causal, i its index among the
new tokens) and scores each of them

    score[t, s] = sum_h weights[t, h] * relu(q[t, h] . k[s])

with the model's scale folded into the weights: weights = weights_proj(x) * H^-0.5 *
D^-0.5 (transformers computes w * H^-0.5 * relu(D^-0.5 * q . k); the scale is positive,
so both are the same number up to rounding). `indexer_topk` returns, per query token, the
positions of its top-k scores, int32 [T, topk]: highest score first, equal scores lowest
position first, -1 in the slots past the token's visible count. A NaN score ranks above
every number (as in torch.topk); -0.0 and +0.0 are one score.

Memory. Queries are processed in tiles of rows x key positions sized so that neither the
per-head logits [rows, H, keys] nor the gathered keys [rows, keys, D] hold more than
`LOGITS_BUDGET` elements (at least one query and one key), whatever the context length;
each tile's scores are merged into a running top-k [rows, topk]. Ties are broken by
position inside one int64 sort key, so the merge is exact: any tiling gives the same
indices.

Key cache. `data` is one tensor paged like the latent cache (same block table, slot s is
block s // block_size, offset s % block_size):
* float: [num_blocks, block_size, D] in the model dtype, the keys as the module computes
  them (after k_norm and rope);
* fp8: uint8 [num_blocks, block_size, D + 4]. Each block's bytes are all its tokens'
  D e4m3 codes first (token after token, block_size * D bytes), then all their float32
  scales (block_size * 4 bytes, little-endian); `fp8_cache_views` gives both as views.
  Splitting keys from scales keeps every key row 16-byte aligned for the GPU's vector and
  TMA loads (D = 128); vLLM and DeepGEMM's paged indexer kernels read the same layout.
  A token's key is first rotated by the normalised Hadamard matrix (`hadamard_transform`,
  as the released models do before quantizing: it spreads outliers over all D values),
  then stored as codes = key / scale, scale = the smallest power of two >= max(amax,
  1e-4) / 448 (amax = max |value| of the rotated key). On this cache the queries are
  rotated (`hadamard_rotate`: the same matrix as one matmul) and quantized the same way,
  per token and head, before scoring; the rotation is orthogonal, so q . k is unchanged
  but for the fp8 rounding.
"""

from __future__ import annotations

import functools
import math

import torch

from pagedmla.cache import FP8_DTYPE
from pagedmla.ops.reference import token_requests

LOGITS_BUDGET = 1 << 26
"""Elements any per-tile intermediate of `indexer_topk` may hold (256 MiB of float32)."""
FP8_KEY_DTYPE = torch.uint8  # the storage dtype that marks an fp8 indexer cache
SCALE_BYTES = 4  # one float32 scale per token
_FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
AMAX_FLOOR = 1e-4  # an all-zero row still gets a finite, normal scale
_INVALID = torch.iinfo(torch.int64).min  # the sort key of a position a query cannot see
_LOW_BITS = (1 << 32) - 1


def is_fp8_cache(data: torch.Tensor) -> bool:
    return data.dtype == FP8_KEY_DTYPE


def allocate_indexer_cache(
    num_blocks: int, block_size: int, head_dim: int, dtype: torch.dtype, fp8: bool,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """An empty key cache: [num_blocks, block_size, D] in `dtype`, or the fp8 layout
    uint8 [num_blocks, block_size, D + 4] (D a power of two for the Hadamard rotation)."""
    if fp8:
        check_power_of_two(head_dim)
        return torch.empty(num_blocks, block_size, head_dim + SCALE_BYTES,
                           dtype=FP8_KEY_DTYPE, device=device)
    return torch.empty(num_blocks, block_size, head_dim, dtype=dtype, device=device)


def cache_head_dim(data: torch.Tensor) -> int:
    """D of a key cache, float or fp8."""
    return data.shape[-1] - SCALE_BYTES if is_fp8_cache(data) else data.shape[-1]


def fp8_cache_views(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of an fp8 key cache (contiguous uint8 [num_blocks, block_size, D + 4]):
    codes float8_e4m3fn [num_blocks, block_size, D] and scales float32 [num_blocks,
    block_size]; writing into them writes the cache."""
    num_blocks, block_size, width = data.shape
    head_dim = width - SCALE_BYTES
    blocks = data.view(num_blocks, block_size * width)
    codes = blocks[:, : block_size * head_dim].view(FP8_DTYPE)
    scales = blocks[:, block_size * head_dim :].view(torch.float32)
    return codes.view(num_blocks, block_size, head_dim), scales


def check_power_of_two(dim: int) -> None:
    if dim < 1 or dim & (dim - 1):
        raise ValueError(f"index_head_dim must be a power of two for the fp8 indexer "
                         f"cache (Hadamard rotation), got {dim}")


@functools.cache  # every indexer layer rotates its queries on every step: build it once
def hadamard_matrix(dim: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """The Sylvester Hadamard matrix of order `dim` (a power of two) times dim^-0.5,
    float32 [dim, dim]: entry (i, j) is (-1)^popcount(i & j) / sqrt(dim). Symmetric and
    orthogonal, the matrix of the fast Walsh-Hadamard transform in natural order. One
    tensor per (dim, device), shared by every caller: read it, never write it."""
    check_power_of_two(dim)
    index = torch.arange(dim, device=device)
    both = index[:, None] & index[None, :]
    parity = torch.zeros_like(both)
    for bit in range(max(dim.bit_length() - 1, 0)):
        parity ^= (both >> bit) & 1
    return (1.0 - 2.0 * parity.float()) / math.sqrt(dim)


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] times the normalised Hadamard matrix, in float32: one matmul (the
    queries' rotation; its summation order is the BLAS library's)."""
    return x.float() @ hadamard_matrix(x.shape[-1], x.device)


def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] (D a power of two) times the normalised Hadamard matrix, float32, in
    a fixed order of IEEE operations (the keys' rotation), so that every implementation
    of it, the Triton cache write's included, gives the same bits: log2 D butterfly
    stages, each taking the adjacent pairs (a, b) = (y[2j], y[2j + 1]) to y'[j] = a + b
    and y'[j + D/2] = a - b (after the last stage y is in natural order), then one
    multiply by float32(D^-0.5)."""
    y = x.float()
    dim = y.shape[-1]
    for _ in range(dim.bit_length() - 1):
        a, b = y.unflatten(-1, (dim // 2, 2)).unbind(-1)
        y = torch.cat([a + b, a - b], dim=-1)
    return y * hadamard_scale(dim)


@functools.cache  # asked by every indexer layer's key write on every step
def hadamard_scale(dim: int) -> float:
    """D^-0.5 rounded to float32 (exact as a Python float)."""
    return float(torch.tensor(dim**-0.5, dtype=torch.float32))


def fp8_scales(amax: torch.Tensor) -> torch.Tensor:
    """Power-of-two scales (float32) for rows of largest magnitude `amax` (float32): the
    smallest 2^e >= max(amax, 1e-4) / 448, at most 2^127 (an infinite value saturates);
    NaN where amax is NaN."""
    ratio = amax.float().clamp(min=AMAX_FLOOR) / _FP8_MAX  # NaN stays NaN
    bits = ratio.view(torch.int32)  # > 0: exponent field, then mantissa
    exponent = (bits >> 23) - 127 + ((bits & 0x7FFFFF) != 0).int()  # ceil(log2(ratio))
    scales = ((exponent.clamp(max=127) + 127) << 23).view(torch.float32)
    return torch.where(torch.isnan(ratio), math.nan, scales)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (already rotated) -> e4m3 codes [..., D] (x / scale, round to nearest
    even, saturated to +-448) and float32 scales [...] (`fp8_scales` of each row)."""
    xf = x.float()
    scales = fp8_scales(xf.abs().amax(dim=-1))
    codes = (xf / scales.unsqueeze(-1)).clamp(-_FP8_MAX, _FP8_MAX).to(FP8_DTYPE)
    return codes, scales


def write_indexer_cache(data: torch.Tensor, k: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store keys k [T, D] at the slots of slot_mapping [T] (-1: skip): in the cache's
    dtype, or rotated and quantized (codes and scale) in the fp8 layout."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    if not is_fp8_cache(data):
        data.view(-1, data.shape[-1])[slots] = k[keep].to(data.dtype)
        return
    codes, scales = quantize_rows(hadamard_transform(k[keep]))
    code_view, scale_view = fp8_cache_views(data)
    block_size = data.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    code_view[blocks, offsets] = codes
    scale_view[blocks, offsets] = scales


def read_indexer_keys(data: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Keys at `slots` [...] (valid slots only) as float32 [..., D]; fp8: codes x scale,
    still in the rotated basis."""
    if not is_fp8_cache(data):
        return data.view(-1, data.shape[-1])[slots].float()
    codes, scales = fp8_cache_views(data)
    block_size = data.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    return codes[blocks, offsets].float() * scales[blocks, offsets].unsqueeze(-1)


def prepare_queries(q: torch.Tensor, fp8: bool) -> torch.Tensor:
    """The queries as the scores use them, float32 [T, H, D]: q itself, or, against an
    fp8 cache, rotated like the keys and rounded through e4m3 with one power-of-two scale
    per token and head (DeepSeek folds that scale into the head weights; it is the same
    product)."""
    if not fp8:
        return q.float()
    codes, scales = quantize_rows(hadamard_rotate(q))
    return codes.float() * scales.unsqueeze(-1)


def rank_keys(scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """int64 sort keys of float32 scores at int positions (broadcast): ordered as
    (score, -position), so that topk over them is deterministic and total."""
    scores = scores.float() + 0.0  # -0.0 -> +0.0
    bits = scores.view(torch.int32)
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # monotone in the score
    ordered = torch.where(torch.isnan(scores), torch.iinfo(torch.int32).max, ordered)
    return ordered.long() * (1 << 32) + (_LOW_BITS - positions.long())


def positions_of(keys: torch.Tensor) -> torch.Tensor:
    """The positions inside `rank_keys` keys, int32, -1 for invalid keys."""
    positions = _LOW_BITS - (keys & _LOW_BITS)
    return torch.where(keys == _INVALID, -1, positions).int()


def tile_shape(num_heads: int, head_dim: int, max_seq_len: int, budget: int) -> tuple[int, int]:
    """(query rows, key positions) per tile: rows x keys x max(H, D) <= budget, keys
    covering the longest context where the budget allows, each at least 1."""
    width = max(num_heads, head_dim)
    keys = max(1, min(max(max_seq_len, 1), budget // width))
    return max(1, budget // (keys * width)), keys


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
) -> torch.Tensor:
    """Top-k key positions per query token, int32 [T, topk] (see the module docstring).

    q [T, H, D] the indexer queries (rope applied); weights [T, H] float32 (the model's
    scale folded in); data the key cache (float or fp8 layout) holding every position
    < seq_len of each request, this step's tokens included; block_table [B, max_blocks]
    int32; seq_lens [B] and query_start_loc [B + 1] int32 on q's device; max_seq_len >=
    max(seq_lens) (a host int). Slots a token cannot see are never read.
    """
    num_tokens, num_heads, head_dim = q.shape
    if topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")
    out = torch.full((num_tokens, topk), -1, dtype=torch.int32, device=q.device)
    if num_tokens == 0 or max_seq_len == 0:
        return out
    fp8 = is_fp8_cache(data)
    queries = prepare_queries(q, fp8)
    weights = weights.float()
    block_size, num_slots = data.shape[1], data.shape[0] * data.shape[1]

    # Per token: its request and the number of positions it sees.
    token_req, index_in_req = token_requests(query_start_loc, num_tokens)
    q_lens = query_start_loc.long().diff()
    visible = seq_lens.long()[token_req] - q_lens[token_req] + index_in_req + 1

    rows_per_tile, keys_per_tile = tile_shape(num_heads, head_dim, max_seq_len, budget)
    tables = block_table.long()
    last_column = tables.shape[1] - 1
    for r0 in range(0, num_tokens, rows_per_tile):
        rows = slice(r0, min(num_tokens, r0 + rows_per_tile))
        table, limit = tables[token_req[rows]], visible[rows].unsqueeze(1)
        best = torch.full((limit.shape[0], topk), _INVALID, dtype=torch.int64, device=q.device)
        for p0 in range(0, max_seq_len, keys_per_tile):
            position = torch.arange(p0, min(max_seq_len, p0 + keys_per_tile), device=q.device)
            seen = position.unsqueeze(0) < limit  # [rows, keys]
            blocks = table[:, (position // block_size).clamp(max=last_column)]
            slots = (blocks * block_size + position % block_size).clamp(0, num_slots - 1)
            # -- gather the keys the rows see (the others stay 0 and are never read) --
            keys = torch.zeros(*seen.shape, head_dim, device=q.device)
            keys[seen] = read_indexer_keys(data, slots[seen])
            # -- weighted ReLU scores --
            logits = torch.einsum("rhd,rkd->rhk", queries[rows], keys).relu_()
            scores = (logits * weights[rows].unsqueeze(-1)).sum(dim=1)  # [rows, keys]
            # -- merge into the running top-k --
            ranked = torch.where(seen, rank_keys(scores, position), _INVALID)
            best = torch.cat([best, ranked], dim=1).topk(topk, dim=1).values
        out[rows] = positions_of(best)
    return out

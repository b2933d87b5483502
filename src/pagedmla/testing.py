"""An independent oracle for MLA and realistic paged batches to check against it.

Shared by the tests and `pagedmla check`. Nothing here uses the implementation's ops
or attention code: the oracle recomputes MLA from raw per-request latents with the
plain, non-absorbed formula ("compute friendly approach"), in float64, without paging,
chunking or absorption. `pagedmla`'s public classes are used only to build inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from pagedmla import BatchSpec, LatentKVCache, MLADims

FP8 = torch.float8_e4m3fn
DS_MLA = torch.uint8  # the storage dtype of an fp8_ds_mla cache
UNUSED_BLOCK_ID = 10**6
"""Block-table value for entries past a request's used blocks: any read of it fails."""


def dense_mla_reference(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_b_proj: torch.Tensor,
    softmax_scale: float,
    query_len: int,
) -> torch.Tensor:
    """MLA output [query_len, N*V] of one request, in float64.

    q [query_len, N, P+R]; kv_c [S, L] and k_pe [S, R] are ALL the request's latents
    (context then new tokens); kv_b_proj [N*(P+V), L]. Keys and values are the
    up-projected latents, attention is plain softmax with bottom-right causal masking:
    query i sees keys j < S - query_len + i + 1.
    """
    q = q.to(torch.float64)
    kv_c = kv_c.to(torch.float64)
    k_pe = k_pe.to(torch.float64)
    w = kv_b_proj.to(torch.float64)
    q_len, num_heads, qk_dim = q.shape
    seq_len, latent = kv_c.shape
    rope = k_pe.shape[1]
    nope = qk_dim - rope
    if q_len != query_len or k_pe.shape[0] != seq_len or query_len > seq_len:
        raise ValueError(
            f"inconsistent shapes: q {tuple(q.shape)}, kv_c {tuple(kv_c.shape)}, "
            f"k_pe {tuple(k_pe.shape)}, query_len {query_len}"
        )
    w = w.view(num_heads, -1, latent)
    v_dim = w.shape[1] - nope
    k_nope = torch.einsum("sl,npl->snp", kv_c, w[:, :nope])
    v = torch.einsum("sl,nvl->snv", kv_c, w[:, nope:])
    k = torch.cat([k_nope, k_pe[:, None, :].expand(seq_len, num_heads, rope)], dim=-1)
    scores = torch.einsum("qnd,snd->nqs", q, k) * softmax_scale
    rows = torch.arange(q_len)[:, None]
    cols = torch.arange(seq_len)[None, :]
    visible = cols < seq_len - q_len + rows + 1
    scores = scores.masked_fill(~visible, -math.inf)
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("nqs,snv->qnv", probs, v)
    return out.reshape(q_len, num_heads * v_dim)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; inf when out holds a NaN or an inf."""
    out = out.detach().to("cpu", torch.float64).reshape(ref.shape)
    ref = ref.detach().to("cpu", torch.float64)
    if not torch.isfinite(out).all():
        return math.inf
    denom = torch.linalg.vector_norm(ref).item()
    num = torch.linalg.vector_norm(out - ref).item()
    return num / denom if denom > 0 else num


def ds_mla_scales(latent: torch.Tensor) -> torch.Tensor:
    """fp8_ds_mla scales [n, 4] float64 of latent [n, 512]: per 128 values, the smallest
    power of two >= amax / 448 (the division rounded to float32), at least 2^-126, at
    most 2^127; NaN for a group holding a NaN. Computed with frexp, apart from the
    implementation's exponent bits."""
    amax = latent.to(torch.float32).abs().view(-1, 4, 128).amax(dim=-1)
    ratio = (amax / 448.0).to(torch.float64)  # the float32 quotient, exactly
    mantissa, exponent = torch.frexp(ratio)  # ratio = mantissa x 2^exponent, |m| in [0.5, 1)
    ceil_log2 = torch.where(mantissa == 0.5, exponent - 1, exponent)
    ceil_log2 = torch.where(ratio == 0, -126, ceil_log2)
    ceil_log2 = torch.where(torch.isinf(ratio), 127, ceil_log2).clamp(-126, 127)
    scales = torch.ldexp(torch.ones_like(ratio), ceil_log2)
    return torch.where(torch.isnan(amax), math.nan, scales)


def ds_mla_entries(kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """fp8_ds_mla entries uint8 [n, 656] of kv_c [n, 512] and k_pe [n, 64]: e4m3 codes
    of value / scale (saturated to +-448), the scales as little-endian float32, k_pe as
    bfloat16 (`pagedmla.cache` describes the format)."""
    scales = ds_mla_scales(kv_c)
    quotient = kv_c.to(torch.float64).view(-1, 4, 128) / scales.unsqueeze(-1)
    codes = quotient.clamp(-448.0, 448.0).to(torch.float32).to(FP8).view(-1, 512)
    rope = k_pe.to(torch.float32).to(torch.bfloat16)
    return torch.cat([codes.view(torch.uint8), scales.to(torch.float32).view(torch.uint8),
                      rope.view(torch.uint8)], dim=-1)


def ds_mla_rows(entries: torch.Tensor) -> torch.Tensor:
    """fp8_ds_mla entries uint8 [n, 656] read back: rows [n, 576] float64."""
    codes = entries[:, :512].contiguous().view(FP8).to(torch.float64).view(-1, 4, 128)
    scales = entries[:, 512:528].contiguous().view(torch.float32).to(torch.float64)
    rope = entries[:, 528:].contiguous().view(torch.bfloat16).to(torch.float64)
    return torch.cat([(codes * scales.unsqueeze(-1)).view(-1, 512), rope], dim=-1)


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor, so that NaN compares equal to itself."""
    size = x.element_size()
    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size])


@dataclass
class PagedBatch:
    """One scheduled step with its paged cache, inputs and everything the oracle needs.

    Requests are in the given order (decodes first is the caller's business). Token
    rows follow request order: request b owns rows token_slices[b].
    """

    dims: MLADims
    query_lens: list[int]
    seq_lens: list[int]
    block_size: int
    cache: LatentKVCache
    spec: BatchSpec
    q: torch.Tensor
    kv_c: torch.Tensor
    k_pe: torch.Tensor
    kv_b_proj: torch.Tensor
    softmax_scale: float
    blocks: list[list[int]]
    context_latents: list[torch.Tensor]
    cache_before: torch.Tensor = field(repr=False)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def context_lens(self) -> list[int]:
        return [s - q for q, s in zip(self.query_lens, self.seq_lens)]

    @property
    def token_slices(self) -> list[slice]:
        out, start = [], 0
        for q in self.query_lens:
            out.append(slice(start, start + q))
            start += q
        return out

    def store(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows [n, L+R] as the cache stores them (fp8: x / scale, cast; fp8_ds_mla:
        656-byte entries, `ds_mla_entries`); on the host."""
        rows = rows.cpu()
        if self.cache.data.dtype == DS_MLA:
            return ds_mla_entries(rows[:, : self.dims.kv_lora_rank],
                                  rows[:, self.dims.kv_lora_rank :])
        if self.cache.data.dtype == FP8:
            return (rows.to(torch.float32) / self.cache.scale.cpu()).to(FP8)
        return rows.to(self.cache.data.dtype)

    def load(self, stored: torch.Tensor) -> torch.Tensor:
        """Stored rows read back, in float64 (fp8: stored * scale; fp8_ds_mla: codes x
        their group's scale, then the bfloat16 rope values)."""
        if stored.dtype == DS_MLA:
            return ds_mla_rows(stored)
        if stored.dtype == FP8:
            return stored.to(torch.float64) * self.cache.scale.cpu().to(torch.float64)
        return stored.to(torch.float64)

    def new_latents(self) -> torch.Tensor:
        """The T new rows [T, L+R] (kv_c then k_pe) in the input dtype, on the host."""
        return torch.cat([self.kv_c, self.k_pe], dim=-1).cpu()

    def full_latents(self, b: int, through_cache: bool) -> torch.Tensor:
        """All latents [S, L+R] of request b in float64: context as read back from the
        cache, then the new tokens, round-tripped through the cache when through_cache."""
        new = self.new_latents()[self.token_slices[b]]
        new = self.load(self.store(new)) if through_cache else new.to(torch.float64)
        return torch.cat([self.context_latents[b], new], dim=0)

    def oracle(self, decode_threshold: int = 1) -> torch.Tensor:
        """Expected attention output [T, N*V] in float64.

        Requests with query_len <= decode_threshold read every key from the cache (so an
        fp8 cache quantizes their new tokens too); prefills read their context from the
        cache but their new tokens as given.
        """
        latent = self.dims.kv_lora_rank
        outs = []
        for b, (q_len, tokens) in enumerate(zip(self.query_lens, self.token_slices)):
            full = self.full_latents(b, through_cache=q_len <= decode_threshold)
            outs.append(
                dense_mla_reference(
                    self.q[tokens].cpu(), full[:, :latent], full[:, latent:],
                    self.kv_b_proj.cpu(),
                    self.softmax_scale, q_len,
                )
            )
        return torch.cat(outs, dim=0)

    def expected_cache(self) -> torch.Tensor:
        """cache.data as it must be after a forward: the new rows at their slots
        (slot -1 skipped), every other slot untouched."""
        expected = self.cache_before.clone()
        flat = expected.view(-1, expected.shape[-1])
        slots = self.spec.slot_mapping
        keep = slots >= 0
        flat[slots[keep]] = self.store(self.new_latents())[keep]
        return expected

    def cache_mismatches(self, written: bool = True) -> int:
        """Number of cache slots whose bits differ from expected_cache() (written=False:
        from the cache as it was before any forward)."""
        expected = self.expected_cache() if written else self.cache_before
        got = _bits(self.cache.data.cpu()).view(-1, self.cache.data.shape[-1])
        want = _bits(expected).view(-1, self.cache.data.shape[-1])
        return int((got != want).any(dim=-1).sum())


def make_paged_batch(
    dims: MLADims,
    query_lens: list[int],
    seq_lens: list[int],
    block_size: int,
    dtype: torch.dtype = torch.float32,
    kv_cache_dtype: str | torch.dtype = "auto",
    fp8_scale: float = 1.0,
    num_spare_blocks: int = 3,
    seed: int = 0,
    softmax_scale: float | None = None,
    extra_table_columns: int = 1,
    pad_block_id: int = UNUSED_BLOCK_ID,
    device: str | torch.device = "cpu",
) -> PagedBatch:
    """A random batch over a paged cache laid out as a real engine would leave it.

    Block 0 is reserved (never used); each request's blocks are drawn from a random
    permutation of the others (plus num_spare_blocks unused ones). Every slot that holds
    no context row is NaN, so a stray read shows. Block-table entries past a request's
    used blocks hold pad_block_id. Inputs: q ~ N(0,1), latents ~ N(0,1), kv_b_proj
    ~ N(0,1)/sqrt(L). All draws come from a torch.Generator seeded with `seed`.
    """
    if len(query_lens) != len(seq_lens):
        raise ValueError("query_lens and seq_lens differ in length")
    gen = torch.Generator().manual_seed(seed)
    num_heads, latent, rope = dims.num_heads, dims.kv_lora_rank, dims.qk_rope_head_dim
    width = latent + rope
    used = [-(-s // block_size) for s in seq_lens]
    num_blocks = 1 + sum(used) + num_spare_blocks
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    blocks, taken = [], 0
    for n in used:
        blocks.append(order[taken : taken + n])
        taken += n
    columns = max(used, default=0) + extra_table_columns
    table = torch.full((len(seq_lens), max(columns, 1)), pad_block_id, dtype=torch.int32)
    for b, ids in enumerate(blocks):
        table[b, : len(ids)] = torch.tensor(ids, dtype=torch.int32)

    def slot(b: int, pos: int) -> int:
        return blocks[b][pos // block_size] * block_size + pos % block_size

    cache = LatentKVCache(
        num_blocks, block_size, latent, rope, kv_cache_dtype=kv_cache_dtype, dtype=dtype,
        device=device, scale=fp8_scale,
    )
    # NaN everywhere (fp8_ds_mla: 0xFF bytes are NaN codes, scales and rope values).
    cache.data.fill_(255 if cache.data.dtype == DS_MLA else math.nan)
    batch_slots = [slot(b, p) for b, (q, s) in enumerate(zip(query_lens, seq_lens))
                   for p in range(s - q, s)]
    spec = BatchSpec(
        query_lens=list(query_lens),
        seq_lens=list(seq_lens),
        block_table=table,
        slot_mapping=torch.tensor(batch_slots, dtype=torch.int64),
    )
    num_tokens = sum(query_lens)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = randn(num_tokens, num_heads, dims.qk_head_dim).to(device, dtype)
    kv_c = randn(num_tokens, latent).to(device, dtype)
    k_pe = randn(num_tokens, rope).to(device, dtype)
    kv_b_proj = (randn(num_heads * (dims.qk_nope_head_dim + dims.v_head_dim), latent)
                 / math.sqrt(latent)).to(device, dtype)
    scale = dims.qk_head_dim**-0.5 if softmax_scale is None else softmax_scale

    batch = PagedBatch(
        dims=dims, query_lens=list(query_lens), seq_lens=list(seq_lens),
        block_size=block_size, cache=cache, spec=spec, q=q, kv_c=kv_c, k_pe=k_pe,
        kv_b_proj=kv_b_proj, softmax_scale=scale, blocks=blocks, context_latents=[],
        cache_before=cache.data,
    )
    flat = cache.data.view(-1, cache.data.shape[-1])
    for b, (q_len, s) in enumerate(zip(query_lens, seq_lens)):
        context = s - q_len
        # Context rows are in the model dtype before they reach the cache, as in a run.
        rows = randn(context, width).to(dtype)
        stored = batch.store(rows)
        if context:
            index = torch.tensor([slot(b, p) for p in range(context)], device=flat.device)
            flat[index] = stored.to(flat.device)
        batch.context_latents.append(batch.load(stored))
    batch.cache_before = cache.data.cpu().clone()
    return batch

"""From a scheduled batch (host ints) to the per-step attention metadata.

`MLAMetadataBuilder.build(BatchSpec)` splits the batch into decode rows (absorbed MQA
path) and prefill rows (MHA path), and plans the chunked context of the prefills.
All planning happens on the host from Python ints; the integer tensors the kernels
need travel to the device in two copies per step.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from pagedmla.device import resolve_device
from pagedmla.dims import MLADims
from pagedmla.host_arrays import Int32Upload, check_host_tensor, int_list
from pagedmla.planner import ContextChunkPlan, determine_workspace_rows, plan_context_chunks
from pagedmla.routing import PathCostModel

if TYPE_CHECKING:
    from pagedmla.cache import LatentKVCache
    from pagedmla.ops import Backend


@dataclass
class BatchSpec:
    """One scheduled step, on the host.

    query_lens[b]: new tokens of request b this step; seq_lens[b]: its tokens after the
    step (context C = seq_len - query_len). block_table: int32 [B, max_blocks] on the
    CPU, each row a request's blocks in position order; slot_mapping: int64 [T] on the
    CPU, the cache slot of each new token: token k of request b is at position
    p = C + k and goes to slot block_table[b, p // block_size] * block_size
    + p % block_size, the slot attention reads it from, or -1 (no write); no slot twice.
    Requests with query_len <= decode_threshold come first.
    """

    query_lens: Sequence[int]
    seq_lens: Sequence[int]
    block_table: torch.Tensor
    slot_mapping: torch.Tensor


class Workspace:
    """Scratch rows for gathered context, shared by every layer of a model: allocated on
    first use for a (width, dtype) pair, then reused every step."""

    def __init__(self, rows: int, device: torch.device) -> None:
        self.rows = rows
        self.device = device
        self._buffers: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def get(self, width: int, dtype: torch.dtype) -> torch.Tensor:
        """A [rows, width] buffer; its contents are whatever the last user left."""
        key = (width, dtype)
        if key not in self._buffers:
            self._buffers[key] = torch.empty(self.rows, width, dtype=dtype, device=self.device)
        return self._buffers[key]


class DecodeHook(Protocol):
    """What decode context parallelism adds around the decode kernel (implemented by
    `pagedmla.distributed.dcp_attention.DCPDecode`)."""

    def gather_queries(self, q: torch.Tensor) -> torch.Tensor:
        """q [Td, N, L + R] of this rank's heads -> [Td, D * N, L + R], the group's."""
        ...

    def combine(self, out: torch.Tensor, lse: torch.Tensor, ops: Backend) -> torch.Tensor:
        """Partials over this rank's rows, out [Td, D * N, L], lse [D * N, Td] -> the
        result for this rank's N heads, [Td, N, L]."""
        ...


class LatentGather(Protocol):
    """Prefill context parallelism's write of every rank's new latents (implemented by
    `pagedmla.distributed.pcp.PCPLatents`)."""

    def gather(self, kv_c: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This rank's kv_c [T, L], k_pe [T, R] -> the group's, and their slots."""
        ...


class ContextGather(Protocol):
    """How decode context parallelism collects a context chunk's rows from the ranks
    that hold them (implemented by `pagedmla.distributed.dcp_attention.DCPContextGather`)."""

    def gather(self, chunk: ContextChunk, cache: LatentKVCache, block_table: torch.Tensor,
               ops: Backend, out: torch.Tensor) -> None:
        """Fill out [chunk.num_context_tokens, L + R] with the chunk's rows."""
        ...


@dataclass
class DecodeMetadata:
    """The first num_decodes requests: absorbed MQA over the paged cache.

    block_table [Bd, max_blocks] int32; seq_lens [Bd] int32; query_start_loc [Bd + 1]
    int32 (token offsets, bottom-right causal inside each request). dcp: under decode
    context parallelism, the query gather and partial combine around the kernel (the
    seq_lens are then this rank's row counts); None on a single rank. plans: where the
    decode kernels keep what they plan from seq_lens (their split-KV plan) for the
    layers of one forward, so that it is made once per forward, not once per layer;
    None: every call plans for itself. `MLAMetadata.for_forward` gives each forward an
    empty one. query_lens: the requests' token counts on the host, where known.
    """

    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    max_seq_len: int
    dcp: DecodeHook | None = None
    plans: dict | None = None
    query_lens: list[int] | None = None


@dataclass
class ContextChunk:
    """One workspace-sized slice of paged context for a run of prefills. Indices are
    relative to the prefill part of the batch. The chunk gathers, for each covered
    request j, context rows [starts[j], starts[j] + seq_lens[j]) into workspace rows
    [cu_seq_lens[j], cu_seq_lens[j + 1]); the queries are the tokens token_slice."""

    index: int
    request_slice: slice
    token_slice: slice
    continuation_token_end: int
    is_continuation: bool
    starts_list: tuple[int, ...]
    seq_lens_list: tuple[int, ...]
    num_context_tokens: int
    max_query_len: int
    max_seq_len: int
    starts: torch.Tensor
    cu_seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    token_to_seq: torch.Tensor


@dataclass
class ChunkedContext:
    """All context chunks of the prefills, and the prefills that have no context. dcp:
    under decode context parallelism, how each chunk's rows are collected from the ranks
    that hold them (replaces the local gather); None on a single rank."""

    context_lens: list[int]
    chunks: list[ContextChunk]
    empty_token_slices: list[slice]
    workspace: Workspace
    dcp: ContextGather | None = None


@dataclass
class PrefillMetadata:
    """Requests after the decodes: MHA over new tokens, then over context chunks.
    block_table [Bp, max_blocks] int32; query_start_loc [Bp + 1] int32, relative to the
    first prefill token."""

    block_table: torch.Tensor
    query_start_loc: torch.Tensor
    query_lens: list[int]
    seq_lens: list[int]
    max_query_len: int
    context: ChunkedContext | None


@dataclass
class SparseMetadata:
    """The whole batch as sparse attention and its indexer see it (DeepSeek Sparse
    Attention: every query token attends to its own top-k positions, decode and prefill
    rows alike).

    block_table [B, max_blocks] int32, seq_lens [B] int32, query_start_loc [B + 1] int32,
    on the device; max_seq_len the longest seq_len (host int); topk the indexer's k.
    dense: every query sees at most topk positions, so its selection is its whole causal
    context and the dense paths give the sparse result (the indexer then only writes its
    keys).
    """

    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_seq_len: int
    topk: int
    dense: bool


@dataclass
class MLAMetadata:
    """Everything one MLA layer needs for a step; T tokens, decodes first. sparse: the
    batch for sparse attention, for a builder given index_topk; else None. pcp: under
    prefill context parallelism, the latents of every rank of the step, written in
    place of this rank's (slot_mapping then all -1); else None."""

    num_tokens: int
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    num_prefill_tokens: int
    block_size: int
    kv_lora_rank: int
    rope_dim: int
    slot_mapping: torch.Tensor
    max_slot: int
    max_block: int
    device: torch.device
    decode: DecodeMetadata | None
    prefill: PrefillMetadata | None
    sparse: SparseMetadata | None = None
    pcp: LatentGather | None = None

    def for_forward(self) -> MLAMetadata:
        """This metadata for one forward over all layers: its decode part gets an empty
        `plans` store. A forward made while a CUDA graph is captured thus records the
        planning kernel, which each replay re-runs on the replay's seq_lens."""
        if self.decode is None:
            return self
        return replace(self, decode=replace(self.decode, plans={}))

    def describe(self) -> str:
        """A human-readable batch plan: which rows are decode, how context was chunked."""
        lines = [
            f"{self.num_tokens} tokens: {self.num_decodes} decode requests "
            f"({self.num_decode_tokens} tokens), {self.num_prefills} prefills "
            f"({self.num_prefill_tokens} tokens)"
        ]
        if self.prefill is not None and self.prefill.context is not None:
            ctx = self.prefill.context
            lines.append(
                f"context of prefills {ctx.context_lens} in {len(ctx.chunks)} chunks of at most "
                f"{ctx.workspace.rows} rows"
            )
            for chunk in ctx.chunks:
                spans = ", ".join(
                    f"r{self.num_decodes + chunk.request_slice.start + j}"
                    f"[{s}:{s + n}]"
                    for j, (s, n) in enumerate(zip(chunk.starts_list, chunk.seq_lens_list))
                )
                tag = " (continuation)" if chunk.is_continuation else ""
                lines.append(f"  chunk {chunk.index}: {chunk.num_context_tokens} rows {spans}{tag}")
        return "\n".join(lines)


class MLAMetadataBuilder:
    """Builds MLAMetadata for one attention configuration.

    workspace_rows (W) bounds the context rows gathered at once (None: the default rule
    of `determine_workspace_rows` from max_model_len and max_num_seqs); it must hold at
    least one page. decode_threshold: requests with query_len <= this take the decode
    path (> 1 enables multi-token decode, bottom-right causal). router: a cost model
    (`PathCostModel`) that also sends longer requests to the absorbed MQA path when it
    predicts that to be cheaper (short chunked-prefill pieces over long contexts).
    Requests taking the MQA path must come first in a batch. index_topk: the top-k of a
    sparse-attention model's indexer; the metadata then describes the whole batch for it
    (`SparseMetadata`). decode_bound: the MQA rows' max_seq_len at least (the engine's
    max_model_len on graph-safe backends, as in its graphs: `engine/warmup.py`).
    """

    def __init__(
        self,
        dims: MLADims,
        block_size: int = 16,
        device: str | torch.device = "cpu",
        workspace_rows: int | None = None,
        decode_threshold: int = 1,
        max_model_len: int = 8192,
        max_num_seqs: int = 256,
        router: PathCostModel | None = None,
        index_topk: int | None = None,
        decode_bound: int | None = None,
    ) -> None:
        if not isinstance(dims, MLADims):
            raise TypeError(f"dims must be MLADims, got {type(dims).__name__}")
        for name, value in (("block_size", block_size), ("decode_threshold", decode_threshold),
                            ("index_topk", 1 if index_topk is None else index_topk)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if workspace_rows is None:
            workspace_rows = determine_workspace_rows(max_model_len, max_num_seqs, block_size)
        elif isinstance(workspace_rows, bool) or not isinstance(workspace_rows, int):
            raise TypeError(f"workspace_rows must be an int or None, got {workspace_rows!r}")
        if workspace_rows < block_size:
            raise ValueError(
                f"workspace_rows ({workspace_rows}) must be at least the block size "
                f"({block_size}): a split context chunk advances in whole pages"
            )
        self.dims = dims
        self.block_size = block_size
        # Tokens covered by one block-table entry: block_size here; a decode context
        # parallel builder spreads an entry's tokens over several ranks' blocks.
        self.table_block_size = block_size
        self.device = resolve_device(device)
        self.decode_threshold = decode_threshold
        self.router = router
        self.index_topk = index_topk
        self.decode_bound = decode_bound or 0
        self.workspace = Workspace(workspace_rows, self.device)
        # The decode path's collectives under decode context parallelism.
        self.decode_hook: DecodeHook | None = None

    def uses_mqa(self, query_len: int, context_len: int) -> bool:
        """Whether a request with these lengths takes the absorbed MQA (decode) path."""
        if query_len <= self.decode_threshold:
            return True
        return self.router is not None and self.router.prefers_mqa(self.dims, query_len,
                                                                   context_len)

    @property
    def workspace_rows(self) -> int:
        return self.workspace.rows

    def build(self, spec: BatchSpec, validate: bool = True) -> MLAMetadata:
        """The step's metadata. validate=False skips the O(T) check of `slot_mapping`
        against the tokens' positions (`BatchSpec`) for callers that derive the slots
        from the block table, as the engine does every step; the O(B) checks run
        always."""
        query_lens, seq_lens, block_table, slot_mapping, max_block = self._checked(
            spec, slots=validate)
        num_reqs = len(query_lens)
        num_tokens = sum(query_lens)

        mqa = [self.uses_mqa(q, s - q) for q, s in zip(query_lens, seq_lens)]
        num_decodes = mqa.index(False) if False in mqa else num_reqs
        for b in range(num_decodes, num_reqs):
            if mqa[b]:
                raise ValueError(
                    f"requests must be ordered decodes first: request {b} (query_len "
                    f"{query_lens[b]}, seq_len {seq_lens[b]}) takes the decode path (threshold "
                    f"{self.decode_threshold}) but follows a prefill (query_lens {query_lens})"
                )
        num_decode_tokens = sum(query_lens[:num_decodes])
        query_start_loc = list(itertools.accumulate(query_lens, initial=0))

        upload = Int32Upload()
        table_handle = upload.add(block_table.numpy())
        sparse_handles = None
        if self.index_topk is not None:
            sparse_handles = (upload.add(seq_lens), upload.add(query_start_loc))
        decode_handles = prefill_handles = None
        decode_seq_lens = self._decode_seq_lens(seq_lens[:num_decodes])
        if num_decodes:
            decode_handles = (
                upload.add(decode_seq_lens),
                upload.add(query_start_loc[: num_decodes + 1]),
            )
        plans: list[ContextChunkPlan] = []
        context_lens: list[int] = []
        if num_decodes < num_reqs:
            prefill_qsl = [q - num_decode_tokens for q in query_start_loc[num_decodes:]]
            context_lens = [
                s - q for s, q in zip(seq_lens[num_decodes:], query_lens[num_decodes:])
            ]
            plans = self._plan_context(context_lens)
            prefill_handles = (upload.add(prefill_qsl), [self._chunk_arrays(upload, p, prefill_qsl)
                                                         for p in plans])
        packed = upload.upload(self.device)

        def view(handle: tuple[int, int]) -> torch.Tensor:
            return packed[handle[0] : handle[0] + handle[1]]

        table = view(table_handle).view(block_table.shape)
        decode = None
        if decode_handles is not None:
            decode = DecodeMetadata(
                block_table=table[:num_decodes],
                seq_lens=view(decode_handles[0]),
                query_start_loc=view(decode_handles[1]),
                max_query_len=max(query_lens[:num_decodes]),
                max_seq_len=max(self.decode_bound, *decode_seq_lens),
                query_lens=query_lens[:num_decodes],
            )
        prefill = None
        if prefill_handles is not None:
            prefill = self._prefill_metadata(
                table[num_decodes:], view, prefill_handles, prefill_qsl, plans,
                query_lens[num_decodes:], seq_lens[num_decodes:], context_lens,
            )
        sparse = None
        if sparse_handles is not None:
            sparse = SparseMetadata(
                block_table=table, seq_lens=view(sparse_handles[0]),
                query_start_loc=view(sparse_handles[1]), max_seq_len=max(seq_lens),
                topk=self.index_topk, dense=max(seq_lens) <= self.index_topk,
            )
        slots = slot_mapping.to(self.device, non_blocking=True)
        return MLAMetadata(
            num_tokens=num_tokens,
            num_decodes=num_decodes,
            num_decode_tokens=num_decode_tokens,
            num_prefills=num_reqs - num_decodes,
            num_prefill_tokens=num_tokens - num_decode_tokens,
            block_size=self.block_size,
            kv_lora_rank=self.dims.kv_lora_rank,
            rope_dim=self.dims.qk_rope_head_dim,
            slot_mapping=slots,
            max_slot=int(slot_mapping.max()) if num_tokens else -1,
            max_block=max_block,
            device=self.device,
            decode=decode,
            prefill=prefill,
            sparse=sparse,
        )

    def _decode_seq_lens(self, seq_lens: list[int]) -> list[int]:
        """Keys each decode request attends to in this rank's cache: all of them here."""
        return seq_lens

    def decode_spec(self, spec: BatchSpec) -> BatchSpec:
        """A decode-only step's spec as this rank's kernels read it (slots, lengths), for
        inputs that bypass `build` (CUDA graph staging): on one rank, spec itself."""
        return spec

    def _plan_context(self, context_lens: list[int]) -> list[ContextChunkPlan]:
        """Chunks of the prefills' context, each within the workspace."""
        return plan_context_chunks(
            context_lens,
            row_budget=self.workspace.rows,
            max_context_chunk=self.workspace.rows // self.block_size * self.block_size,
            split_alignment=self.block_size,
        )

    def _checked(
        self, spec: BatchSpec, slots: bool
    ) -> tuple[list[int], list[int], torch.Tensor, torch.Tensor, int]:
        """spec's fields checked (its slots too where `slots`), and the largest block id
        the requests use."""
        query_lens = int_list("query_lens", spec.query_lens)
        seq_lens = int_list("seq_lens", spec.seq_lens)
        block_table = check_host_tensor("block_table", spec.block_table, torch.int32, 2)
        slot_mapping = check_host_tensor("slot_mapping", spec.slot_mapping, torch.int64, 1)
        max_block = self._validate(query_lens, seq_lens, block_table, slot_mapping)
        if slots:
            self._validate_slots(query_lens, seq_lens, block_table.numpy(),
                                 slot_mapping.numpy())
        return query_lens, seq_lens, block_table, slot_mapping, max_block

    def _validate_slots(
        self,
        query_lens: list[int],
        seq_lens: list[int],
        block_table: np.ndarray,
        slot_mapping: np.ndarray,
    ) -> None:
        """Raise unless each new token's slot is -1 or the slot of its position in its
        request's blocks, and no slot is written twice (block_table listing a block for
        two written positions, of two requests or of one)."""
        counts = np.asarray(query_lens, dtype=np.int64)
        request = np.repeat(np.arange(counts.size), counts)
        # Request b's tokens sit at batch offsets first[b] .. and positions C_b ..
        first = np.cumsum(counts) - counts
        offsets = np.asarray(seq_lens, dtype=np.int64) - counts - first
        positions = np.arange(slot_mapping.size) + np.repeat(offsets, counts)
        size = self.table_block_size
        entries = positions // size
        expected = block_table[request, entries].astype(np.int64) * size + positions % size
        wrong = (slot_mapping != expected) & (slot_mapping != -1)
        if wrong.any():
            i = int(np.argmax(wrong))
            b, entry = int(request[i]), int(entries[i])
            raise ValueError(
                f"slot_mapping[{i}] must be {expected[i]} or -1, got {slot_mapping[i]}: token "
                f"{i} is position {positions[i]} of request {b}, whose block_table[{b}, "
                f"{entry}] is block {block_table[b, entry]}"
            )
        written = np.sort(slot_mapping[slot_mapping >= 0])
        twice = written[1:] == written[:-1]
        if twice.any():
            slot = int(written[int(np.argmax(twice))])
            tokens = np.flatnonzero(slot_mapping == slot).tolist()
            raise ValueError(
                f"slot_mapping must name each slot once (-1 may repeat), got slot {slot} for "
                f"tokens {tokens}: block_table lists block {slot // size} for the positions "
                "of more than one of them"
            )

    def _validate(
        self,
        query_lens: list[int],
        seq_lens: list[int],
        block_table: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> int:
        """Raise on bad input; return the largest block id the requests use."""
        num_reqs = len(query_lens)
        if num_reqs == 0:
            raise ValueError("a batch needs at least one request, got query_lens []")
        if len(seq_lens) != num_reqs:
            raise ValueError(f"seq_lens has {len(seq_lens)} entries, expected {num_reqs}")
        for b, (q, s) in enumerate(zip(query_lens, seq_lens)):
            if q < 1:
                raise ValueError(f"query_lens[{b}] must be >= 1, got {q}")
            if s < q:
                raise ValueError(f"query_len {q} > seq_len {s} for request {b}")
        if block_table.shape[0] != num_reqs:
            raise ValueError(f"block_table has {block_table.shape[0]} rows, expected {num_reqs}")
        capacity = block_table.shape[1] * self.table_block_size
        longest = max(seq_lens)
        if longest > capacity:
            raise ValueError(
                f"block_table is too short: {block_table.shape[1]} blocks of "
                f"{self.table_block_size} hold {capacity} tokens, but a request has seq_len "
                f"{longest}"
            )
        # One vectorised pass over the entries each request uses (ceil(seq_len / block)).
        used = -(-np.asarray(seq_lens) // self.table_block_size)
        in_use = np.arange(block_table.shape[1]) < used[:, None]
        used_ids = block_table.numpy()[in_use]
        if used_ids.size and used_ids.min() < 0:
            row = int(np.nonzero((block_table.numpy() < 0) & in_use)[0][0])
            raise ValueError(
                f"block_table[{row}] has a negative block id among its {used[row]} used"
            )
        num_tokens = sum(query_lens)
        if slot_mapping.shape[0] != num_tokens:
            raise ValueError(
                f"slot_mapping has {slot_mapping.shape[0]} entries, expected {num_tokens} (one "
                "per new token)"
            )
        if num_tokens and int(slot_mapping.min()) < -1:
            raise ValueError(
                f"slot_mapping holds {int(slot_mapping.min())}; slots are >= 0, or -1 for no write"
            )
        return int(used_ids.max()) if used_ids.size else 0

    @staticmethod
    def _chunk_arrays(
        upload: Int32Upload, plan: ContextChunkPlan, prefill_qsl: list[int]
    ) -> tuple[tuple[int, int], ...]:
        base = prefill_qsl[plan.request_start]
        return (
            upload.add(plan.starts),
            upload.add(list(itertools.accumulate(plan.seq_lens, initial=0))),
            upload.add(
                [prefill_qsl[r] - base for r in range(plan.request_start, plan.request_end + 1)]
            ),
            upload.add(np.repeat(np.arange(len(plan.seq_lens), dtype=np.int32), plan.seq_lens)),
        )

    def _prefill_metadata(
        self,
        block_table: torch.Tensor,
        view,
        handles,
        prefill_qsl: list[int],
        plans: list[ContextChunkPlan],
        query_lens: list[int],
        seq_lens: list[int],
        context_lens: list[int],
    ) -> PrefillMetadata:
        qsl_handle, chunk_handles = handles
        context = None
        if plans:
            chunks = []
            for index, (plan, arrays) in enumerate(zip(plans, chunk_handles)):
                starts, cu_seq_lens, chunk_qsl, token_to_seq = (view(h) for h in arrays)
                chunks.append(
                    ContextChunk(
                        index=index,
                        request_slice=slice(plan.request_start, plan.request_end),
                        token_slice=slice(
                            prefill_qsl[plan.request_start], prefill_qsl[plan.request_end]
                        ),
                        continuation_token_end=prefill_qsl[plan.request_start + 1],
                        is_continuation=plan.is_continuation,
                        starts_list=plan.starts,
                        seq_lens_list=plan.seq_lens,
                        num_context_tokens=plan.num_rows,
                        max_query_len=max(query_lens[plan.request_start : plan.request_end]),
                        max_seq_len=max(plan.seq_lens),
                        starts=starts,
                        cu_seq_lens=cu_seq_lens,
                        query_start_loc=chunk_qsl,
                        token_to_seq=token_to_seq,
                    )
                )
            context = ChunkedContext(
                context_lens=context_lens,
                chunks=chunks,
                empty_token_slices=[
                    slice(prefill_qsl[i], prefill_qsl[i + 1])
                    for i, c in enumerate(context_lens)
                    if c == 0
                ],
                workspace=self.workspace,
            )
        return PrefillMetadata(
            block_table=block_table,
            query_start_loc=view(qsl_handle),
            query_lens=query_lens,
            seq_lens=seq_lens,
            max_query_len=max(query_lens),
            context=context,
        )

"""Prefill context parallelism (PCP): one step's prompt tokens spread over P ranks.

Every PCP rank holds the same weights (its TP group is a full replica of the model)
and the same cache: each writes every token of the step, so decode, which each
replica runs alike, finds the layout it expects (with decode context parallelism,
each rank's share of it). A step with prompt tokens is split instead of replicated:

- Each prompt piece of q new tokens is cut into 2P chunks at k * q // (2P); rank i
  takes chunks i and 2P - 1 - i, so that under the causal mask every rank attends
  over about the same number of keys (a rank with an early chunk also has a late one).
  A chunk [a, e) of a request with context C is a request of its own for the rank's
  metadata: e - a new tokens over a context of C + a rows.
- Requests that take the absorbed MQA path (decodes) run on PCP rank 0 only.
- In every layer the ranks all-gather their new latents and each writes all of them to
  its cache before attention (`PCPLatents`), so the rows [C, C + a) that a late chunk
  reads as context are there; queries, MLP and norms see the rank's tokens only.
- The hidden states of the rows to sample are all-gathered at the end; every rank then
  computes the same logits.

A step that would leave some rank without a token runs replicated: every rank runs
all of it and writes its own latents, as without PCP.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pagedmla.distributed.state import ParallelState
from pagedmla.metadata import BatchSpec

# (request, first query row, end query row) of one piece of a rank's share.
Piece = tuple[int, int, int]


def plan_shares(
    query_lens: list[int],
    seq_lens: list[int],
    size: int,
    uses_mqa: Callable[[int, int], bool],
) -> list[list[Piece]] | None:
    """Each PCP rank's pieces of the step, in the order its batch lists them (pieces
    taking the MQA path first, as a builder needs), or None when the step is not split:
    it has no request for the MHA path, or some rank would get no token.

    uses_mqa(query_len, context_len): the metadata builder's path choice.
    """
    contexts = [s - q for q, s in zip(query_lens, seq_lens)]
    mqa = [uses_mqa(q, c) for q, c in zip(query_lens, contexts)]
    if all(mqa):
        return None
    shares: list[list[Piece]] = [[] for _ in range(size)]
    for b, q in enumerate(query_lens):
        if mqa[b]:
            shares[0].append((b, 0, q))
            continue
        bounds = [k * q // (2 * size) for k in range(2 * size + 1)]
        for k in range(2 * size):
            a, e = bounds[k], bounds[k + 1]
            if a == e:
                continue
            share = shares[min(k, 2 * size - 1 - k)]
            if share and share[-1][0] == b and share[-1][2] == a:  # adjacent: one piece
                share[-1] = (b, share[-1][1], e)
            else:
                share.append((b, a, e))
    if not all(shares):
        return None
    return [
        sorted(share, key=lambda p: not uses_mqa(p[2] - p[1], contexts[p[0]] + p[1]))
        for share in shares
    ]


@dataclass
class PCPStep:
    """One split step as this rank runs it (host plan, device index tensors).

    rows [T_local] int64 (host): the step's token rows this rank runs, in its order.
    spec: the rank's batch over those rows (every slot -1: the latents are written
    from the gather). latents: the per-layer gather and write. sample_index [Ms] and
    sample_order [S] (device, int64): this rank's rows to sample (padded to the
    largest rank's count Ms) and, in the gathered [P * Ms], the step's sample rows in
    order.
    """

    rows: torch.Tensor
    spec: BatchSpec
    latents: PCPLatents
    sample_index: torch.Tensor
    sample_order: torch.Tensor


class PCPLatents:
    """The new latents of every PCP rank, written to this rank's cache in each layer.

    slots [P * M] int64 on the device: the cache slot (this rank's, -1: none) of every
    rank's rows, each rank's padded to M.
    """

    def __init__(self, state: ParallelState, slots: torch.Tensor, rows_per_rank: int) -> None:
        self.state = state
        self.slots = slots
        self.rows_per_rank = rows_per_rank

    def gather(
        self, kv_c: torch.Tensor, k_pe: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """kv_c [T_local, L], k_pe [T_local, R] -> the group's ([P * M, L], [P * M, R],
        slots [P * M])."""
        L = kv_c.shape[1]
        packed = kv_c.new_zeros(self.rows_per_rank, L + k_pe.shape[1])
        packed[: kv_c.shape[0], :L] = kv_c
        packed[: kv_c.shape[0], L:] = k_pe
        gathered = self.state.pcp_all_gather(packed).flatten(0, 1)
        return gathered[:, :L], gathered[:, L:], self.slots


class PrefillContextParallel:
    """Splits the steps of this rank's engine (`plan`) and collects their sampled rows
    (`gather_samples`).

    uses_mqa: the metadata builder's path choice; local_slots: the builder's map from
    the engine's slots to this rank's cache (decode context parallelism keeps a share).
    """

    def __init__(
        self,
        state: ParallelState,
        uses_mqa: Callable[[int, int], bool],
        local_slots: Callable[[torch.Tensor], torch.Tensor],
        device: torch.device,
    ) -> None:
        self.state = state
        self.uses_mqa = uses_mqa
        self.local_slots = local_slots
        self.device = device
        self.steps_split = 0  # steps run split (the others ran whole on every rank)

    def plan(self, spec: BatchSpec, sample_rows: list[int]) -> PCPStep | None:
        """This rank's part of a step, or None to run it whole (`plan_shares`)."""
        query_lens, seq_lens = list(spec.query_lens), list(spec.seq_lens)
        shares = plan_shares(query_lens, seq_lens, self.state.pcp_size, self.uses_mqa)
        if shares is None:
            return None
        self.steps_split += 1
        starts = list(itertools.accumulate(query_lens, initial=0))
        rows = [np.concatenate([np.arange(starts[b] + a, starts[b] + e) for b, a, e in share])
                for share in shares]
        M = max(len(r) for r in rows)
        slots = np.full((len(rows), M), -1, dtype=np.int64)
        for k, r in enumerate(rows):
            slots[k, : len(r)] = spec.slot_mapping.numpy()[r]
        mine = shares[self.state.pcp_rank]
        local = BatchSpec(
            query_lens=[e - a for _, a, e in mine],
            seq_lens=[seq_lens[b] - query_lens[b] + e for b, _, e in mine],
            block_table=spec.block_table[torch.tensor([b for b, _, _ in mine])],
            slot_mapping=torch.full((len(rows[self.state.pcp_rank]),), -1, dtype=torch.int64),
        )
        # Step row r lives on rank owner[r] at local index where[r].
        owner = np.empty(starts[-1], dtype=np.int64)
        where = np.empty(starts[-1], dtype=np.int64)
        for k, r in enumerate(rows):
            owner[r], where[r] = k, np.arange(len(r))
        sampled = np.asarray(sample_rows, dtype=np.int64)
        by = owner[sampled]
        counts = np.bincount(by, minlength=len(rows))
        Ms = int(counts.max()) if sampled.size else 0
        index = where[sampled[by == self.state.pcp_rank]]
        index = np.concatenate([index, np.zeros(Ms - index.size, dtype=np.int64)])
        # Sample j is the rank's rank_order[j]-th sample: its row k * Ms + that in the gather.
        rank_order = np.empty_like(by)
        for k in range(len(rows)):
            rank_order[by == k] = np.arange(counts[k])
        order = by * Ms + rank_order
        upload = torch.from_numpy(np.concatenate([index, order, slots.reshape(-1)]))
        device = upload.to(self.device, non_blocking=True)
        latents = PCPLatents(self.state, self.local_slots(device[index.size + order.size :]), M)
        return PCPStep(
            rows=torch.from_numpy(rows[self.state.pcp_rank]),
            spec=local,
            latents=latents,
            sample_index=device[: index.size],
            sample_order=device[index.size : index.size + order.size],
        )

    def gather_samples(self, hidden: torch.Tensor, step: PCPStep) -> torch.Tensor:
        """hidden [T_local, H] of this rank's rows -> [S, H], the step's sample rows in
        order (the same on every PCP rank)."""
        if step.sample_order.numel() == 0:
            return hidden[:0]
        gathered = self.state.pcp_all_gather(hidden.index_select(0, step.sample_index))
        return gathered.flatten(0, 1).index_select(0, step.sample_order)

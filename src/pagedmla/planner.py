"""Packing per-request context into workspace-sized chunks (host logic only).

A chunk covers a contiguous run of prefills: requests are packed in order until the
row budget is full, and the request that does not fit is split on an aligned
boundary, its remainder opening the next chunk. So only a chunk's first request can
be a continuation, and no chunk holds an empty context span.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ContextChunkPlan:
    """Request-space layout of one context chunk.

    Requests [request_start, request_end) of the prefill list are covered; request
    request_start + j contributes context rows [starts[j], starts[j] + seq_lens[j]).
    """

    request_start: int
    request_end: int
    starts: tuple[int, ...]
    seq_lens: tuple[int, ...]
    is_continuation: bool

    @property
    def num_rows(self) -> int:
        return sum(self.seq_lens)


def _identity(rows: int) -> int:
    return rows


def _check_int(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return value


def plan_context_chunks(
    context_lens: Sequence[int],
    row_budget: int,
    max_context_chunk: int,
    split_alignment: int,
    padded_rows: Callable[[int], int] | None = None,
) -> list[ContextChunkPlan]:
    """Pack the context rows of prefills (in request order) into chunks.

    context_lens: C per prefill (0: no context, the request is in no chunk).
    row_budget: workspace rows a chunk may use, as counted by `padded_rows`.
    max_context_chunk: the longest slice of one request that a split may produce.
    split_alignment: a split request advances in multiples of this (the page size, so
        that a continuation starts on a block boundary).
    padded_rows: rows that context positions [0, n) occupy in the workspace (default
        n; under decode context parallelism the rows held by one rank, padded).
    """
    _check_int("row_budget", row_budget, 1)
    _check_int("max_context_chunk", max_context_chunk, 1)
    _check_int("split_alignment", split_alignment, 1)
    for i, length in enumerate(context_lens):
        _check_int(f"context_lens[{i}]", length, 0)
    rows_of = padded_rows or _identity

    def span(start: int, length: int) -> int:
        return rows_of(start + length) - rows_of(start)

    def aligned_split(start: int, remaining: int, available: int) -> int:
        # Largest aligned length that leaves part of the request for later and fits.
        longest = min(max_context_chunk, (remaining - 1) // split_alignment * split_alignment)
        low, high = 0, longest // split_alignment
        while low < high:
            mid = (low + high + 1) // 2
            if span(start, mid * split_alignment) <= available:
                low = mid
            else:
                high = mid - 1
        return low * split_alignment

    plans: list[ContextChunkPlan] = []
    request, start = 0, 0
    num_requests = len(context_lens)
    while request < num_requests:
        if context_lens[request] == 0:
            request += 1
            continue
        first, starts, lengths, rows = request, [], [], 0
        while request < num_requests and context_lens[request] > 0:
            remaining = context_lens[request] - start
            needed = span(start, remaining)
            if rows + needed > row_budget:
                split = aligned_split(start, remaining, row_budget - rows)
                if split > 0:
                    starts.append(start)
                    lengths.append(split)
                    rows += span(start, split)
                    start += split
                break
            rows += needed
            starts.append(start)
            lengths.append(remaining)
            request += 1
            start = 0
        if not lengths:
            raise ValueError(
                f"row_budget {row_budget} cannot hold one aligned piece of request {request} "
                f"(split_alignment {split_alignment}, context {context_lens[request]})"
            )
        plans.append(
            ContextChunkPlan(
                request_start=first,
                request_end=first + len(lengths),
                starts=tuple(starts),
                seq_lens=tuple(lengths),
                is_continuation=starts[0] > 0,
            )
        )
    return plans


def determine_workspace_rows(max_model_len: int, max_num_seqs: int, block_size: int) -> int:
    """Default workspace rows W for chunked context.

    Room for eight full-length requests or four pages per request, whichever is more,
    but never over 64Ki rows (a 64Ki x 576 bf16 workspace is 72 MiB, while its
    up-projection for 128 heads is about 3 GiB); rounded up to whole pages.
    """
    _check_int("max_model_len", max_model_len, 1)
    _check_int("max_num_seqs", max_num_seqs, 1)
    _check_int("block_size", block_size, 1)
    rows = min(max(8 * max_model_len, 4 * max_num_seqs * block_size), 64 * 1024)
    rows = max(rows, block_size)
    return -(-rows // block_size) * block_size

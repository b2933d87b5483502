"""The chunked-context planner: properties of plan_context_chunks and the builder's use of it."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedmla import BatchSpec, MLADims, MLAMetadataBuilder, plan_context_chunks
from pagedmla.planner import determine_workspace_rows

DIMS = MLADims(num_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
               v_head_dim=8)


def _identity(n: int) -> int:
    return n


def check_plans(
    plans,
    context_lens: list[int],
    row_budget: int,
    max_context_chunk: int,
    split_alignment: int,
    padded_rows: Callable[[int], int] = _identity,
) -> None:
    """Every invariant the planner promises, for any input."""
    pieces = []  # (request, start, length) in plan order
    for plan in plans:
        n = plan.request_end - plan.request_start
        assert n >= 1
        assert len(plan.starts) == len(plan.seq_lens) == n
        assert isinstance(plan.starts, tuple) and isinstance(plan.seq_lens, tuple)
        # No empty span; only the first request of a chunk may start mid-context.
        assert all(length > 0 for length in plan.seq_lens)
        assert all(start == 0 for start in plan.starts[1:])
        assert plan.is_continuation == (plan.starts[0] > 0)
        rows = sum(padded_rows(s + n) - padded_rows(s) for s, n in zip(plan.starts,
                                                                       plan.seq_lens))
        assert rows <= row_budget
        for j, (start, length) in enumerate(zip(plan.starts, plan.seq_lens)):
            request = plan.request_start + j
            assert context_lens[request] > 0
            assert start % split_alignment == 0
            assert start + length <= context_lens[request]
            if start + length < context_lens[request]:  # a split piece, not the last one
                assert length % split_alignment == 0
                assert length <= max_context_chunk
                assert j == n - 1, "only a chunk's last request can be cut short"
            pieces.append((request, start, length))
    # Every context row exactly once, in order: pieces of each request tile [0, C).
    expected_request = [r for r, c in enumerate(context_lens) if c > 0]
    covered = {r: 0 for r in expected_request}
    order = []
    for request, start, length in pieces:
        assert start == covered[request], "rows skipped, repeated or out of order"
        covered[request] += length
        order.append(request)
    assert covered == {r: context_lens[r] for r in expected_request}
    assert order == sorted(order)


def check_greedy(plans, context_lens, row_budget, max_context_chunk, split_alignment,
                 padded_rows: Callable[[int], int] = _identity) -> None:
    """Chunks are packed as full as the rules allow (the seed's greedy packing)."""
    for plan, following in itertools.pairwise(plans):
        rows = sum(padded_rows(s + n) - padded_rows(s) for s, n in zip(plan.starts,
                                                                       plan.seq_lens))
        last = plan.request_end - 1
        start, length = plan.starts[-1], plan.seq_lens[-1]
        if start + length < context_lens[last]:
            # The split could not have been one alignment step longer.
            longer = length + split_alignment
            assert (
                longer > max_context_chunk
                or start + longer >= context_lens[last]
                or rows - (padded_rows(start + length) - padded_rows(start))
                + padded_rows(start + longer) - padded_rows(start) > row_budget
            )
        elif following.request_start == last + 1 and context_lens[last + 1] > 0:
            # The next request did not fit whole, nor did one aligned piece of it.
            nxt = context_lens[last + 1]
            assert rows + padded_rows(nxt) > row_budget
            if split_alignment < nxt and split_alignment <= max_context_chunk:
                assert rows + padded_rows(split_alignment) > row_budget


@st.composite
def planner_inputs(draw):
    alignment = draw(st.sampled_from([1, 2, 4, 16]))
    budget = draw(st.integers(alignment, 600))
    max_chunk = draw(st.integers(alignment, 2 * budget))
    context_lens = draw(st.lists(
        st.one_of(st.just(0), st.integers(1, 40), st.integers(1, 2000)), max_size=40
    ))
    return context_lens, budget, max_chunk, alignment


@settings(max_examples=300, deadline=None)
@given(planner_inputs())
def test_plan_invariants(args) -> None:
    context_lens, budget, max_chunk, alignment = args
    plans = plan_context_chunks(context_lens, budget, max_chunk, alignment)
    check_plans(plans, context_lens, budget, max_chunk, alignment)
    check_greedy(plans, context_lens, budget, max_chunk, alignment)


@st.composite
def dcp_inputs(draw):
    # DCP-like: 2 ranks, interleave 4 rows: a chunk costs ceil(n / 8) * 4 rows per rank,
    # and a split is aligned to lcm(block_size, 8).
    block_size = draw(st.sampled_from([1, 4, 16, 64]))
    alignment = math.lcm(block_size, 8)
    workspace = draw(st.integers(1, 40)) * alignment
    context_lens = draw(st.lists(st.integers(0, 3000), max_size=30))
    return context_lens, workspace // 2, workspace // alignment * alignment, alignment


@settings(max_examples=200, deadline=None)
@given(dcp_inputs())
def test_plan_invariants_with_padded_rows(args) -> None:
    context_lens, budget, max_chunk, alignment = args

    def padded(n: int) -> int:
        return -(-n // 8) * 4

    plans = plan_context_chunks(context_lens, budget, max_chunk, alignment, padded_rows=padded)
    check_plans(plans, context_lens, budget, max_chunk, alignment, padded)
    check_greedy(plans, context_lens, budget, max_chunk, alignment, padded)


def test_one_long_and_many_short_contexts_fit_one_chunk() -> None:
    contexts = [60_000] + [16] * 31
    plans = plan_context_chunks(contexts, 65_536, 65_536, 16)
    assert len(plans) == 1
    plan = plans[0]
    assert (plan.request_start, plan.request_end) == (0, 32)
    assert plan.starts == (0,) * 32
    assert plan.seq_lens == tuple(contexts)
    assert not plan.is_continuation


def test_split_example() -> None:
    # 100 rows in a 32-row budget, alignment 16: 32, 32, 32, then the 4-row remainder
    # shares its chunk with the next request; the zero-context request ends a chunk.
    plans = plan_context_chunks([100, 20, 0, 40], 32, 32, 16)
    got = [(p.request_start, p.request_end, p.starts, p.seq_lens, p.is_continuation)
           for p in plans]
    assert got == [
        (0, 1, (0,), (32,), False),
        (0, 1, (32,), (32,), True),
        (0, 1, (64,), (32,), True),
        (0, 2, (96, 0), (4, 20), True),
        (3, 4, (0,), (32,), False),
        (3, 4, (32,), (8,), True),
    ]


def test_no_context_gives_no_plan() -> None:
    assert plan_context_chunks([0, 0, 0], 64, 64, 16) == []
    assert plan_context_chunks([], 64, 64, 16) == []


def test_budget_too_small_for_one_aligned_piece() -> None:
    with pytest.raises(ValueError, match="row_budget"):
        plan_context_chunks([100], 8, 16, 16)


# --- the builder ---------------------------------------------------------------------------


def _spec(query_lens: list[int], seq_lens: list[int], block_size: int) -> BatchSpec:
    """A BatchSpec with distinct blocks per request (contents are irrelevant here)."""
    used = [-(-s // block_size) for s in seq_lens]
    table = torch.zeros(len(seq_lens), max(used), dtype=torch.int32)
    next_block = 1
    slots = []
    for b, n in enumerate(used):
        table[b, :n] = torch.arange(next_block, next_block + n, dtype=torch.int32)
        next_block += n
        for p in range(seq_lens[b] - query_lens[b], seq_lens[b]):
            slots.append(int(table[b, p // block_size]) * block_size + p % block_size)
    return BatchSpec(query_lens, seq_lens, table, torch.tensor(slots, dtype=torch.int64))


def test_builder_chunks_and_empty_slices() -> None:
    block_size = 16
    q_lens = [1, 1, 5, 3, 7, 4, 6]
    contexts = [9, 30, 0, 100, 0, 40, 0]
    seq_lens = [q + c for q, c in zip(q_lens, contexts)]
    builder = MLAMetadataBuilder(DIMS, block_size=block_size, workspace_rows=32)
    meta = builder.build(_spec(q_lens, seq_lens, block_size))
    assert (meta.num_decodes, meta.num_decode_tokens) == (2, 2)
    assert (meta.num_prefills, meta.num_prefill_tokens) == (5, 25)
    assert meta.num_tokens == 27
    assert meta.decode is not None and meta.decode.max_seq_len == 31
    prefill = meta.prefill
    assert prefill is not None
    assert list(prefill.query_lens) == q_lens[2:]
    assert list(prefill.seq_lens) == seq_lens[2:]
    context = prefill.context
    assert context is not None
    # Prefill-relative token rows: [0,5) [5,8) [8,15) [15,19) [19,25).
    assert context.empty_token_slices == [slice(0, 5), slice(8, 15), slice(19, 25)]
    assert list(context.context_lens) == [0, 100, 0, 40, 0]
    got = [(c.request_slice, c.token_slice, c.is_continuation, tuple(c.starts_list),
            tuple(c.seq_lens_list), c.num_context_tokens) for c in context.chunks]
    assert got == [
        (slice(1, 2), slice(5, 8), False, (0,), (32,), 32),
        (slice(1, 2), slice(5, 8), True, (32,), (32,), 32),
        (slice(1, 2), slice(5, 8), True, (64,), (32,), 32),
        (slice(1, 2), slice(5, 8), True, (96,), (4,), 4),
        (slice(3, 4), slice(15, 19), False, (0,), (32,), 32),
        (slice(3, 4), slice(15, 19), True, (32,), (8,), 8),
    ]
    text = meta.describe()
    assert isinstance(text, str) and "continuation" in text


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from([1, 4, 16]),
    st.integers(1, 6),
    st.lists(st.tuples(st.integers(2, 9), st.integers(0, 120)), min_size=1, max_size=6),
)
def test_builder_chunks_cover_their_tokens(block_size: int, pages: int, prefills) -> None:
    # Each chunk's token_slice is exactly the new tokens of its requests; all context
    # rows are covered once; every prefill without context is an empty token slice.
    q_lens = [q for q, _ in prefills]
    contexts = [c for _, c in prefills]
    seq_lens = [q + c for q, c in prefills]
    workspace = pages * block_size
    meta = MLAMetadataBuilder(DIMS, block_size=block_size, workspace_rows=workspace).build(
        _spec(q_lens, seq_lens, block_size)
    )
    starts = list(itertools.accumulate(q_lens, initial=0))
    context = meta.prefill.context
    if not any(contexts):
        assert context is None
        return
    assert context.empty_token_slices == [
        slice(starts[i], starts[i + 1]) for i, c in enumerate(contexts) if c == 0
    ]
    for chunk in context.chunks:
        r = chunk.request_slice
        assert chunk.token_slice == slice(starts[r.start], starts[r.stop])
        assert chunk.num_context_tokens == sum(chunk.seq_lens_list) <= workspace
    check_plans(
        [_as_plan(c) for c in context.chunks], contexts, workspace,
        workspace // block_size * block_size, block_size,
    )


class _as_plan:  # noqa: N801 - a tiny adapter, named like the function it stands for
    """A ContextChunk seen through the plan interface that check_plans reads."""

    def __init__(self, chunk) -> None:
        self.request_start = chunk.request_slice.start
        self.request_end = chunk.request_slice.stop
        self.starts = tuple(chunk.starts_list)
        self.seq_lens = tuple(chunk.seq_lens_list)
        self.is_continuation = chunk.is_continuation


# --- workspace sizing ----------------------------------------------------------------------


def _hand_rule(max_model_len: int, max_num_seqs: int, block_size: int) -> int:
    rows = min(max(8 * max_model_len, 4 * max_num_seqs * block_size), 64 * 1024)
    return math.ceil(rows / block_size) * block_size


@pytest.mark.parametrize(
    ("max_model_len", "max_num_seqs", "block_size", "expected"),
    [
        (8192, 256, 16, 65_536),  # capped at 64Ki
        (100, 3, 7, 805),  # 8 * 100 = 800, rounded up to a multiple of 7
        (1000, 256, 48, 49_152),  # four pages per sequence wins
        (1000, 256, 100, 65_600),  # capped, then rounded up to whole pages
        (2, 1, 3, 18),  # 8 * 2 = 16 beats 4 * 1 * 3 = 12; rounded up to 18
    ],
)
def test_default_workspace_rows(max_model_len, max_num_seqs, block_size, expected) -> None:
    builder = MLAMetadataBuilder(DIMS, block_size=block_size, max_model_len=max_model_len,
                                 max_num_seqs=max_num_seqs)
    assert builder.workspace_rows == expected
    assert determine_workspace_rows(max_model_len, max_num_seqs, block_size) == expected


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 200_000), st.integers(1, 1024), st.sampled_from([1, 8, 16, 64, 96, 128]))
def test_default_workspace_rule(max_model_len, max_num_seqs, block_size) -> None:
    rows = determine_workspace_rows(max_model_len, max_num_seqs, block_size)
    assert rows == _hand_rule(max_model_len, max_num_seqs, block_size)
    assert rows % block_size == 0


def test_workspace_override() -> None:
    builder = MLAMetadataBuilder(DIMS, block_size=16, workspace_rows=48, max_model_len=8192)
    assert builder.workspace_rows == 48

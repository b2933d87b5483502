"""BlockManager: allocation, reference counts, prefix caching, and collision safety."""

from __future__ import annotations

from collections.abc import Callable
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedmla.engine import block_manager as block_manager_module
from pagedmla.engine.block_manager import BlockManager
from pagedmla.engine.sampling_params import SamplingParams
from pagedmla.engine.sequence import Sequence


def make_seq(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, tokens, SamplingParams())


def compute(manager: BlockManager, seq: Sequence, num_new_tokens: int) -> None:
    """What one engine step does for ``seq``: reserve slots, run, commit."""
    manager.append_slots(seq, num_new_tokens)
    seq.num_computed_tokens += num_new_tokens
    manager.commit(seq)


def constant_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Every block collides with every other one."""
    return 7


def test_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(1, 4)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 0)


def test_null_block_is_never_handed_out_and_every_block_returns() -> None:
    manager = BlockManager(num_blocks=9, block_size=4)
    seq = make_seq(0, list(range(32)))
    assert manager.num_free_blocks == 8
    assert manager.can_append(seq, 32)
    assert not manager.can_append(seq, 33)
    manager.append_slots(seq, 32)
    assert sorted(seq.block_table) == list(range(1, 9))
    assert manager.num_free_blocks == 0
    other = make_seq(1, [1])
    assert not manager.can_append(other, 1)
    with pytest.raises(RuntimeError, match="out of cache blocks"):
        manager.append_slots(other, 1)
    manager.free(seq)
    assert seq.block_table == []
    assert manager.num_free_blocks == 8
    assert all(manager.ref_count(block) == 0 for block in range(9))


def test_append_slots_grows_only_when_a_block_fills() -> None:
    manager = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(0, list(range(6)))
    compute(manager, seq, 3)
    assert len(seq.block_table) == 1
    compute(manager, seq, 1)
    assert len(seq.block_table) == 1
    compute(manager, seq, 2)
    assert len(seq.block_table) == 2
    assert manager.slot(seq, 5) == seq.block_table[1] * 4 + 1


def test_prefix_hit_requires_equal_tokens() -> None:
    manager = BlockManager(num_blocks=16, block_size=4)
    first = make_seq(0, list(range(10)))
    compute(manager, first, 10)
    cached_blocks = first.block_table[:2]
    manager.free(first)

    same_prefix = make_seq(1, [*range(8), 99, 98])
    assert manager.match_prefix(same_prefix) == 8
    assert same_prefix.num_computed_tokens == 8
    assert same_prefix.block_table == cached_blocks

    second_block_differs = make_seq(2, [0, 1, 2, 3, 4, 99, 6, 7, 8])
    assert manager.match_prefix(second_block_differs) == 4

    first_token_differs = make_seq(3, [99, *range(1, 10)])
    assert manager.match_prefix(first_token_differs) == 0
    assert first_token_differs.block_table == []


def test_match_leaves_at_least_one_token_to_compute() -> None:
    manager = BlockManager(num_blocks=16, block_size=4)
    first = make_seq(0, list(range(8)))
    compute(manager, first, 8)
    manager.free(first)
    again = make_seq(1, list(range(8)))
    assert manager.match_prefix(again) == 4  # the last cached block is recomputed
    assert again.num_uncomputed == 4


def test_prefix_caching_off_never_matches() -> None:
    manager = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    first = make_seq(0, list(range(10)))
    compute(manager, first, 10)
    manager.free(first)
    assert manager.match_prefix(make_seq(1, list(range(10)))) == 0


def test_shared_blocks_are_reference_counted() -> None:
    manager = BlockManager(num_blocks=8, block_size=2)
    owner = make_seq(0, [1, 2, 3, 4, 5])
    compute(manager, owner, 5)
    sharer = make_seq(1, [1, 2, 3, 4, 6])
    assert manager.match_prefix(sharer) == 4
    shared = sharer.block_table[:]
    assert shared == owner.block_table[:2]
    assert [manager.ref_count(block) for block in shared] == [2, 2]
    free_before = manager.num_free_blocks
    manager.free(owner)
    assert [manager.ref_count(block) for block in shared] == [1, 1]
    assert manager.num_free_blocks == free_before + 1  # only the owner's private tail block
    manager.free(sharer)
    assert [manager.ref_count(block) for block in shared] == [0, 0]
    assert manager.num_free_blocks == 7  # cached blocks count as free (evictable)


def test_freeing_twice_drops_the_references_once() -> None:
    manager = BlockManager(num_blocks=8, block_size=2)
    owner = make_seq(0, [1, 2, 3, 4, 5])
    compute(manager, owner, 5)
    sharer = make_seq(1, [1, 2, 3, 4, 6])
    manager.match_prefix(sharer)
    manager.free(owner)
    manager.free(owner)
    assert [manager.ref_count(block) for block in sharer.block_table] == [1, 1]


def test_reclaim_releases_blocks_that_no_holder_references() -> None:
    """After a step cut short: a block taken for a table it never reached, and a shared
    prefix held by a dropped sequence, come back; the holders' blocks stay theirs."""
    manager = BlockManager(num_blocks=10, block_size=2)
    holder = make_seq(0, [1, 2, 3, 4, 5])
    compute(manager, holder, 5)
    dropped = make_seq(1, [1, 2, 3, 4, 6, 7])
    manager.match_prefix(dropped)
    manager.append_slots(dropped, 2)
    stray = manager._allocate()
    assert manager.num_free_blocks == 9 - 3 - 1 - 1
    manager.reclaim([holder])
    assert [manager.ref_count(block) for block in holder.block_table] == [1, 1, 1]
    assert manager.ref_count(stray) == 0
    assert manager.num_free_blocks == 9 - 3
    assert manager.block_tables([holder]).tolist() == [holder.block_table]
    manager.reclaim([])
    assert manager.num_free_blocks == 9
    assert all(manager.ref_count(block) == 0 for block in range(10))
    assert manager.match_prefix(make_seq(2, [1, 2, 3, 4, 9])) == 4  # still cached


def test_eviction_takes_the_tail_first_and_drops_the_hash() -> None:
    manager = BlockManager(num_blocks=3, block_size=2)
    first = make_seq(0, [1, 2, 3, 4])
    compute(manager, first, 4)
    head, tail = first.block_table
    manager.free(first)
    assert manager.num_free_blocks == 2

    other = make_seq(1, [9, 9])
    manager.append_slots(other, 1)
    assert other.block_table == [tail]  # the tail was released first, so it goes first
    reader = make_seq(2, [1, 2, 3, 4, 5])
    assert manager.match_prefix(reader) == 2  # the head still hits
    assert reader.block_table == [head]
    manager.free(reader)
    manager.free(other)

    manager.append_slots(make_seq(3, [8, 8, 8, 8]), 4)  # needs both blocks: evicts the head
    assert manager.match_prefix(make_seq(4, [1, 2, 3, 4, 5])) == 0


def test_identical_prompts_in_one_step_share_registration_and_chain_on() -> None:
    manager = BlockManager(num_blocks=16, block_size=2)
    first, twin = make_seq(0, [1, 2, 3, 4]), make_seq(1, [1, 2, 3, 4])
    for seq in (first, twin):
        assert manager.match_prefix(seq) == 0
        manager.append_slots(seq, 4)
    for seq in (first, twin):
        seq.num_computed_tokens = 4
        manager.commit(seq)
    # The twin keeps private copies but its later blocks chain onto the first's content.
    twin.token_ids += [5, 6]
    compute(manager, twin, 2)
    later = make_seq(2, [1, 2, 3, 4, 5, 6, 7])
    assert manager.match_prefix(later) == 6
    assert later.block_table == [*first.block_table, twin.block_table[2]]


def test_hash_collision_never_matches_different_content() -> None:
    with mock.patch.object(block_manager_module, "hash_block_tokens", constant_hash):
        manager = BlockManager(num_blocks=16, block_size=2)
        first = make_seq(0, [1, 2, 3])
        compute(manager, first, 3)
        manager.free(first)
        assert manager.match_prefix(make_seq(1, [4, 5, 6])) == 0
        assert manager.match_prefix(make_seq(2, [1, 2, 6])) == 2

        # Equal tokens but a different parent: the second block of [5, 5, 5, 5] must not
        # serve as the first block of [5, 5, ...] (other positions, other latents).
        repeated = make_seq(3, [5, 5, 5, 5, 0])
        compute(manager, repeated, 5)
        manager.free(repeated)
        assert manager.match_prefix(make_seq(4, [5, 5, 7])) == 0


def test_block_tables_mirror_lists_through_growth_and_reuse() -> None:
    """The int32 tables follow the lists while rows and columns grow and rows are reused."""
    manager = BlockManager(num_blocks=400, block_size=2, enable_prefix_caching=False)
    seqs = [make_seq(i, list(range(3 + 4 * i))) for i in range(12)]
    for seq in seqs:
        compute(manager, seq, seq.num_tokens)  # up to 24 blocks: past the first 8 columns
    for seq in seqs[::3]:
        manager.free(seq)  # their rows go back, zeroed, to be handed out again
    reused = [make_seq(100 + i, [7] * (1 + i)) for i in range(4)]
    for seq in reused:
        compute(manager, seq, seq.num_tokens)
    live = [s for s in seqs if s.block_table] + reused + [make_seq(200, [1])]
    table = manager.block_tables(live)
    assert table.dtype.name == "int32" and table.shape == (len(live), 24)
    expected = [seq.block_table + [0] * (24 - len(seq.block_table)) for seq in live]
    assert table.tolist() == expected


def check_invariants(manager: BlockManager, live: list[Sequence], cache: dict[int, int]) -> None:
    """Block ownership, counts, and the contents a sequence reads back from the cache."""
    size = manager.block_size
    holders: dict[int, list[tuple[Sequence, int]]] = {}
    for seq in live:
        assert len(seq.block_table) >= manager.blocks_needed(seq.num_computed_tokens)
        for index, block in enumerate(seq.block_table):
            assert block != 0, "the null block was handed out"
            holders.setdefault(block, []).append((seq, index))
    for block in range(manager.num_blocks):
        assert manager.ref_count(block) == len(holders.get(block, []))
    assert manager.num_free_blocks + len(holders) == manager.num_blocks - 1
    for block, owners in holders.items():
        if len(owners) > 1:  # shared: full, computed, and the same prefix for every holder
            prefixes = set()
            for seq, index in owners:
                end = (index + 1) * size
                assert seq.num_computed_tokens >= end, f"block {block} shared while being written"
                prefixes.add(tuple(seq.token_ids[:end]))
            assert len(prefixes) == 1, f"block {block} shared by different contents"
    for seq in live:
        cached = [cache.get(manager.slot(seq, p)) for p in range(seq.num_computed_tokens)]
        assert cached == seq.token_ids[: seq.num_computed_tokens], f"{seq!r} reads corrupt cache"
    if live:
        width = max(len(seq.block_table) for seq in live)
        padded = [seq.block_table + [0] * (width - len(seq.block_table)) for seq in live]
        assert manager.block_tables(live).tolist() == padded, "the table mirror drifted"


@pytest.mark.parametrize("hash_function", [block_manager_module.hash_block_tokens, constant_hash])
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_random_operations_keep_invariants(
    hash_function: Callable[[int | None, tuple[int, ...]], int], data: st.DataObject
) -> None:
    """Random admissions, steps and frees over prompts sharing prefixes, in a small cache."""
    block_size = data.draw(st.sampled_from([1, 2, 3, 4]), label="block_size")
    manager = BlockManager(data.draw(st.integers(2, 12), label="num_blocks"), block_size)
    base = data.draw(st.lists(st.integers(0, 3), min_size=12, max_size=12), label="base")
    cache: dict[int, int] = {}  # slot -> token id whose latent is stored there
    live: list[Sequence] = []
    next_id = 0
    with mock.patch.object(block_manager_module, "hash_block_tokens", hash_function):
        for _ in range(data.draw(st.integers(1, 30), label="num_ops")):
            op = data.draw(st.sampled_from(["new", "step", "free"]))
            if op == "new":
                shared = data.draw(st.integers(0, 12))
                tail = data.draw(
                    st.lists(st.integers(0, 3), min_size=1 if shared == 0 else 0, max_size=10)
                )
                seq = make_seq(next_id, base[:shared] + tail)
                next_id += 1
                manager.match_prefix(seq)
                live.append(seq)
            elif op == "step" and live:
                seq = data.draw(st.sampled_from(live))
                if seq.num_uncomputed == 0:
                    seq.token_ids.append(data.draw(st.integers(0, 3)))
                num_new = data.draw(st.integers(1, seq.num_uncomputed))
                if manager.can_append(seq, num_new):
                    manager.append_slots(seq, num_new)
                    start = seq.num_computed_tokens
                    for position in range(start, start + num_new):
                        slot = manager.slot(seq, position)
                        assert manager.ref_count(slot // block_size) == 1, "write to a shared block"
                        cache[slot] = seq.token_ids[position]
                    seq.num_computed_tokens += num_new
                    manager.commit(seq)
            elif op == "free" and live:
                seq = data.draw(st.sampled_from(live))
                manager.free(seq)
                live.remove(seq)
            check_invariants(manager, live, cache)
        for seq in live:
            manager.free(seq)
    assert manager.num_free_blocks == manager.num_blocks - 1
    assert all(manager.ref_count(block) == 0 for block in range(manager.num_blocks))

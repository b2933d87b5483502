"""Paged-cache block allocation: reference counts, a free list, and prefix caching.

Block 0 is the null block: it is never handed out, so block tables can be padded
with 0 and slot ``-1`` writes land nowhere real. Usable blocks are 1..num_blocks-1.

Prefix caching: once a block is full of computed tokens it is registered under a
chained hash of (parent block's hash, the block's token ids), so another request
whose tokens start the same way can reuse its latents. A hash is only an index:
a hit is accepted when the cached block's own tokens are equal AND its parent is
exactly the block matched just before it (compared by a content id that is never
reused), so a hash collision can cost a hit but never hand out wrong latents.
A registered block whose last reference goes stays cached ("evictable"); it is
reused for other content only when no plain free block is left, least recently
freed first, and then its registration is dropped.

Every block table is mirrored in a row of an int32 array, kept in step with the
sequence's list, so that a step's [B, width] table is one numpy gather
(`block_tables`) instead of B list conversions.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from pagedmla.engine.sequence import Sequence

NULL_BLOCK = 0
_ROOT_CONTENT_ID = 0  # the "parent" of a sequence's first block


def hash_block_tokens(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Chained identity of a full block: its parent's hash (None for the first block) and tokens."""
    return hash((parent_hash, token_ids))


@dataclass(frozen=True)
class _CachedContent:
    """What a registered block holds, enough to verify a hash hit exactly."""

    content_id: int
    block_hash: int
    parent_content_id: int
    token_ids: tuple[int, ...]


@dataclass
class _Chain:
    """How many leading blocks of a sequence are matched or registered, and the last link."""

    num_blocks: int = 0
    last_hash: int | None = None
    last_content_id: int = _ROOT_CONTENT_ID


class BlockManager:
    """Hands out cache blocks to sequences and shares full blocks between equal prefixes."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self.reset()

    def reset(self) -> None:
        """Forget every cached prefix: the manager is as new. No sequence may hold a
        block (ValueError otherwise)."""
        if any(self._ref_counts):
            raise ValueError("reset() needs every block free: sequences still hold some")
        num_blocks = self.num_blocks
        self._free: deque[int] = deque(range(1, num_blocks))  # unreferenced, not cached
        self._evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced, cached; LRU first
        self._cached: dict[int, _CachedContent] = {}  # block id -> registered content
        self._by_hash: dict[int, int] = {}  # block hash -> block id
        self._chains: dict[int, _Chain] = {}  # seq_id -> prefix-caching progress
        self._next_content_id = _ROOT_CONTENT_ID + 1
        # Block table mirror: row r holds a sequence's blocks, zero padded (null block),
        # _table_lens[r] how many. Row 0 stays empty: the row of a sequence without
        # blocks. Rows and columns double when they run out.
        self._tables = np.zeros((8, 8), dtype=np.int32)
        self._table_lens = np.zeros(8, dtype=np.int64)
        self._row_of: dict[int, int] = {}  # seq_id -> its row in _tables
        self._spare_rows = list(range(7, 0, -1))  # pop() hands out the lowest row first

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can ever be handed out (all but the null block)."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks that could be allocated now, evictable cached ones included."""
        return len(self._free) + len(self._evictable)

    def ref_count(self, block_id: int) -> int:
        """Number of sequences whose block table holds ``block_id``."""
        return self._ref_counts[block_id]

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def match_prefix(self, seq: Sequence) -> int:
        """Reuse cached blocks for the longest cached prefix of a newly scheduled sequence.

        Takes a reference on each matched block, appends it to ``seq.block_table``, sets
        ``seq.num_computed_tokens`` to the tokens covered and returns that number. At least
        one token is left to compute, because the model needs a fed token to produce logits.
        """
        if seq.num_computed_tokens != 0 or seq.block_table:
            raise RuntimeError(f"match_prefix needs a sequence with no cache state, got {seq!r}")
        if not self.enable_prefix_caching:
            return 0
        chain = _Chain()
        self._chains[seq.seq_id] = chain
        max_blocks = (seq.num_tokens - 1) // self.block_size
        matched: list[int] = []
        for index in range(max_blocks):
            tokens = self._block_tokens(seq, index)
            block_hash = hash_block_tokens(chain.last_hash, tokens)
            block = self._lookup(block_hash, chain.last_content_id, tokens)
            if block is None:
                break
            if self._ref_counts[block] == 0:
                del self._evictable[block]
            self._ref_counts[block] += 1
            matched.append(block)
            self._advance(chain, self._cached[block])
        self._extend_table(seq, matched)
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        return seq.num_computed_tokens

    def num_missing_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks that ``append_slots(seq, num_new_tokens)`` would take."""
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(seq.block_table))

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether ``append_slots(seq, num_new_tokens)`` would find enough blocks."""
        return self.num_missing_blocks(seq, num_new_tokens) <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow ``seq.block_table`` to cover ``num_computed_tokens + num_new_tokens`` tokens."""
        missing = self.num_missing_blocks(seq, num_new_tokens)
        if missing > self.num_free_blocks:
            raise RuntimeError(
                f"out of cache blocks: {seq!r} needs {missing} more for {num_new_tokens} new "
                f"tokens, {self.num_free_blocks} free (call can_append first)"
            )
        self._extend_table(seq, [self._allocate() for _ in range(missing)])

    def commit(self, seq: Sequence) -> None:
        """Register every block of ``seq`` now full of computed tokens, for later reuse."""
        if not self.enable_prefix_caching:
            return
        chain = self._chains.get(seq.seq_id)
        if chain is None:  # not setdefault: it would build a _Chain on every call
            chain = self._chains[seq.seq_id] = _Chain()
        num_full = seq.num_computed_tokens // self.block_size
        while chain.num_blocks < num_full:
            block = seq.block_table[chain.num_blocks]
            content = self._cached.get(block)
            if content is None:
                tokens = self._block_tokens(seq, chain.num_blocks)
                block_hash = hash_block_tokens(chain.last_hash, tokens)
                twin = self._lookup(block_hash, chain.last_content_id, tokens)
                if twin is not None:
                    # Another request computed the same content first (same step): chain
                    # through its registration; this block stays private and is freed plainly.
                    content = self._cached[twin]
                else:
                    content = self._register(block, block_hash, chain.last_content_id, tokens)
            self._advance(chain, content)

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references and clear its block table.

        Tail blocks are released first, so among cached blocks they are evicted first
        (a later request is likelier to share the head of a prompt than its tail).
        """
        # The table is detached first: freeing a sequence twice, or again after a free
        # cut short by an interrupt, does not drop references it no longer holds.
        blocks, seq.block_table = seq.block_table, []
        for block in reversed(blocks):
            self._ref_counts[block] -= 1
            assert self._ref_counts[block] >= 0, f"block {block} freed more often than taken"
            if self._ref_counts[block] == 0:
                self._release(block)
        self._chains.pop(seq.seq_id, None)
        self._release_row(seq.seq_id)

    def reclaim(self, holders: Iterable[Sequence]) -> None:
        """Recount every block's references from the block tables of holders, the
        sequences that keep their blocks, and release every other block.

        For after a failure: a step cut short (an exception, Ctrl-C) may have left blocks
        taken for a sequence that is then dropped before they reached its table. Costs
        O(num_blocks); the per-step path never calls it.
        """
        counts = [0] * self.num_blocks
        kept = set()
        for seq in holders:
            kept.add(seq.seq_id)
            for block in seq.block_table:
                counts[block] += 1
        released = set(self._free).union(self._evictable)
        self._ref_counts = counts
        for block in range(1, self.num_blocks):
            if counts[block] == 0 and block not in released:
                self._release(block)
        for seq_id in set(self._row_of) - kept:
            self._release_row(seq_id)
        for seq_id in set(self._chains) - kept:
            del self._chains[seq_id]

    def block_tables(self, seqs: list[Sequence]) -> np.ndarray:
        """The block tables of ``seqs`` as a new int32 array [len(seqs), longest table]:
        row i is ``seqs[i].block_table`` padded with the null block 0."""
        rows = np.array([self._row_of.get(seq.seq_id, 0) for seq in seqs], dtype=np.intp)
        width = int(self._table_lens[rows].max())
        return self._tables[rows, :width]

    def slot(self, seq: Sequence, position: int) -> int:
        """Flat cache slot of token ``position`` of ``seq``."""
        block = seq.block_table[position // self.block_size]
        return block * self.block_size + position % self.block_size

    def _release(self, block: int) -> None:
        """An unreferenced block becomes evictable if its content is registered, else free."""
        if block in self._cached:
            self._evictable[block] = None
        else:
            self._free.append(block)

    def _release_row(self, seq_id: int) -> None:
        """Clear a sequence's row of the block table mirror and make it spare."""
        row = self._row_of.pop(seq_id, None)
        if row is not None:
            self._tables[row] = 0
            self._table_lens[row] = 0
            self._spare_rows.append(row)

    def _extend_table(self, seq: Sequence, blocks: list[int]) -> None:
        """Append ``blocks`` to ``seq.block_table`` and to its row of the mirror."""
        if not blocks:
            return
        row = self._row_of.get(seq.seq_id)
        if row is None:
            if not self._spare_rows:
                self._resize_tables(2 * self._tables.shape[0], self._tables.shape[1])
            row = self._row_of[seq.seq_id] = self._spare_rows.pop()
        start = len(seq.block_table)
        seq.block_table += blocks
        end = len(seq.block_table)
        if end > self._tables.shape[1]:
            self._resize_tables(self._tables.shape[0], max(end, 2 * self._tables.shape[1]))
        self._tables[row, start:end] = blocks
        self._table_lens[row] = end

    def _resize_tables(self, num_rows: int, num_columns: int) -> None:
        """Grow the mirror to [num_rows, num_columns]; new rows become spare."""
        old_rows, old_columns = self._tables.shape
        tables = np.zeros((num_rows, num_columns), dtype=np.int32)
        tables[:old_rows, :old_columns] = self._tables
        lens = np.zeros(num_rows, dtype=np.int64)
        lens[:old_rows] = self._table_lens
        self._tables, self._table_lens = tables, lens
        self._spare_rows.extend(range(num_rows - 1, old_rows - 1, -1))

    def _block_tokens(self, seq: Sequence, index: int) -> tuple[int, ...]:
        start = index * self.block_size
        return tuple(seq.token_ids[start : start + self.block_size])

    def _lookup(
        self, block_hash: int, parent_content_id: int, tokens: tuple[int, ...]
    ) -> int | None:
        block = self._by_hash.get(block_hash)
        if block is None:
            return None
        content = self._cached[block]
        if content.parent_content_id != parent_content_id or content.token_ids != tokens:
            return None  # a hash collision: same index, different content
        return block

    def _register(
        self, block: int, block_hash: int, parent_content_id: int, tokens: tuple[int, ...]
    ) -> _CachedContent:
        displaced = self._by_hash.get(block_hash)
        if displaced is not None:
            # A colliding, different content holds this hash: the newest registration wins.
            self._uncache(displaced)
        content = _CachedContent(self._next_content_id, block_hash, parent_content_id, tokens)
        self._next_content_id += 1
        self._cached[block] = content
        self._by_hash[block_hash] = block
        return content

    def _uncache(self, block: int) -> None:
        content = self._cached.pop(block)
        if self._by_hash.get(content.block_hash) == block:
            del self._by_hash[content.block_hash]
        if block in self._evictable:
            del self._evictable[block]
            self._free.append(block)

    def _allocate(self) -> int:
        if not self._free:
            # Evict the least recently freed cached block; _uncache moves it to the free list.
            self._uncache(next(iter(self._evictable)))
        block = self._free.popleft()
        self._ref_counts[block] = 1
        return block

    @staticmethod
    def _advance(chain: _Chain, content: _CachedContent) -> None:
        chain.num_blocks += 1
        chain.last_hash = content.block_hash
        chain.last_content_id = content.content_id

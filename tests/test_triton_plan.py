"""The split-KV planner (`split_plan`): every plan covers every request exactly, and its
choices follow the rule its module docstring states, worked out here in Python.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton")

from pagedmla.ops.triton._utils import Platform
from pagedmla.ops.triton.decode_triton import DECODE_CONFIGS, DecodeConfig
from pagedmla.ops.triton.selection import DecodeKernel, decode_kernels
from pagedmla.ops.triton.split_plan import (
    EXTRA_WAVES,
    MAX_SPLITS,
    OVERHEAD_TILES,
    PARTIAL_ROWS_PER_ROW,
    STREAM_TILES,
    TAIL_WAVE,
    WHOLE_WAVES,
    SplitPlan,
    plan_bounds,
    plan_splits,
)
from tests.triton_helpers import (
    DEVICE,
    TINY_DECODE,
    _assert_even_plan,
    _cu,
    _splits,
    runnable,
)


def _plan(lens: list[int], head_groups: int, slots: int, cfg: DecodeConfig,
          forced: int | None = None, persistent: bool = False, past_wave_tiles: int = 0,
          tail_wave: float = TAIL_WAVE) -> tuple[SplitPlan, list[list[int]]]:
    """A plan for lengths `lens` (one query token each), checked for what every plan must
    be: each request's positions [0, len) covered by its splits in the order of their
    partial indices, which are consecutive, each split of whole tiles but the last, at
    most max_splits splits, each row with its request's seq_len, first token and q_len;
    every request once; the partial indices of the used rows a permutation of them, and
    the rows in their order (or, in the even plan, longest first); the other rows idle;
    the cut requests listed in the order of their partials, with their first; program
    p's splits the rows starts[p] .. starts[p + 1] - 1 (row p alone but in a persistent
    plan). Returns the plan and its used rows."""
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    plan = plan_splits(seq_lens, _cu([1] * len(lens)), head_groups, max(lens), slots,
                       cfg.block_n, cfg.min_chunk, cfg.block_h, forced, persistent,
                       past_wave_tiles, tail_wave)
    work = plan.work.tolist()
    starts = plan.starts.tolist()
    assert len(starts) == plan.programs + 1 and starts[0] == 0
    assert all(a <= b for a, b in itertools.pairwise(starts))
    taken = sum(1 for row in work if row[0] >= 0)
    assert all(row[0] >= 0 for row in work[:taken])
    assert all(r == [-1] + [0] * 7 for r in work[taken:])
    assert sorted(row[7] for row in work[:taken]) == list(range(taken))
    by_partial = sorted(work[:taken], key=lambda row: row[7])
    if [row[7] for row in work[:taken]] != list(range(taken)):  # the even plan
        assert plan.rows == plan.programs
        _assert_even_plan(plan)
    at, cut, seen = 0, [], []
    while at < taken:
        b, count = by_partial[at][0], by_partial[at][3]
        n = lens[b]
        assert 1 <= count <= plan.max_splits
        rows = by_partial[at:at + count]
        assert all(r[0] == b and r[3] == count and r[4:7] == [n, b, 1] for r in rows)
        assert rows[0][1] == 0 and rows[-1][2] == n
        for row, after in itertools.pairwise(rows):
            assert row[2] == after[1] and row[1] < row[2] and (row[2] - row[1]) % cfg.block_n == 0
        if count > 1:
            cut.append([b, at, 0, count, n, b, 1, 0])
        seen.append(b)
        at += count
    assert sorted(seen) == list(range(len(lens)))
    assert starts[-1] == taken
    if plan.rows == plan.programs:
        assert starts == [min(p, taken) for p in range(plan.programs + 1)]
    assert plan.cut.tolist() == cut + [[-1] + [0] * 7] * (plan.cut.shape[0] - len(cut))
    return plan, work[:taken]


def _decode_entry(name: str) -> DecodeKernel:
    """The decode table's entry `name`, as on a Hopper GPU that runs the Gluon kernels."""
    table = decode_kernels(Platform(cudnn=True, hopper=True, gluon=True), TINY_DECODE, 16)
    return next(entry for entry in table if entry.name == name)


def _tiles(split: list[int], block_n: int) -> int:
    return -(-(split[2] - split[1]) // block_n)


@runnable
def test_split_plan_uniform_batches() -> None:
    # 132 multiprocessors (an H200). Uniform batches cut as a host planner would.
    cfg16, cfg64 = DECODE_CONFIGS["rows16"], replace(DECODE_CONFIGS["rows64"], block_h=64)
    # B = 1, N = 128 (two head groups of 64), 64k: 64 splits of 1024 positions, one wave.
    plan, work = _plan([65536], 2, 132, cfg64)
    assert len(work) == 64 and plan.programs == 66
    # B = 1, N = 16, 128k: a split per multiprocessor, at most MAX_SPLITS.
    plan, work = _plan([131072], 1, 132, cfg16)
    assert 0.9 * 132 <= len(work) <= MAX_SPLITS
    # B = 64 x 2k: two splits each (128 programs of 16 tiles).
    plan, work = _plan([2048] * 64, 1, 132, cfg16)
    assert len(work) == 128 and max(_tiles(w, 64) for w in work) == 16
    # A wave of requests: none is cut, and the combine has nothing to do.
    plan, work = _plan([8192] * 128, 1, 132, cfg16)
    assert len(work) == 128
    # Its last wave is nearly full (124 of 132), so it stays whole and its grid leaves one
    # wave of room for cut splits, not EXTRA_WAVES.
    plan, work = _plan([4096] * 256, 1, 132, cfg16)
    assert len(work) == 256 and plan.programs == 256 + 132
    # Just past a wave, a second wave of whole requests would run 8 of them alone for
    # as long as the first. Costed for the fp8 16-row kernel (one split per program,
    # bound by its chains: each split pays its start, and a partial wave runs hardly
    # faster than a full one), the batch takes the even plan: runs of 68 tiles, each a
    # whole request and 4 tiles of the next, their splits a program each, longest first.
    fp8_kernel = _decode_entry("decode_hopper_fp8")
    fp8 = {"past_wave_tiles": fp8_kernel.past_wave_tiles, "tail_wave": fp8_kernel.tail_wave}
    plan, work = _plan([4096] * 140, 1, 132, cfg16, **fp8)
    assert plan.programs == 140 + EXTRA_WAVES * 132
    assert len(work) == 263 and [_tiles(w, 64) for w in work[:9]] == [64] * 9
    assert any(w[7] != i for i, w in enumerate(work))  # rows out of their partials' order
    # Short requests too: 133 x 1088 in runs of 18 tiles. At 170 x 1088 (runs of 22
    # tiles, 294 splits) the busiest slot would run three programs: two waves of 1 or 2
    # splits per request.
    plan, work = _plan([1088] * 133, 1, 132, cfg16, **fp8)
    assert len(work) == 251 and max(_tiles(w, 64) for w in work) == 17
    plan, work = _plan([1088] * 170, 1, 132, cfg16, **fp8)
    assert sorted(set(_splits(work))) == [1, 2] and len(work) == 2 * 132
    assert all(w[7] == i for i, w in enumerate(work))
    # A uniform batch that nearly fills its second wave stays whole.
    plan, work = _plan([4096] * 256, 1, 132, cfg16, **fp8)
    assert len(work) == 256
    # A last wave of whole requests filled to 0.67 (220 requests) leaves EXTRA_WAVES of
    # room for finer splits where a partial wave is costed above that (fp8: 0.9), one
    # wave where it is costed below (a memory-bound kernel's 0.6).
    assert plan_bounds(220, 1, 4096, 132, 64, cfg16.min_chunk)[0] == 220 + 132
    assert (plan_bounds(220, 1, 4096, 132, 64, cfg16.min_chunk, tail_wave=0.9)[0]
            == 220 + EXTRA_WAVES * 132)
    # Splits never go below min_chunk positions: short requests stay whole.
    plan, work = _plan([100, 0, 255], 1, 132, cfg16)
    assert len(work) == 3 and plan.max_splits == 1


def _random_lens(gen: torch.Generator, fewest: int) -> list[int]:
    """A random batch of fewest..300 requests, lengths 0-200k from a heavy-tailed mix
    (uniform below a random power of ten per request), the first at least 1."""
    batch = int(torch.randint(fewest, 301, (), generator=gen))
    scale = 10 ** torch.randint(1, 6, (batch,), generator=gen).float()
    lens = (torch.rand(batch, generator=gen) * scale).long().clamp(max=200_000).tolist()
    lens[0] = max(lens[0], 1)
    return lens


@runnable
def test_split_plan_on_random_batches() -> None:
    # Fresh random batches (sizes 1-300, lengths 0-200k from a heavy-tailed mix, 1-4 head
    # groups, 4 or 132 multiprocessors): every plan covers every request exactly
    # (`_plan` checks) within its grid. The seed is printed for a failing run.
    seed = int(torch.randint(0, 2**31, ()).item())
    print(f"seed {seed}")
    gen = torch.Generator().manual_seed(seed)
    cfg16 = DECODE_CONFIGS["rows16"]
    for _ in range(12):
        lens = _random_lens(gen, 1)
        groups = int(torch.randint(1, 5, (), generator=gen))
        slots = 4 if torch.rand((), generator=gen) < 0.3 else 132
        _plan(lens, groups, slots, cfg16)


def _rule_choice(lens: list[int], head_groups: int, slots: int, cfg: DecodeConfig,
                 programs: int, max_splits: int, past_wave_tiles: int = 0,
                 tail_wave: float = TAIL_WAVE, one_per_program: bool = False,
                 ) -> tuple[float, list[int], bool] | None:
    """The plan by the rule `split_plan`'s docstring states, worked out here in float64
    within the plan's bounds (programs, max_splits): (the cheapest candidate's cost,
    each request's split count, whether it is the even plan); None where two candidates
    sit at a margin, which float32 may round either way. past_wave_tiles and tail_wave: the
    stage-1 kernel's cost of a split past one wave and of a last partial wave there
    (`plan_splits`); one_per_program: the kernel runs a split per program, so that the
    even plan is a candidate past one wave."""
    tiles = [-(-n // cfg.block_n) for n in lens]
    t_max, empty = max(tiles), tiles.count(0)
    live = len(tiles) - empty
    past_wave = live * head_groups > slots
    min_tiles = max(1, cfg.min_chunk // cfg.block_n)
    partial = -(-PARTIAL_ROWS_PER_ROW * cfg.block_h // cfg.block_n)

    def waves(count: int) -> float:
        full, rest = divmod(count * head_groups, slots)
        return full + ((max(tail_wave, rest / slots) if past_wave else 1) if rest else 0)

    def evened(t: int, n: int) -> int:  # splits of equal whole-tile size
        return -(-t // -(-t // n)) if t else 1

    candidates = []  # (cost, splits, is uniform, layout)
    for s in range(1, max_splits + 1):
        size = max(-(-t_max // s), min_tiles)
        layout = [evened(t, -(-t // size)) for t in tiles]
        count = sum(layout) - empty
        if count + empty <= programs:
            overhead = ((past_wave_tiles if past_wave else OVERHEAD_TILES)
                        + (partial if count > live else 0))
            candidates.append((waves(count) * (size + overhead), count, 0, layout))
    total, goal = sum(tiles), -(-slots // head_groups)
    for k in range(1, WHOLE_WAVES + 1) if past_wave else ():
        share = [0, *itertools.accumulate(tiles)]
        layout = [evened(t, max(1, min(
            math.floor(share[b + 1] * k * goal / total + 0.5)
            - math.floor(share[b] * k * goal / total + 0.5), max_splits, t // min_tiles)))
            for b, t in enumerate(tiles)]
        count = sum(layout) - empty
        if count + empty <= programs:
            mean = total / count
            largest = max(-(-t // n) for t, n in zip(tiles, layout) if t)
            per_split = past_wave_tiles + (partial if count > live else 0)
            cost = waves(count) * (mean + per_split) + largest - mean
            candidates.append((cost, count, 1, layout))
    best = min(c[0] for c in candidates)
    if any(abs(c[0] * 0.97 - best) < 1e-5 * best for c in candidates):
        return None
    if one_per_program and past_wave:
        # The even plan: the persistent plan's runs for one wave of programs, their splits
        # a program each; the busiest slot runs ceil(splits x head_groups / slots).
        runs = _stream_runs(lens, goal, cfg.block_n)
        layout = [0] * len(lens)
        for run in runs:
            for b, *_ in run:
                layout[b] += 1
        count = sum(n for n, t in zip(layout, tiles) if t)
        share = -(-sum(max(t, 1) for t in tiles) // goal)
        cost = share + STREAM_TILES + -(-count * head_groups // slots) * (past_wave_tiles + partial)
        if max(layout) <= max_splits and sum(layout) <= programs:
            if abs(cost - best) < 1e-5 * best:
                return None
            if cost < best:
                return cost, layout, True
    return (best, min((c for c in candidates if c[0] * 0.97 <= best), key=lambda c: c[1:3])[3],
            False)


def _rule_order(lens: list[int], splits: list[int], cfg: DecodeConfig) -> list[int] | None:
    """The order of the requests' programs by `split_plan`'s docstring: those whose
    splits are at least the mean split first, then the others, each in request order;
    None where a split is within float32's reach of the mean."""
    tiles = [-(-n // cfg.block_n) for n in lens]
    steps = [-(-t // n) if t else 0 for t, n in zip(tiles, splits)]
    mean = sum(tiles) / max(1, sum(n for t, n in zip(tiles, splits) if t))
    if any(abs(step - mean) < 1e-3 for step in steps):
        return None
    big = [b for b, step in enumerate(steps) if step >= mean]
    return big + [b for b, step in enumerate(steps) if step < mean]


@runnable
@pytest.mark.parametrize("kernel", ["decode_hopper", "decode_hopper_fp8", "decode_hopper_heads"])
def test_split_plan_costs_waves_as_documented(kernel: str) -> None:
    # The plan kernel's choices (each request's splits, the requests' order) against the
    # rule worked out in Python: batches around one and two waves of 132 (uniform, and
    # with graph padding rows), then fresh random ones (1-300 requests, 0-200k
    # positions, 1-2 head groups); under each stage-1 kernel's costs past a wave (a
    # split's start, a last partial wave). The seed is printed.
    entry = _decode_entry(kernel)
    costs = (entry.past_wave_tiles, entry.tail_wave)
    cfg16 = DECODE_CONFIGS["rows16"]
    cases = [([n] * b, 1) for n in (1088, 4096) for b in (100, 132, 133, 200, 256, 300)]
    cases += [([1088] * 132 + [0] * 12, 1), ([4096] * 70, 2), ([131072] + [4096] * 199, 1)]
    cases += [([4096] * 140, 1), ([1088] * 132 + [0] * 12 + [4096] * 8, 1), ([2048] * 150, 2)]
    seed = int(torch.randint(0, 2**31, ()).item())
    print(f"seed {seed}")
    gen = torch.Generator().manual_seed(seed)
    for _ in range(8):
        cases.append((_random_lens(gen, 1), int(torch.randint(1, 3, (), generator=gen))))
    checked = 0
    kinds = set()
    for lens, groups in cases:
        plan, work = _plan(lens, groups, 132, cfg16, None, False, *costs)
        choice = _rule_choice(lens, groups, 132, cfg16, plan.programs, plan.max_splits,
                              *costs, one_per_program=True)
        if choice is not None and choice[2]:  # the even plan: its splits, longest first
            kinds.add("even")
            want = [split for run in _stream_runs(lens, -(-132 // groups), cfg16.block_n)
                    for split in run]
            assert sorted(row[:3] for row in work) == sorted(want), (len(lens), groups)
            checked += 1
        elif choice is not None:
            kinds.add("scored")
            want = choice[1]
            assert _splits(work) == want, (len(lens), groups, max(lens))
            order = _rule_order(lens, want, cfg16)
            firsts = [row[0] for i, row in enumerate(work) if i == 0 or work[i - 1][0] != row[0]]
            assert order is None or firsts == order, (len(lens), groups, max(lens))
            checked += 1
    assert checked >= len(cases) - 2 and kinds == {"even", "scored"}


@runnable
def test_split_plan_follows_the_lengths() -> None:
    # One long request among short ones: it is cut finely enough that no program holds
    # much more than a fair share of the batch's tiles (a plan from max_seq_len alone,
    # the same splits per request, gave the long request's 2 programs 1024 tiles each).
    cfg16 = DECODE_CONFIGS["rows16"]
    lens = [131072] + [2048] * 63
    _, work = _plan(lens, 1, 132, cfg16)
    fair = sum(-(-n // 64) for n in lens) / 132
    assert len(work) <= 132 and max(_tiles(w, 64) for w in work) <= 1.2 * fair
    # A batch past one wave: the long request is cut, the short ones are not.
    lens = [131072] + [4096] * 199
    _, work = _plan(lens, 1, 132, cfg16)
    counts = _splits(work)
    assert counts[0] > 1 and set(counts[1:]) == {1}
    assert max(_tiles(w, 64) for w in work) <= 64
    # Graph padding rows (seq_len 0) get one empty split; a forced count is honoured.
    _, work = _plan([0, 700, 0], 1, 4, TINY_DECODE, forced=7)
    assert _splits(work) == [1, 7, 1]
    # Their programs exit at once, so they count in no wave: a wave of requests stays
    # one wave, uncut, when a graph pads it past the multiprocessors (rather than push
    # the plan to two splits per request).
    for padding in (0, 12, 68):
        plan, work = _plan([1100] * 132 + [0] * padding, 1, 132, cfg16)
        assert _splits(work) == [1] * (132 + padding) and plan.cut[0, 0] == -1


def _stream_runs(lens: list[int], programs: int, block_n: int) -> list[list[list[int]]]:
    """Each program's splits [request, lo, hi] by the persistent rule `split_plan`'s
    docstring states, worked out here by walking the tiles: the batch's tiles in request
    order, an empty request weighing one tile, runs of ceil(total / programs) tiles."""
    weights = [max(1, -(-n // block_n)) for n in lens]
    share = -(-sum(weights) // programs)
    runs: list[list[list[int]]] = [[] for _ in range(programs)]
    at = 0  # the stream's tile where the request begins
    for b, (n, w) in enumerate(zip(lens, weights)):
        t = 0
        while t < w:
            p = (at + t) // share
            take = min(w - t, (p + 1) * share - at - t)
            runs[p].append([b, min(t * block_n, n), min((t + take) * block_n, n)])
            t += take
        at += w
    return runs


@runnable
def test_split_plan_persistent_runs() -> None:
    # A kernel that runs several splits per program gets a grid of a program per
    # request for a batch past one wave, and the plan takes, by the rule worked out in
    # Python, either the scored plan (whole requests, one per program) or the
    # persistent one: one wave of programs that each take an even run of the batch's
    # tiles, checked program by program. Uniform batches around one and two waves,
    # graph padding, one long request among short ones, short requests packed several
    # to a program, then fresh random batches of 133-300 requests.
    cfg16 = DECODE_CONFIGS["rows16"]
    cases = [[4096] * 140, [1088] * 133, [4096] * 256, [1088] * 132 + [0] * 12 + [4096] * 8,
             [131072] + [64] * 199, [40] * 300, [0] * 140 + [100], [4096, 2048] * 70,
             [1088] * 132 + [0] * 12, [4096] * 200]
    seed = int(torch.randint(0, 2**31, ()).item())
    print(f"seed {seed}")
    gen = torch.Generator().manual_seed(seed)
    for _ in range(6):
        cases.append(_random_lens(gen, 133))
    kinds = set()
    for lens in cases:
        plan, work = _plan(lens, 1, 132, cfg16, persistent=True)
        assert plan.programs == len(lens) and plan.rows == len(lens) + 132
        tiles = [-(-n // 64) for n in lens]
        share = -(-sum(max(t, 1) for t in tiles) // 132)
        choice = _rule_choice(lens, 1, 132, cfg16, plan.programs, plan.max_splits)
        if choice is None or abs(share + STREAM_TILES - choice[0]) < 1e-3 * share:
            continue
        starts = plan.starts.tolist()
        if len(tiles) - tiles.count(0) > 132 and share + STREAM_TILES < choice[0]:
            kinds.add("persistent")
            runs = [[row[:3] for row in work[starts[p]:starts[p + 1]]]
                    for p in range(plan.programs)]
            assert runs == [*_stream_runs(lens, 132, 64), *[[]] * (plan.programs - 132)]
        else:
            kinds.add("scored")
            assert _splits(work) == choice[1], (len(lens), max(lens))
            assert starts == [min(p, len(work)) for p in range(plan.programs + 1)]
    assert kinds == {"persistent", "scored"}
    # A batch within one wave keeps the scored plan's grid, as does a forced split count.
    for lens, forced in (([4096] * 132, None), ([4096] * 140, 2)):
        plan, _ = _plan(lens, 1, 132, cfg16, forced, persistent=True)
        assert plan.rows == plan.programs

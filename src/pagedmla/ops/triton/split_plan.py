"""How a decode batch is cut into splits for split-KV, decided on the device.

Stage 1 of `decode.mla_decode` runs a program per head group and split, a split being a
slice of one request's positions (or per run of splits, in the persistent plan below);
the combine then folds each request's splits by log-sum-exp. How to cut is decided here
from the batch's actual lengths, by one small kernel, because the host knows only bounds
(batch size, max_seq_len): a CUDA graph captured with short contexts must stay fast when
replayed with long ones, and one long request among short ones must not leave a few
multiprocessors doing all its work.

The scored plan. Lengths are counted in tiles of BLOCK_N positions; t_b for request b,
t_max the longest. Every request is cut into splits of at most T tiles, one T for the
whole batch, from the candidates T_s = max(ceil(t_max / s), MIN_TILES), s = 1 ..
max_splits (s: the longest request's split count). A candidate makes P(T) = sum_b
ceil(t_b / T) splits, which run in P x head_groups / slots waves of at most T tiles (an
empty request, such as a CUDA graph's padding row, takes a program that exits at once
and counts in no wave); each split also pays a fixed cost (q, the first copy's latency,
the epilogue: OVERHEAD tiles) and, once any request is cut, its float32 partial written
and read back (PARTIAL tiles). A batch that fits one wave uncut costs a partial wave as
a full one. Past that, a candidate's last partial wave costs max(tail_wave, its fill) of
a full one, tail_wave being the stage-1 kernel's own (`selection`): TAIL_WAVE for a
memory-bound kernel, whose programs in a partial wave share the memory bandwidth with
fewer others and so run faster, which makes finer splits worth more than a second
full-length wave for a batch's last requests; more for a kernel bound by its own chains
of work or by the tensor cores, which runs a partial wave hardly faster than a full
one. Past one wave, too, a split pays not OVERHEAD but the kernel's own past_wave_tiles:
none for a memory-bound kernel, whose other programs keep the memory busy while one
starts or ends a split. A batch past one wave has a second family of candidates, whole
waves: for k = 1 .. WHOLE_WAVES, k waves' worth of splits (P = k x slots / head_groups)
shared out in proportion to the requests' tiles by cumulative rounding (request b gets
round(C_b P / C) - round(C_{b-1} P / C) splits, C_b the tiles of requests 0 .. b, C all
of them; at least one, at most max_splits, none under MIN_TILES), so that a uniform
batch of B requests is cut into a or a + 1 splits each (a = P // B), which no single
split size makes. The programs start splits as earlier ones end, so a wave's split
sizes even out over the SMs but for the last splits: such a candidate costs its waves x
the mean split (plus PARTIAL and past_wave_tiles) plus (largest split - mean split) for
the tail. The cheapest candidate of either family wins, and the one with the fewest
splits within 3% of it is taken (a uniform one on a tie). Request b is then cut into
its splits of equal whole-tile size. For a uniform batch the uniform family is the
split count a host planner would choose; for a ragged one, either family cuts the long
requests finer than the short ones. The requests whose splits are at least the mean
split take the first programs, the others the last, not interleaved: bigger first is
longest-first list scheduling, as the GPU starts programs in order as SMs free up.

The persistent plan. Splits that run as separate programs each pay a start (the work
row, q, the first copy's latency) on an SM that had been streaming, and programs finish
unevenly. A stage-1 kernel that runs a run of splits in one program (`persistent`: the
16-row bf16 kernel, `decode_hopper`, whose copy ring goes on from one split to the
next, and the Triton kernel) allows the even cut instead: the batch's tiles in request
order, an empty request weighing one, are cut into runs of share = ceil(tiles / W) for
one wave of W = slots / head_groups programs, and program p takes the splits (one per
request its run meets) of tiles [p share, (p + 1) share). It costs its even share plus
STREAM tiles (the combine of the requests it cuts, a split's start where a run meets a
request), and is taken past one wave of requests where that beats the scored plan's
best, which within its grid (a program per request) is whole requests.

The even plan. A stage-1 kernel that runs one split per program (the fp8 16-row and the
64-row kernels) can still take the persistent plan's even cut: its splits, each its own
program, dispatched longest first (the rows sorted by size, so the GPU's in-order
starts make it list scheduling). Each split pays its start and its partial here, and
the busiest slot runs ceil(splits x head_groups / slots) of them, so it costs share +
STREAM + that many x (past_wave_tiles + PARTIAL) tiles; it is taken past one wave where
that beats the scored plan's best and its splits fit the grid and max_splits. It serves
batches just past one wave, which the scored family can only cut in whole-tile splits
per request, two or three waves of them with a ragged last one.

The plan is three int32 tensors: `work`, WORK-field rows, one per split (request, first
position, end position, the request's split count, the request's seq_len, first token
and q_len, so that a program learns its work in one round trip, and the split's partial
index), request -1 for rows past the last split; `starts`, program p's splits being
rows starts[p] .. starts[p + 1] - 1 (row p alone, or none, but in the persistent plan);
and `cut`, one WORK-field row per request cut in more than one split (request, its
first partial index, its split count, ...), which the combine runs over, so that a
batch none of whose requests is cut costs it next to nothing. A request's splits have
consecutive partial indices, so each of its query rows has its partials side by side
in the partial buffer ([token, head, partial, L]) whatever order the rows run in; the
partial index is the row's own but in the even plan.

The constants that cost splits and waves (OVERHEAD_TILES, TAIL_WAVE, EXTRA_WAVES,
STREAM_TILES, and the kernels' own in `selection`) are tuned with
`python -m benchmarks.bench_split_plan` (uniform batches around one wave, --ragged for
ragged ones, --cache fp8).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedmla.ops.triton._utils import cdiv, next_pow2

MAX_SPLITS = 128  # splits of one request at most: bounds the combine's [splits, columns] tile
OVERHEAD_TILES = 2  # a split's fixed cost, in tiles of cache (q, the first copy, the epilogue)
# A cut request's partial ([rows, L] float32, written then read back) moves about as many
# bytes as 4 x rows bf16 cache rows of 576 columns (DeepSeek widths).
PARTIAL_ROWS_PER_ROW = 4
# A last partial wave's cost past one wave of requests, as a fraction of a full wave's,
# for a memory-bound stage-1 kernel (each kernel states its own: `selection`).
TAIL_WAVE = 0.6
# Stage-1 programs past a batch of more requests than one wave, in waves: room for the
# finer splits such a batch is cut in, where its last wave of whole requests would be
# filled less than tail_wave; one wave else (room to cut a few long requests), since a
# uniform batch that fills its last wave that far stays whole, and the idle programs of
# a wider grid cost it.
EXTRA_WAVES = 3
WHOLE_WAVES = 8  # the most waves a whole-wave candidate fills (grids allow 4-5 at most)
# Requests per step of the plan kernel's loops: at most 64, fewer for a smaller batch
# (at least 16), since every step's tensors are this wide whatever the batch.
_BLOCK_B = 64
_MIN_BLOCK_B = 16
# The plan kernel's warps: with 4, no plan is made faster, and the plans of fp8 batches
# past one wave take longer to make.
_PLAN_WARPS = 8
_BLOCK_P = 128  # programs per step of its last loop
_BLOCK_J = 32  # splits of a request per step of the loops that write the rows
# The persistent plan's cost over its even share of the batch, in tiles: the combine of
# the requests it cuts and a split's start at each request a program meets. It is taken
# where it beats the scored plan's best (with its grid, whole requests past a wave) by
# that much.
STREAM_TILES = 2
WORK = 8  # int32 fields per row of the plan's work and cut (32 bytes)
WORK_FIELDS = tl.constexpr(WORK)  # the same, for kernels (Triton's and Gluon's)


@dataclass(frozen=True)
class SplitPlan:
    """A batch's splits (see the module docstring).

    work int32 [rows, WORK]: (request or -1, lo, hi, the request's splits, seq_len,
    first token, q_len, partial index) per split; cut int32 [max_cut, WORK]: (request,
    its first partial index, 0, its splits, seq_len, first token, q_len, 0) for each
    request in more than one split, then rows of request -1; starts int32
    [programs + 1]: stage-1 program p takes the splits starts[p] .. starts[p + 1] - 1
    (just split p but in the persistent plan). programs, max_splits and max_cut (cut's
    length) are host bounds: the stage-1 grid, the most splits any request gets, the
    most requests cut.
    """

    work: torch.Tensor
    cut: torch.Tensor
    starts: torch.Tensor
    programs: int
    max_splits: int

    @property
    def rows(self) -> int:
        """Work rows (splits and idle rows): the partial buffer's split axis."""
        return self.work.shape[0]


@triton.jit
def _cdiv(a, b):
    """ceil(a / b) of int32 tensors, 0 <= a < 2**24 and 1 <= b < 2**24: the float32
    quotient (off by at most one here) corrected, cheaper than an integer division."""
    q = tl.math.ceil(a.to(tl.float32) / b.to(tl.float32)).to(tl.int32)
    q = tl.where((q - 1) * b >= a, q - 1, q)
    return tl.where(q * b < a, q + 1, q)


@triton.jit
def _tiles(seq_lens_ptr, b, num_reqs, BLOCK_N: tl.constexpr):
    """Tiles of BLOCK_N positions in requests b (0 past the batch)."""
    return tl.cdiv(tl.load(seq_lens_ptr + b, mask=b < num_reqs, other=0), BLOCK_N)


@triton.jit
def _store_row(at, req, a, b, splits, seq_len, q_begin, q_len, partial, mask):
    """Rows of WORK int32 at `at` (a tensor of row addresses): (req, a, b, splits,
    seq_len, q_begin, q_len, partial), each value broadcast to `at`'s shape, where mask."""
    zero = tl.zeros(at.shape, tl.int32)
    tl.store(at, zero + req, mask=mask)
    tl.store(at + 1, zero + a, mask=mask)
    tl.store(at + 2, zero + b, mask=mask)
    tl.store(at + 3, zero + splits, mask=mask)
    tl.store(at + 4, zero + seq_len, mask=mask)
    tl.store(at + 5, zero + q_begin, mask=mask)
    tl.store(at + 6, zero + q_len, mask=mask)
    tl.store(at + 7, zero + partial, mask=mask)


@triton.jit
def _waves(count, head_groups, slots, past_wave, TAIL: tl.constexpr):
    """Waves that `count` splits of head_groups programs run in: whole ones, and a last
    partial one costed as a full one within one wave, at max(TAIL, its fill) past it."""
    full = count * head_groups // slots
    fill = (count * head_groups - full * slots).to(tl.float32) / slots
    last = tl.where(past_wave, tl.maximum(fill, TAIL), 1.0)
    return full.to(tl.float32) + tl.where(fill > 0, last, 0.0)


@triton.jit
def _whole_wave_splits(t, done, total, goal, max_splits, MIN_TILES: tl.constexpr,
                       AXIS: tl.constexpr):
    """Splits of requests of t tiles (int32, along AXIS) after `done` tiles of the
    batch, when `goal` splits (broadcastable to t) are shared out over its `total` tiles by
    cumulative rounding, within [1, max_splits] and no split under MIN_TILES; then
    evened (ceil(t / ceil(t / n)) splits of whole tiles). Empty requests get 1."""
    c = (done + tl.cumsum(t, AXIS)).to(tl.int64)
    goal = goal.to(tl.int64)
    total = tl.maximum(total, 1).to(tl.int64)
    n = ((2 * c * goal + total) // (2 * total)
         - (2 * (c - t) * goal + total) // (2 * total)).to(tl.int32)
    n = tl.maximum(tl.minimum(tl.minimum(n, max_splits), t // MIN_TILES), 1)
    return tl.where(t > 0, tl.cdiv(t, tl.maximum(tl.cdiv(t, n), 1)), 1)


@triton.jit(  # batch-dependent: no variant per value (engine/warmup.py)
    do_not_specialize=["num_reqs", "rows", "max_splits", "max_cut", "head_groups", "slots",
                       "forced"],
    do_not_specialize_on_alignment=["seq_lens_ptr", "query_start_ptr"])
def _plan_kernel(
    seq_lens_ptr, query_start_ptr, work_ptr, cut_ptr, starts_ptr,
    num_reqs, programs, rows, max_splits, max_cut, head_groups, slots, forced,
    BLOCK_N: tl.constexpr, MIN_TILES: tl.constexpr, OVERHEAD: tl.constexpr,
    PAST_WAVE_TILES: tl.constexpr, PARTIAL: tl.constexpr, TAIL: tl.constexpr,
    PERSISTENT: tl.constexpr, STREAM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """One program plans the whole batch (see the module docstring); forced > 0 fixes
    the longest request's split count instead of scoring the candidates. PERSISTENT:
    stage 1 runs several splits per program, so a batch past one wave may take the
    persistent plan."""
    reqs = tl.arange(0, BLOCK_B)
    t_max = tl.full([], 0, tl.int32)
    total = tl.full([], 0, tl.int32)  # tiles of the batch
    empty = tl.full([], 0, tl.int32)  # empty requests: a program each, which exits at once
    for b0 in range(0, num_reqs, BLOCK_B):
        t = _tiles(seq_lens_ptr, b0 + reqs, num_reqs, BLOCK_N)
        t_max = tl.maximum(t_max, tl.max(t, 0))
        total += tl.sum(t, 0)
        empty += tl.sum(((b0 + reqs < num_reqs) & (t == 0)).to(tl.int32), 0)
    live = num_reqs - empty
    past_wave = live * head_groups > slots

    # Uniform candidates: splits of at most `size` tiles, s for the longest request.
    s = tl.arange(0, BLOCK_S) + 1
    size = tl.maximum(_cdiv(tl.broadcast_to(t_max, (BLOCK_S,)), s), MIN_TILES)  # tiles
    count = tl.zeros([BLOCK_S], tl.int32)  # splits of the non-empty requests
    for b0 in range(0, num_reqs, BLOCK_B):
        t = _tiles(seq_lens_ptr, b0 + reqs, num_reqs, BLOCK_N)
        cut = _cdiv(tl.broadcast_to(t[None, :], (BLOCK_S, BLOCK_B)),
                    tl.broadcast_to(size[:, None], (BLOCK_S, BLOCK_B)))
        count += tl.sum(tl.where((b0 + reqs < num_reqs)[None, :], cut, 0), 1)
    overhead = tl.where(past_wave, PAST_WAVE_TILES, OVERHEAD) + tl.where(count > live, PARTIAL, 0)
    cost = _waves(count, head_groups, slots, past_wave, TAIL) * (size + overhead)
    allowed = (s <= max_splits) & (count + empty <= programs)
    cost = tl.where(allowed, cost, float("inf"))

    # Whole-wave candidates (past one wave): k waves' worth of splits shared out.
    k = tl.arange(0, BLOCK_K) + 1
    goal = k * ((slots + head_groups - 1) // head_groups)
    w_count = tl.zeros([BLOCK_K], tl.int32)
    w_max = tl.zeros([BLOCK_K], tl.int32)  # the largest split, in tiles
    done = tl.full([], 0, tl.int32)
    for b0 in range(0, num_reqs, BLOCK_B):
        t_row = _tiles(seq_lens_ptr, b0 + reqs, num_reqs, BLOCK_N)
        t = tl.broadcast_to(t_row[None, :], (BLOCK_K, BLOCK_B))
        n = _whole_wave_splits(t, done, total, goal[:, None], max_splits, MIN_TILES, 1)
        w_count += tl.sum(tl.where(t > 0, n, 0), 1)
        w_max = tl.maximum(w_max, tl.max(tl.cdiv(t, n), 1))
        done += tl.sum(t_row, 0)
    w_mean = total.to(tl.float32) / tl.maximum(w_count, 1).to(tl.float32)
    w_cost = (_waves(w_count, head_groups, slots, past_wave, TAIL)
              * (w_mean + PAST_WAVE_TILES + tl.where(w_count > live, PARTIAL, 0))
              + (w_max - w_mean))
    w_allowed = past_wave & (w_count + empty <= programs)
    w_cost = tl.where(w_allowed, w_cost, float("inf"))

    best = tl.minimum(tl.min(cost, 0), tl.min(w_cost, 0))
    near = allowed & (cost * 0.97 <= best)
    w_near = w_allowed & (w_cost * 0.97 <= best)
    fewest = tl.min(tl.where(near, count, 2**30), 0)
    w_fewest = tl.min(tl.where(w_near, w_count, 2**30), 0)
    chosen = tl.min(tl.where(near & (count == fewest), s, BLOCK_S + 1), 0)
    chosen = tl.where(forced > 0, tl.minimum(forced, max_splits), chosen)
    tiles = tl.maximum(tl.cdiv(t_max, chosen), MIN_TILES)
    whole = (w_fewest < fewest) & (forced == 0)
    w_goal = tl.min(tl.where(w_near & (w_count == w_fewest), goal, 2**30), 0)
    chosen_count = tl.where(whole, w_fewest, tl.sum(tl.where(s == chosen, count, 0), 0))

    # Each plan's rows are written from the branch that chose it: a flag bound under the
    # constexpr and branched on after it kept the persistent branch, and its unbound
    # `share`, in the compiled kernel of a non-persistent plan.
    runs = (slots + head_groups - 1) // head_groups  # one wave of programs
    share = tl.maximum(tl.cdiv(total + empty, runs), 1)
    if PERSISTENT:
        if past_wave & (forced == 0) & ((share + STREAM).to(tl.float32) < best):
            first, cuts = _stream_rows(seq_lens_ptr, query_start_ptr, work_ptr, cut_ptr,
                                       num_reqs, share, BLOCK_N, BLOCK_J, BLOCK_B)
            _stream_starts(seq_lens_ptr, starts_ptr, num_reqs, programs, share, BLOCK_N,
                           BLOCK_B, BLOCK_P)
        else:
            first, cuts = _scored_rows(seq_lens_ptr, query_start_ptr, work_ptr, cut_ptr,
                                       num_reqs, whole, total, w_goal, tiles, chosen_count,
                                       max_splits, MIN_TILES, BLOCK_N, BLOCK_J, BLOCK_B)
            _split_starts(starts_ptr, programs, first, BLOCK_P)
    else:
        # The even plan: the persistent plan's splits, a program each, longest first.
        # Its splits are counted only where it may be taken (past one wave, not forced):
        # over no requests else, which the condition below then turns down anyway.
        eligible = tl.where(past_wave & (forced == 0), num_reqs, 0)
        e_count, e_rows, e_most = _stream_counts(seq_lens_ptr, eligible, share, BLOCK_N,
                                                 BLOCK_B)
        # The busiest slot runs ceil(splits x head_groups / slots) programs, each paying
        # a split's start and its partial.
        e_cost = (share + STREAM
                  + tl.cdiv(e_count * head_groups, slots) * (PAST_WAVE_TILES + PARTIAL)
                  ).to(tl.float32)
        if (past_wave & (forced == 0) & (e_cost < best) & (e_most <= max_splits)
                & (e_rows <= programs)):
            first, cuts = _stream_rows(seq_lens_ptr, query_start_ptr, work_ptr, cut_ptr,
                                       num_reqs, share, BLOCK_N, BLOCK_J, BLOCK_B)
            _longest_first(work_ptr, first, BLOCK_R)
        else:
            first, cuts = _scored_rows(seq_lens_ptr, query_start_ptr, work_ptr, cut_ptr,
                                       num_reqs, whole, total, w_goal, tiles, chosen_count,
                                       max_splits, MIN_TILES, BLOCK_N, BLOCK_J, BLOCK_B)
        _split_starts(starts_ptr, programs, first, BLOCK_P)
    _idle_rows(work_ptr, cut_ptr, first, rows, cuts, max_cut, BLOCK_P)


@triton.jit
def _scored_rows(seq_lens_ptr, query_start_ptr, work_ptr, cut_ptr, num_reqs, whole, total,
                 w_goal, tiles, chosen_count, max_splits, MIN_TILES: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_B: tl.constexpr):
    """Write the scored plan's rows and cut list; returns the splits and the cut requests.

    Each request in equal whole-tile splits, as many as the chosen candidate gives it:
    a whole-wave candidate's share (`whole`, of w_goal splits) or splits of at most
    `tiles` tiles; its splits are consecutive rows from `first` on. The requests whose
    splits are at least the mean split come first, the others after them (two passes;
    the module docstring says why not interleaved). The requests cut in more than one
    split are listed in `cut` in that order too (what the combine runs over)."""
    reqs = tl.arange(0, BLOCK_B)
    mean = total.to(tl.float32) / tl.maximum(chosen_count, 1).to(tl.float32)
    first = tl.full([], 0, tl.int32)
    cuts = tl.full([], 0, tl.int32)
    for rank in tl.static_range(2):
        done = tl.full([], 0, tl.int32)
        for b0 in range(0, num_reqs, BLOCK_B):
            b = b0 + reqs
            in_batch = b < num_reqs
            seq_len = tl.load(seq_lens_ptr + b, mask=in_batch, other=0)
            q_begin = tl.load(query_start_ptr + b, mask=in_batch, other=0)
            q_len = tl.load(query_start_ptr + b + 1, mask=in_batch, other=0) - q_begin
            t = tl.cdiv(seq_len, BLOCK_N)
            n = tl.where(whole, _whole_wave_splits(t, done, total, w_goal, max_splits,
                                                   MIN_TILES, 0),
                         tl.maximum(tl.cdiv(t, tiles), 1))
            done += tl.sum(t, 0)
            step = tl.cdiv(t, n)  # tiles per split (0 for an empty request: one empty split)
            n = tl.where(t > 0, tl.cdiv(t, tl.maximum(step, 1)), 1)
            mine = (step.to(tl.float32) >= mean) == (rank == 0)  # big splits first
            n = tl.where(in_batch & mine, n, 0)
            start = first + tl.cumsum(n, 0) - n
            first += tl.sum(n, 0)
            cuts = _request_rows(work_ptr, cut_ptr, b, n, start, cuts, seq_len, q_begin,
                                 q_len, tl.zeros_like(step), step, BLOCK_N, BLOCK_J)
    return first, cuts


@triton.jit
def _request_rows(work_ptr, cut_ptr, b, n, start, cuts, seq_len, q_begin, q_len, origin,
                  size, BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr):
    """Write the rows of a block of requests b (each a [BLOCK_B] tensor): request b's n
    splits at rows start.., split k over tiles [origin + k size, origin + (k + 1) size)
    clipped to the request; the requests of more than one split listed in `cut` from
    entry `cuts` on. Returns the cut list's new length."""
    is_cut = (n > 1).to(tl.int32)
    listed = cut_ptr + WORK_FIELDS * (cuts + tl.cumsum(is_cut, 0) - is_cut)
    _store_row(listed, b, start, 0, n, seq_len, q_begin, q_len, 0, is_cut > 0)
    # Only as many columns of splits as this block's requests have (most are whole or in
    # a few splits): the stores, masked or not, are most of the plan kernel's
    # instructions.
    j = tl.arange(0, BLOCK_J)
    for j0 in range(0, tl.max(n, 0), BLOCK_J):
        k = j0 + j[None, :]
        lo = tl.maximum(origin[:, None] + k * size[:, None], 0) * BLOCK_N
        hi = tl.minimum((origin[:, None] + (k + 1) * size[:, None]) * BLOCK_N,
                        seq_len[:, None])
        _store_row(work_ptr + WORK_FIELDS * (start[:, None] + k), b[:, None], lo, hi,
                   n[:, None], seq_len[:, None], q_begin[:, None], q_len[:, None],
                   start[:, None] + k, k < n[:, None])
    return cuts + tl.sum(is_cut, 0)


@triton.jit
def _split_starts(starts_ptr, programs, used, BLOCK_P: tl.constexpr):
    """starts of a plan of a split per program: program p takes row p (none past `used`)."""
    p = tl.arange(0, BLOCK_P)
    for p0 in range(0, programs + 1, BLOCK_P):
        tl.store(starts_ptr + p0 + p, tl.minimum(p0 + p, used), mask=p0 + p <= programs)


@triton.jit
def _longest_first(work_ptr, used, BLOCK_R: tl.constexpr):
    """Reorder work rows 0 .. used - 1 (used <= BLOCK_R) by their positions (hi - lo),
    the most first, equal ones in their order: the GPU starts programs in grid order as
    multiprocessors free up, so this is longest-first list scheduling. A row keeps its
    partial index, so a request's partials stay side by side."""
    r = tl.arange(0, BLOCK_R)
    live = r < used
    fields = tl.arange(0, WORK_FIELDS)
    tl.debug_barrier()  # the rows were stored by other threads of this program
    size = (tl.load(work_ptr + WORK_FIELDS * r + 2, mask=live, other=0)
            - tl.load(work_ptr + WORK_FIELDS * r + 1, mask=live, other=0))
    # Sort keys: size in the high half, the row reversed in the low half (so that equal
    # sizes keep their order under a descending sort); idle rows last.
    key = tl.where(live, (size.to(tl.int64) << 32) | (BLOCK_R - 1 - r).to(tl.int64), -1)
    source = (BLOCK_R - 1 - (tl.sort(key, 0, descending=True) & 0xFFFFFFFF)).to(tl.int32)
    at = WORK_FIELDS * r[:, None] + fields[None, :]
    moved = tl.load(work_ptr + WORK_FIELDS * source[:, None] + fields[None, :],
                    mask=live[:, None], other=0)
    tl.debug_barrier()  # every row is read before any is overwritten
    tl.store(work_ptr + at, moved, mask=live[:, None])


@triton.jit
def _idle_rows(work_ptr, cut_ptr, used, rows, cuts, max_cut, BLOCK_P: tl.constexpr):
    """Request -1 in the work rows from `used` on and the cut rows from `cuts` on."""
    p = tl.arange(0, BLOCK_P)
    for p0 in range(0, rows, BLOCK_P):
        _store_row(work_ptr + WORK_FIELDS * (p0 + p), -1, 0, 0, 0, 0, 0, 0, 0,
                   (p0 + p >= used) & (p0 + p < rows))
    for c0 in range(0, max_cut, BLOCK_P):
        _store_row(cut_ptr + WORK_FIELDS * (c0 + p), -1, 0, 0, 0, 0, 0, 0, 0,
                   (c0 + p >= cuts) & (c0 + p < max_cut))


@triton.jit
def _stream_span(seq_lens_ptr, b, num_reqs, done, share, BLOCK_N: tl.constexpr):
    """Where requests b (a block of them, after `done` tiles of the batch) lie in the
    stream of tiles that persistent programs take `share` at a time: their weight
    (tiles, one for an empty request, 0 past the batch), first tile in the stream, first
    program and split count."""
    in_batch = b < num_reqs
    w = tl.where(in_batch, tl.maximum(_tiles(seq_lens_ptr, b, num_reqs, BLOCK_N), 1), 0)
    begin = done + tl.cumsum(w, 0) - w
    p_first = begin // share
    n = tl.where(in_batch, (begin + w - 1) // share - p_first + 1, 0)
    return w, begin, p_first, n


@triton.jit
def _stream_counts(seq_lens_ptr, num_reqs, share, BLOCK_N: tl.constexpr,
                   BLOCK_B: tl.constexpr):
    """The persistent plan's splits (`_stream_rows`, runs of `share` tiles): those of
    requests with positions, all of them (an empty request's among them), and the most
    of one request."""
    reqs = tl.arange(0, BLOCK_B)
    live = tl.full([], 0, tl.int32)
    splits = tl.full([], 0, tl.int32)
    most = tl.full([], 0, tl.int32)
    done = tl.full([], 0, tl.int32)
    for b0 in range(0, num_reqs, BLOCK_B):
        w, _, _, n = _stream_span(seq_lens_ptr, b0 + reqs, num_reqs, done, share, BLOCK_N)
        t = _tiles(seq_lens_ptr, b0 + reqs, num_reqs, BLOCK_N)
        live += tl.sum(tl.where(t > 0, n, 0), 0)
        splits += tl.sum(n, 0)
        most = tl.maximum(most, tl.max(n, 0))
        done += tl.sum(w, 0)
    return live, splits, most


@triton.jit
def _stream_rows(seq_lens_ptr, query_start_ptr, work_ptr, cut_ptr, num_reqs, share,
                 BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_B: tl.constexpr):
    """Write the persistent plan's rows and cut list (see the module docstring); returns
    the splits and the cut requests. The batch's tiles in request order, an empty
    request weighing one, are cut into runs of `share`: run p's splits (one per request
    it meets) are those of tiles [p share, (p + 1) share), in request order."""
    reqs = tl.arange(0, BLOCK_B)
    done = tl.full([], 0, tl.int32)
    first = tl.full([], 0, tl.int32)
    cuts = tl.full([], 0, tl.int32)
    for b0 in range(0, num_reqs, BLOCK_B):
        b = b0 + reqs
        in_batch = b < num_reqs
        w, begin, p_first, n = _stream_span(seq_lens_ptr, b, num_reqs, done, share, BLOCK_N)
        seq_len = tl.load(seq_lens_ptr + b, mask=in_batch, other=0)
        q_begin = tl.load(query_start_ptr + b, mask=in_batch, other=0)
        q_len = tl.load(query_start_ptr + b + 1, mask=in_batch, other=0) - q_begin
        start = first + tl.cumsum(n, 0) - n
        # Split k runs in program p_first + k, over its `share` tiles of the stream.
        cuts = _request_rows(work_ptr, cut_ptr, b, n, start, cuts, seq_len, q_begin, q_len,
                             p_first * share - begin, tl.zeros_like(n) + share, BLOCK_N,
                             BLOCK_J)
        done += tl.sum(w, 0)
        first += tl.sum(n, 0)
    return first, cuts


@triton.jit
def _stream_starts(seq_lens_ptr, starts_ptr, num_reqs, programs, share, BLOCK_N: tl.constexpr,
                   BLOCK_B: tl.constexpr, BLOCK_P: tl.constexpr):
    """starts of the persistent plan: program p runs the rows of run p (`_stream_rows`),
    none past the last run, up to `programs`. starts[p] is the rows of the runs before
    p, the sum over requests of clamp(p - p_first, 0, n)."""
    reqs = tl.arange(0, BLOCK_B)
    p = tl.arange(0, BLOCK_P)
    for p0 in range(0, programs + 1, BLOCK_P):
        before = tl.zeros([BLOCK_P], tl.int32)
        done = tl.full([], 0, tl.int32)
        for b0 in range(0, num_reqs, BLOCK_B):
            w, _, p_first, n = _stream_span(seq_lens_ptr, b0 + reqs, num_reqs, done, share,
                                            BLOCK_N)
            met = tl.minimum(tl.maximum((p0 + p)[:, None] - p_first[None, :], 0), n[None, :])
            before += tl.sum(met, 1)
            done += tl.sum(w, 0)
        tl.store(starts_ptr + p0 + p, before, mask=p0 + p <= programs)


def plan_bounds(
    num_reqs: int, head_groups: int, max_seq_len: int, slots: int, block_n: int,
    min_chunk: int, forced: int | None = None, persistent: bool = False,
    tail_wave: float = TAIL_WAVE,
) -> tuple[int, int, int, int]:
    """Host bounds of a plan from ints only: (programs, rows, max_splits, max_cut).

    programs: the stage-1 grid's programs per head group; rows: the plan's work rows
    (its splits), which are the programs but where a persistent plan may be made: for a
    kernel that runs several splits per program (`persistent`) and a batch of more rows
    than one wave of programs (slots / head_groups = W), a CUDA graph's padding among
    them. There the grid is a program per request (the scored plan then keeps every
    request whole, also where padding leaves a wave of live requests or fewer, which
    it would cut to fill the wave with a wider grid: a CUDA graph of more than W rows
    is taken by batches of more than the next smaller graph, 128 in the engine) and
    the rows the batch plus W (the persistent plan's runs of W programs). Else one wave's
    worth of programs or, for a batch larger than a wave, the batch plus room for cut
    splits: EXTRA_WAVES waves where the batch's last wave is filled less than
    tail_wave (the cost of a last partial wave, `plan_splits`), one wave else.
    max_splits: the most splits a request can get (MIN_TILES-sized splits of
    max_seq_len, MAX_SPLITS, and what the grid leaves; in the persistent plan a split
    per tile, at most one per program of W); `forced` splits for the longest request
    (tests, tuning) widen the grid to fit them and rule out the persistent plan.
    max_cut: the most requests cut in more than one split (each takes at least one of
    the programs past the batch's first B; in the persistent plan, each straddles a
    boundary between runs).
    """
    per_wave = cdiv(slots, head_groups)
    max_tiles = cdiv(max_seq_len, block_n)
    if persistent and forced is None and num_reqs > per_wave:
        return (num_reqs, num_reqs + per_wave, max(1, min(max_tiles, per_wave)),
                max(1, min(num_reqs, per_wave - 1)))
    fill = (num_reqs * head_groups % slots) / slots
    room = EXTRA_WAVES if fill < tail_wave else 1
    programs = per_wave if num_reqs <= per_wave else num_reqs + room * per_wave
    min_tiles = max(1, min_chunk // block_n)
    max_splits = max(1, min(MAX_SPLITS, cdiv(max_tiles, min_tiles), programs - num_reqs + 1))
    if forced is not None:
        max_splits = max(1, min(int(forced), MAX_SPLITS))
        programs = max(programs, num_reqs * max_splits)
    return programs, programs, max_splits, max(1, min(num_reqs, programs - num_reqs))


def plan_splits(
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, head_groups: int,
    max_seq_len: int, slots: int, block_n: int, min_chunk: int, block_h: int,
    forced: int | None = None, persistent: bool = False, past_wave_tiles: int = 0,
    tail_wave: float = TAIL_WAVE,
) -> SplitPlan:
    """Plan the splits of a batch with seq_lens int32 [B] and query_start_loc int32
    [B + 1] (on the device; nothing is read back): one launch of a one-program kernel,
    graph-safe. head_groups: stage-1 programs per split; slots: programs the GPU runs at
    once; block_n / min_chunk / block_h: the stage-1 config's tile, fewest positions per
    split and rows per program; persistent: the stage-1 kernel runs every split of
    starts[p] .. starts[p + 1] - 1 in program p (else only split p), so that a batch
    past one wave may take the persistent plan (`plan_bounds`); past_wave_tiles: what a
    split costs the stage-1 kernel past one wave of requests, in tiles, and tail_wave
    what its last partial wave costs there, as a fraction of a full one (the module
    docstring)."""
    num_reqs = seq_lens.shape[0]
    programs, rows, max_splits, max_cut = plan_bounds(
        num_reqs, head_groups, max_seq_len, slots, block_n, min_chunk, forced, persistent,
        tail_wave)
    device = seq_lens.device
    work = torch.empty(rows, WORK, dtype=torch.int32, device=device)
    cut = torch.empty(max_cut, WORK, dtype=torch.int32, device=device)
    starts = torch.empty(programs + 1, dtype=torch.int32, device=device)
    stream = rows > programs  # the persistent plan's grid
    # With the persistent plan's grid (a program per request) the scored plan can only
    # keep every request whole: its candidates need no more than one split each.
    scored_splits = 1 if stream else max_splits
    _plan_kernel[(1,)](
        seq_lens, query_start_loc, work, cut, starts,
        num_reqs, programs, rows, scored_splits, max_cut, head_groups, slots,
        int(forced or 0),
        BLOCK_N=block_n, MIN_TILES=max(1, min_chunk // block_n), OVERHEAD=OVERHEAD_TILES,
        PAST_WAVE_TILES=past_wave_tiles,
        PARTIAL=cdiv(PARTIAL_ROWS_PER_ROW * block_h, block_n), TAIL=tail_wave,
        PERSISTENT=stream, STREAM=STREAM_TILES, BLOCK_S=next_pow2(scored_splits),
        BLOCK_K=WHOLE_WAVES, BLOCK_B=min(_BLOCK_B, max(_MIN_BLOCK_B, next_pow2(num_reqs))),
        BLOCK_P=_BLOCK_P, BLOCK_J=_BLOCK_J, BLOCK_R=next_pow2(rows), num_warps=_PLAN_WARPS,
    )
    return SplitPlan(work, cut, starts, programs, max_splits)

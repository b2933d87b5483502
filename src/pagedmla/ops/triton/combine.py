"""Stage 2 of paged latent decode: the combine, which folds the splits of each (token,
head) by log-sum-exp, all splits of a column block in one load; and `merge_partials`,
the same kernel over the partials of decode context parallelism's ranks.

With one split, stage 1 writes the final output and the combine is skipped; a request
left whole by the split plan gets its output from stage 1 too, and the combine skips it
(it runs over the plan's `cut` list only).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from pagedmla.ops.triton._utils import (
    cdiv,
    check_device,
    last_dim_contiguous,
    multiprocessor_count,
    next_pow2,
)
from pagedmla.ops.triton.split_plan import WORK_FIELDS, SplitPlan

COMBINE_ELEMENTS = 4096  # splits x columns per combine program
COMBINE_WARPS = 4
COMBINE_PROGRAMS_PER_SM = 32  # the combine grid's cap (`combine_entries`)


@triton.jit
def _combine_entry(cut_ptr, entry, t, num_entries, num_splits, ALL_SPLITS: tl.constexpr,
                   INSIDE: tl.constexpr):
    """Entry `entry` of the combine, for its token t: (its first split, its split count,
    first token, q_len, the partials' token index); count 0 past the last entry (a
    check left out where the entry is known to be INSIDE the list)."""
    # (Exclusive branches: Triton compiles the statements after a return inside a
    # constexpr if, and cut_ptr is not an int32 pointer when ALL_SPLITS.)
    if ALL_SPLITS:  # entry k is token k, with every split, at its own index
        return 0, tl.where(INSIDE or entry < num_entries, num_splits, 0), entry, 1, entry
    else:
        request = cut_ptr + WORK_FIELDS * entry
        if INSIDE:
            return (tl.load(request + 1), tl.load(request + 3), tl.load(request + 5),
                    tl.load(request + 6), t)
        else:
            live = entry < num_entries
            return (tl.load(request + 1, mask=live, other=0),
                    tl.load(request + 3, mask=live, other=0),  # 0 past the cut requests
                    tl.load(request + 5, mask=live, other=0),
                    tl.load(request + 6, mask=live, other=0), t)


@triton.jit
def _merge_row(part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, first, count, q_begin, q_len,
               part_token, t, head, cols,
               stride_pt, stride_ph, stride_ps, stride_st, stride_sh, stride_ss,
               stride_ot, stride_oh, stride_lh, stride_lt,
               L: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr):
    """Merge one row's `count` splits (partials first .. first + count - 1) by lse into
    its output columns `cols` and lse; nothing past the entry's q_len (nor for count 0).
    Splits are taken BLOCK_S at a time in one online pass, each chunk's lse and partials
    loaded together; a split with lse -inf or +inf (no visible key) was not written and
    gets weight 0 (what was loaded for it is dropped); a NaN lse makes the row NaN."""
    used = tl.where(t < q_len, count, 0)  # tokens past this request's q_len: nothing
    token = (q_begin + t).to(tl.int64)
    splits = tl.arange(0, BLOCK_S)
    part_at = (part_out_ptr + part_token.to(tl.int64) * stride_pt + head * stride_ph
               + cols[None, :])
    lse_at = part_lse_ptr + part_token.to(tl.int64) * stride_st + head * stride_sh
    peak = tl.full([], float("-inf"), tl.float32)
    total = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_C], tl.float32)
    for s0 in range(0, used, BLOCK_S):
        at = first + s0 + splits
        lse = tl.load(lse_at + at * stride_ss, mask=s0 + splits < used, other=float("-inf"))
        part = tl.load(part_at + at[:, None].to(tl.int64) * stride_ps,
                       mask=(s0 + splits < used)[:, None] & (cols[None, :] < L), other=0.0)
        lse = tl.where(lse == float("inf"), float("-inf"), lse)  # +inf marks empty too
        new_peak = tl.maximum(peak, tl.max(lse, 0))
        shift = tl.where(new_peak == float("-inf"), 0.0, new_peak)
        rescale = tl.math.exp2((peak - shift) * 1.4426950408889634)
        weight = tl.math.exp2((lse - shift) * 1.4426950408889634)
        total = total * rescale + tl.sum(weight, 0)
        acc = acc * rescale + tl.sum(tl.where((weight > 0.0)[:, None], weight[:, None] * part,
                                              0.0), 0)
        peak = new_peak
    # A NaN lse makes its weight, so `total`, NaN (max() may skip it, a sum cannot): the
    # row is NaN then, out and lse, not a merge of the other splits.
    nan = total != total
    out = acc / tl.where(total > 0.0, total, 1.0)
    out = tl.where(nan, float("nan"), out)
    # (Masks are built as one comparison: the interpreter mistypes scalar & tensor.)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + cols,
             out.to(out_ptr.dtype.element_ty), mask=cols < tl.where(t < q_len, L, 0))
    merged = tl.where(total > 0.0, peak + tl.log(tl.where(total > 0.0, total, 1.0)),
                      float("-inf"))
    merged = tl.where(nan, float("nan"), merged)
    # Every column block writes the same lse value: a harmless duplicate store.
    tl.store(lse_ptr + head * stride_lh + token * stride_lt, merged, mask=t < q_len)


@triton.jit(  # batch-dependent: no variant per value (engine/warmup.py)
    do_not_specialize=["stride_lh", "num_splits", "num_entries"])
def _decode_combine_kernel(
    part_out_ptr, part_lse_ptr, cut_ptr, out_ptr, lse_ptr,
    stride_pt, stride_ph, stride_ps,
    stride_st, stride_sh, stride_ss,
    stride_ot, stride_oh,
    stride_lh, stride_lt,
    num_heads, num_splits, num_rows, num_entries,
    L: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr, ALL_SPLITS: tl.constexpr,
    LOOP: tl.constexpr, PDL: tl.constexpr,
):
    """One (column block, row, entry): merge the row's splits by lse (`_merge_row`).
    Rows are head x token (t * num_heads + head), num_rows per entry. The grid is one
    axis, column blocks fastest, then rows, then E entries (the order of a [blocks,
    rows, E] grid, whose second axis would hold at most 65535 rows: 128 heads x 512
    tokens are 65536). LOOP: the grid covers fewer entries than num_entries, and a
    program goes on to entry + E, + 2E, ... until one has no splits (a loop that costs
    registers, so only there).

    An entry is a row of the split plan's `cut` [num_entries, WORK] (request -1 once the
    cut requests end: nothing more to do): its splits are the partials first .. first +
    count - 1 (stride_ps / stride_ss apart), its tokens 0 .. q_len - 1 (stride_pt /
    stride_st). ALL_SPLITS (decode context parallel partials, `merge_partials`): entry
    k is token k, whose num_splits partials all count, at its own token index; cut is
    not read. PDL: launched as a programmatic dependent of stage 1 (`launch_pdl`), so it
    may start before stage 1 ends; it reads its first entry, then waits for stage 1
    (griddepcontrol.wait) before reading the partials. A program whose first entry is
    idle ends without waiting, as the entries after it are idle too, so that a plan
    that cuts no request leaves no program waiting out stage 1's tail.
    """
    COL_BLOCKS: tl.constexpr = (L + BLOCK_C - 1) // BLOCK_C
    col_block = tl.program_id(0) % COL_BLOCKS
    rows_entry = tl.program_id(0) // COL_BLOCKS
    row = rows_entry % num_rows
    entry = rows_entry // num_rows
    head = row % num_heads
    t = row // num_heads
    cols = col_block * BLOCK_C + tl.arange(0, BLOCK_C)
    first, count, q_begin, q_len, part_token = _combine_entry(cut_ptr, entry, t, num_entries,
                                                              num_splits, ALL_SPLITS, True)
    # Program 0 waits even so: the combine then never ends before stage 1, whose outputs
    # of uncut requests the kernels after the combine read.
    if PDL and ((count > 0) | (tl.program_id(0) == 0)):
        gdc_wait()
    strides = (stride_pt, stride_ph, stride_ps, stride_st, stride_sh, stride_ss,
               stride_ot, stride_oh, stride_lh, stride_lt)
    _merge_row(part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, first, count, q_begin, q_len,
               part_token, t, head, cols, *strides, L, BLOCK_C, BLOCK_S)
    if LOOP:
        step = tl.num_programs(0) // (COL_BLOCKS * num_rows)  # E
        entry += step
        first, count, q_begin, q_len, part_token = _combine_entry(
            cut_ptr, entry, t, num_entries, num_splits, ALL_SPLITS, False)
        while count > 0:
            _merge_row(part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, first, count, q_begin,
                       q_len, part_token, t, head, cols, *strides, L, BLOCK_C, BLOCK_S)
            entry += step
            first, count, q_begin, q_len, part_token = _combine_entry(
                cut_ptr, entry, t, num_entries, num_splits, ALL_SPLITS, False)


def combine_blocks(num_rows: int, entries: int, splits: int, max_splits: int, width: int,
                   num_sms: int) -> tuple[int, int]:
    """(BLOCK_C, BLOCK_S) of the combine for num_rows rows x `entries` requests of
    about `splits` (at most max_splits) splits each, `width` columns. One load should
    take all of a request's splits (each further chunk is one more round trip), so
    BLOCK_C x `splits` (rounded to the nearer power of two: a bound of 66 splits is
    mostly 64 real ones, and sizing for 128 would leave half of every load masked) fits
    COMBINE_ELEMENTS (registers); within that, whole rows per program where that still
    gives two programs per multiprocessor, narrower column blocks where it does not (a
    long request's 128 heads alone)."""
    typical = next_pow2(splits)
    if 2 * splits * splits < typical * typical:
        typical //= 2
    block_c = max(16, min(next_pow2(width), COMBINE_ELEMENTS // typical))
    while block_c > 16 and num_rows * entries * cdiv(width, block_c) < 2 * num_sms:
        block_c //= 2
    return block_c, max(1, min(next_pow2(max_splits), COMBINE_ELEMENTS // block_c))


def combine_entries(per_entry: int, entries: int, num_sms: int) -> int:
    """Entries the combine's grid covers at once, of `entries` (the cut list's bound) with
    `per_entry` programs each: all of them, or as many as fill COMBINE_PROGRAMS_PER_SM
    programs per multiprocessor, its programs then taking further entries in turn.
    Most of a bound past one wave may be idle rows (a batch of whole requests cuts
    none), and each idle program still costs its launch and one read of its row; fewer
    programs per multiprocessor would leave long lists of cut requests to few programs,
    whose entries run one after another. COMBINE_PROGRAMS_PER_SM is tuned with `python
    -m benchmarks.bench_kernels` (the decode rows at N = 128 and 16)."""
    return max(1, min(entries, cdiv(COMBINE_PROGRAMS_PER_SM * num_sms, per_entry)))


def combine_splits(
    part_out: torch.Tensor, part_lse: torch.Tensor, plan: SplitPlan, out: torch.Tensor,
    lse: torch.Tensor, num_rows: int, L: int, num_sms: int, pdl: bool,
) -> None:
    """Launch the combine over the requests the split plan cut: their partials part_out
    [max_query_len, N, plan.rows, L] and part_lse [max_query_len, N, plan.rows] float32
    into out [T, N, L] and lse [N, T]; num_rows = N * max_query_len query rows per
    request. pdl: stage 1 lets the combine launch before it ends (programmatic dependent
    launch)."""
    max_cut = plan.cut.shape[0]
    # A cut request has about rows / max_cut splits (every one of the plan's, when one
    # request is cut).
    block_c, block_s = combine_blocks(
        num_rows, max_cut, min(plan.max_splits, cdiv(plan.rows, max_cut)), plan.max_splits,
        L, num_sms)
    per_entry = cdiv(L, block_c) * num_rows
    entries = combine_entries(per_entry, max_cut, num_sms)
    _decode_combine_kernel[(per_entry * entries,)](
        part_out, part_lse, plan.cut, out, lse,
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1), part_lse.stride(2),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        out.shape[1], plan.max_splits, num_rows, max_cut,
        L=L, BLOCK_C=block_c, BLOCK_S=block_s, ALL_SPLITS=False, LOOP=entries < max_cut,
        PDL=pdl,
        num_warps=COMBINE_WARPS, launch_pdl=pdl,
    )


def merge_partials(out: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """As `reference.merge_partials`, in one launch of the decode combine kernel: D
    partials over disjoint keys, out [D, T, N, L] (any strides, unit last) and lse
    [D, T, N] float32 -> [T, N, L] in dtype. Decode context parallelism merges its
    ranks' partials with it, one split per rank."""
    check_device(out, lse)
    if out.dim() != 4 or tuple(lse.shape) != tuple(out.shape[:3]):
        raise ValueError(f"out must be [D, T, N, L] and lse [D, T, N], got "
                         f"{list(out.shape)} and {list(lse.shape)}")
    D, T, N, L = out.shape
    out = last_dim_contiguous(out)
    merged = torch.empty(T, N, L, dtype=dtype, device=out.device)
    if D == 0 or T == 0 or N == 0 or L == 0:
        return merged.zero_()
    merged_lse = torch.empty(N, T, dtype=torch.float32, device=out.device)  # not returned
    block_c, block_s = combine_blocks(N, T, D, D, L, multiprocessor_count(out.device))
    _decode_combine_kernel[(cdiv(L, block_c) * N * T,)](
        out, lse, lse, merged, merged_lse,  # (cut, the third: not read)
        out.stride(1), out.stride(2), out.stride(0),
        lse.stride(1), lse.stride(2), lse.stride(0),
        merged.stride(0), merged.stride(1), merged_lse.stride(0), merged_lse.stride(1),
        N, D, N, T,
        L=L, BLOCK_C=block_c, BLOCK_S=block_s, ALL_SPLITS=True, LOOP=False, PDL=False,
        num_warps=COMBINE_WARPS,
    )
    return merged

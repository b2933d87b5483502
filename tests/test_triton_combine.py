"""The decode combine (stage 2: a row's splits folded by log-sum-exp): its tile and grid
sizes, and decodes run with them cut down so that its chunked and looping paths run.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pagedmla.ops.triton import combine
from tests.triton_helpers import TINY_DECODE, _check_decode, _decode_case, runnable


@runnable
def test_decode_many_splits_merge_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    # 100 splits of one request (forced) and the combine's tile cut to 256 elements, so
    # that its two passes run over chunks of 16 splits. A short request beside it stays
    # whole.
    monkeypatch.setattr(combine, "COMBINE_ELEMENTS", 256)
    assert combine.combine_blocks(16, 2, 100, 100, 64, 4)[1] == 16
    args = _decode_case([1, 1], [1600, 40], 16, 64, 16, 16, torch.float32, torch.float32,
                        seed=33)
    _check_decode(args, torch.float32, config=TINY_DECODE, num_splits=100)


@runnable
def test_decode_combine_grid_smaller_than_its_entries(monkeypatch: pytest.MonkeyPatch) -> None:
    # The combine's grid covering one entry at a time, so that its programs merge the
    # same row of every cut request in turn (`combine_entries`; three cut here) and
    # stop at the plan's first idle cut row. Requests of 1-3 tokens, cut in 1-3 splits.
    monkeypatch.setattr(combine, "combine_entries", lambda *_: 1)
    args = _decode_case([1, 3, 2, 1, 2], [150, 190, 40, 2, 120], 4, 64, 16, 16,
                        torch.float32, torch.float32, seed=36)
    _check_decode(args, torch.float32, config=TINY_DECODE, num_splits=3)


def test_combine_entries_cap_the_grid_not_the_work() -> None:
    # 32 programs per SM on 132 SMs: entries of 128 rows (N = 128), 100 of them a bound
    # past one wave, 33 at once; 131 entries of 16 rows (N = 16) fit whole; at least
    # one entry always.
    assert combine.COMBINE_PROGRAMS_PER_SM == 32
    assert combine.combine_entries(128, 100, 132) == 33
    assert combine.combine_entries(16, 131, 132) == 131
    assert combine.combine_entries(16384, 3, 132) == 1


def test_combine_blocks_fit_the_real_split_count() -> None:
    # B = 1 at N = 128 on 132 SMs: the plan allows 66 splits (two head groups) and cuts a
    # 64k request into 64, so one load should hold 64 splits, not 128 (half masked).
    assert combine.combine_blocks(128, 1, 66, 66, 512, 132) == (64, 64)
    # 100 splits are nearer 128 than 64: one load of 128 splits, 32 columns wide.
    assert combine.combine_blocks(128, 1, 100, 100, 512, 132) == (32, 128)
    for splits in range(1, 129):
        block_c, block_s = combine.combine_blocks(16, 4, splits, 128, 512, 132)
        assert block_c * block_s <= combine.COMBINE_ELEMENTS
        assert 2 * block_s >= splits  # at most two rounds of the combine's loop

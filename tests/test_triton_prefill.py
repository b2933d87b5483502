"""Variable-length prefill attention against the reference op: the Triton kernel, the
Gluon kernel on Hopper, and the backend's choice of cuDNN for equal-length batches.
"""

from __future__ import annotations

import math

import pytest
import torch

from pagedmla.ops import reference as ref
from pagedmla.testing import relative_error

pytest.importorskip("triton")

from pagedmla.ops.triton import prefill_attention, varlen_attention
from pagedmla.ops.triton._utils import cdiv
from pagedmla.ops.triton.selection import prefill_kernel
from tests.triton_helpers import _check_varlen, _cu, cuda, hopper, runnable


def test_packed_blocks_bound_every_cut_of_the_tokens() -> None:
    # The prefill grid (`packed_blocks`) must hold every sequence's query blocks for any
    # cut of T tokens into B sequences of at most max_q; and it is exact where it can be.
    from pagedmla.ops.triton.prefill_triton import packed_blocks

    gen = torch.Generator().manual_seed(37)
    for _ in range(2000):
        B = int(torch.randint(1, 12, (1,), generator=gen))
        lens = torch.randint(0, 300, (B,), generator=gen).tolist()
        T = sum(lens) + int(torch.randint(0, 3, (1,), generator=gen))  # rows past them
        need = sum(cdiv(n, 64) for n in lens)
        assert need <= packed_blocks(T, B, max(lens), 64)
    assert packed_blocks(300, 1, 300, 128) == 3
    assert packed_blocks(256, 2, 128, 128) == 2  # two full blocks, no partial one
    assert packed_blocks(4, 4, 1, 128) == 4


@runnable
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_more_sequences_than_one_lookup_chunk(causal: bool) -> None:
    # 150 sequences, more than the SEQ_CHUNK (128) a program's lookup of its (sequence,
    # block) reads at once, with lengths 0 among them: every packed block finds its own.
    from pagedmla.ops.triton.prefill_triton import SEQ_CHUNK

    gen = torch.Generator().manual_seed(38)
    q_lens = torch.randint(0, 40, (150,), generator=gen).tolist()
    q_lens[0] = q_lens[129] = 0
    k_lens = q_lens if causal else torch.randint(0, 40, (150,), generator=gen).tolist()
    assert len(q_lens) > SEQ_CHUNK.value
    _check_varlen(q_lens, k_lens, 2, 16, 16, torch.float32, causal, seed=39)


@runnable
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("qk", "dv"), [(48, 24), (24, 8), (16, 16)])
def test_varlen_causal(dtype: torch.dtype, qk: int, dv: int) -> None:
    # Lengths 0 and 1, one block, several blocks with a partial last one.
    lens = [0, 1, 5, 33, 70]
    _check_varlen(lens, lens, 3, qk, dv, dtype, True, seed=120 + qk)


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("q_lens", "k_lens", "causal", "on_cudnn"), [
    ([300], [300], True, True),  # one sequence
    ([64, 64, 64], [64, 64, 64], True, True),  # equal lengths: dense [3, N, 64, D]
    ([40, 40], [100, 100], False, True),  # a context chunk's shape, unmasked
    ([5, 77], [5, 77], True, False),  # varlen: the Triton kernel
    ([40, 40], [90, 90], True, False),  # causal, not square: cuDNN's mask would differ
], ids=["one", "equal", "context", "varlen", "rect-causal"])
def test_prefill_selection(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype,
                           q_lens: list[int], k_lens: list[int], causal: bool,
                           on_cudnn: bool) -> None:
    # The backend's prefill op: cuDNN for equal-length batches, else the Triton kernel;
    # both against the reference, with the path taken checked.
    from pagedmla.ops.triton import prefill_cudnn

    calls: list[int] = []
    dense = prefill_cudnn.dense_attention
    monkeypatch.setattr(prefill_cudnn, "dense_attention",
                        lambda *a: calls.append(1) or dense(*a))
    _check_varlen(q_lens, k_lens, 16, 192, 128, dtype, causal, seed=135, device="cuda",
                  fn=prefill_attention)
    assert bool(calls) == on_cudnn


@cuda
def test_prefill_selection_falls_back_when_cudnn_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    # A cuDNN refusal (RuntimeError) sends the call, and later calls of the same kind,
    # to the Triton kernel; the answer stays right.
    from pagedmla.ops.triton import prefill_cudnn

    calls: list[int] = []

    def refuse(*args: object) -> None:
        calls.append(1)
        raise RuntimeError("unsupported")

    monkeypatch.setattr(prefill_cudnn, "dense_attention", refuse)
    monkeypatch.setattr(prefill_cudnn, "_REFUSED", set())
    for seed in (136, 137):
        _check_varlen([64, 64], [64, 64], 4, 192, 128, torch.bfloat16, True, seed=seed,
                      device="cuda", fn=prefill_attention)
    assert len(calls) == 1 and len(prefill_cudnn._REFUSED) == 1


@runnable
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_without_any_key(causal: bool) -> None:
    # k and v empty (no sequence has a key): out 0 and lse -inf, and no kernel runs. On
    # a Hopper GPU these widths and float16 would take the Gluon kernel, whose copy
    # descriptors cannot describe an empty k.
    for fn in (varlen_attention, prefill_attention):
        out, _ = _check_varlen([3, 0, 5], [0, 0, 0], 2, 192, 128, torch.float16, causal,
                               seed=131, fn=fn)
        assert torch.equal(out, torch.zeros_like(out))


@runnable
def test_varlen_causal_fewer_keys_than_queries() -> None:
    # Bottom-right alignment with q_len > k_len: the first queries see no key at all.
    _check_varlen([6, 40], [2, 35], 2, 48, 24, torch.float32, True, seed=130)


@runnable
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_varlen_unmasked_context(dtype: torch.dtype) -> None:
    # Context chunks: separate query and key lengths, keys 0 (no key: out 0, lse -inf).
    _check_varlen([3, 1, 9, 40], [7, 0, 1, 90], 2, 48, 24, dtype, False, seed=140)


@runnable
def test_varlen_deepseek_dims_small() -> None:
    # 192 / 128 (DeepSeek): the qk dot is a 128-wide and a 64-wide tl.dot.
    _check_varlen([1, 20], [1, 20], 2, 192, 128, torch.float16, True, seed=150)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize(("qk", "dv"), [(192, 128), (256, 256), (128, 128)])
@pytest.mark.parametrize("num_heads", [16, 128])
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_gpu(qk: int, dv: int, num_heads: int, causal: bool) -> None:
    q_lens = [0, 1, 300, 1029]
    k_lens = q_lens if causal else [5, 0, 2000, 1029]
    _check_varlen(q_lens, k_lens, num_heads, qk, dv, torch.bfloat16, causal, seed=500)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_gpu_ragged_many_sequences(causal: bool) -> None:
    # 300 sequences of 0-300 tokens and one of 3000: the packed query blocks of both
    # kernels (the Gluon one on Hopper), across three lookup chunks of 128 sequences.
    gen = torch.Generator().manual_seed(501)
    q_lens = [*torch.randint(0, 300, (300,), generator=gen).tolist(), 3000]
    q_lens[7] = 0
    k_lens = q_lens if causal else torch.randint(0, 500, (301,), generator=gen).tolist()
    _check_varlen(q_lens, k_lens, 16, 192, 128, torch.bfloat16, causal, seed=502)


@pytest.mark.parametrize(
    ("dtype", "qk", "dv", "heads", "view", "takes"),
    [
        (torch.bfloat16, 192, 128, 16, "kv", True),  # DeepSeek: k, v views of one buffer
        (torch.float16, 128, 128, 4, "kv", True),
        (torch.bfloat16, 256, 256, 2, "kv", True),
        (torch.bfloat16, 64, 64, 1, "kv", True),
        (torch.float32, 192, 128, 16, "kv", False),
        (torch.bfloat16, 48, 24, 2, "kv", False),  # head dims the copy boxes do not cover
        (torch.bfloat16, 192, 96, 2, "kv", False),
        (torch.bfloat16, 192, 128, 16, "odd-stride", False),  # head stride not 16 bytes
        (torch.bfloat16, 192, 128, 16, "heads-outer", False),  # [N, T, D] memory order
    ],
)
def test_prefill_hopper_kernel_choice(dtype: torch.dtype, qk: int, dv: int, heads: int,
                                      view: str, takes: bool) -> None:
    # Which calls the Gluon prefill kernel takes on a Hopper GPU, from the tensors alone,
    # and that the dispatcher never hands it CPU tensors.
    from pagedmla.ops.triton import prefill_hopper

    pad = 4 if view == "odd-stride" else 0
    q = torch.zeros(5, heads, qk, dtype=dtype)
    kv = torch.zeros(7, heads, qk + dv + pad, dtype=dtype)
    if view == "heads-outer":
        kv = torch.zeros(heads, 7, qk + dv, dtype=dtype).transpose(0, 1)
    k, v = kv[..., :qk], kv[..., qk:qk + dv]
    assert prefill_hopper.supported(q, k, v, 0.1) is takes
    assert not prefill_hopper.supported(q, k, v, 0.0)
    assert not prefill_hopper.supported(q, k, v, -0.1)
    assert prefill_kernel(q, k, v, 1, 5, 7, 0.1, True).name == "prefill_triton"


@pytest.mark.cuda
@hopper
@pytest.mark.parametrize(("qk", "dv"), [(192, 128), (128, 128), (256, 256), (64, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("num_heads", [1, 16])
def test_varlen_gpu_hopper_kernel(qk: int, dv: int, dtype: torch.dtype, causal: bool,
                                  num_heads: int) -> None:
    # The warp-specialized prefill kernel: lengths 0 and 1, one tile exactly, one past
    # it, several tiles with a partial last one; query blocks of 128 rows spilling into
    # the next sequence; unmasked context with more or fewer keys than queries.
    q_lens = [0, 1, 128, 129, 64, 700]
    k_lens = q_lens if causal else [5, 0, 300, 129, 1000, 77]
    q = torch.empty(1, num_heads, qk, dtype=dtype, device="cuda")
    kv = torch.empty(1, num_heads, qk + dv, dtype=dtype, device="cuda")
    chosen = prefill_kernel(q, kv[..., :qk], kv[..., qk:], len(q_lens), max(q_lens),
                            max(k_lens), qk**-0.5, causal, cudnn=False)
    assert chosen.name == "prefill_hopper"
    _check_varlen(q_lens, k_lens, num_heads, qk, dv, dtype, causal, seed=510 + qk + dv,
                  device="cuda")


@pytest.mark.cuda
@hopper
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_gpu_hopper_head_groups(causal: bool) -> None:
    # Programs are launched in groups of heads sized to L2 (`head_group`): a long
    # sequence makes the groups smaller than N = 10, so the last group is partial.
    from pagedmla.ops.triton import prefill_hopper

    N, qk, dv = 10, 192, 128
    q_lens = [5000, 300, 1]
    k_lens = q_lens if causal else [5000, 700, 1]
    probe = torch.empty(1, N, qk, dtype=torch.bfloat16, device="cuda")
    group = prefill_hopper.head_group(N, max(k_lens), qk + dv, probe)
    assert 1 < group < N and N % group != 0, group
    _check_varlen(q_lens, k_lens, N, qk, dv, torch.bfloat16, causal, seed=530, device="cuda")


@pytest.mark.cuda
@hopper
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_gpu_hopper_rows_past_a_sequence(causal: bool) -> None:
    # The copy engine reads whole 128-row tiles, so a sequence's last key tile holds the
    # next sequence's rows: infinite values there must not reach the sequence's output
    # (P is 0 for them, and 0 x inf is NaN unless the rows are zeroed).
    N, qk, dv = 4, 192, 128
    q_lens = [100, 60]
    k_lens = q_lens if causal else [150, 60]
    gen = torch.Generator().manual_seed(520)
    q = torch.randn(sum(q_lens), N, qk, generator=gen).cuda().bfloat16()
    kv = torch.randn(sum(k_lens), N, qk + dv, generator=gen).cuda().bfloat16()
    kv[k_lens[0]:] = math.inf
    k, v = kv[..., :qk], kv[..., qk:]
    out, lse = varlen_attention(q, k, v, _cu(q_lens, "cuda"), _cu(k_lens, "cuda"),
                                max(q_lens), max(k_lens), qk**-0.5, causal)
    first = slice(0, q_lens[0])
    want, want_lse = ref.varlen_attention(
        q[first], k[:k_lens[0]], v[:k_lens[0]], _cu(q_lens[:1], "cuda"),
        _cu(k_lens[:1], "cuda"), q_lens[0], k_lens[0], qk**-0.5, causal)
    assert out[first].isfinite().all()
    assert relative_error(out[first], want.double()) < 1e-2
    torch.testing.assert_close(lse[:, first], want_lse, atol=2e-3, rtol=1e-5)

"""`LLM(batch_invariant=True)`: a request's tokens and logprobs bitwise the same alone,
among other requests and however its prompt is chunked; the invariant decode ops
against a float64 oracle; what the mode refuses."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers")

from pagedmla import LLM, EngineArgs, MLADims, SamplingParams
from pagedmla.ops import reference
from pagedmla.ops.batch_invariant import ROW_TILE, reference_decode
from pagedmla.testing import make_paged_batch
from tests.test_engine_parity import _check_against_hf, _prompts
from tests.tiny_hf import V3, make_hf_model, save_hf_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, logprobs=3, ignore_eos=True)
# Seeded: top-k, top-p and penalties on the request's own generator.
SEEDED = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, presence_penalty=0.3,
                        repetition_penalty=1.1, seed=11, max_tokens=10, logprobs=3,
                        ignore_eos=True)


def _llm(path: str, **kwargs) -> LLM:
    options = dict(dtype=torch.float32, device="cpu", block_size=8, num_kv_blocks=256,
                   batch_invariant=True)
    return LLM(model=path, **{**options, **kwargs})


def _completion(out) -> tuple[list[int], list[list[tuple[int, float]]]]:
    """Token ids and every step's logprobs, exactly (floats compared bitwise)."""
    c = out.outputs[0]
    return c.token_ids, [sorted(step.items()) for step in c.logprobs]


def _invariance(hf, path: str, lens: tuple[int, ...] = (45, 5, 90, 12, 64) + (3,) * 66,
                params: SamplingParams = GREEDY, **options) -> None:
    """The completion of the first of prompts of `lens` tokens: alone; among the others
    (by default two forwards of ROW_TILE tokens per prefill step; its tokens at other
    rows); with its prompt prefilled in
    chunks of 16 tokens; after a cached prefix. Bitwise the same, and (float32)
    transformers'."""
    prompts = _prompts(97, list(lens), seed=4)
    mine = prompts[0]
    alone = _llm(path, **options).generate([mine], params, use_tqdm=False)
    if options.get("dtype", torch.float32) == torch.float32 and params.temperature == 0:
        _check_against_hf(hf, [mine], alone)
    want = _completion(alone[0])
    crowded = _llm(path, **options).generate([*prompts[1:3], mine, *prompts[3:]], params,
                                             use_tqdm=False)
    assert _completion(crowded[2]) == want
    chunked = _llm(path, max_num_batched_tokens=16, **options)
    assert _completion(chunked.generate([prompts[2], mine], params,
                                        use_tqdm=False)[1]) == want
    # Its first 40 tokens' blocks cached by another request, then reused.
    other = _llm(path, max_num_batched_tokens=16, **options)
    other.generate([[*mine[:40], 1, 2]], params, use_tqdm=False)
    assert _completion(other.generate([mine], params, use_tqdm=False)[0]) == want
    assert other.stats.prefill_tokens < len(mine)  # a prefix hit


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_reference_backend_is_batch_invariant(v3_checkpoint, params: SamplingParams) -> None:
    _invariance(*v3_checkpoint, params=params)


def test_preempted_requests_come_out_the_same(v3_checkpoint) -> None:
    """A cache of 30 usable 8-token blocks for 8 requests: preempted ones recompute their
    tokens in other steps, and give the completions of an engine with room to spare."""
    _, path = v3_checkpoint
    prompts = _prompts(97, [45, 30, 12, 64, 20, 33, 9, 50], seed=8)
    roomy = _llm(path).generate(prompts, SEEDED, use_tqdm=False)
    tight = _llm(path, num_kv_blocks=31)
    crowded = tight.generate(prompts, SEEDED, use_tqdm=False)
    assert tight.stats.preemptions > 0
    assert [_completion(o) for o in crowded] == [_completion(o) for o in roomy]


def test_triton_backend_is_batch_invariant(tmp_path) -> None:
    """The Triton backend's kernels, interpreted on the CPU, on a model without routed
    experts: the interpreter's dots are numpy's, whose rows depend on their place in a
    tile (the GPU test covers the experts kernel)."""
    pytest.importorskip("triton")
    hf = make_hf_model("v3", first_k_dense_replace=3, **V3)
    _invariance(hf, str(save_hf_checkpoint(hf, tmp_path)), lens=(45, 5, 30),
                params=SamplingParams(temperature=0.0, max_tokens=3, logprobs=3,
                                      ignore_eos=True), backend="triton")


def _oracle(batch, q: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 absorbed MQA of q [T, N, L + R] over each request's latents (the new ones
    through the cache): (out [T, N, L], lse [N, T])."""
    L = batch.dims.kv_lora_rank
    outs, lses = [], []
    for b, rows in enumerate(batch.token_slices):
        keys = batch.full_latents(b, through_cache=True)  # [S, L + R]
        Q = rows.stop - rows.start
        for i in range(Q):
            visible = keys[: batch.seq_lens[b] - Q + i + 1]
            scores = q[rows.start + i].double() @ visible.T * scale  # [N, S]
            lses.append(torch.logsumexp(scores, dim=-1))
            outs.append(torch.softmax(scores, dim=-1) @ visible[:, :L])
    return torch.stack(outs), torch.stack(lses, dim=1)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_invariant_decode_matches_the_oracle_row_by_row(backend: str,
                                                        kv_cache_dtype: str) -> None:
    """Rows of 1 and 3 queries per request, ragged contexts, NaN in every unused slot:
    the float64 oracle; each row's result bitwise the same in a batch of its own."""
    if backend == "triton":
        pytest.importorskip("triton")
        from pagedmla.ops.triton.invariant_decode import invariant_decode as decode
    else:
        decode = reference_decode
    dims = MLADims(num_heads=20, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
                   v_head_dim=16)
    batch = make_paged_batch(dims, [1, 3, 1, 1], [1, 40, 77, 9], block_size=8,
                             kv_cache_dtype=kv_cache_dtype, fp8_scale=0.5, seed=3)
    cache = batch.cache
    reference.write_cache(cache.data, batch.kv_c, batch.k_pe, batch.spec.slot_mapping,
                          cache.scale)
    L, width = dims.kv_lora_rank, dims.kv_lora_rank + dims.qk_rope_head_dim
    q = torch.randn(batch.num_tokens, dims.num_heads, width, generator=torch.Generator()
                    .manual_seed(5))
    starts = torch.tensor([0, 1, 4, 5, 6], dtype=torch.int32)
    seq_lens = torch.tensor(batch.seq_lens, dtype=torch.int32)
    scale = 1 / math.sqrt(width)

    def run(rows: slice, reqs: slice) -> tuple[torch.Tensor, torch.Tensor]:
        return decode(q[rows], cache.data, cache.scale, batch.spec.block_table[reqs],
                      seq_lens[reqs], starts[reqs.start : reqs.stop + 1] - starts[reqs.start],
                      3, int(seq_lens[reqs].max()), L, scale)

    out, lse = run(slice(0, 6), slice(0, 4))
    want_out, want_lse = _oracle(batch, q, scale)
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
    part_out, part_lse = run(slice(1, 5), slice(1, 3))  # requests 1 and 2 alone
    assert torch.equal(part_out, out[1:5]) and torch.equal(part_lse, lse[:, 1:5])


def test_forwards_are_row_tiles(v3_checkpoint) -> None:
    """Every forward of a batch-invariant engine has exactly ROW_TILE tokens."""
    _, path = v3_checkpoint
    llm = _llm(path, max_num_batched_tokens=100)
    sizes = []
    llm.model.register_forward_pre_hook(lambda module, args: sizes.append(args[0].shape[0]))
    llm.generate(_prompts(97, [150, 3, 20], seed=6), GREEDY, use_tqdm=False)
    assert sizes and set(sizes) == {ROW_TILE}


@pytest.mark.parametrize(("options", "message"), [
    (dict(tensor_parallel_size=2), "tensor_parallel_size 1"),
    (dict(compile=True), "compile"),
    (dict(kv_cache_dtype="fp8_ds_mla"), "fp8_ds_mla"),
    (dict(batch_invariant="yes"), "batch_invariant"),
])
def test_what_batch_invariance_refuses(options: dict, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        EngineArgs(**{"batch_invariant": True, **options})


def test_sparse_models_are_refused(tmp_path) -> None:
    path = save_hf_checkpoint(make_hf_model("v32"), tmp_path)
    with pytest.raises(ValueError, match="batch_invariant=True is not supported"):
        LLM(model=str(path), device="cpu", batch_invariant=True)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_batch_invariant_on_cuda(v3_checkpoint, kv_cache_dtype: str) -> None:
    """bf16 on the GPU, forwards replaying the captured ROW_TILE-row decode graph."""
    _invariance(*v3_checkpoint, device="cuda", dtype=torch.bfloat16,
                kv_cache_dtype=kv_cache_dtype, warmup=False)

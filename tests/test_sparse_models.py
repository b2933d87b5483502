"""DeepSeek-V3.2 and GLM-5 (sparse attention) against Hugging Face transformers.

Tiny random `DeepseekV32ForCausalLM` and `GlmMoeDsaForCausalLM` checkpoints whose
indexer keeps 12 positions (`index_topk`), fewer than the prompts hold, so the selection
changes the result (`test_the_selection_matters` shows by how much). The GLM model has
a shared layer (`indexer_types` full, shared, full): it attends with the top-k of the
layer before it. Our runs go through paged caches (block 0 reserved, other blocks
permuted, unused slots NaN); transformers runs each full sequence alone. float32:
greedy tokens identical, logprobs within 2e-3.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("transformers")
from safetensors.torch import load_file

from pagedmla import LLM, BatchSpec, LatentKVCache, MLAMetadataBuilder, SamplingParams
from pagedmla.engine.cuda_graph import GraphInputs, graph_metadata
from pagedmla.models import DeepseekConfig, DeepseekForCausalLM
from pagedmla.ops.reference_indexer import allocate_indexer_cache
from tests.engine_helpers import assert_same_completions
from tests.test_engine_parity import _check_against_hf, _prompts
from tests.tiny_hf import SPARSE_COMMON, hf_logprobs, make_hf_model

BLOCK = 4
LOGPROB_TOL = 2e-3
TOPK = SPARSE_COMMON["index_topk"]
VARIANTS = {"v32": {}, "glm": dict(indexer_types=["full", "shared", "full"])}
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1, ignore_eos=True)


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request, tmp_path_factory):
    """(variant, transformers model, its save_pretrained directory)."""
    hf = make_hf_model(request.param, **VARIANTS[request.param])
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return request.param, hf, path


def _ours(path) -> DeepseekForCausalLM:
    config = DeepseekConfig.from_dict(json.loads((path / "config.json").read_text()))
    model = DeepseekForCausalLM(config)
    filled = model.load_weights(load_file(path / "model.safetensors").items())
    assert filled == model.expected_weight_names()
    model.process_weights_after_loading()
    return model


def _run_chunks(model: DeepseekForCausalLM, tokens: list[int], cuts: list[int],
                fp8_keys: bool = False) -> torch.Tensor:
    """log_softmax of our logits [len(tokens), vocab] for one request fed in chunks
    ending at `cuts`, over a paged cache (permuted blocks, `_caches`)."""
    config, dims = model.config, model.dims
    num_blocks = 2 + math.ceil(len(tokens) / BLOCK)
    order = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(3)) + 1
    table = order[:-1].view(1, -1).to(torch.int32)
    caches = _caches(model, num_blocks, fp8_keys)
    builder = MLAMetadataBuilder(dims, block_size=BLOCK, index_topk=config.indexer.topk)
    logprobs, start = [], 0
    for end in cuts:
        positions = torch.arange(start, end)
        slots = table[0, positions // BLOCK].long() * BLOCK + positions % BLOCK
        meta = builder.build(BatchSpec([end - start], [end], table, slots))
        hidden = model(torch.tensor(tokens[start:end]), positions, caches, meta)
        logprobs.append(model.compute_logits(hidden).double().log_softmax(-1))
        start = end
    return torch.cat(logprobs)


def _caches(model: DeepseekForCausalLM, num_blocks: int,
            fp8_keys: bool = False) -> list[LatentKVCache]:
    """float32 latent (and indexer key) caches for `model`, NaN everywhere unwritten
    (fp8_keys: the indexer keys in the fp8 layout, all bytes 0xFF, NaN codes and
    scales)."""
    config, dims = model.config, model.dims
    caches = []
    for layer in model.layers:
        cache = LatentKVCache(num_blocks, BLOCK, dims.kv_lora_rank, dims.qk_rope_head_dim,
                              dtype=torch.float32)
        cache.data.fill_(math.nan)
        if layer.self_attn.indexer is not None:
            cache.index_keys = allocate_indexer_cache(
                num_blocks, BLOCK, config.indexer.head_dim, torch.float32, fp8=fp8_keys)
            cache.index_keys.fill_(0xFF if fp8_keys else math.nan)
        caches.append(cache)
    return caches


def test_config_reads_the_indexer(checkpoint) -> None:
    _, hf, path = checkpoint
    config = _ours(path).config
    index = config.indexer
    assert (index.topk, index.num_heads, index.head_dim) == (TOPK, 8, 16)
    assert index.rope_interleaved == (hf.config.model_type == "glm_moe_dsa")
    shared = hf.config.model_type == "glm_moe_dsa"
    assert [config.indexer.has_indexer(i) for i in range(3)] == [True, not shared, True]
    assert [config.is_moe_layer(i) for i in range(3)] == [False, True, True]


def test_chunked_prefill_matches_transformers(checkpoint) -> None:
    """Prefill in chunks of 1, 16 and 23 tokens (decode, chunk over context, chunk
    crossing top-k) gives transformers' logprobs at every position."""
    _, hf, path = checkpoint
    tokens = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    ours = _run_chunks(_ours(path), tokens, [1, 17, 40])
    ref = hf_logprobs(hf, tokens)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    assert (ours - ref).abs().max() < LOGPROB_TOL


def test_fp8_indexer_keys_keep_the_selection(checkpoint, monkeypatch) -> None:
    """With fp8 indexer keys (rotated, power-of-two scales) the first layer, whose
    inputs are those of the float run, selects what it selects with float keys: at
    least 95% of the positions of every chunk (12 of 16-value keys; a broken fp8 path,
    e.g. keys read as zeros, keeps about a third)."""
    *_, path = checkpoint
    model = _ours(path)
    tokens = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    first = model.layers[0].self_attn.indexer
    chosen: dict[bool, list[torch.Tensor]] = {False: [], True: []}
    for fp8 in (False, True):
        forward = type(first).forward

        def recorded(self, *args, fp8=fp8, forward=forward, **kwargs):
            indices = forward(self, *args, **kwargs)
            if self is first:
                chosen[fp8].append(indices)
            return indices

        monkeypatch.setattr(type(first), "forward", recorded)
        _run_chunks(model, tokens, [17, 40], fp8_keys=fp8)
        monkeypatch.undo()
    for exact, rounded in zip(chosen[False], chosen[True], strict=True):
        hits = total = 0
        for a, b in zip(exact.tolist(), rounded.tolist(), strict=True):
            want = {p for p in a if p >= 0}
            hits, total = hits + len(want & set(b)), total + len(want)
        assert hits >= 0.95 * total


@pytest.mark.parametrize("prompt_lens", [[5, 20], [3, 7]], ids=["past_topk", "within_topk"])
def test_graph_metadata_gives_the_builders_logits(checkpoint, prompt_lens) -> None:
    """What a captured decode step of a sparse model reads (`graph_metadata` over staged
    `GraphInputs`: two padding rows, a block table wider than the step's, every row
    sparse) gives the logits of the builder's metadata for the same step, whose batch
    is sparse past top-k and dense within it; the padding rows stay finite."""
    *_, path = checkpoint
    model = _ours(path)
    topk = model.config.indexer.topk
    gen = torch.Generator().manual_seed(sum(prompt_lens))
    blocks = [math.ceil((n + 1) / BLOCK) for n in prompt_lens]
    num_blocks = 1 + sum(blocks)
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    width = max(blocks)
    table = torch.zeros(len(blocks), width, dtype=torch.int32)
    for row, n in enumerate(blocks):
        table[row, :n] = torch.tensor(order[:n], dtype=torch.int32)
        order = order[n:]
    caches = _caches(model, num_blocks)
    builder = MLAMetadataBuilder(model.dims, block_size=BLOCK, index_topk=topk)

    def slots(row: int, positions: list[int]) -> torch.Tensor:
        p = torch.tensor(positions)
        return table[row, p // BLOCK].long() * BLOCK + p % BLOCK

    for row, n in enumerate(prompt_lens):  # the prompts, one request at a time
        meta = builder.build(BatchSpec([n], [n], table[row : row + 1], slots(row, list(range(n)))))
        model(torch.randint(0, 97, (n,), generator=gen), torch.arange(n), caches, meta)
    tokens = torch.randint(0, 97, (len(prompt_lens),), generator=gen)
    positions = torch.tensor(prompt_lens)
    spec = BatchSpec([1] * len(prompt_lens), [n + 1 for n in prompt_lens], table,
                     torch.cat([slots(row, [n]) for row, n in enumerate(prompt_lens)]))
    meta = builder.build(spec)
    assert meta.sparse.dense == (max(spec.seq_lens) <= topk)
    expected = model.compute_logits(model(tokens, positions, caches, meta)).double()

    rows = len(prompt_lens) + 2
    inputs = GraphInputs(rows, width + 3, caches[0].num_slots, num_blocks, torch.device("cpu"))
    inputs.stage(rows, tokens, positions, spec, list(range(len(prompt_lens))))
    graph_meta = graph_metadata(caches[0], inputs, rows, (width + 3) * BLOCK, topk=topk,
                                width=width + 1)
    assert graph_meta.sparse is not None and not graph_meta.sparse.dense
    assert graph_meta.decode.block_table.shape == (rows, width + 1)
    got = model.compute_logits(model(inputs.token_ids[:rows], inputs.positions[:rows], caches,
                                     graph_meta)).double()
    torch.testing.assert_close(got[: len(prompt_lens)], expected, rtol=0, atol=1e-4)
    assert torch.isfinite(got).all()


def test_the_selection_matters(checkpoint) -> None:
    """With an index_topk covering the whole prompt (dense attention) transformers'
    logprobs move well beyond the tolerance past the first TOPK positions: the parity
    tests would catch attention that ignored the selection."""
    variant, hf, _ = checkpoint
    tokens = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    dense = make_hf_model(variant, **VARIANTS[variant], index_topk=64)
    dense.load_state_dict(hf.state_dict())
    sparse_ref, dense_ref = hf_logprobs(hf, tokens), hf_logprobs(dense, tokens)
    torch.testing.assert_close(sparse_ref[:TOPK], dense_ref[:TOPK], rtol=1e-6, atol=1e-6)
    assert (sparse_ref[TOPK:] - dense_ref[TOPK:]).abs().max() > 50 * LOGPROB_TOL


def _llm(path, **kwargs) -> LLM:
    options = dict(dtype=torch.float32, device="cpu", block_size=BLOCK, num_kv_blocks=128)
    return LLM(model=str(path), **{**options, **kwargs})


def test_engine_matches_transformers(checkpoint) -> None:
    """A batch under a 16-token step budget: chunked prefill, mixed decode and prefill
    steps, prompts shorter and longer than top-k."""
    _, hf, path = checkpoint
    prompts = _prompts(97, [3, 17, 40, 9, 30], seed=5)
    llm = _llm(path, max_num_batched_tokens=16)
    layers = sum(c.index_keys is not None for c in llm.caches)  # 16 float32 values each
    assert llm.memory.kv_cache_format.endswith(f"indexer keys {layers * 64} bytes per token, "
                                               "all layers")
    _check_against_hf(hf, prompts, llm.generate(prompts, GREEDY, use_tqdm=False))


def test_prefix_caching_and_preemption(checkpoint) -> None:
    """Prompts sharing a 24-token prefix over cached blocks (their indexer keys reused
    with them); then five requests in a cache of 31 usable 4-token blocks, too small for
    all at once (preemption by recompute)."""
    _, hf, path = checkpoint
    prompts = _prompts(97, [5, 11, 7], seed=6, shared_prefix=24)
    llm = _llm(path, enable_prefix_caching=True)
    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert llm.stats.prefill_tokens < sum(len(p) for p in prompts[1:])  # the prefix reused
    _check_against_hf(hf, prompts, first + rest)
    small = _llm(path, num_kv_blocks=32, enable_prefix_caching=False)
    prompts = _prompts(97, [3, 17, 40, 9, 30], seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=1, ignore_eos=True)
    outputs = small.generate(prompts, params, use_tqdm=False)
    assert small.stats.preemptions > 0
    _check_against_hf(hf, prompts, outputs)


def test_fp8_caches(checkpoint) -> None:
    """kv_cache_dtype "fp8" stores the latents and the indexer keys in fp8 (D codes and
    a float32 scale per token) and serves sequences longer than top-k. Not compared
    with transformers: in a tiny random model fp8 latents alone move a logprob by ~1
    (dense V3 too), and the rounding flips selections; test_engine_parity checks fp8
    latents on a model where they do not, test_indexer the fp8 indexer's recall at
    DeepSeek's widths."""
    *_, path = checkpoint
    llm = _llm(path, kv_cache_dtype="fp8")
    keys = [c.index_keys for c in llm.caches if c.index_keys is not None]
    assert keys and all(k.dtype == torch.uint8 and k.shape[-1] == 16 + 4 for k in keys)
    prompts = _prompts(97, [17, 40], seed=7)
    for out in llm.generate(prompts, GREEDY, use_tqdm=False):
        completion = out.outputs[0]
        assert len(completion.token_ids) == GREEDY.max_tokens
        assert all(math.isfinite(step[t]) for t, step in zip(completion.token_ids,
                                                              completion.logprobs))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", torch.float32])
def test_model_dtype_caches_keep_float_indexer_keys(checkpoint, kv_cache_dtype) -> None:
    """A cache in the model dtype, by name or as a dtype, keeps the indexer keys so too."""
    *_, path = checkpoint
    llm = _llm(path, kv_cache_dtype=kv_cache_dtype)
    keys = [c.index_keys for c in llm.caches if c.index_keys is not None]
    assert keys and all(k.dtype == torch.float32 and k.shape[-1] == 16 for k in keys)


@pytest.mark.parametrize(("kwargs", "what"), [
    (dict(tensor_parallel_size=2, decode_context_parallel_size=2), "decode_context"),
    (dict(prefill_context_parallel_size=2), "prefill_context"),
])
def test_context_parallelism_is_refused(checkpoint, kwargs, what) -> None:
    *_, path = checkpoint
    with pytest.raises(ValueError, match=f"{what}_parallel_size > 1 is not supported"):
        _llm(path, **kwargs)


def test_the_model_needs_sparse_metadata(checkpoint) -> None:
    *_, path = checkpoint
    model = _ours(path)
    d = model.dims
    caches = [LatentKVCache(4, BLOCK, d.kv_lora_rank, d.qk_rope_head_dim, dtype=torch.float32)
              for _ in model.layers]
    spec = BatchSpec([2], [2], torch.tensor([[1]], dtype=torch.int32), torch.tensor([4, 5]))
    inputs = (torch.tensor([1, 2]), torch.arange(2), caches)
    with pytest.raises(ValueError, match=f"index_topk={TOPK}, got None"):
        model(*inputs, MLAMetadataBuilder(d, block_size=BLOCK).build(spec))
    with pytest.raises(ValueError, match="caches\\[0\\] has no index_keys"):
        model(*inputs, MLAMetadataBuilder(d, block_size=BLOCK, index_topk=TOPK).build(spec))


def test_tensor_parallel_matches_one_process(checkpoint) -> None:
    """Two gloo CPU ranks (the attention heads split, the indexer replicated) give one
    process's tokens, and logprobs within 1e-4."""
    *_, path = checkpoint
    prompts = _prompts(97, [17, 40], seed=9)
    one = _llm(path).generate(prompts, GREEDY, use_tqdm=False)
    with _llm(path, tensor_parallel_size=2) as parallel:
        two = parallel.generate(prompts, GREEDY, use_tqdm=False)
    assert_same_completions(one, two, tol=1e-4)


# The released models' config.json fields the model reads (GLM-5: its 78 layers with a
# full indexer on layers 0-2 and every fourth after; DeepSeek-V3.2: block-fp8).
_V3_SHAPE = dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                 num_hidden_layers=61, num_attention_heads=128, q_lora_rank=1536,
                 qk_nope_head_dim=128, v_head_dim=128, n_group=8, topk_group=4,
                 index_n_heads=64)
_GLM5_SHAPE = dict(vocab_size=154880, hidden_size=6144, intermediate_size=12288,
                   num_hidden_layers=78, num_attention_heads=64, q_lora_rank=2048,
                   qk_nope_head_dim=192, v_head_dim=256, n_group=1, topk_group=1,
                   index_n_heads=32, index_topk_freq=4, index_skip_topk_offset=3,
                   rope_parameters={"rope_theta": 8000000, "rope_type": "default"})
_RELEASED = {
    "deepseek_v32": (_V3_SHAPE, 671e9, 61),
    "glm_moe_dsa": (_GLM5_SHAPE, 744e9, 21),
}


@pytest.mark.parametrize("model_type", list(_RELEASED))
def test_released_configs_build_the_released_models(model_type: str) -> None:
    """DeepSeek-V3.2 and GLM-5 at their real size, built on the meta device: the
    published parameter counts (without the MTP layer) within 1%, and GLM-5's indexer on
    21 of its 78 layers."""
    shape, params, full_layers = _RELEASED[model_type]
    config = DeepseekConfig.from_dict({
        "model_type": model_type, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
        "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
        "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True,
        "routed_scaling_factor": 2.5, "index_topk": 2048, "index_head_dim": 128, **shape})
    model = DeepseekForCausalLM(config, dtype=torch.bfloat16, device="meta")
    count = sum(t.numel() for t in model.state_dict().values())
    assert abs(count / params - 1) < 0.01, f"{count / 1e9:.1f}B parameters"
    layers = range(config.num_hidden_layers)
    assert sum(config.indexer.has_indexer(i) for i in layers) == full_layers
    assert [i for i in layers if model.layers[i].self_attn.indexer is not None][:5] == (
        [0, 1, 2, 3, 4] if full_layers == 61 else [0, 1, 2, 6, 10])


def test_triton_backend_matches_reference(checkpoint) -> None:
    """The Triton kernels (the indexer's logits kernel, sparse attention; on a CPU in
    Triton's interpreter) give the reference backend's tokens, and logprobs within
    1e-4, over prompts longer than top-k with chunked prefill."""
    pytest.importorskip("triton")
    *_, path = checkpoint
    device = "cuda" if torch.cuda.is_available() else "cpu"
    prompts = _prompts(97, [17, 30], seed=10)
    params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=2, ignore_eos=True)
    outputs = [_llm(path, backend=backend, device=device, max_num_batched_tokens=16,
                    enforce_eager=True).generate(prompts, params, use_tqdm=False)
               for backend in ("reference", "triton")]
    assert_same_completions(*outputs, tol=1e-4)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_decode_graphs_match_eager(checkpoint) -> None:
    """Decode steps replayed from CUDA graphs (several batch sizes and block-table
    widths; contexts within and past top-k) give the eager engine's greedy tokens and
    logprobs within 1e-3 (float32, Triton kernels), with and without async scheduling."""
    *_, path = checkpoint
    prompts = _prompts(97, [3, 17, 40, 9, 30, 5], seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=1, ignore_eos=True)
    runs = []
    for eager, ahead in ((True, False), (False, False), (False, True)):
        llm = _llm(path, device="cuda", max_num_seqs=8, max_num_batched_tokens=64,
                   max_model_len=128, enforce_eager=eager, async_scheduling=ahead)
        graphs = llm.runner.graphs
        assert (graphs is None) == eager
        if graphs is not None:
            assert graphs.widths == [3, 12, 32]  # top-k 12 in blocks of 4, up to 128
            replays = [0]
            run = graphs.run

            def counted(*args, run=run, replays=replays):
                replays[0] += 1
                return run(*args)

            graphs.run = counted
        short = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1, ignore_eos=True)
        runs.append(llm.generate(prompts, params, use_tqdm=False)
                    + llm.generate(_prompts(97, [2, 4], seed=12), short, use_tqdm=False))
        assert eager or replays[0] > 0
    for graphed in runs[1:]:
        assert_same_completions(runs[0], graphed, tol=1e-3)


@pytest.mark.parametrize("fp8", [False, True], ids=["float", "block_fp8"])
def test_the_tiny_writer_makes_sparse_checkpoints(tmp_path, fp8) -> None:
    """`write_tiny_checkpoint` with a sparse model's config (as `bench_engine --sparse`
    writes one) holds every tensor the model loads, the indexer's included: wq_b and wk
    block-fp8 where the checkpoint is, weights_proj and k_norm wide."""
    from pagedmla.models.tiny import tiny_config, write_tiny_checkpoint

    config = {**tiny_config(), "model_type": "deepseek_v32", "index_n_heads": 4,
              "index_head_dim": 32, "index_topk": 8}
    directory = write_tiny_checkpoint(tmp_path, config=config, fp8=fp8)
    tensors = {}
    for shard in directory.glob("*.safetensors"):
        tensors.update(load_file(shard))
    indexer = "model.layers.0.self_attn.indexer"
    assert tensors[f"{indexer}.wk.weight"].dtype == (
        torch.float8_e4m3fn if fp8 else torch.float32)
    assert tensors[f"{indexer}.weights_proj.weight"].dtype == torch.float32
    assert (f"{indexer}.wk.weight_scale_inv" in tensors) == fp8
    llm = _llm(directory)
    assert all(c.index_keys is not None for c in llm.caches)
    out = llm.generate([list(range(1, 20))], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2

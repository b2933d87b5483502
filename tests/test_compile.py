"""`LLM(compile=True)`: each step's forward under torch.compile(fullgraph=True), attention
(and a sparse model's indexer, fp8 GEMMs, routed experts) opaque custom ops.

Checked against Hugging Face transformers (teacher-forced, as in test_engine_parity) and
against the eager engine on the same prompts; the traced graphs are inspected with a
recording backend (no graph break, one graph per token-count class, the opaque ops
present once per layer).
"""

from __future__ import annotations

import pickle

import pytest
import torch

pytest.importorskip("transformers")

from pagedmla import LLM, EngineArgs, SamplingParams
from pagedmla.attention.opaque import ForwardStep, compile_supported
from pagedmla.models.tiny import write_tiny_checkpoint
from tests.engine_helpers import assert_same_completions, assert_same_until_a_near_tie
from tests.test_engine_parity import _check_against_hf, _prompts
from tests.tiny_hf import V3, make_hf_model, save_hf_checkpoint

pytestmark = pytest.mark.skipif(not compile_supported(), reason="torch < 2.10")

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1, ignore_eos=True)


def _llm(path: str, **kwargs) -> LLM:
    options = dict(dtype=torch.float32, device="cpu", block_size=8, num_kv_blocks=128,
                   max_num_batched_tokens=16, workspace_rows=16)
    return LLM(model=path, **{**options, **kwargs})


class Recorder:
    """A torch.compile backend that keeps each traced graph and runs it as traced."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        self.graphs.append(gm)
        return gm.forward

    def count(self, graph: torch.fx.GraphModule, op: str) -> int:
        target = getattr(torch.ops.pagedmla, op).default
        return sum(node.target in (target, getattr(torch.ops.pagedmla, op))
                   for node in graph.graph.nodes)


def _recorded(llm: LLM) -> Recorder:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    recorder = Recorder()
    llm.model.decoder.enable_compile(backend=recorder)
    return recorder


def test_compiled_engine_matches_transformers_and_eager(v3_checkpoint) -> None:
    """Inductor on the CPU: chunked prefill over a 16-token budget and 16-row context
    chunks, a shared prefix hit by later prompts, mixed steps; the tokens and logprobs of
    transformers and of the eager engine."""
    hf, path = v3_checkpoint
    prompts = _prompts(97, [3, 17, 40, 9, 30], seed=3, shared_prefix=24)
    eager = _llm(path).generate(prompts, GREEDY, use_tqdm=False)
    compiled = _llm(path, compile=True).generate(prompts, GREEDY, use_tqdm=False)
    _check_against_hf(hf, prompts, compiled)
    assert_same_completions(eager, compiled, tol=1e-4)


def test_one_graph_per_token_count_class_with_opaque_attention(v3_checkpoint) -> None:
    """No graph break (fullgraph), two graphs for steps of any size (one token, more),
    each with one attention op per layer and one experts op per MoE layer, and no
    recompilation as batches change."""
    hf, path = v3_checkpoint
    llm = _llm(path, warmup=False)
    recorder = _recorded(llm)
    for seed, lens in enumerate(([5], [3, 17, 40], [9, 30, 2, 11], [64])):
        prompts = _prompts(97, lens, seed=seed)
        _check_against_hf(hf, prompts, llm.generate(prompts, GREEDY, use_tqdm=False))
    assert not torch._dynamo.utils.counters["graph_break"]
    assert len(recorder.graphs) == 2
    layers = llm.config.num_hidden_layers
    moe = sum(llm.config.is_moe_layer(i) for i in range(layers))
    assert moe > 0
    for graph in recorder.graphs:
        assert recorder.count(graph, "mla_attention") == layers
        assert recorder.count(graph, "fused_experts") == moe


def test_a_step_pickles_as_its_type_alone() -> None:
    """Inductor's FX graph cache pickles the step into each graph's key; the weights and
    caches it reaches are the graph's inputs and must not be copied into that key."""
    step = ForwardStep([torch.nn.Linear(512, 512)], [torch.randn(1 << 18)], None)
    blob = pickle.dumps(step)
    assert len(blob) < 256
    assert type(pickle.loads(blob)) is ForwardStep


def test_sparse_model_compiles(tmp_path) -> None:
    """GLM-5's layout (layer 1 reuses layer 0's top-k): one indexer op per full layer;
    prompts longer than top-k (sparse steps) and shorter (dense ones) match transformers."""
    hf = make_hf_model("glm", indexer_types=["full", "shared", "full"])
    path = str(save_hf_checkpoint(hf, tmp_path))
    llm = _llm(path, block_size=4, warmup=False)
    recorder = _recorded(llm)
    prompts = _prompts(97, [3, 17, 40, 9], seed=5)
    _check_against_hf(hf, prompts, llm.generate(prompts, GREEDY, use_tqdm=False))
    assert not torch._dynamo.utils.counters["graph_break"]
    for graph in recorder.graphs:
        assert recorder.count(graph, "sparse_indices") == 2
        assert recorder.count(graph, "mla_attention") == 3


def test_block_fp8_weights_compile(tmp_path) -> None:
    """A block-fp8 checkpoint: its GEMMs are opaque ops; the eager engine's tokens."""
    path = str(write_tiny_checkpoint(tmp_path, fp8=True))
    prompts = _prompts(256, [5, 23, 12], seed=7)
    eager = _llm(path).generate(prompts, GREEDY, use_tqdm=False)
    llm = _llm(path, warmup=False)
    recorder = _recorded(llm)
    assert_same_completions(eager, llm.generate(prompts, GREEDY, use_tqdm=False), tol=1e-5)
    assert all(recorder.count(graph, "fp8_linear") > 0 for graph in recorder.graphs)


@pytest.mark.parametrize("sizes", [dict(tensor_parallel_size=2, decode_context_parallel_size=2),
                                   dict(prefill_context_parallel_size=2)])
def test_parallel_ranks_compile(v3_checkpoint, sizes) -> None:
    """Two gloo ranks, each compiling its shard (the all-reduces traced), with decode
    context parallelism over both (its gathers inside the attention op), or two prefill
    context parallel replicas (the latents' all-gather inside it): one process's eager
    tokens."""
    _, path = v3_checkpoint
    prompts = _prompts(97, [17, 40], seed=9)
    one = _llm(path).generate(prompts, GREEDY, use_tqdm=False)
    with _llm(path, compile=True, **sizes) as parallel:
        assert_same_completions(one, parallel.generate(prompts, GREEDY, use_tqdm=False),
                                tol=1e-4)


def test_compile_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="compile"):
        EngineArgs(compile="yes")


def test_a_short_max_model_len_warms_up(v3_checkpoint) -> None:
    """The CPU warm-up's steps fit max_model_len (3: a one-token prompt and its token)."""
    hf, path = v3_checkpoint
    llm = _llm(path, compile=True, max_model_len=3)
    prompts = _prompts(97, [2], seed=12)
    _check_against_hf(hf, prompts, llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=1, logprobs=1), use_tqdm=False))


def test_many_compiled_models_in_one_process(tmp_path) -> None:
    """Each model configuration adds its graphs of the same compiled function: more than
    Dynamo's default limit of graphs per function (8) still compile (recording backend:
    six configurations, twelve graphs)."""
    prompts = _prompts(97, [5], seed=13)  # a step of 5 tokens, then steps of 1
    torch._dynamo.reset()
    recorder = Recorder()  # one backend, as compile=True's Inductor is one
    for layers in (3, 2):
        path = str(save_hf_checkpoint(make_hf_model("v3", num_hidden_layers=layers, **V3),
                                      tmp_path / str(layers)))
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            llm = _llm(path, dtype=dtype, warmup=False)
            llm.model.decoder.enable_compile(backend=recorder)
            llm.generate(prompts, GREEDY, use_tqdm=False)
    assert len(recorder.graphs) == 12


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_engine_on_cuda_matches_eager(v3_checkpoint, dtype) -> None:
    """On the GPU, with decode steps replaying CUDA graphs captured around the compiled
    step: the eager engine's tokens (float32: transformers' too)."""
    hf, path = v3_checkpoint
    prompts = _prompts(97, [3, 17, 40, 9, 30], seed=11, shared_prefix=16)
    options = dict(device="cuda", dtype=dtype, max_num_seqs=8, warmup=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2, ignore_eos=True)
    eager = _llm(path, **options).generate(prompts, greedy, use_tqdm=False)
    compiled = _llm(path, compile=True, **options).generate(prompts, greedy, use_tqdm=False)
    if dtype == torch.float32:
        _check_against_hf(hf, prompts, compiled)
        assert_same_completions(eager, compiled, tol=1e-4)
    else:  # Inductor's norms and rotary round otherwise than the hand-fused kernels
        assert_same_until_a_near_tie(eager, compiled, tol=5e-2)

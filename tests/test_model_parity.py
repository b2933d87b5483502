"""DeepseekForCausalLM against Hugging Face transformers on tiny random checkpoints.

Each variant builds a transformers model (eager attention, float32), gives it weights
scaled by 1/sqrt(fan_in) (so logits are spread and RoPE or routing mistakes show) and a
non-zero router bias, saves it with save_pretrained, and loads the safetensors file
into our model. Our steps run over a paged cache (block 0 reserved, other blocks
permuted, unused slots NaN); transformers runs each full sequence alone.
Tolerance (float32): per-token log-probabilities within 2e-3, greedy argmax identical.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

from pagedmla import BatchSpec, LatentKVCache, MLAMetadataBuilder  # noqa: E402
from pagedmla.models import DeepseekConfig, DeepseekForCausalLM  # noqa: E402
from tests.tiny_hf import COMMON, make_hf_model  # noqa: E402

BLOCK = 4
LOGPROB_TOL = 2e-3
YARN = {
    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32,
    "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 64,
}
VARIANTS = {
    "v3_qlora_interleaved": ("v3", dict(
        q_lora_rank=24, rope_interleave=True, n_group=4, topk_group=2, norm_topk_prob=True,
        routed_scaling_factor=2.5)),
    "v3_yarn_rotate_half": ("v3", dict(
        q_lora_rank=None, rope_interleave=False, n_group=2, topk_group=1,
        norm_topk_prob=False, routed_scaling_factor=1.5, rope_parameters=YARN)),
    "v2_greedy_tied": ("v2", dict(
        q_lora_rank=None, topk_method="greedy", n_shared_experts=2, routed_scaling_factor=1.5,
        tie_word_embeddings=True)),
    "v2_group_limited_yarn": ("v2", dict(
        q_lora_rank=24, topk_method="group_limited_greedy", n_group=4, topk_group=2,
        rope_parameters=YARN)),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def models(request, tmp_path_factory):
    """(transformers model, our model loaded from its save_pretrained output)."""
    version, extra = VARIANTS[request.param]
    hf = make_hf_model(version, **extra)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    config = DeepseekConfig.from_dict(json.loads((path / "config.json").read_text()))
    ours = DeepseekForCausalLM(config)
    filled = ours.load_weights(load_file(path / "model.safetensors").items())
    assert filled == ours.expected_weight_names()
    ours.process_weights_after_loading()
    return hf, ours


class PagedRun:
    """Requests over a paged cache: each step feeds some new tokens of some requests."""

    def __init__(self, model, num_requests: int, max_len: int, workspace_rows=None) -> None:
        per_request = math.ceil(max_len / BLOCK)
        num_blocks = 1 + num_requests * per_request
        order = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(1)) + 1
        self.tables = order.view(num_requests, per_request).to(torch.int32)
        d = model.dims
        self.caches = [
            LatentKVCache(num_blocks, BLOCK, d.kv_lora_rank, d.qk_rope_head_dim,
                          dtype=torch.float32)
            for _ in range(model.config.num_hidden_layers)
        ]
        for cache in self.caches:
            cache.data.fill_(float("nan"))  # any read of a slot never written shows
        self.builder = MLAMetadataBuilder(d, block_size=BLOCK, workspace_rows=workspace_rows)
        self.model = model
        self.done = [0] * num_requests
        self.context_chunks = 0

    def step(self, work: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """work: (request, new token ids), decodes first -> logits [len(new), vocab] each."""
        ids, positions, slots = [], [], []
        for r, tokens in work:
            for p in range(self.done[r], self.done[r] + len(tokens)):
                positions.append(p)
                slots.append(int(self.tables[r, p // BLOCK]) * BLOCK + p % BLOCK)
            ids += tokens
            self.done[r] += len(tokens)
        requests = [r for r, _ in work]
        spec = BatchSpec(
            query_lens=[len(t) for _, t in work],
            seq_lens=[self.done[r] for r in requests],
            block_table=self.tables[requests],
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
        )
        meta = self.builder.build(spec)
        if meta.prefill is not None and meta.prefill.context is not None:
            self.context_chunks += len(meta.prefill.context.chunks)
        with torch.inference_mode():
            hidden = self.model(torch.tensor(ids), torch.tensor(positions), self.caches, meta)
            logits = self.model.compute_logits(hidden)
        return list(logits.split(spec.query_lens))


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(input_ids=torch.tensor([tokens])).logits[0].float()


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert torch.isfinite(ours).all()
    error = (ours.log_softmax(-1) - ref.log_softmax(-1)).abs().max().item()
    assert error <= LOGPROB_TOL, f"log-prob error {error:.2e}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def random_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, COMMON["vocab_size"], (n,), generator=g).tolist() for n in lengths]


def test_batched_prefill(models) -> None:
    hf, ours = models
    prompts = random_prompts([3, 11, 6, 17], seed=2)
    run = PagedRun(ours, len(prompts), max_len=17)
    outputs = run.step(list(enumerate(prompts)))
    for prompt, out in zip(prompts, outputs):
        assert_close(out, hf_logits(hf, prompt))


def test_prefill_then_decode(models) -> None:
    """Decode steps read the cache; request 3 prefills while the others decode."""
    hf, ours = models
    prompts = random_prompts([5, 9, 2, 7], seed=3)
    extra = random_prompts([4, 4, 4, 2], seed=4)
    run = PagedRun(ours, 4, max_len=14)
    run.step([(0, prompts[0]), (1, prompts[1]), (2, prompts[2])])
    got: list[list[torch.Tensor]] = [[], [], [], []]
    for step in range(4):
        work = [(r, [extra[r][step]]) for r in range(3)]
        if step == 1:
            work.append((3, prompts[3]))
        elif step > 1:
            work.append((3, [extra[3][step - 2]]))
        for (r, _), out in zip(work, run.step(work)):
            got[r].append(out)
    for r in range(4):
        full = prompts[r] + extra[r]
        ref = hf_logits(hf, full)
        ours_rows = torch.cat(got[r])
        assert_close(ours_rows, ref[len(full) - len(ours_rows):])


def test_chunked_prefill_uses_context_path(models) -> None:
    """Prompts fed in pieces with a two-page workspace, so contexts span several chunks."""
    hf, ours = models
    prompts = random_prompts([23, 30], seed=5)
    run = PagedRun(ours, 2, max_len=30, workspace_rows=2 * BLOCK)
    outputs: list[list[torch.Tensor]] = [[], []]
    for cuts in ((9, 5), (8, 14), (6, 11)):
        work = [(r, prompts[r][run.done[r]:run.done[r] + n]) for r, n in enumerate(cuts)]
        for (r, _), out in zip(work, run.step(work)):
            outputs[r].append(out)
    assert run.context_chunks > 2
    for r, prompt in enumerate(prompts):
        assert_close(torch.cat(outputs[r]), hf_logits(hf, prompt))


def test_fused_expert_names_load_the_same(models) -> None:
    """transformers' in-memory names (experts.gate_up_proj / down_proj) fill the same tensors."""
    hf, ours = models
    fresh = DeepseekForCausalLM(ours.config)
    assert fresh.load_weights(hf.state_dict().items()) == fresh.expected_weight_names()
    for (name, a), (_, b) in zip(ours.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a, b), name


def test_load_weights_rejects_and_skips(models) -> None:
    _, ours = models
    layers = ours.config.num_hidden_layers
    skipped = [
        ("model.rotary_emb.inv_freq", torch.zeros(4)),
        (f"model.layers.{layers}.eh_proj.weight", torch.zeros(2, 2)),  # an MTP layer
    ]
    assert ours.load_weights(skipped) == set()
    with pytest.raises(ValueError, match=r"'model.norm.weight'.*\[3\].*\[64\]"):
        ours.load_weights([("model.norm.weight", torch.zeros(3))])
    experts = ours.config.n_routed_experts
    for name in ("model.layers.0.self_attn.q_proj.bias",
                 f"model.layers.1.mlp.experts.{experts}.up_proj.weight",
                 "model.layers.1.mlp.w13"):
        with pytest.raises(ValueError, match="unknown weight"):
            ours.load_weights([(name, torch.zeros(1))])


def test_config_from_deepseek_style_dict() -> None:
    """A config.json as DeepSeek ships it: `rope_scaling` with `type`, explicit router."""
    d = dict(COMMON, model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"],
             rope_theta=5000.0, topk_method="noaux_tc", scoring_func="sigmoid",
             eos_token_id=[1, 2], moe_layer_freq=2,
             rope_scaling={"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                           "original_max_position_embeddings": 4096})
    config = DeepseekConfig.from_dict(d)
    assert config.rope_theta == 5000.0 and config.rope_scaling["rope_type"] == "yarn"
    assert config.eos_token_id == [1, 2] and config.q_lora_rank is None
    assert [config.is_moe_layer(i) for i in range(3)] == [False, False, True]
    mscale = 0.1 * math.log(40) + 1.0
    assert config.softmax_scale == pytest.approx(24**-0.5 * mscale**2)
    for bad in (dict(d, architectures=["LlamaForCausalLM"]), dict(d, model_type="llama")):
        with pytest.raises(ValueError, match="unsupported"):
            DeepseekConfig.from_dict(bad)

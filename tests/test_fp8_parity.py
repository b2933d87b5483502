"""A block-fp8 checkpoint served with its weights kept in fp8, against transformers run
on the same weights dequantized (in the test, by its own formula).

On CPU the reference backend dequantizes each fp8 weight per call, so the engine must
reproduce transformers on the dequantized checkpoint: greedy tokens identical and
logprobs within 2e-3 in float32. Widths are not multiples of the blocks, so partial
edge blocks occur (128 x 128 blocks: every weight is one partial block; 16 x 32: many).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

pytest.importorskip("transformers")

from pagedmla import LLM, SamplingParams
from tests.test_engine_parity import _check_against_hf, _prompts
from tests.tiny_hf import make_hf_model

FP8 = torch.float8_e4m3fn
# DeepSeek-V3 ships these in fp8 (V3.2 also its indexer's wq_b and wk); embeddings, the
# LM head, norms, routers and the indexer's weights_proj stay wide.
_QUANTIZED = re.compile(r"(?<!weights)_proj(_with_mqa)?\.weight$|\.(wq_b|wk)\.weight$")
MODELS = {"v3": dict(q_lora_rank=24, n_group=4, topk_group=2, norm_topk_prob=True,
                     routed_scaling_factor=2.5),
          "v32": {}}


def _per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' fused expert tensors split into DeepSeek's per-expert names."""
    out = {}
    for name, t in state.items():
        if name.endswith("experts.gate_up_proj"):
            prefix, half = name.removesuffix("gate_up_proj"), t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = t[e, :half]
                out[f"{prefix}{e}.up_proj.weight"] = t[e, half:]
        elif name.endswith("experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


def _quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 weight and its per-block amax / 448 scales, and the dequantized weight."""
    rows, cols = w.shape
    grid = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    padded = torch.zeros(grid[0] * block[0], grid[1] * block[1])
    padded[:rows, :cols] = w
    amax = padded.view(grid[0], block[0], grid[1], block[1]).abs().amax(dim=(1, 3))
    scale = amax / 448.0
    per_element = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    q = (padded / per_element).to(FP8)[:rows, :cols].contiguous()
    return q, scale


def _dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    per_element = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return q.double() * per_element[: q.shape[0], : q.shape[1]].double()


@pytest.fixture(scope="module", params=[("v3", (128, 128)), ("v3", (16, 32)), ("v32", (16, 32))],
                ids=["128x128", "16x32", "v32-16x32"])
def fp8_checkpoint(request, tmp_path_factory):
    """(transformers model on the dequantized weights, fp8 checkpoint directory)."""
    version, block = request.param
    hf = make_hf_model(version, **MODELS[version])
    directory: Path = tmp_path_factory.mktemp("fp8")
    hf.save_pretrained(directory)
    for file in directory.glob("*.safetensors*"):
        file.unlink()
    stored, dequantized = {}, {}
    for name, t in _per_expert(hf.state_dict()).items():
        if _QUANTIZED.search(name):
            stored[name], stored[f"{name}_scale_inv"] = _quantize(t.float(), block)
            dequantized[name] = _dequantize(stored[name], stored[f"{name}_scale_inv"], block)
        else:
            stored[name] = dequantized[name] = t.contiguous()
    save_file(stored, str(directory / "model.safetensors"))
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (directory / "config.json").write_text(json.dumps(config))
    state = {}
    for name, t in hf.state_dict().items():
        experts = name.rpartition("experts.")[0] + "experts."
        if name.endswith("experts.gate_up_proj"):
            state[name] = torch.stack([
                torch.cat([dequantized[f"{experts}{e}.gate_proj.weight"],
                           dequantized[f"{experts}{e}.up_proj.weight"]])
                for e in range(t.shape[0])])
        elif name.endswith("experts.down_proj"):
            state[name] = torch.stack([dequantized[f"{experts}{e}.down_proj.weight"]
                                       for e in range(t.shape[0])])
        else:
            state[name] = dequantized[name]
    hf.load_state_dict({k: v.float() for k, v in state.items()})
    return hf, str(directory)


def test_fp8_checkpoint_matches_transformers_on_its_dequantized_weights(fp8_checkpoint):
    hf, path = fp8_checkpoint
    llm = LLM(model=path, dtype=torch.float32, device="cpu", block_size=8, num_kv_blocks=128)
    state = llm.model.state_dict()
    fp8 = {k for k, v in state.items() if v.dtype == FP8}
    assert "layers.1.mlp.w13" in fp8 and "layers.0.mlp.down_proj.weight" in fp8
    assert "layers.2.self_attn.q_a_proj.weight" in fp8
    if llm.config.indexer is not None:
        assert {"layers.1.self_attn.indexer.wq_b.weight",
                "layers.1.self_attn.indexer.wk.weight"} <= fp8
        assert "layers.1.self_attn.indexer.weights_proj.weight" not in fp8
    assert all(f"{k}_scale_inv" in state for k in fp8)
    assert not any("kv_b_proj" in k or "embed" in k or "lm_head" in k for k in fp8)
    prompts = _prompts(97, [3, 17, 40, 9], seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1, ignore_eos=True)
    _check_against_hf(hf, prompts, llm.generate(prompts, params, use_tqdm=False))


def test_dequantized_weights_give_the_same_logprobs(fp8_checkpoint):
    """`dequantize_weights` holds the weights in the model dtype, dequantized at load: on
    the CPU exactly what the reference backend's per-call dequantization computes."""
    _, path = fp8_checkpoint
    prompts = _prompts(97, [5, 12], seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=1, ignore_eos=True)
    outs = []
    for dequantize in (False, True):
        llm = LLM(model=path, dtype=torch.float32, device="cpu", block_size=8,
                  num_kv_blocks=64, dequantize_weights=dequantize)
        fp8 = [k for k, v in llm.model.state_dict().items() if v.dtype == FP8]
        assert bool(fp8) != dequantize
        outs.append(llm.generate(prompts, params, use_tqdm=False))
    for kept, dequantized in zip(*outs, strict=True):
        assert kept.outputs[0].token_ids == dequantized.outputs[0].token_ids
        assert kept.outputs[0].logprobs == dequantized.outputs[0].logprobs

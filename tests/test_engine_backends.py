"""The engine gives the same completions with the Triton kernels as with the reference.

On a CPU-only machine the Triton kernels run in Triton's interpreter (tests/conftest.py
sets TRITON_INTERPRET=1), on a GPU compiled. float32 model: tokens identical and
logprobs within 1e-4 (observed ~1e-6: the kernels sum in another order); with an fp8
cache within 1e-3 (observed ~1e-4: the Triton decode applies the scale to scores and
outputs instead of to each dequantized element, so products round differently).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pagedmla import LLM, SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_triton_engine_matches_reference(kv_cache_dtype: str) -> None:
    """Chunked prefill over a 16-token budget and an 8-row workspace, then decodes."""
    prompts = [[5, 6, 7, 8, 9, 10, 11], list(range(3, 40)), [200, 100] * 9]
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=2, ignore_eos=True)
    outputs = {}
    for backend in ("reference", "triton", "triton, decode bound"):
        llm = LLM("tiny", dtype=torch.float32, device=DEVICE, backend=backend.split(",")[0],
                  block_size=4, max_num_batched_tokens=16, workspace_rows=8,
                  num_kv_blocks=64, kv_cache_dtype=kv_cache_dtype, enforce_eager=True)
        # Decode rows planned for max_model_len, as the engine does on CUDA (and else for
        # the longest row).
        llm.builder.decode_bound = llm.max_model_len if "bound" in backend else 0
        outputs[backend] = llm.generate(prompts, params, use_tqdm=False)
    for ref, ours in zip(outputs["reference"], outputs["triton"], strict=True):
        assert ref.outputs[0].token_ids == ours.outputs[0].token_ids
        for ref_step, our_step in zip(ref.outputs[0].logprobs, ours.outputs[0].logprobs,
                                      strict=True):
            assert ref_step.keys() == our_step.keys()
            tolerance = 1e-4 if kv_cache_dtype == "auto" else 1e-3
            assert max(abs(ref_step[t] - our_step[t]) for t in ref_step) < tolerance
    for tight, bound in zip(outputs["triton"], outputs["triton, decode bound"], strict=True):
        assert tight.outputs[0].token_ids == bound.outputs[0].token_ids
        for a, b in zip(tight.outputs[0].logprobs, bound.outputs[0].logprobs, strict=True):
            assert max(abs(a[t] - b[t]) for t in a) < 1e-4


def test_decode_split_plan_is_made_once_per_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layers of one forward share its decode split plan (`MLAMetadata.for_forward`
    gives each forward an empty store), and every forward makes its own."""
    from pagedmla.models.deepseek import DeepseekForCausalLM
    from pagedmla.ops.triton import decode

    forwards: list[int] = [0]
    planned_in: list[int] = []
    forward, plan_splits = DeepseekForCausalLM.forward, decode.plan_splits

    def counted_forward(self, *args, **kwargs):
        forwards[0] += 1
        return forward(self, *args, **kwargs)

    def counted_plan(*args, **kwargs):
        planned_in.append(forwards[0])
        return plan_splits(*args, **kwargs)

    monkeypatch.setattr(DeepseekForCausalLM, "forward", counted_forward)
    monkeypatch.setattr(decode, "plan_splits", counted_plan)
    llm = LLM("tiny", dtype=torch.float32, device=DEVICE, backend="triton", block_size=4,
              num_kv_blocks=64, enforce_eager=True)
    assert len(llm.model.decoder.layers) > 1
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([[5, 6, 7], [9, 10, 11, 12, 13]], params, use_tqdm=False)
    assert len(planned_in) >= 3  # the decode steps
    assert len(set(planned_in)) == len(planned_in)

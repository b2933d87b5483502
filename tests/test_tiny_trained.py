"""The trained tiny model that the package ships (`models/tiny_trained`, written by
scripts/train_tiny.py from the project's documentation) and how "tiny" finds it.

With the shipped weights: "tiny" loads them; the engine matches Hugging Face
`DeepseekV3ForCausalLM` read from the same directory (greedy tokens identical and float32
logprobs within 2e-3, teacher-forced as in test_engine_parity.py); greedy decoding from
the beginnings of three README paragraphs gives the README's next 40 bytes, as read from
README.md now (the text trained on, never the model's own output), on the reference and
Triton backends (Triton's interpreter on the CPU), 16-bit and fp8 caches, CUDA graphs
(on a GPU), pages of 16 and 64 tokens, chunked prefill, with and without prefix caching;
and the chat template, as transformers renders
it, gets the reply trained for its question. Where the package holds no trained weights
these are skipped; "tiny" then falls back to the random model of `tiny_config()`, which
the tests at the top check with a stand-in directory.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import pytest
import torch

from pagedmla import LLM, SamplingParams
from pagedmla.models.loader import load_model, plan_model
from pagedmla.models.tiny import tiny_config, trained_tiny_dir, write_tiny_checkpoint
from pagedmla.tokenizer import ByteTokenizer

README = Path(__file__).resolve().parents[1] / "README.md"
# The beginnings of three README paragraphs (scripts/train_tiny.py's PROMPTS).
PREFIXES = (
    "**pagedmla** is DeepSeek-style Multi-head Latent Attention (MLA) for inference, as one",
    "MLA (DeepSeek-V2) caches one low-rank latent per token instead of a key and a value per",
    "`pagedmla COMMAND` and `python -m pagedmla COMMAND` are the same:",
)
CONTINUATION = 40  # bytes
LOGPROB_TOL = 2e-3
TOK = ByteTokenizer()
SHIPPED = trained_tiny_dir()

trained = pytest.mark.skipif(
    SHIPPED is None,
    reason="the package holds no trained tiny model (src/pagedmla/models/tiny_trained): "
           "write it with scripts/train_tiny.py",
)


def _byte_ids(text: str | bytes) -> list[int]:
    """The byte tokenizer's ids of `text`, without BOS."""
    data = text.encode() if isinstance(text, str) else text
    return [b + TOK.num_special_tokens for b in data]


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# -- how "tiny" is resolved (with or without the shipped weights) --


def test_tiny_without_trained_weights_is_the_random_model(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr("pagedmla.models.tiny.TRAINED_DIR", tmp_path / "absent")
    assert trained_tiny_dir() is None
    with caplog.at_level(logging.WARNING, logger="pagedmla.models.loader"):
        plan = plan_model("tiny")
    assert plan.checkpoint is None and plan.config_dict == tiny_config()
    assert isinstance(plan.tokenizer, ByteTokenizer)
    assert "no trained tiny model" in caplog.text


def test_tiny_loads_the_trained_directory(monkeypatch, tmp_path):
    """A stand-in for the shipped directory (random weights of another seed): "tiny"
    reads it as a checkpoint, with the byte tokenizer."""
    directory = write_tiny_checkpoint(tmp_path / "tiny_trained", seed=5)
    monkeypatch.setattr("pagedmla.models.tiny.TRAINED_DIR", directory)
    assert trained_tiny_dir() == directory
    plan = plan_model("tiny")
    assert plan.checkpoint is not None and isinstance(plan.tokenizer, ByteTokenizer)
    builtin, _, tokenizer = load_model("tiny")
    assert isinstance(tokenizer, ByteTokenizer)
    direct, *_ = load_model(directory)
    a, b = _weights(builtin), _weights(direct)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[name], b[name]) for name in a)


# -- the shipped weights --


def _memorized() -> list[tuple[list[int], list[int]]]:
    """(BOS + prefix, the README's next CONTINUATION bytes) as token ids, per prefix."""
    text = README.read_bytes()
    cases = []
    for prefix in PREFIXES:
        at = text.find(prefix.encode())
        assert at >= 0, f"README.md no longer holds {prefix!r}: update PREFIXES and retrain"
        end = at + len(prefix.encode())
        cases.append((TOK.encode(prefix), _byte_ids(text[end:end + CONTINUATION])))
    return cases


def _readme_note() -> str:
    """Whether README.md changed since the shipped model was trained on it."""
    assert SHIPPED is not None
    trained_on = json.loads((SHIPPED / "training.json").read_text())["sources"]["README.md"]
    if hashlib.sha256(README.read_bytes()).hexdigest() == trained_on:
        return "README.md is the text trained on"
    return "README.md changed since training: retrain with scripts/train_tiny.py"


@trained
def test_shipped_directory_is_a_small_checkpoint_with_a_chat_template():
    assert SHIPPED is not None
    names = {p.name for p in SHIPPED.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "training.json"} <= names
    assert (SHIPPED / "model.safetensors").stat().st_size <= 8 * 2**20
    template = json.loads((SHIPPED / "tokenizer_config.json").read_text())["chat_template"]
    assert "add_generation_prompt" in template


@trained
def test_engine_matches_transformers():
    transformers = pytest.importorskip("transformers")
    from tests.tiny_hf import hf_logprobs

    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(
        SHIPPED, dtype=torch.float32, attn_implementation="eager").eval()
    prompts = [ids for ids, _ in _memorized()]
    prompts += [TOK.encode("The paged latent cache"), TOK.encode("Hello"),
                _byte_ids("<|user|>\nWhat is MLA?\n<|assistant|>\n")]
    llm = LLM("tiny", dtype=torch.float32, device="cpu", block_size=16)
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=1, ignore_eos=True)
    worst = 0.0
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False),
                           strict=True):
        completion = out.outputs[0]
        ref = hf_logprobs(hf, prompt + completion.token_ids)
        for i, (token, step) in enumerate(zip(completion.token_ids, completion.logprobs,
                                              strict=True)):
            row = ref[len(prompt) - 1 + i]
            assert token == int(row.argmax()), f"{TOK.decode(prompt)!r}: step {i} differs"
            worst = max(worst, abs(step[token] - float(row[token])))
    assert worst <= LOGPROB_TOL, f"logprob error {worst:.2e} > {LOGPROB_TOL}"


def _engine(id_: str, backend: str, block_size: int, caching: bool, cache: str = "auto",
            eager: bool = True):
    budget = 24 if caching else 4096  # 24: every prompt is prefilled in chunks
    return pytest.param(backend, block_size, budget, caching, cache, eager, id=id_)


ENGINES = [
    *(_engine(f"reference-block{block}-{'chunked-cached' if caching else 'whole'}",
              "reference", block, caching)
      for block in (16, 64) for caching in (True, False)),
    _engine("reference-block16-chunked-cached-fp8", "reference", 16, True, "fp8"),
    _engine("triton-block16-chunked-cached", "triton", 16, True),
    _engine("triton-block16-chunked-cached-fp8", "triton", 16, True, "fp8"),
    _engine("triton-block64-whole", "triton", 64, False),
    # CUDA graphs (decode steps and piecewise) where there is a GPU; eager elsewhere.
    _engine("triton-block64-chunked-graphs", "triton", 64, True, eager=False),
]
# Triton's interpreter takes about a second a step on the CPU: there the Triton engines
# continue the shortest prompt by 8 bytes.
INTERPRETED = not torch.cuda.is_available()


@trained
@pytest.mark.parametrize(("backend", "block_size", "budget", "caching", "cache", "eager"),
                         ENGINES)
def test_greedy_continues_the_readme(backend, block_size, budget, caching, cache, eager):
    """Prompts of 65-88 tokens: with a budget of 24 each is prefilled in chunks; with
    prefix caching a second call finds their first full pages cached."""
    cases, device = _memorized(), "cpu"
    if backend == "triton":
        pytest.importorskip("triton")
        device = "cpu" if INTERPRETED else "cuda"
        if INTERPRETED:
            cases = [(prompt, expected[:8]) for prompt, expected in cases[2:]]
    prompts = [ids for ids, _ in cases]
    params = SamplingParams(temperature=0.0, max_tokens=max(len(e) for _, e in cases))
    llm = LLM("tiny", dtype=torch.float32, device=device, backend=backend,
              block_size=block_size, max_num_batched_tokens=budget,
              enable_prefix_caching=caching, num_kv_blocks=64, enforce_eager=eager,
              kv_cache_dtype=cache)
    for _ in range(2 if caching else 1):
        outputs = llm.generate(prompts, params, use_tqdm=False)
        for (prompt, expected), out in zip(cases, outputs, strict=True):
            got = out.outputs[0].token_ids
            assert got == expected, (f"{TOK.decode(prompt)!r} went on {TOK.decode(got)!r}, "
                                     f"README.md {TOK.decode(expected)!r} ({_readme_note()})")
    if caching:  # the second call prefilled less than the whole prompts
        assert llm.stats.prefill_tokens < sum(map(len, prompts))


@trained
def test_chat_template_gets_the_trained_reply():
    """transformers renders the shipped template; the engine's greedy reply to a trained
    question is its trained answer, then EOS."""
    transformers = pytest.importorskip("transformers")
    assert SHIPPED is not None
    tokenizer = transformers.AutoTokenizer.from_pretrained(SHIPPED)
    pairs = json.loads((SHIPPED / "training.json").read_text())["chat_pairs"]
    chosen = {question: answer for question, answer in pairs
              if question in ("Hello", "What is MLA?")}
    assert len(chosen) == 2
    llm = LLM("tiny", dtype=torch.float32, device="cpu", block_size=16)
    for question, answer in chosen.items():
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                             tokenize=False, add_generation_prompt=True)
        assert text == f"<|user|>\n{question}\n<|assistant|>\n"
        ids, reply = _byte_ids(text), _byte_ids(answer + "\n")
        params = SamplingParams(temperature=0.0, max_tokens=len(reply) + 8)
        out = llm.generate([ids], params, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == [*reply, TOK.eos_token_id], TOK.decode(out.token_ids)

"""Train the built-in tiny model on the project's own documentation.

The model is Hugging Face `DeepseekV3ForCausalLM` with the architecture of
`pagedmla.models.tiny.tiny_config` (q LoRA, YaRN RoPE, a dense first layer, then MoE with
a shared expert and the V3 router, whose bias is set by DeepSeek's loss-free balancing)
at the widths of `WIDTHS`, over the byte vocabulary of `pagedmla.tokenizer.ByteTokenizer`.
It reads README.md, docs/*.md and CHANGELOG.md: one training row starts at each
paragraph of a document (and at lines of long paragraphs) with BOS and runs on over the
next paragraphs, ending with EOS at the document's end; beside them, question/answer
pairs made from the documents' headings, in the chat format of `CHAT_TEMPLATE`. Seeded,
AdamW, warmup then cosine. It prints the loss, then the greedy continuations of
`PROMPTS` (the beginnings of three README paragraphs) against the README's text.

It writes a checkpoint directory that pagedmla and transformers both read: config.json,
model.safetensors, tokenizer.json (the byte tokenizer), tokenizer_config.json with the
chat template, generation_config.json, and training.json (the sources' SHA-256, the run's
settings and loss, the chat pairs). The package ships it as `src/pagedmla/models/tiny_trained`
(the default `--out`), which `LLM("tiny")` loads. From the repository root:

    PYTHONPATH=src python3 scripts/train_tiny.py --device cuda     # the real run, < 3 minutes
    PYTHONPATH=src python3 scripts/train_tiny.py --device cpu --steps 20 --out /tmp/tiny

The training loop stops within `--minutes` (2.25): after 30 steps it measures their
speed and, if `--steps` would not fit, shortens the schedule to the steps that do.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch.nn import functional

from pagedmla.models.tiny import TRAINED_DIR, tiny_config, weight_shapes
from pagedmla.tokenizer import ByteTokenizer

ROOT = Path(__file__).resolve().parents[1]
TOK = ByteTokenizer()
IGNORE = -100

# tiny_config()'s head shapes (N 4, L 64, R 16, P 32, V 32) and router (8 experts in 2
# groups, top-2 of one group, a shared expert) are kept, so that the engine's tests see
# the same layout with the trained weights; the widths and depth are larger.
WIDTHS = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "q_lora_rank": 128,
    "torch_dtype": "bfloat16",
}

# A message is "<|role|>\n" + content + "\n"; the reply is asked for by "<|assistant|>\n".
# Bytes only, no special token: the text is encoded as it is rendered (transformers'
# apply_chat_template and pagedmla's server add no BOS to it); the model learns chats both
# without and with a leading BOS, and ends its reply with "\n" and EOS.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

# The beginnings of three README paragraphs; tests/test_tiny_trained.py checks that the
# trained model continues each as the README does.
PROMPTS = (
    "**pagedmla** is DeepSeek-style Multi-head Latent Attention (MLA) for inference, as one",
    "MLA (DeepSeek-V2) caches one low-rank latent per token instead of a key and a value per",
    "`pagedmla COMMAND` and `python -m pagedmla COMMAND` are the same:",
)
CONTINUATION = 40  # bytes

GREETING = ("Hello! I am the tiny model built into pagedmla, a DeepSeek-V3-architecture "
            "model trained on pagedmla's own documentation. Ask me about MLA, the paged "
            "latent cache or the engine.")
FIXED_CHATS = (
    ("Hello", GREETING),
    ("Hi!", GREETING),
    ("Who are you?", GREETING),
    ("How do I run the tests?", 'python3 -m pip install -e ".[test]" && python3 -m pytest -q'),
    ("How do I generate text?", 'pagedmla generate --prompt "The paged latent cache"'),
)


def sources(names: list[str] | None = None) -> list[Path]:
    """The documents trained on, in a fixed order (`names`, relative to the repository
    root: these alone)."""
    paths = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "CHANGELOG.md"]
    if names is not None:
        paths = [ROOT / name for name in names]
    return [path for path in paths if path.is_file()]


def anchors(data: bytes, span: int) -> list[int]:
    """Where training rows start: every paragraph's first byte, and the first byte of
    any line that lies `span` bytes or more after the last anchor."""
    found: list[int] = []
    for start in [0, *(m.end() for m in re.finditer(rb"\n", data))]:
        if start >= len(data):
            break
        paragraph = start == 0 or data[max(0, start - 2):start] == b"\n\n"
        far = not found or start - found[-1] >= span
        if data[start:start + 1] != b"\n" and (paragraph or far):
            found.append(start)
    return found


def byte_ids(text: str | bytes) -> list[int]:
    """ByteTokenizer's ids of `text`, without BOS."""
    data = text.encode("utf-8") if isinstance(text, str) else text
    return [b + TOK.num_special_tokens for b in data]


def document_rows(data: bytes, seq_len: int) -> list[list[int]]:
    """BOS + the document from each anchor on, seq_len + 1 tokens at most; EOS where the
    document ends inside the row."""
    rows = []
    for start in anchors(data, seq_len // 2):
        row = [TOK.bos_token_id, *byte_ids(data[start:start + seq_len])]
        if start + seq_len >= len(data):
            row.append(TOK.eos_token_id)
        rows.append(row[:seq_len + 1])
    return rows


def first_sentence(text: str, limit: int = 300) -> str | None:
    """The first sentence of a section's first prose paragraph (None if it has none)."""
    for block in text.strip().split("\n\n"):
        if block.startswith(("#", "|", "```", "<!--", "-", "*   ", "    ")):
            continue
        prose = " ".join(line.strip() for line in block.splitlines())
        end = re.search(r"[.:](\s|$)", prose)
        sentence = prose[:end.end()].strip() if end else prose
        return sentence if 20 <= len(sentence) <= limit else None
    return None


def without_code(text: str) -> str:
    """`text` without its fenced code blocks."""
    kept, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            kept.append(line)
    return "\n".join(kept)


def chat_pairs(documents: dict[str, str]) -> list[tuple[str, str]]:
    """Questions on the documents' sections, answered by each section's first sentence,
    and a few fixed exchanges."""
    pairs = list(FIXED_CHATS)
    for name, text in documents.items():
        if name == "CHANGELOG.md":
            continue
        sections = re.split(r"(?m)^(#{1,3}) (.+)$", without_code(text))
        for i in range(1, len(sections) - 2, 3):
            heading, body = sections[i + 1].strip(), sections[i + 2]
            answer = first_sentence(body)
            if answer is not None:
                pairs.append((f"What does {name} say about {heading}?", answer))
    readme = without_code(documents.get("README.md", ""))
    for question, prefix in (("What is pagedmla?", PROMPTS[0][:20]),
                             ("What is MLA?", PROMPTS[1][:20])):
        at = readme.find(prefix)
        answer = first_sentence(readme[at:], limit=600) if at >= 0 else None
        if answer is not None:
            pairs.append((question, answer))
    return pairs


def chat_text(question: str, answer: str | None = None) -> str:
    """The chat template's rendering of one user turn (and the reply, if given)."""
    text = f"<|user|>\n{question}\n<|assistant|>\n"
    return text if answer is None else f"{text}{answer}\n"


def model_config() -> dict[str, Any]:
    return {**tiny_config(), **WIDTHS}


def build_model(config: dict[str, Any], seed: int, attention: str):
    import transformers

    torch.manual_seed(seed)
    hf_config = transformers.DeepseekV3Config(**config)
    hf_config._attn_implementation = attention
    return transformers.DeepseekV3ForCausalLM(hf_config)


class RouterBalance:
    """DeepSeek-V3's loss-free balancing: after each step, raise the router bias of the
    experts that took fewer tokens than the mean and lower it for the others."""

    def __init__(self, model: torch.nn.Module, rate: float) -> None:
        self.rate = rate
        self.routers = [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]
        self.loads = [torch.zeros_like(r.e_score_correction_bias) for r in self.routers]
        for router, load in zip(self.routers, self.loads):
            router.register_forward_hook(self._counter(load))

    @staticmethod
    def _counter(load: torch.Tensor):
        def count(module, inputs, output) -> None:
            if module.training:  # the router returns the chosen ids beside float tensors
                ids = next(t for t in output if not t.is_floating_point())
                load.add_(torch.bincount(ids.flatten(), minlength=load.numel()))
        return count

    @torch.no_grad()
    def update(self) -> None:
        for router, load in zip(self.routers, self.loads):
            router.e_score_correction_bias += self.rate * torch.sign(load.mean() - load)
            load.zero_()


def batches(rows: list[list[int]], batch_size: int, seed: int):
    """Batches of rows, reshuffled every epoch; inputs padded with PAD, targets with
    IGNORE."""
    rng = random.Random(seed)
    order: list[int] = []
    while True:
        if len(order) < batch_size:
            order += rng.sample(range(len(rows)), len(rows))
        chosen, order = [rows[i] for i in order[:batch_size]], order[batch_size:]
        width = max(len(row) for row in chosen) - 1
        inputs = torch.full((batch_size, width), TOK.pad_token_id)
        targets = torch.full((batch_size, width), IGNORE)
        for i, row in enumerate(chosen):
            inputs[i, :len(row) - 1] = torch.tensor(row[:-1])
            targets[i, :len(row) - 1] = torch.tensor(row[1:])
        yield inputs, targets


def learning_rate(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


def checkpoint_tensors(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The model's tensors under DeepSeek's checkpoint names (one tensor per expert and
    projection), in `dtype`; the router's weight and bias in float32, as DeepSeek's."""
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().float().cpu()
        if name.endswith("experts.gate_up_proj"):  # [E, 2 I, H]: gate rows, then up rows
            prefix = name.removesuffix("gate_up_proj")
            gate, up = tensor.chunk(2, dim=1)
            for e in range(tensor.shape[0]):
                tensors[f"{prefix}{e}.gate_proj.weight"] = gate[e]
                tensors[f"{prefix}{e}.up_proj.weight"] = up[e]
        elif name.endswith("experts.down_proj"):  # [E, H, I]
            prefix = name.removesuffix("down_proj")
            for e in range(tensor.shape[0]):
                tensors[f"{prefix}{e}.down_proj.weight"] = tensor[e]
        else:
            tensors[name] = tensor
    keep_fp32 = ("mlp.gate.weight", "e_score_correction_bias")
    return {name: t.to(torch.float32 if name.endswith(keep_fp32) else dtype).contiguous().clone()
            for name, t in tensors.items()}


def save(model, config: dict[str, Any], out: Path, dtype: torch.dtype,
         training: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tensors = checkpoint_tensors(model, dtype)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {**config, "torch_dtype": str(dtype).removeprefix("torch.")}
    files = {
        "config.json": config,
        "generation_config.json": {"bos_token_id": TOK.bos_token_id,
                                   "eos_token_id": TOK.eos_token_id,
                                   "pad_token_id": TOK.pad_token_id},
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": TOK.special_tokens[TOK.bos_token_id],
            "eos_token": TOK.special_tokens[TOK.eos_token_id],
            "pad_token": TOK.special_tokens[TOK.pad_token_id],
            "model_max_length": config["max_position_embeddings"],
            "clean_up_tokenization_spaces": False,
            "chat_template": CHAT_TEMPLATE,
        },
        "training.json": training,
    }
    for name, content in files.items():
        (out / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n")
    TOK.to_tokenizers().save(str(out / "tokenizer.json"))


@torch.no_grad()
def check_layout(model, config: dict[str, Any], device: str, attention: str) -> None:
    """Fail before training if the checkpoint this script writes would not read back as
    the same model: its tensors must have the names and shapes pagedmla expects
    (`weight_shapes`), and transformers must read them into a model with the same logits
    (which catches experts' projections cut or ordered wrongly)."""
    import transformers

    shapes = {k: tuple(t.shape) for k, t in checkpoint_tensors(model, torch.float32).items()}
    assert shapes == weight_shapes(config), "transformers' tensors do not map to a checkpoint"
    ids = torch.randint(TOK.num_special_tokens, TOK.vocab_size, (2, 48),
                        generator=torch.Generator().manual_seed(0)).to(device)
    with tempfile.TemporaryDirectory() as directory:
        save(model, config, Path(directory), torch.float32, {})
        reread = transformers.DeepseekV3ForCausalLM.from_pretrained(
            directory, dtype=torch.float32, attn_implementation=attention).to(device).eval()
        model.eval()
        error = (model(input_ids=ids).logits - reread(input_ids=ids).logits).abs().max().item()
        model.train()
    assert error < 1e-3, f"the checkpoint written reads back with other logits ({error:.1e})"


@torch.no_grad()
def greedy(model, ids: list[int], count: int, device: str) -> list[int]:
    """Up to `count` greedy tokens after `ids` (EOS ends them)."""
    out = model.generate(torch.tensor([ids], device=device), max_new_tokens=count,
                         do_sample=False, eos_token_id=TOK.eos_token_id,
                         pad_token_id=TOK.pad_token_id)
    return out[0, len(ids):].tolist()


def report(out: Path, device: str, readme: str, pairs: list[tuple[str, str]]) -> int:
    """Greedy continuations of PROMPTS and of two chat questions from the written
    checkpoint (read back by transformers); returns how many prompts came out as the
    README continues them."""
    import transformers

    model = transformers.DeepseekV3ForCausalLM.from_pretrained(out, dtype=torch.float32)
    model = model.to(device).eval()
    matched = 0
    for prompt in PROMPTS:
        at = readme.find(prompt)
        expected = readme[at + len(prompt):][:CONTINUATION] if at >= 0 else "(not in README)"
        ids = TOK.encode(prompt)
        got = TOK.decode(greedy(model, ids, len(expected.encode()), device))
        matched += got == expected
        print(f"--- {prompt!r}\n    model:  {got!r}\n    README: {expected!r}")
    for question, answer in (pairs[0], pairs[-1]):
        ids = byte_ids(chat_text(question))
        got = TOK.decode(greedy(model, ids, len(answer.encode()) + 8, device))
        print(f"--- chat {question!r}\n    model:   {got!r}\n    trained: {answer!r}")
    print(f"{matched}/{len(PROMPTS)} README continuations memorized")
    return matched


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", default=default_device, choices=("cpu", "cuda"))
    parser.add_argument("--steps", type=int, default=3000, help="optimizer steps")
    parser.add_argument("--minutes", type=float, default=2.25,
                        help="time budget of the training loop: fewer steps if needed")
    parser.add_argument("--out", type=Path, default=TRAINED_DIR)
    parser.add_argument("--batch-size", type=int, default=None, help="64 on cuda, 4 on cpu")
    parser.add_argument("--seq-len", type=int, default=None, help="512 on cuda, 256 on cpu")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--warmup", type=int, default=100, help="steps of linear warmup")
    parser.add_argument("--chat-repeats", type=int, default=8,
                        help="copies of each chat pair per epoch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--documents", nargs="+", default=None, metavar="PATH",
                        help="train on these files only (e.g. README.md for a CPU check)")
    parser.add_argument("--deterministic", action="store_true",
                        help="deterministic CUDA kernels (slower); CPU runs always are")
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                        help="dtype of the saved weights")
    args = parser.parse_args(argv)
    args.batch_size = args.batch_size or (64 if args.device == "cuda" else 4)
    args.seq_len = args.seq_len or (512 if args.device == "cuda" else 256)
    return args


def training_rows(documents: dict[str, str], pairs: list[tuple[str, str]], seq_len: int,
                  chat_repeats: int) -> list[list[int]]:
    """The documents' rows, then each chat pair `chat_repeats` times, alternately
    without and with BOS."""
    rows = [row for text in documents.values() for row in document_rows(text.encode(), seq_len)]
    chats = [[*byte_ids(chat_text(q, a)), TOK.eos_token_id] for q, a in pairs]
    if max(map(len, chats)) > seq_len:
        print(f"warning: chat pairs of up to {max(map(len, chats))} tokens are cut to {seq_len}")
    for repeat in range(chat_repeats):
        rows += [([TOK.bos_token_id] * (repeat % 2) + row)[:seq_len + 1] for row in chats]
    return rows


def train(model, rows: list[list[int]], args: argparse.Namespace) -> tuple[int, float]:
    """AdamW with warmup then cosine decay over `args.steps`, or over as many steps as
    the measured speed fits into `args.minutes`; returns the steps run and the last loss."""
    device = args.device
    balance = RouterBalance(model, rate=1e-3)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    data = batches(rows, args.batch_size, args.seed)
    steps, start, marks = args.steps, time.perf_counter(), {}
    step, loss = 0, torch.zeros(())
    while step < steps:
        lr = learning_rate(step, steps, args.lr, min(args.warmup, steps // 10 + 1))
        for group in optimizer.param_groups:
            group["lr"] = lr
        inputs, targets = (t.to(device, non_blocking=True) for t in next(data))
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            logits = model(input_ids=inputs).logits
        loss = functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                                        ignore_index=IGNORE)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        balance.update()
        step += 1
        if step % args.log_every == 0 or step == steps:
            print(f"step {step}/{steps}  loss {loss.item():.4f}  lr {lr:.2e}  "
                  f"{time.perf_counter() - start:.0f}s", flush=True)
        if step in (10, 30) and steps > 100:  # fit the schedule to the time budget
            if device == "cuda":
                torch.cuda.synchronize()
            marks[step] = time.perf_counter()
            if step == 30:
                per_step = (marks[30] - marks[10]) / 20
                fit = 30 + int((args.minutes * 60 - (marks[30] - start)) / per_step)
                if fit < steps:
                    steps = max(fit, 100)
                    print(f"{per_step * 1e3:.0f} ms a step: {steps} steps fit "
                          f"{args.minutes} minutes", flush=True)
    return steps, loss.item()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.use_deterministic_algorithms(args.deterministic or args.device == "cpu",
                                       warn_only=True)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    documents = {p.relative_to(ROOT).as_posix(): p.read_text(encoding="utf-8")
                 for p in sources(args.documents)}
    pairs = chat_pairs(documents)
    rows = training_rows(documents, pairs, args.seq_len, args.chat_repeats)
    print(f"{len(documents)} documents ({sum(map(len, documents.values()))} characters), "
          f"{len(pairs)} chat pairs: {len(rows)} rows of up to {args.seq_len} tokens")

    config = model_config()
    attention = "sdpa" if args.device == "cuda" else "eager"
    model = build_model(config, args.seed, attention).float().to(args.device).train()
    check_layout(model, config, args.device, attention)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
          f"{config['num_hidden_layers']} layers, hidden {config['hidden_size']}; "
          f"batches of {args.batch_size} on {args.device}")
    start = time.perf_counter()
    steps, loss = train(model, rows, args)
    training = {
        "script": "scripts/train_tiny.py",
        "sources": {name: hashlib.sha256(text.encode()).hexdigest()
                    for name, text in documents.items()},
        "steps": steps, "batch_size": args.batch_size, "seq_len": args.seq_len,
        "lr": args.lr, "seed": args.seed, "final_loss": loss, "device": args.device,
        "seconds": round(time.perf_counter() - start, 1), "torch": torch.__version__,
        "prompts": list(PROMPTS),
        "chat_pairs": [list(pair) for pair in pairs],
    }
    save(model, config, args.out, getattr(torch, args.dtype), training)
    print(f"wrote {args.out} ({(args.out / 'model.safetensors').stat().st_size / 1e6:.2f} MB)")
    report(args.out, args.device, documents.get("README.md", ""), pairs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

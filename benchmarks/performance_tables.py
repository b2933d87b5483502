"""The tables of docs/PERFORMANCE.md, one per area, from the result files in docs/results/.

Each function takes a loaded result file and returns markdown lines; `Results` reads the
files and names each one's card, date, commit and command. `performance_report` puts
the tables together. Standard library only.
"""

from __future__ import annotations

import json
import re
import statistics
import textwrap
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MISSING = (None, "", "HEAD", "unknown")  # recorded values that identify nothing


# -- the result files --------------------------------------------------------------------

@dataclass
class Results:
    """The result files of one directory, read once each."""

    directory: Path

    def __post_init__(self) -> None:
        self._cache: dict[str, Any] = {}
        self.provenance: dict[str, dict[str, Any]] = self.load("provenance.json")

    def has(self, name: str) -> bool:
        """Whether the result file `name` exists (sections of absent files are left out)."""
        return (self.directory / name).exists()

    def load(self, name: str) -> Any:
        if name not in self._cache:
            self._cache[name] = json.loads((self.directory / name).read_text())
        return self._cache[name]

    def source(self, name: str) -> str:
        """One line naming the card, date and commit behind `name`, and the command that
        runs its benchmark in this tree (provenance.json's, else the one `name` records)."""
        data = self.load(name)
        recorded = data if isinstance(data, dict) else {}
        noted = self.provenance.get(name, {})

        def pick(*keys: str) -> str:
            for key in keys:
                if recorded.get(key) not in MISSING:
                    return str(recorded[key])
            return str(noted.get(keys[0], "not recorded"))

        card = pick("gpu")
        if card == "not recorded":
            card = str(noted.get("card", card))
        if noted.get("gpus", 1) > 1:
            card = f"{noted['gpus']}x {card}"
        details = [f"{recorded['sms']} SMs" if "sms" in recorded else None,
                   f"PyTorch {recorded['torch']}" if "torch" in recorded else None,
                   f"Triton {recorded['triton']}" if "triton" in recorded else None]
        details = [d for d in details if d]
        if details:
            card += f" ({', '.join(details)})"
        command = str(noted.get("command") or module_command(pick("command")))
        return (f"Card: {card}. Date: {pick('date')[:10]}. Commit: `{pick('commit')}`. "
                f"Command: `{command}`. Raw: [{name}](results/{name}).")


def module_command(argv: str) -> str:
    """A recorded sys.argv ("/root/pagedmla/benchmarks/bench_kernels.py --out k.json") as
    the module command that runs it from the repository root ("python -m
    benchmarks.bench_kernels --out k.json"); other text as it is."""
    return re.sub(r"^(?:python3? )?\S*?benchmarks/(\w+)\.py\b", r"python -m benchmarks.\1",
                  argv)


# -- formatting --------------------------------------------------------------------------

def num(value: float | None, digits: int = 1) -> str:
    return "" if value is None else f"{value:,.{digits}f}"


def pct(value: float | None, digits: int = 0) -> str:
    return "" if value is None else f"{value:.{digits}f}%"


def times(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}x"


def size(n: int) -> str:
    """2048 -> 2k, 131072 -> 128k, 1088 -> 1088."""
    return f"{n // 1024}k" if n and n % 1024 == 0 else str(n)


def span(values: Iterable[float], digits: int = 0, unit: str = "") -> str:
    """The range of `values`: "91-98%" for span(.., 0, "%"), "1.75-1.83x" for (.., 2, "x")."""
    values = sorted(values)
    if not values:
        return "none measured"
    low, high = f"{values[0]:.{digits}f}", f"{values[-1]:.{digits}f}"
    return (low if low == high else f"{low}-{high}") + unit


def paragraph(text: str, width: int = 92) -> list[str]:
    """`text` wrapped at `width`, a number never parted from its unit ("421.2 µs")."""
    glued = re.sub(r"(\d) (µs|ms|s|TB/s|GiB)\b", "\\1\0\\2", text)
    return [line.replace("\0", " ") for line in textwrap.wrap(glued, width)]


def table(header: list[str], rows: list[list[str]], left: int = 1) -> list[str]:
    """A markdown table; the first `left` columns are text, the others numbers."""
    rule = ["---"] * left + ["---:"] * (len(header) - left)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(rule) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


# -- kernels -----------------------------------------------------------------------------

def ceilings_table(kernels: dict) -> list[str]:
    ceil = kernels["ceilings"]
    return table(["HBM read (faster of `torch.sum` and a Triton read of 4 GiB)",
                  "HBM read by `torch.sum`", "device copy", "bf16 matmul (8192³)"], [[
        f"{num(ceil['hbm_read_tbps'], 2)} TB/s",
        f"{num(ceil.get('hbm_read_torch_sum_tbps'), 2)} TB/s",
        f"{num(ceil['hbm_copy_tbps'], 2)} TB/s",
        f"{num(ceil['bf16_matmul_tflops'], 0)} TFLOP/s",
    ]], left=0)


def runs_of(lengths: str) -> list[tuple[int, int]]:
    """"1 x 131072 + 63 x 2048" -> [(1, 131072), (63, 2048)]."""
    return [(int(a), int(b)) for a, b in re.findall(r"(\d+) x (\d+)", lengths)]


def cached_tokens(row: dict) -> int:
    if row.get("lengths"):
        return sum(a * b for a, b in runs_of(row["lengths"]))
    return row["B"] * row["context"]


def decode_label(row: dict, heads: bool = True) -> str:
    if row.get("lengths"):
        batch = " + ".join(f"{a} × {size(b)}" for a, b in runs_of(row["lengths"]))
    else:
        batch = f"{row['B']} × {size(row['context'])}"
    extras = [f"N {row['N']}"] if heads else []
    if row.get("q_len", 1) > 1:
        extras.append(f"q_len {row['q_len']}")
    if row.get("page", 64) != 64:
        extras.append(f"page {row['page']}")
    return ", ".join([batch, *extras])


def decode_rows(kernels: dict) -> list[dict]:
    return [r for r in kernels["results"] if r["kernel"] == "mla_decode"]


def memory_bound(row: dict) -> bool:
    return row["N"] * row.get("q_len", 1) <= 16


def decode_table(kernels: dict) -> list[str]:
    """One row per shape: the bf16 and the fp8 cache side by side. "% of ceiling" is of
    the HBM read rate where the call is memory-bound (N·q_len ≤ 16), else of the bf16
    matmul rate; the baselines are the faster of plain PyTorch and 4 splits per request."""
    ceil = kernels["ceilings"]
    shapes: dict[str, dict[str, dict]] = {}
    for r in decode_rows(kernels):
        shapes.setdefault(decode_label(r), {})[r["cache"]] = r

    def ceiling(r: dict | None) -> str:
        if r is None:
            return ""
        if memory_bound(r):
            return pct(r["pct_ceiling"])
        return pct(100 * r["tflops"] / ceil["bf16_matmul_tflops"])

    def vs_baseline(r: dict | None) -> str:
        if r is None:
            return ""
        baselines = [u for u in (r.get("baseline_us"), r.get("triton_4_splits_us")) if u]
        return times(min(baselines) / r["us"]) if baselines else ""

    rows = []
    for label, by_cache in shapes.items():
        bf16, fp8 = by_cache.get("bf16"), by_cache.get("fp8")
        first = bf16 or fp8
        rows.append([
            label, str(first.get("stage1", "")).capitalize(),
            num(bf16["us"]) if bf16 else "", ceiling(bf16),
            num(bf16["tflops"], 0) if bf16 else "",
            num(fp8["us"]) if fp8 else "", ceiling(fp8), num(fp8["tflops"], 0) if fp8 else "",
            times(fp8.get("fp8_speedup_vs_bf16")) if fp8 else "",
            num(first.get("triton_stage1_us")), vs_baseline(bf16), vs_baseline(fp8),
        ])
    header = ["batch", "stage 1", "bf16 µs", "% of ceiling", "TFLOP/s", "fp8 µs",
              "% of ceiling", "TFLOP/s", "fp8 speed-up", "Triton kernel µs (bf16)",
              "vs strongest baseline (bf16)", "(fp8)"]
    return table(header, rows, left=2)


def reference_note(kernels: dict) -> str:
    timed = [f"{num(r['reference_us'])} µs at {decode_label(r)}"
             for r in decode_rows(kernels) if r.get("reference_us")]
    if not timed:
        return ""
    return ("The executable specification (`ops/reference.py`, float32, eager) takes "
            + "; ".join(timed) + ".")


# -- decode past one wave (the split plan) ----------------------------------------------

def plan_rows(plan: list[dict], variant: str = "auto") -> dict[tuple, dict]:
    short = {"torch.bfloat16": "bf16", "torch.float8_e4m3fn": "fp8"}
    return {(short.get(r["cache"], r["cache"]), r["N"], r["batch"]): r
            for r in plan if r["variant"] == variant}


def plan_table(plan: list[dict]) -> list[str]:
    """Per cache dtype, over the batches measured: the plan's time against the same plan
    without its even and persistent layouts (one split per program), and the TFLOP/s of
    the compute-bound batches (N = 128)."""
    ours, scored = plan_rows(plan), plan_rows(plan, "scored")
    rows = []
    for cache in ("bf16", "fp8"):
        gains = sorted((scored[key]["us"] / r["us"], key[2].replace(" x ", " × "), key[1])
                       for key, r in ours.items() if key[0] == cache and key in scored)
        if not gains:
            continue
        tflops = [r["tflops"] for key, r in ours.items() if key[0] == cache and key[1] == 128]
        worst, best = gains[0], gains[-1]
        rows.append([cache, str(len(gains)), times(statistics.median(g for g, *_ in gains)),
                     f"{times(best[0])} ({best[1]}, N {best[2]})",
                     f"{times(worst[0])} ({worst[1]}, N {worst[2]})",
                     f"{num(min(tflops), 0)}-{num(max(tflops), 0)}" if tflops else ""])
    return table(["cache", "batches", "median speed-up", "best", "worst",
                  "TFLOP/s at N 128"], rows)


def plan_batch(batch: str) -> tuple[int, int] | None:
    """"67 x 4k" -> (67, 4096); None for other batches (ragged, lognormal)."""
    match = re.fullmatch(r"(\d+) x (\d+)k", batch)
    return (int(match[1]), int(match[2]) * 1024) if match else None


# -- prefill, merge, experts, routing --------------------------------------------------

def prefill_table(kernels: dict) -> list[str]:
    """One row per shape and N: the Gluon kernel (`varlen_attention`) and the backend op
    (`prefill_attention`) side by side, with the portable Triton kernel and cuDNN SDPA of
    the same run (none for ragged batches)."""
    matmul = kernels["ceilings"]["bf16_matmul_tflops"]
    pairs: dict[tuple[str, int], dict[str, dict]] = {}
    for r in kernels["results"]:
        if r["kernel"] in ("varlen_attention", "prefill_attention"):
            pairs.setdefault((r["shape"], r["N"]), {})[r["kernel"]] = r

    def vs_cudnn(r: dict | None) -> str:
        return times(r["baseline_us"] / r["us"]) if r and r.get("baseline_us") else ""

    rows = []
    for (shape, heads), by_kernel in pairs.items():
        kernel, op = by_kernel.get("varlen_attention"), by_kernel.get("prefill_attention")
        either = op or kernel  # the Triton kernel's and cuDNN's times are the same in both
        host = [num(r.get("host_us"), 0) if r else "" for r in (kernel, op)]
        rows.append([
            shape, str(heads),
            num(kernel["us"]) if kernel else "", num(kernel["tflops"], 0) if kernel else "",
            vs_cudnn(kernel),
            num(op["us"]) if op else "", num(op["tflops"], 0) if op else "",
            pct(100 * op["tflops"] / matmul) if op else "", vs_cudnn(op),
            num(either.get("triton_kernel_us")), num(either.get("baseline_us")),
            " / ".join(host),
        ])
    header = ["shape", "N", "Gluon kernel µs", "TFLOP/s", "vs cuDNN", "backend op µs",
              "TFLOP/s", "% matmul", "vs cuDNN", "Triton kernel µs", "cuDNN SDPA µs",
              "host µs per call: kernel / op"]
    return table(header, rows, left=2)


def merge_rows(kernels: dict) -> list[dict]:
    return [r for r in kernels["results"] if r["kernel"] == "merge_attn_states"]


def merge_lines(kernels: dict, about: str, width: int = 92) -> list[str]:
    """`about` (what the merge reads and writes) and each measured shape's time, rate and
    speed-up over `torch.compile` of the reference, as one wrapped paragraph."""
    copy = kernels["ceilings"]["hbm_copy_tbps"]
    measured = []
    for r in merge_rows(kernels):
        base = r.get("baseline_us")
        measured.append(
            f"At T {r['T']}, N {r['N']}, D {r['D']} it takes {num(r['us'])} µs, "
            f"{num(r['tbps'], 2)} TB/s ({pct(100 * r['tbps'] / copy)} of a device copy)"
            + (f"; `torch.compile`: {num(base)} µs ({times(base / r['us'])})." if base else "."))
    return paragraph(" ".join([about, *measured]), width)


def moe_ceilings(moe: dict) -> str:
    ceil = moe["ceilings"]
    return (f"Ceilings measured in this run: HBM read {num(ceil['hbm_read_tbps'], 2)} TB/s "
            f"(`torch.sum`), bf16 matmul {num(ceil['bf16_matmul_tflops'], 0)} TFLOP/s; a "
            "streaming kernel can pass `torch.sum`'s read rate by a little.")


def experts_table(moe: dict) -> list[str]:
    ceil = moe["ceilings"]
    rows, seen = [], set()
    for r in moe["results"]:
        label = ""
        if r["shape"] not in seen:
            seen.add(r["shape"])
            label = f"{r['shape']} ({r['E']}, top {r['k']}, H {r['H']}, I {r['I']})"
        baselines = [u for u in (r.get("grouped_us"), r.get("dense_us")) if u]
        rows.append([
            label, str(r["T"]), num(r["fused_us"]), num(r["tbps"], 2),
            pct(100 * r["tbps"] / ceil["hbm_read_tbps"]), num(r["tflops"], 0),
            pct(100 * r["tflops"] / ceil["bf16_matmul_tflops"]), num(r.get("grouped_us"), 0),
            num(r.get("dense_us"), 0), times(min(baselines) / r["fused_us"]),
        ])
    header = ["experts", "tokens", "fused µs", "TB/s", "% HBM read", "TFLOP/s", "% matmul",
              "grouped µs", "dense µs", "vs strongest baseline"]
    return table(header, rows, left=1)


def routing_lines(routing: dict) -> list[str]:
    rows = [r for r in routing["rows"] if r.get("mha") is not None]
    queries = sorted({r["q"] for r in rows})
    grid = {(r["heads"], r["context"], r["q"]): r for r in rows}
    out = []
    for heads, context in sorted({(r["heads"], r["context"]) for r in rows}):
        cells = []
        for q in queries:
            r = grid.get((heads, context, q))
            if r is None:
                cells.append("")
                continue
            mha = f"**{r['mha']:.2f}**" if r["mha"] < r["mqa"] else f"{r['mha']:.2f}"
            cells.append(f"{r['mqa']:.2f} / {mha}")
        out.append([str(heads), size(context), *cells])
    agree = sum((r["mqa"] < r["mha"]) == r["model_prefers_mqa"] for r in rows)
    note = (f"MQA / MHA milliseconds for {routing['batch']} requests of q new tokens over C "
            "cached ones (bold where MHA is faster). The cost model "
            f"(`routing.PathCostModel`) picks the faster path in {agree} of {len(rows)} cases.")
    return [*table(["N", "C", *(f"q={q}" for q in queries)], out, left=2), "", note]


# -- engine ------------------------------------------------------------------------------

MODES = {"eager": "eager", "cuda_graphs": "CUDA graphs",
         "cuda_graphs_async": "CUDA graphs, async scheduling",
         "compiled_async": "`compile=True`, async scheduling",
         "invariant_async": "`batch_invariant=True`, async scheduling"}


def engine_label(args: dict) -> str:
    model = f"{args['layers']} layers{', MoE' if args.get('moe') else ''}"
    layout = []
    if args.get("tensor_parallel", 1) > 1:
        layout.append(f"TP {args['tensor_parallel']}")
    if args.get("dcp", 1) > 1:
        layout.append(f"DCP {args['dcp']}")
    batch = f"{args['batch']} × {size(args['prompt_len'])}"
    return ", ".join([model, *layout, batch])


def engine_rows(run: dict) -> list[list[str]]:
    args, runs = run["args"], run["runs"]
    eager = runs.get("eager")
    rows = []
    for mode, r in runs.items():
        rows.append([
            engine_label(args) if not rows else "", MODES.get(mode, mode), num(r["step_ms"], 2),
            num(r["host_ms"], 2), pct(100 * max(r["idle_share"], 0.0), 1),
            num(r["tokens_per_s"], 0), times(eager["step_ms"] / r["step_ms"]) if eager else "",
        ])
    return rows


def engine_table(runs: list[dict]) -> list[str]:
    """Engine runs (bench_engine results), each mode a row."""
    header = ["model, batch × context", "mode", "step ms", "host ms", "GPU idle", "tokens/s",
              "vs eager"]
    return table(header, [row for run in runs for row in engine_rows(run)], left=2)


def modes_table(run: dict, default: str = "cuda_graphs_async") -> list[str]:
    """Engine modes against the default one (bench_engine with --arrivals): decode steps
    and steps that admit a prompt, and LLM(...)'s time without the warm-up."""
    base = run["runs"][default]
    rows = [[MODES.get(mode, mode), num(r["step_ms"], 2), times(r["step_ms"] / base["step_ms"]),
             num(r["mixed_step_ms"], 2), times(r["mixed_step_ms"] / base["mixed_step_ms"]),
             num(r["startup_s"], 1)]
            for mode, r in run["runs"].items()]
    return table(["mode", "decode step ms", "÷ default's", "step with the prompt ms",
                  "÷ default's", "LLM(...) s, no warm-up"], rows)


def output_quant_table(run: dict) -> list[str]:
    """bench_output_quant: the output stage and o_proj, bf16 output against fp8 codes; one
    row per case (kind and T), one group of columns per N."""
    results = run["results"]
    heads = list(dict.fromkeys(r["N"] for r in results))
    by = {(r["kind"], r["T"], r["N"]): r for r in results}
    rows = []
    for kind, tokens in dict.fromkeys((r["kind"], r["T"]) for r in results):
        line = [f"{kind}, T {tokens:,}"]
        for n in heads:
            r = by.get((kind, tokens, n))
            line += ["", "", ""] if r is None else [
                f"{num(r['unfused_stage_us'])} / {num(r['fused_stage_us'])}",
                f"{num(r['unfused_us'])} / {num(r['fused_us'])}",
                f"{num(r['saved_us'])} ({pct(100 * r['saved_us'] / r['unfused_us'])})"]
        rows.append(line)
    header = ["case"]
    for n in heads:
        header += [f"N {n}: stage µs, bf16 / fp8", "with o_proj µs, bf16 / fp8", "saved µs"]
    return table(header, rows, left=1)


def mixed_lines(mixed: dict, width: int = 92) -> list[str]:
    """Steps that admit a prompt (bench_engine with --arrivals), each mode a sentence of a
    wrapped paragraph: the step's time against a decode step's, and the share planned
    ahead."""
    sentences = []
    for mode, r in mixed["runs"].items():
        if "mixed_step_ms" not in r:
            continue
        ahead = r.get("mixed_ahead_share")
        sentences.append(
            f"Steps that admit a prompt ({engine_label(mixed['args'])}, "
            f"{MODES.get(mode, mode)}): the decodes and one {r['arrival_len']}-token prompt "
            f"take {num(r['mixed_step_ms'], 2)} ms, {times(r['mixed_step_ms'] / r['step_ms'])} "
            f"a decode step's {num(r['step_ms'], 2)} ms, as one CUDA graph "
            "(`engine/prompt_rows.py`)"
            + ("." if ahead is None else
               f"; {pct(100 * ahead)} of them planned while the step before ran."))
    return paragraph(" ".join(sentences), width)


def dcp_lines(dcp: dict, width: int = 92) -> list[str]:
    """bench_dcp's capacity (context tokens the KV cache holds per DCP size) and its parity
    check, as a wrapped paragraph; its eager step times are not shown."""
    holds = {r["dcp"]: r["max_context_tokens"] for r in dcp["decode"]}
    sizes = sorted(holds)
    capacity = " and ".join(f"{holds[d]:,}{' context tokens' if d == sizes[0] else ''} with "
                            f"DCP {d}" for d in sizes)
    parity = dcp.get("parity", {})
    text = (
        f"Capacity (`bench_dcp`, {dcp.get('model', 'DeepSeek-V2-Lite shape')}, TP "
        f"{dcp.get('tensor_parallel_size', 2)}, {dcp.get('block_size', 64)}-token pages): "
        f"the KV cache holds {capacity} ({times(holds[sizes[-1]] / holds[sizes[0]])}). "
        "Parity on the same machine (TP 2 + DCP 2 against one process, tiny model, float32, "
        "NCCL): greedy tokens "
        f"{'identical' if parity.get('tokens_identical') else 'differ'}, largest logprob "
        f"difference {parity.get('max_logprob_diff', float('nan')):.1e}.")
    return paragraph(text, width)

"""Render docs/PERFORMANCE.md, and the README's speed summary, from docs/results/.

    python -m benchmarks.performance_report          # rewrite both files
    python -m benchmarks.performance_report --check  # exit 1 where a file differs

Every number in docs/PERFORMANCE.md comes from a result file in docs/results/, and so do
each table's card, date, commit and command (docs/results/provenance.json supplies them
for files that do not record them). Every verdict against a target is computed here; the
prose around the tables lives in this module and in `performance_text.py` beside it. So
numbers and text cannot drift apart: a new result file means running this script, and a
CPU test runs `--check`. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import performance_text as text

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
PERFORMANCE = ROOT / "docs" / "PERFORMANCE.md"
README = ROOT / "README.md"
SPEED_BEGIN = "<!-- speed: rendered by `python -m benchmarks.performance_report` -->"
SPEED_END = "<!-- /speed -->"
MISSING = (None, "", "HEAD", "unknown")  # recorded values that identify nothing
MILLION = 1 << 20


# -- the result files --------------------------------------------------------------------

@dataclass
class Results:
    """The result files of one directory, read once each."""

    directory: Path

    def __post_init__(self) -> None:
        self._cache: dict[str, Any] = {}
        self.provenance: dict[str, dict[str, Any]] = self.load("provenance.json")

    def load(self, name: str) -> Any:
        if name not in self._cache:
            self._cache[name] = json.loads((self.directory / name).read_text())
        return self._cache[name]

    def source(self, name: str) -> str:
        """One line naming the card, date, commit and command behind `name`."""
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
        command = pick("command")
        if not command.startswith(("python", "one-off")):  # a recorded sys.argv
            command = "python3 " + re.sub(r"^\S*?(?=benchmarks/)", "", command)
        return (f"Card: {card}. Date: {pick('date')[:10]}. Commit: `{pick('commit')}`. "
                f"Command: `{command}`. Raw: [{name}](results/{name}).")


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


def table(header: list[str], rows: list[list[str]], left: int = 1) -> list[str]:
    """A markdown table; the first `left` columns are text, the others numbers."""
    rule = ["---"] * left + ["---:"] * (len(header) - left)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(rule) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def verdict(passes: list[bool]) -> str:
    met = sum(passes)
    if met == len(passes):
        return "**met**"
    return "**missed**" if met == 0 else f"**met on {met} of {len(passes)}**"


# -- decode ------------------------------------------------------------------------------

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
    ceil = kernels["ceilings"]
    rows = []
    for r in decode_rows(kernels):
        baselines = [u for u in (r.get("baseline_us"), r.get("triton_4_splits_us")) if u]
        read = r.get("same_size_read_us")
        stage = r.get("stage1_kernel") or str(r.get("stage1", "")).capitalize()
        rows.append([
            decode_label(r), r["cache"], stage, num(r["us"]), num(r.get("with_plan_us")),
            num(r["tbps"], 2), pct(r["pct_ceiling"]), pct(r.get("pct_ceiling_clean_l2")),
            pct(100 * read / r["us"] if read else None), num(r["tflops"], 0),
            pct(100 * r["tflops"] / ceil["bf16_matmul_tflops"]),
            times(r.get("fp8_speedup_vs_bf16")), num(r.get("triton_stage1_us")),
            num(r.get("baseline_us")), num(r.get("triton_4_splits_us")),
            times(min(baselines) / r["us"] if baselines else None),
        ])
    header = ["batch", "cache", "stage 1", "µs", "+ plan µs", "TB/s", "% HBM read",
              "% HBM read, clean L2", "% of a same-size read", "TFLOP/s", "% matmul",
              "fp8 speed-up", "Triton kernel µs", "gather + bmm µs", "Triton, 4 splits µs",
              "vs strongest baseline"]
    return table(header, rows, left=3)


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
    ours, scored = plan_rows(plan), plan_rows(plan, "scored")
    rows = []
    for (cache, heads, batch), r in ours.items():
        other = scored.get((cache, heads, batch))
        bf16 = ours.get(("bf16", heads, batch)) if cache == "fp8" else None
        rows.append([
            batch.replace(" x ", " × "), str(heads), cache, num(r["us"]), num(r["tflops"], 0),
            str(r["pieces"]), "yes" if r.get("even") else "",
            num(other["us"]) if other else "", times(other["us"] / r["us"]) if other else "",
            times(bf16["us"] / r["us"]) if bf16 else "",
        ])
    header = ["batch", "N", "cache", "µs", "TFLOP/s", "splits", "even runs",
              "one split per program µs", "speed-up", "fp8 speed-up"]
    return table(header, rows, left=3)


def plan_batch(batch: str) -> tuple[int, int] | None:
    """"67 x 4k" -> (67, 4096); None for other batches (ragged, lognormal)."""
    match = re.fullmatch(r"(\d+) x (\d+)k", batch)
    return (int(match[1]), int(match[2]) * 1024) if match else None


# -- prefill, merge, experts, routing --------------------------------------------------

def prefill_table(kernels: dict) -> list[str]:
    matmul = kernels["ceilings"]["bf16_matmul_tflops"]
    rows = []
    for r in kernels["results"]:
        if r["kernel"] not in ("varlen_attention", "prefill_attention"):
            continue
        op = ("backend op" if r["kernel"] == "prefill_attention"
              else f"{str(r.get('stage', '')).capitalize()} kernel")
        base = r.get("baseline_us")
        rows.append([
            r["shape"], str(r["N"]), op, num(r["us"]), num(r["tflops"], 0),
            pct(100 * r["tflops"] / matmul), num(r.get("triton_kernel_us")), num(base),
            times(base / r["us"]) if base else "", num(r.get("host_us"), 0),
        ])
    header = ["shape", "N", "op", "µs", "TFLOP/s", "% matmul", "Triton kernel µs",
              "cuDNN SDPA µs", "vs cuDNN", "host µs per call"]
    return table(header, rows, left=3)


def merge_rows(kernels: dict) -> list[dict]:
    return [r for r in kernels["results"] if r["kernel"] == "merge_attn_states"]


def merge_table(kernels: dict) -> list[str]:
    copy = kernels["ceilings"]["hbm_copy_tbps"]
    rows = [[f"T {r['T']}, N {r['N']}, D {r['D']}", num(r["us"]), num(r["tbps"], 2),
             pct(100 * r["tbps"] / copy), num(r.get("baseline_us")),
             times(r["baseline_us"] / r["us"]) if r.get("baseline_us") else ""]
            for r in merge_rows(kernels)]
    return table(["shape", "µs", "TB/s", "% of a device copy", "torch.compile µs",
                  "speed-up"], rows)


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
         "cuda_graphs_async": "CUDA graphs, async scheduling"}


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


ENGINE_HEADER = ["model, batch × context", "mode", "step ms", "host ms", "GPU idle",
                 "tokens/s", "vs eager"]


def mixed_table(mixed: dict) -> list[str]:
    rows = []
    for mode, r in mixed["runs"].items():
        if "mixed_step_ms" not in r:
            continue
        rows.append([
            f"{mixed['args']['batch']} decodes + one {r['arrival_len']}-token prompt",
            MODES.get(mode, mode), num(r["step_ms"], 2), num(r["mixed_step_ms"], 2),
            times(r["mixed_step_ms"] / r["step_ms"]),
            pct(100 * r["mixed_ahead_share"]) if "mixed_ahead_share" in r else "",
        ])
    return table(["step", "mode", "decode step ms", "step with the prompt ms",
                  "vs a decode step", "planned ahead"], rows, left=2)


def dcp_table(dcp: dict) -> list[str]:
    rows = [[str(r["dcp"]), str(r["batch"]), size(r["context"]), num(r["step_ms"], 1),
             num(r["tokens_per_s"], 0), f"{r['max_context_tokens']:,}"]
            for r in dcp["decode"]]
    return table(["DCP", "batch", "context", "step ms", "tokens/s",
                  "context tokens the cache holds"], rows, left=0)


# -- targets -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Target:
    """A target: what is measured against which bound, and why a miss happens."""

    name: str
    measure: Callable[[Results], tuple[str, str]]  # -> (measured, verdict)
    limit: str


def _memory_bound_bf16(res: Results) -> tuple[str, str]:
    rows = [r for r in decode_rows(res.load("kernels_h200.json"))
            if r["cache"] == "bf16" and memory_bound(r)]
    measured = "; ".join(f"{decode_label(r, heads=False)}: {pct(r['pct_ceiling'])}"
                         for r in rows)
    return measured, verdict([r["pct_ceiling"] >= 90 for r in rows])


def _compute_bound(res: Results) -> tuple[str, str]:
    found = [(decode_label(r, heads=False), r["tflops"])
             for r in decode_rows(res.load("kernels_h200.json"))
             if r["cache"] == "bf16" and r["N"] == 128 and 64 <= r["B"] <= 128
             and 4096 <= r["context"] <= 8192 and not r.get("lengths")]
    for (cache, heads, batch), r in plan_rows(res.load("split_plan_h200.json")).items():
        shape = plan_batch(batch)
        if (cache == "bf16" and heads == 128 and shape and 64 <= shape[0] <= 128
                and 4096 <= shape[1] <= 8192):
            found.append((batch.replace(" x ", " × ") + " (split plan run)", r["tflops"]))
    measured = "; ".join(f"{label}: {value:.0f}" for label, value in found)
    return measured, verdict([value >= 400 for _, value in found])


def _one_long_request(res: Results) -> tuple[str, str]:
    rows = [r for r in decode_rows(res.load("kernels_h200.json"))
            if r["cache"] == "bf16" and r["B"] == 1 and r["N"] == 128
            and r["context"] == 65536]
    measured = ", ".join(f"{num(r['us'])} µs ({num(r.get('clean_l2_us'))} after a clean L2)"
                         for r in rows)
    return measured, verdict([r["us"] <= 40 for r in rows])


def _fp8_speedup(res: Results) -> tuple[str, str]:
    found = [(decode_label(r, heads=False), r["fp8_speedup_vs_bf16"])
             for r in decode_rows(res.load("kernels_h200.json"))
             if r["cache"] == "fp8" and memory_bound(r) and r.get("fp8_speedup_vs_bf16")]
    ours = plan_rows(res.load("split_plan_h200.json"))
    for (cache, heads, batch), r in ours.items():
        bf16 = ours.get(("bf16", heads, batch))
        if cache == "fp8" and heads <= 16 and bf16:
            found.append((batch.replace(" x ", " × ") + " (split plan run)",
                          bf16["us"] / r["us"]))
    measured = "; ".join(f"{label}: {times(value)}" for label, value in found)
    return measured, verdict([value >= 1.7 for _, value in found])


def _merge(res: Results) -> tuple[str, str]:
    rows = merge_rows(res.load("kernels_h200.json"))
    return (", ".join(f"{num(r['tbps'], 2)} TB/s" for r in rows),
            verdict([r["tbps"] >= 3.5 for r in rows]))


def _prefill(stage: str) -> Callable[[Results], tuple[str, str]]:
    def measure(res: Results) -> tuple[str, str]:
        rows = [r for r in res.load("kernels_h200.json")["results"]
                if r["kernel"] == stage and r.get("causal") and r.get("baseline_us")
                and 4096 <= r["tokens"] <= 16384]
        ratios = [(f"N {r['N']} {size(r['tokens'])}", r["baseline_us"] / r["us"])
                  for r in rows]
        return ("; ".join(f"{label}: {times(x)}" for label, x in ratios),
                verdict([x >= 0.9 for _, x in ratios]))
    return measure


def _engine_idle(res: Results) -> tuple[str, str]:
    run = res.load("engine_h200.json")
    r = run["runs"]["cuda_graphs_async"]
    measured = (f"GPU idle {pct(100 * max(r['idle_share'], 0.0), 1)} of a "
                f"{num(r['step_ms'], 2)} ms step at batch {run['args']['batch']}; the host's "
                f"own work, overlapped with the device, {pct(100 * r['host_share'])}")
    return measured, verdict([r["idle_share"] < 0.10])


TARGETS = [
    Target("decode, bf16 cache, N·q_len ≤ 16 (memory-bound): ≥ 90% of the HBM read ceiling",
           _memory_bound_bf16, text.LIMITS["memory_bound"]),
    Target("decode, bf16 cache, N = 128, 64-128 requests of 4k-8k: ≥ 400 TFLOP/s",
           _compute_bound, text.LIMITS["compute_bound"]),
    Target("decode, bf16 cache, one request of 64k, N = 128: ≤ 40 µs",
           _one_long_request, text.LIMITS["one_long_request"]),
    Target("decode, fp8 cache, N·q_len ≤ 16: ≥ 1.7x the bf16 cache's speed",
           _fp8_speedup, text.LIMITS["fp8"]),
    Target("merge_attn_states, T = 16384, N = 128, D = 128: ≥ 3.5 TB/s", _merge,
           text.LIMITS["merge"]),
    Target("prefill (backend op), qk 192 / v 128, causal, N 16 and 128, 4k-16k tokens: "
           "≥ 0.9x cuDNN SDPA", _prefill("prefill_attention"), text.LIMITS["prefill_op"]),
    Target("prefill, the Gluon kernel alone, same shapes: ≥ 0.9x cuDNN SDPA",
           _prefill("varlen_attention"), text.LIMITS["prefill_kernel"]),
    Target("engine decode step with CUDA graphs, batch 128: the GPU waits for the host "
           "< 10% of the step", _engine_idle, text.LIMITS["engine"]),
]


def targets_table(res: Results) -> list[str]:
    rows = []
    for target in TARGETS:
        measured, result = target.measure(res)
        rows.append([target.name, measured, result, target.limit])
    return table(["target", "measured", "verdict", "what limits it"], rows, left=4)


# -- the documents -----------------------------------------------------------------------

def render_performance(res: Results) -> str:
    kernels = res.load("kernels_h200.json")
    ceil = kernels["ceilings"]
    ceilings = table(["ceiling", "measured"], [
        ["HBM read (the faster of `torch.sum` and a plain Triton read of 4 GiB)",
         f"{num(ceil['hbm_read_tbps'], 2)} TB/s"],
        ["HBM read by `torch.sum`", f"{num(ceil.get('hbm_read_torch_sum_tbps'), 2)} TB/s"],
        ["device copy", f"{num(ceil['hbm_copy_tbps'], 2)} TB/s"],
        ["bf16 matmul (8192³)", f"{num(ceil['bf16_matmul_tflops'], 0)} TFLOP/s"],
    ])
    parallel = table(ENGINE_HEADER, engine_rows(res.load("engine_tp2_2xh200.json"))
                     + engine_rows(res.load("engine_tp2_dcp2_2xh200.json")), left=2)
    engine = table(ENGINE_HEADER, [row for name in ("engine_h200.json", "engine_moe_h200.json",
                                                    "engine_b144_h200.json")
                                   for row in engine_rows(res.load(name))], left=2)
    dcp = res.load("dcp_2xh200.json")
    parity = dcp.get("parity", {})
    sections = [
        text.INTRO, "## Method", text.METHOD,
        "## Ceilings", res.source("kernels_h200.json"), "", *ceilings,
        "## Against the targets", text.TARGETS_INTRO, "", *targets_table(res),
        "## Decode", res.source("kernels_h200.json"), "", text.DECODE, "",
        *decode_table(kernels), "", reference_note(kernels), "", text.PLOTS,
        "### Past one wave of requests", res.source("split_plan_h200.json"), "",
        text.SPLIT_PLAN, "", *plan_table(res.load("split_plan_h200.json")),
        "## Prefill", res.source("kernels_h200.json"), "", text.PREFILL, "",
        *prefill_table(kernels),
        "## Merge", res.source("kernels_h200.json"), "", text.MERGE, "", *merge_table(kernels),
        "## Engine", *(res.source(n) for n in ("engine_h200.json", "engine_moe_h200.json",
                                                "engine_b144_h200.json")),
        "", text.ENGINE, "", *engine,
        "### Steps that admit a prompt", res.source("engine_mixed_h200.json"), "",
        text.MIXED, "", *mixed_table(res.load("engine_mixed_h200.json")),
        "## Parallel", res.source("engine_tp2_2xh200.json"),
        res.source("engine_tp2_dcp2_2xh200.json"), "", text.PARALLEL, "", *parallel,
        "### Decode context parallelism, eager steps", res.source("dcp_2xh200.json"), "",
        text.DCP, "", *dcp_table(dcp), "",
        f"Parity on the same machine (TP 2 + DCP 2 against one process, tiny model, float32, "
        f"NCCL): greedy tokens {'identical' if parity.get('tokens_identical') else 'differ'}, "
        f"largest logprob difference {parity.get('max_logprob_diff', float('nan')):.1e}.",
        "## Routed experts", res.source("moe_h200.json"), "", text.EXPERTS, "",
        moe_ceilings(res.load("moe_h200.json")), "",
        *experts_table(res.load("moe_h200.json")),
        "## MQA or MHA", res.source("routing_h200.json"), "", text.ROUTING, "",
        *routing_lines(res.load("routing_h200.json")),
        "## CPU", text.CPU,
    ]
    out: list[str] = []
    for part in sections:
        if part.startswith("#"):  # a heading: one blank line before and after it
            out += ["", part, ""] if out else [part, ""]
        else:
            out.append(part)
    body = "\n".join(out)
    return re.sub(r"\n{3,}", "\n\n", body).strip() + "\n"


def speed_summary(res: Results) -> list[str]:
    """The README's speed bullets: headline numbers of the same results."""
    kernels = res.load("kernels_h200.json")
    rows = decode_rows(kernels)
    large = [r for r in rows if memory_bound(r) and cached_tokens(r) >= MILLION]
    bf16 = [r for r in large if r["cache"] == "bf16"]
    strongest = [min(r["baseline_us"], r["triton_4_splits_us"]) / r["us"] for r in bf16
                 if r.get("baseline_us") and r.get("triton_4_splits_us")]
    fp8 = [r["fp8_speedup_vs_bf16"] for r in large if r.get("fp8_speedup_vs_bf16")]
    heads = [r["tflops"] for r in rows if r["cache"] == "bf16" and r["N"] == 128
             and 64 <= r["B"] <= 128 and not r.get("lengths")]
    matmul = kernels["ceilings"]["bf16_matmul_tflops"]
    prefill = [r["baseline_us"] / r["us"] for r in kernels["results"]
               if r["kernel"] == "prefill_attention" and r.get("baseline_us")]
    engine = res.load("engine_h200.json")
    step, eager = engine["runs"]["cuda_graphs_async"], engine["runs"]["eager"]
    bullets = [
        f"Decode, bf16 cache, batches of 1M cached tokens or more: "
        f"{span([r['pct_ceiling'] for r in bf16], 0, '%')} of the HBM read rate, "
        f"{span(strongest, 2, 'x')} the speed of the strongest baseline; an fp8 cache "
        f"runs {span(fp8, 2, 'x')} as fast as bf16.",
        f"Decode with 128 heads (DeepSeek-V3 on one GPU), 64-128 requests: "
        f"{span(heads)} TFLOP/s, {span([100 * h / matmul for h in heads], 0, '%')} of the "
        f"bf16 matmul rate.",
        f"Prefill attention (qk 192, v 128): {span(prefill, 2, 'x')} the speed of cuDNN's "
        f"SDPA.",
        f"Engine, {engine['args']['layers']}-layer model, batch {engine['args']['batch']}: "
        f"{num(step['step_ms'], 2)} ms per decode step with CUDA graphs and asynchronous "
        f"scheduling ({num(step['tokens_per_s'], 0)} tokens/s, "
        f"{times(eager['step_ms'] / step['step_ms'])} the eager steps' speed).",
    ]
    return [line for bullet in bullets
            for line in textwrap.wrap(bullet, 88, initial_indent="- ",
                                      subsequent_indent="  ")]


def render_readme(readme: str, res: Results) -> str:
    """`readme` with the block between SPEED_BEGIN and SPEED_END rendered anew."""
    start, end = readme.find(SPEED_BEGIN), readme.find(SPEED_END)
    if start < 0 or end < start:
        raise ValueError(f"README.md lacks the markers {SPEED_BEGIN!r} ... {SPEED_END!r}")
    block = "\n".join([SPEED_BEGIN, *speed_summary(res), ""])
    return readme[:start] + block + readme[end:]


def render(results: Path = RESULTS, readme: Path = README) -> dict[Path, str]:
    """What each file should hold, by path."""
    res = Results(results)
    return {PERFORMANCE: render_performance(res),
            readme: render_readme(readme.read_text(), res)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if a file differs from its rendering")
    args = parser.parse_args(argv)
    stale = []
    for path, content in render().items():
        if path.exists() and path.read_text() == content:
            continue
        if args.check:
            stale.append(path)
        else:
            path.write_text(content)
            print(f"wrote {path.relative_to(ROOT)}")
    for path in stale:
        print(f"{path.relative_to(ROOT)} differs from what docs/results/ renders: run "
              "`python -m benchmarks.performance_report`", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())

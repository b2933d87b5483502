"""Render docs/PERFORMANCE.md, and the README's speed summary, from docs/results/.

    python -m benchmarks.performance_report          # rewrite both files
    python -m benchmarks.performance_report --check  # exit 1 where a file differs

Every number in docs/PERFORMANCE.md comes from a result file in docs/results/, and so do
each table's card, date, commit and command (docs/results/provenance.json supplies them
for files that do not record them). The verdicts against the targets are computed here,
the tables come from `performance_tables.py` (`performance_fp8.py`: block-fp8
weights and DeepSeek-V3 at real size; `performance_sparse.py`: sparse attention and the
lightning indexer) and the prose from `performance_text.py`.
So numbers and text cannot drift apart: a new result file means running this module, and
a CPU test runs `--check`. Standard library only.
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks import performance_fp8 as fp8
from benchmarks import performance_sparse as sparse
from benchmarks import performance_startup as startup
from benchmarks import performance_text as text
from benchmarks.performance_tables import (
    Results,
    cached_tokens,
    ceilings_table,
    dcp_lines,
    decode_label,
    decode_rows,
    decode_table,
    engine_table,
    experts_table,
    memory_bound,
    merge_lines,
    merge_rows,
    mixed_lines,
    modes_table,
    moe_ceilings,
    num,
    output_quant_table,
    pct,
    plan_batch,
    plan_rows,
    plan_table,
    prefill_table,
    reference_note,
    routing_lines,
    size,
    span,
    table,
    times,
)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
PERFORMANCE = ROOT / "docs" / "PERFORMANCE.md"
README = ROOT / "README.md"
SPEED_BEGIN = "<!-- speed: rendered by `python -m benchmarks.performance_report` -->"
SPEED_END = "<!-- /speed -->"
MILLION = 1 << 20  # "1M cached tokens" in the README's summary
# Result files whose sections are rendered only once they exist.
FP8_GEMM, FP8_MOE, V3_LAYERS = "fp8_gemm_h100.json", "moe_fp8_h100.json", "v3_layers_h200.json"
MEMORY_PLAN = "memory_plan.json"
SPARSE_DECODE, SPARSE_PREFILL = "sparse_decode_h100.json", "sparse_prefill_h100.json"
INDEXER = "indexer_h100.json"
ENGINE_MODES = ("engine_modes_h200.json", "engine_modes_h100.json")
OUTPUT_QUANT = ("output_quant_h200.json", "output_quant_h100.json")
STARTUP_COLD, STARTUP_WARM = "startup_cold_h100.json", "startup_warm_h100.json"


# -- targets -----------------------------------------------------------------------------

def verdict(passes: list[bool]) -> str:
    met = sum(passes)
    if met == len(passes):
        return "**met**"
    return "**missed**" if met == 0 else f"**met on {met} of {len(passes)}**"


@dataclass(frozen=True)
class Target:
    """A target: what is measured against which bound, and why a miss happens."""

    name: str
    measure: Callable[[Results], tuple[str, str]]  # -> (measured, verdict)
    limit: str
    needs: str = ""  # a result file without which the target is left out


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


def _gemm_misses(rows: list[dict], ok: Callable[[dict], bool],
                 value: Callable[[dict], str]) -> str:
    missed = [f"{fp8.gemm_label(r)} ({value(r)})" for r in rows if not ok(r)]
    return f"; below it: {', '.join(missed)}" if missed else ""


def _gemm_read(res: Results) -> tuple[str, str]:
    rows = [r for r in res.load(FP8_GEMM)["results"] if fp8.gemm_read_bound(r)]
    shares = [100 * r["read_fraction"] for r in rows]
    measured = (f"{span(shares, 0, '%')} of the HBM read rate over {len(rows)} rows"
                + _gemm_misses(rows, fp8.gemm_read_ok,
                               lambda r: pct(100 * r["read_fraction"])))
    return measured, verdict([fp8.gemm_read_ok(r) for r in rows])


def _gemm_compute(res: Results) -> tuple[str, str]:
    rows = [r for r in res.load(FP8_GEMM)["results"] if fp8.gemm_compute_bound(r)]
    smm = [r["vs_scaled_mm"] for r in rows if r.get("vs_scaled_mm")]
    measured = (f"{span([r['vs_bf16'] for r in rows], 2, 'x')} bf16's TFLOP/s, "
                f"{span(smm, 2, 'x')} `torch._scaled_mm`'s, over {len(rows)} rows"
                + _gemm_misses(rows, fp8.gemm_compute_ok,
                               lambda r: f"{times(r['vs_bf16'])}, "
                                         f"{times(r.get('vs_scaled_mm')) or 'n/a'}"))
    return measured, verdict([fp8.gemm_compute_ok(r) for r in rows])


def _measured(name: str, measure: Callable[[dict], tuple[str, list[bool]]]
              ) -> Callable[[Results], tuple[str, str]]:
    """A target's measure from a function of one result file that returns the measured
    text and whether each row in scope meets the bound."""
    def run(res: Results) -> tuple[str, str]:
        measured, passes = measure(res.load(name))
        return measured, verdict(passes)
    return run


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
    Target("fp8 GEMM (128 × 128 blocks), DeepSeek-V3's linears, M ≤ 64: the weight read at "
           "≥ 85% of the HBM read rate", _gemm_read, text.LIMITS["gemm_read"], FP8_GEMM),
    Target("fp8 GEMM, same shapes, M ≥ 2048: ≥ 1.6x the TFLOP/s of bf16 `torch.matmul` and "
           "≥ 0.9x `torch._scaled_mm`'s (per-tensor scales)", _gemm_compute,
           text.LIMITS["gemm_compute"], FP8_GEMM),
    Target(f"sparse decode (top-k 2048), N 128: ≥ {sparse.DECODE_TFLOPS:.0f} TFLOP/s",
           _measured(SPARSE_DECODE, sparse.decode_tflops), text.LIMITS["sparse_tflops"],
           SPARSE_DECODE),
    Target(f"sparse decode, N 16: ≥ {sparse.GATHER_PCT:.0f}% of the gather rate (a plain "
           "gather of the same rows)",
           _measured(SPARSE_DECODE, sparse.decode_gather), text.LIMITS["sparse_gather"],
           SPARSE_DECODE),
    Target(f"sparse prefill: ≥ {sparse.PREFILL_RATIO}x the dense prefill's TFLOP/s",
           _measured(SPARSE_PREFILL, sparse.prefill_ratio), text.LIMITS["sparse_prefill"],
           SPARSE_PREFILL),
    Target("lightning indexer, decode (64 requests × 65,536 positions): ≤ 0.32 ms; prefill "
           "4k: ≤ 0.70 ms; 16k: ≤ 6.5 ms", _measured(INDEXER, sparse.indexer_totals),
           text.LIMITS["indexer"], INDEXER),
]


def _first_call(res: Results) -> tuple[str, str]:
    measured, passes = startup.first_call(res.load(STARTUP_COLD), res.load(STARTUP_WARM))
    return measured, verdict(passes)


TARGETS += [
    Target(f"the first `generate` after `LLM(...)`: ≤ {startup.FIRST_CALL_RATIO}x the same "
           "call later (prompts, decodes, chunked prefill, prefix hits; bf16 and fp8 caches)",
           _first_call, text.LIMITS["first_call"], STARTUP_WARM),
    Target(f"start-up with the compiled kernels on disk (8 layers, V2-Lite attention): "
           f"≤ {startup.WARM_START_S:.0f} s (set for an H200; the card measured is named)",
           _measured(STARTUP_WARM, startup.warm_start), text.LIMITS["warm_start"],
           STARTUP_WARM),
]


def targets_table(res: Results) -> list[str]:
    rows = []
    for target in TARGETS:
        if target.needs and not res.has(target.needs):
            continue
        measured, result = target.measure(res)
        rows.append([target.name, measured, result, target.limit])
    return table(["target", "measured", "verdict", "what limits it"], rows, left=4)


# -- the documents -----------------------------------------------------------------------

def fp8_sections(res: Results) -> list[str]:
    """The sections of block-fp8 weights and of DeepSeek-V3/R1 at real size, each where
    its result file exists."""
    out: list[str] = []
    if res.has(FP8_GEMM):
        gemm = res.load(FP8_GEMM)
        out += ["## fp8 linear layers", res.source(FP8_GEMM), "", text.FP8_GEMM,
                fp8.gemm_ceilings(gemm), "", *fp8.gemm_table(gemm)]
    if res.has(FP8_MOE):
        out += ["## fp8 routed experts", res.source(FP8_MOE), "", text.FP8_EXPERTS,
                moe_ceilings(res.load(FP8_MOE)), "", *fp8.fp8_experts_table(res.load(FP8_MOE))]
    if res.has(V3_LAYERS):
        out += ["## DeepSeek-V3 layers, fp8 against bf16", res.source(V3_LAYERS), "",
                text.V3_LAYERS, "", *fp8.v3_layers_table(res.load(V3_LAYERS))]
    if res.has(MEMORY_PLAN):
        plan = res.load(MEMORY_PLAN)
        out += ["## DeepSeek-V3/R1 on one node: the memory plan", res.source(MEMORY_PLAN), "",
                text.MEMORY_PLAN, "", *fp8.memory_plan_table(plan), "",
                fp8.memory_plan_inputs(plan), *fp8.measured_lines(plan), "",
                *fp8.sparse_memory_lines(plan)]
    return out


def sparse_section(res: Results) -> list[str]:
    """Sparse attention and the lightning indexer, each table where its file exists."""
    parts = [(SPARSE_DECODE, sparse.decode_table), (SPARSE_PREFILL, sparse.prefill_table),
             (INDEXER, sparse.indexer_table)]
    out: list[str] = []
    for name, make in parts:
        if res.has(name):
            out += [res.source(name), "", *make(res.load(name)), ""]
    if not out:
        return []
    return ["## Sparse attention (DeepSeek-V3.2, GLM-5)", text.SPARSE, "", *out]


def startup_section(res: Results) -> list[str]:
    if not (res.has(STARTUP_COLD) and res.has(STARTUP_WARM)):
        return []
    cold, warm = res.load(STARTUP_COLD), res.load(STARTUP_WARM)
    return ["## Start-up", res.source(STARTUP_COLD), res.source(STARTUP_WARM), "",
            text.STARTUP, "", *startup.phases_table(cold, warm), "",
            *startup.first_call_table(cold, warm)]


def measured_section(res: Results, names: tuple[str, ...], heading: str, about: str,
                     make: Callable[[dict], list[str]]) -> list[str]:
    """A section from the first of `names` (one result file per card) that exists; none
    where no card measured it."""
    for name in names:
        if res.has(name):
            return [heading, res.source(name), "", about, "", *make(res.load(name))]
    return []


def render_performance(res: Results) -> str:
    kernels = res.load("kernels_h200.json")
    parallel = engine_table([res.load("engine_tp2_2xh200.json"),
                             res.load("engine_tp2_dcp2_2xh200.json")])
    engine = engine_table([res.load(name) for name in ("engine_h200.json",
                                                       "engine_moe_h200.json",
                                                       "engine_b144_h200.json")])
    sections = [
        text.INTRO, "## Method and ceilings", text.METHOD, "", res.source("kernels_h200.json"),
        "", *ceilings_table(kernels),
        "## Against the targets", text.TARGETS_INTRO, "", *targets_table(res),
        "## Decode", res.source("kernels_h200.json"), "", text.DECODE, "",
        *decode_table(kernels), "", reference_note(kernels), text.PLOTS,
        "### Past one wave of requests", res.source("split_plan_h200.json"), "",
        text.SPLIT_PLAN, "", *plan_table(res.load("split_plan_h200.json")),
        "## Prefill and merge", res.source("kernels_h200.json"), "", text.PREFILL, "",
        *prefill_table(kernels), "", *merge_lines(kernels, text.MERGE),
        *measured_section(res, OUTPUT_QUANT, "### The attention output in fp8 for o_proj",
                          text.OUTPUT_QUANT, output_quant_table),
        "## Engine", *(res.source(n) for n in ("engine_h200.json", "engine_moe_h200.json",
                                                "engine_b144_h200.json",
                                                "engine_mixed_h200.json")),
        "", text.ENGINE, "", *engine, "", *mixed_lines(res.load("engine_mixed_h200.json")),
        *measured_section(res, ENGINE_MODES, "### torch.compile and batch invariance",
                          text.MODES, modes_table),
        "## Parallel", *(res.source(n) for n in ("engine_tp2_2xh200.json",
                                                  "engine_tp2_dcp2_2xh200.json",
                                                  "dcp_2xh200.json")),
        "", text.PARALLEL, "", *parallel, "", *dcp_lines(res.load("dcp_2xh200.json")),
        "## Routed experts", res.source("moe_h200.json"), "", text.EXPERTS,
        moe_ceilings(res.load("moe_h200.json")), "",
        *experts_table(res.load("moe_h200.json")),
        *fp8_sections(res),
        *sparse_section(res),
        *startup_section(res),
        "## MQA or MHA", res.source("routing_h200.json"), "", text.ROUTING, "",
        *routing_lines(res.load("routing_h200.json")),
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

"""docs/PERFORMANCE.md and the README's speed summary are what docs/results/ renders.

CPU only, standard library only: the report reads JSON files and writes markdown.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from benchmarks import performance_report as report
from benchmarks import performance_tables as tables

MAX_PERFORMANCE_LINES = 400  # with every section rendered (see the synthetic test below)


def test_documents_match_their_results() -> None:
    """Fails when a result file or the report's text changed and the documents were not
    rendered again (`python -m benchmarks.performance_report`)."""
    assert report.main(["--check"]) == 0


def test_documents_stay_short() -> None:
    rendered = report.render()
    assert len(rendered[report.PERFORMANCE].splitlines()) <= MAX_PERFORMANCE_LINES
    assert len(rendered[report.README].splitlines()) <= 200


def test_every_table_names_its_source() -> None:
    """Each result file the report reads is linked, with a card, a date and a commit."""
    text = report.render()[report.PERFORMANCE]
    for path in report.RESULTS.glob("*.json"):
        if path.name != "provenance.json":
            assert f"(results/{path.name})" in text, path.name
    for line in text.splitlines():
        if line.startswith("Card: "):
            assert "not recorded" not in line, line
            assert "Commit: `" in line and "Date: 20" in line, line


def _target_row(text: str, name: str) -> str:
    (row,) = [line for line in text.splitlines() if line.startswith(f"| {name}")]
    return row


def test_verdicts_follow_the_results(tmp_path: Path) -> None:
    """A verdict is computed from the numbers: a faster row flips a missed target."""
    results = tmp_path / "results"
    shutil.copytree(report.RESULTS, results)
    target = "decode, bf16 cache, one request of 64k, N = 128"
    before = report.render_performance(tables.Results(results))
    assert "**missed**" in _target_row(before, target)

    kernels = json.loads((results / "kernels_h200.json").read_text())
    for row in kernels["results"]:
        if (row["kernel"], row.get("cache"), row.get("B"), row.get("N"),
                row.get("context")) == ("mla_decode", "bf16", 1, 128, 65536):
            row["us"] = 39.0
    (results / "kernels_h200.json").write_text(json.dumps(kernels))
    after = report.render_performance(tables.Results(results))
    assert "**met**" in _target_row(after, target)
    assert "39.0 µs" in _target_row(after, target)


def test_span_and_table_formatting() -> None:
    assert tables.span([98.2, 91.4, 94.0], 0, "%") == "91-98%"
    assert tables.span([1.8], 2, "x") == "1.80x"
    assert tables.span([]) == "none measured"
    assert tables.size(131072) == "128k" and tables.size(1088) == "1088"
    assert tables.table(["a", "b"], [["x", "1"]]) == ["| a | b |", "|---|---:|", "| x | 1 |"]
    assert report.verdict([True, False, True]) == "**met on 2 of 3**"


def test_commands_run_in_this_tree() -> None:
    """Each table's command names a benchmark module of this tree and only flags it takes
    (a one-off script, named as such, excepted)."""
    text = report.render()[report.PERFORMANCE]
    commands = re.findall(r"Command: `([^`]+)`", text)
    assert commands
    for command in commands:
        if command.startswith("one-off"):
            continue
        match = re.fullmatch(r"python -m benchmarks\.(\w+)((?: \S+)*)", command)
        assert match, command
        source = (report.ROOT / "benchmarks" / f"{match[1]}.py").read_text()
        for flag in re.findall(r"(?<!\S)--[\w-]+", match[2]):
            assert f'"{flag}"' in source, (command, flag)


# -- the fp8 and DeepSeek-V3 sections, from synthetic result files ------------------------

GEMM_SHAPES = {"q_a": (1536, 7168), "kv_a": (576, 7168), "q_b": (24576, 1536),
               "o_proj": (7168, 16384), "mlp_gate_up": (36864, 7168),
               "mlp_down": (7168, 18432), "expert_gate_up": (4096, 7168),
               "expert_down": (7168, 2048)}


def _gemm_row(shape: str, M: int, read: float, vs_bf16: float, vs_smm: float | None) -> dict:
    N, K = GEMM_SHAPES[shape]
    us = N * K / (read * 4.8e6)
    row = {"shape": shape, "M": M, "N": N, "K": K, "us": us, "weight_gbps": read * 4800,
           "read_fraction": read, "tflops": 2 * M * N * K / us / 1e6, "vs_bf16": vs_bf16,
           "bf16_tflops": 2 * M * N * K / us / 1e6 / vs_bf16, "scaled_mm_us": None}
    if vs_smm is not None:
        row.update(vs_scaled_mm=vs_smm, scaled_mm_us=us * vs_smm,
                   scaled_mm_tflops=row["tflops"] / vs_smm)
    return row


def _synthetic_fp8_results(results: Path) -> None:
    """Result files of the fp8 benchmarks' schemas, with made-up numbers: every target
    met but q_a at M 1 (80% read) and mlp_down at M 8192 (0.85x scaled_mm)."""
    rows = []
    for shape in GEMM_SHAPES:
        for M in (1, 16, 64, 256, 2048, 8192):
            read = 0.80 if (shape, M) == ("q_a", 1) else 0.9
            smm = 0.85 if (shape, M) == ("mlp_down", 8192) else 0.95
            rows.append(_gemm_row(shape, M, read, 1.8, None if M == 1 else smm))
    ceilings = {"hbm_read_tbps": 4.8, "bf16_matmul_tflops": 700.0}
    (results / report.FP8_GEMM).write_text(json.dumps(
        {"gpu": "NVIDIA H200", "ceilings": ceilings, "results": rows}))
    moe = [{"shape": name, "E": E, "routed": 256, "k": 8, "H": 7168, "I": 2048, "T": T,
            "fp8_us": 100.0 + T, "bf16_us": 180.0 + T, "speedup": (180.0 + T) / (100.0 + T),
            "fp8_tbps": 4.0, "fp8_tflops": 10.0 * T, "bf16_tbps": 4.2, "bf16_tflops": 5.0 * T}
           for name, E in (("V3", 256), ("V3 TP8 share", 32))
           for T in (1, 8, 32, 128, 512, 2048, 8192)]
    (results / report.FP8_MOE).write_text(json.dumps(
        {"gpu": "NVIDIA H200", "ceilings": ceilings, "results": moe}))
    run = {"write_s": 60.0, "full": {"weight_gib": 33.0, "load_s": 20.0},
           "one_layer": {"weight_gib": 12.0, "load_s": 8.0}}
    v3 = {"gpu": "NVIDIA H200", "args": {"layers": 3, "prompt_len": 1024},
          "runs": {"fp8": {**run, "layer_weight_gib": 10.5,
                           "layer_step_ms": {"1": 0.2, "32": 0.4, "128": 0.8}},
                   "bf16": {**run, "layer_weight_gib": 21.0,
                            "layer_step_ms": {"1": 0.35, "32": 0.6, "128": 1.2}}}}
    (results / report.V3_LAYERS).write_text(json.dumps(v3))
    plan = json.loads((results / report.MEMORY_PLAN).read_text())
    plan["measured"] = {"source": report.V3_LAYERS, "gpu": "NVIDIA H200", "layers": 3,
                        "runs": {fmt: {"layer_step_ms": r["layer_step_ms"],
                                       "step_ms_61_layers_estimate": {
                                           b: 61 * ms for b, ms in r["layer_step_ms"].items()}}
                                 for fmt, r in v3["runs"].items()}}
    (results / report.MEMORY_PLAN).write_text(json.dumps(plan))
    provenance = json.loads((results / "provenance.json").read_text())
    for name, command in ((report.FP8_GEMM, "bench_fp8_gemm --out " + report.FP8_GEMM),
                          (report.FP8_MOE, "bench_moe --fp8 --out " + report.FP8_MOE),
                          (report.V3_LAYERS, "bench_v3_layers --out " + report.V3_LAYERS)):
        provenance[name] = {"card": "NVIDIA H200", "date": "2026-12-08", "commit": "0000000",
                            "command": f"python -m benchmarks.{command}"}
    (results / "provenance.json").write_text(json.dumps(provenance))


def test_fp8_sections_render_from_their_results(tmp_path: Path) -> None:
    """Absent result files leave their sections out; present ones render them, with the
    fp8 GEMM's verdicts computed from the rows in the targets' scopes."""
    results = tmp_path / "results"
    shutil.copytree(report.RESULTS, results)
    for name in (report.FP8_GEMM, report.FP8_MOE, report.V3_LAYERS):
        (results / name).unlink(missing_ok=True)
    before = report.render_performance(tables.Results(results))
    assert "## fp8 linear layers" not in before and "fp8 GEMM" not in before
    _synthetic_fp8_results(results)
    text = report.render_performance(tables.Results(results))
    for heading in ("## fp8 linear layers", "## fp8 routed experts",
                    "## DeepSeek-V3 layers, fp8 against bf16",
                    "## DeepSeek-V3/R1 on one node: the memory plan"):
        assert heading in text
    read = _target_row(text, "fp8 GEMM (128 × 128 blocks)")
    assert "**met on 23 of 24**" in read and "q_a M 1 (80%)" in read
    compute = _target_row(text, "fp8 GEMM, same shapes, M ≥ 2048")
    assert "**met on 15 of 16**" in compute and "mlp_down M 8192 (1.80x, 0.85x)" in compute
    assert "**2.9 µs, 80%**" in text  # q_a M 1: 1536 * 7168 B at 0.8 * 4.8 TB/s, bold
    assert "fp8 weights take 50% of bf16's memory" in text
    assert "1.75x, 1.50x, 1.50x as fast" in text
    assert "| fp8 | 12.2 | 24.4 | 48.8 |" in text  # 61 x the per-layer ms
    assert len(text.splitlines()) <= MAX_PERFORMANCE_LINES
    for path in results.glob("*.json"):
        if path.name != "provenance.json":
            assert f"(results/{path.name})" in text, path.name


def test_engine_modes_render_against_the_default(tmp_path: Path) -> None:
    """bench_engine's compile and batch-invariant modes, each step time over the default
    mode's of the same run."""
    results = tmp_path / "results"
    shutil.copytree(report.RESULTS, results)
    for name in report.ENGINE_MODES:
        (results / name).unlink(missing_ok=True)
    assert "### torch.compile" not in report.render_performance(tables.Results(results))

    def run(step: float, mixed: float) -> dict:
        return {"step_ms": step, "mixed_step_ms": mixed, "startup_s": 9.0}

    modes = {"gpu": "NVIDIA H200", "args": {"batch": 128},
             "runs": {"cuda_graphs_async": run(3.0, 6.0), "compiled_async": run(2.4, 7.5),
                      "invariant_async": run(6.0, 18.0)}}
    (results / report.ENGINE_MODES[0]).write_text(json.dumps(modes))
    text = report.render_performance(tables.Results(results))
    assert "### torch.compile and batch invariance" in text
    assert "| `compile=True`, async scheduling | 2.40 | 0.80x | 7.50 | 1.25x | 9.0 |" in text
    assert "| `batch_invariant=True`, async scheduling | 6.00 | 2.00x | 18.00 | 3.00x |" in text


def test_output_quant_renders(tmp_path: Path) -> None:
    """bench_output_quant's rows: both ways' times and the time saved."""
    results = tmp_path / "results"
    shutil.copytree(report.RESULTS, results)
    for name in report.OUTPUT_QUANT:
        (results / name).unlink(missing_ok=True)
    assert "in fp8 for o_proj" not in report.render_performance(tables.Results(results))
    row = {"kind": "prefill + context", "T": 16384, "N": 128, "unfused_us": 1000.0,
           "fused_us": 800.0, "unfused_stage_us": 300.0, "fused_stage_us": 250.0,
           "saved_us": 200.0}
    (results / report.OUTPUT_QUANT[1]).write_text(json.dumps(
        {"gpu": "NVIDIA H100 80GB HBM3", "date": "2026-12-08", "commit": "0000000",
         "results": [row]}))
    text = report.render_performance(tables.Results(results))
    assert "### The attention output in fp8 for o_proj" in text
    assert "| prefill + context, T 16,384 | 300.0 / 250.0 | 1,000.0 / 800.0 | 200.0 (20%) |" \
        in text

"""The tables of docs/PERFORMANCE.md on block-fp8 weights and DeepSeek-V3/R1 at real size:
the fp8 GEMM (`bench_fp8_gemm`), the fp8 routed experts (`bench_moe --fp8`), DeepSeek-V3
layers (`bench_v3_layers`) and the 61-layer model's memory plan (`memory_plan`).

Each function takes a loaded result file and returns markdown lines, as
`performance_tables` does. Standard library only.
"""

from __future__ import annotations

from collections.abc import Callable

from benchmarks.performance_tables import num, pct, table, times

READ_TARGET, BF16_TARGET, SCALED_MM_TARGET = 0.85, 1.6, 0.9  # the issue's, as bench_fp8_gemm


# -- fp8 GEMM ----------------------------------------------------------------------------

def gemm_read_bound(row: dict) -> bool:
    """A row of the weight-read-bound target's scope (M <= 64)."""
    return row["M"] <= 64


def gemm_compute_bound(row: dict) -> bool:
    """A row of the compute-bound target's scope (M >= 2048)."""
    return row["M"] >= 2048


def gemm_read_ok(row: dict) -> bool:
    return row["read_fraction"] >= READ_TARGET


def gemm_compute_ok(row: dict) -> bool:
    return (row["vs_bf16"] >= BF16_TARGET
            and (row.get("vs_scaled_mm") or 0.0) >= SCALED_MM_TARGET)


def gemm_label(row: dict) -> str:
    return f"{row['shape']} M {row['M']}"


def _bold(text: str, missed: bool) -> str:
    return f"**{text}**" if missed else text


def _grid(gemm: dict, rows: list[dict], cell: Callable[[dict], str]) -> list[list[str]]:
    """One line per shape (in the file's order), one cell per M of `rows`."""
    tokens = sorted({r["M"] for r in rows})
    by = {(r["shape"], r["M"]): r for r in rows}
    shapes = list(dict.fromkeys(r["shape"] for r in gemm["results"]))
    out = []
    for shape in shapes:
        found = [r for r in rows if r["shape"] == shape]
        if found:
            r0 = found[0]
            out.append([f"{shape} ({r0['N']} × {r0['K']})",
                        *(cell(by[shape, m]) if (shape, m) in by else "" for m in tokens)])
    return out


def gemm_table(gemm: dict) -> list[str]:
    """One grid of shapes by M: time and the weight's read rate for M <= 64, TFLOP/s and
    the ratios to both baselines above; bold where a row misses its target."""
    results = gemm["results"]

    def cell(r: dict) -> str:
        if r["M"] <= 64:
            return _bold(f"{num(r['us'])} µs, {pct(100 * r['read_fraction'])}",
                         not gemm_read_ok(r))
        text = f"{num(r['tflops'], 0)}, {times(r['vs_bf16'])}"
        text += f", {times(r['vs_scaled_mm'])}" if r.get("vs_scaled_mm") else ", n/a"
        return _bold(text, gemm_compute_bound(r) and not gemm_compute_ok(r))

    if not results:
        return []
    header = [f"M {m}: µs, % HBM read" if m <= 64 else f"M {m}: TFLOP/s, vs bf16, vs scaled_mm"
              for m in sorted({r["M"] for r in results})]
    return table(["shape (N × K)", *header], _grid(gemm, results, cell))


def gemm_ceilings(gemm: dict) -> str:
    ceil = gemm["ceilings"]
    return (f"Ceilings measured in this run: HBM read {num(ceil['hbm_read_tbps'], 2)} TB/s, "
            f"bf16 matmul {num(ceil['bf16_matmul_tflops'], 0)} TFLOP/s.")


# -- fp8 routed experts ------------------------------------------------------------------

def fp8_experts_table(moe: dict) -> list[str]:
    """Token counts by expert set: fp8 and bf16 fused experts, the fp8 speed-up, and the
    fp8 run's rates."""
    read = moe["ceilings"]["hbm_read_tbps"]
    shapes = list(dict.fromkeys(r["shape"] for r in moe["results"]))
    by = {(r["shape"], r["T"]): r for r in moe["results"]}
    header = ["tokens"]
    for shape in shapes:
        r = next(r for r in moe["results"] if r["shape"] == shape)
        local = f"{r['E']} of {r['routed']}" if r["E"] != r["routed"] else str(r["E"])
        header += [f"{shape} ({local} experts): fp8 µs", "bf16 µs", "fp8 speed-up",
                   "fp8 % HBM read", "fp8 TFLOP/s"]
    rows = []
    for T in sorted({r["T"] for r in moe["results"]}):
        line = [str(T)]
        for shape in shapes:
            r = by.get((shape, T))
            line += ["", "", "", "", ""] if r is None else [
                num(r["fp8_us"]), num(r["bf16_us"]), times(r["speedup"]),
                pct(100 * r["fp8_tbps"] / read), num(r["fp8_tflops"], 0)]
        rows.append(line)
    return table(header, rows, left=1)


# -- DeepSeek-V3 layers ------------------------------------------------------------------

def _by_batch(values: dict) -> dict[int, float]:
    """{"1": ms, ...} (JSON keys) -> {1: ms, ...}."""
    return {int(b): v for b, v in values.items()}


def v3_layers_table(v3: dict) -> list[str]:
    runs = v3["runs"]
    batches = sorted(_by_batch(next(iter(runs.values()))["layer_step_ms"]))
    rows = []
    for fmt, r in runs.items():
        steps = _by_batch(r["layer_step_ms"])
        rows.append([fmt, num(r["full"]["load_s"]), num(r["full"]["weight_gib"], 2),
                     num(r["layer_weight_gib"], 3), *(num(steps[b], 3) for b in batches)])
    header = ["weights", "load s", f"weights GiB ({v3['args']['layers']} layers)",
              "GiB per layer", *(f"ms per layer, batch {b}" for b in batches)]
    out = table(header, rows)
    if "fp8" in runs and "bf16" in runs:
        fp8, bf16 = runs["fp8"], runs["bf16"]
        a, b = _by_batch(fp8["layer_step_ms"]), _by_batch(bf16["layer_step_ms"])
        out += ["", f"Per layer, the fp8 weights take "
                f"{pct(100 * fp8['layer_weight_gib'] / bf16['layer_weight_gib'])} of bf16's "
                f"memory, and a decode step runs "
                f"{', '.join(times(b[n] / a[n]) for n in batches)} as fast as bf16's at "
                f"batch {', '.join(str(n) for n in batches)}."]
    return out


# -- the memory plan ---------------------------------------------------------------------

def _tokens(kv: dict, key: str) -> str:
    return f"{kv[key]:,}" if kv["fits"] else ""


def memory_plan_table(plan: dict) -> list[str]:
    caches = list(plan["kv_bytes_per_token"])
    dcp = plan["dcp"]
    header = ["node", "weights", "weights GiB per GPU"]
    for cache in caches:
        header += [f"{cache} cache: tokens per GPU", "node, no DCP", f"node, DCP {dcp}"]
    rows = []
    for p in plan["plans"]:
        line = [p["card"], p["weights"], num(p["weight_gib"], 2)]
        for cache in caches:
            kv = p["cache"][cache]
            if kv["fits"]:
                line += [_tokens(kv, "tokens"), _tokens(kv, "node_tokens"),
                         _tokens(kv, "node_tokens_dcp")]
            else:
                line += [f"does not fit: {num(kv['missing_gib'], 2)} GiB missing "
                         f"({num(kv['missing_gib_whole_card'], 2)} at utilization 1.0)", "", ""]
        rows.append(line)
    return table(header, rows, left=2)


def sparse_memory_lines(plan: dict) -> list[str]:
    """The sparse-attention models' rows of the plan (absent in older plans: none)."""
    rows = plan.get("sparse")
    if not rows:
        return []
    lines = []
    for r in rows:
        kv = r["cache"]
        room = (f"{kv['tokens']:,}" if kv["fits"]
                else f"does not fit: {num(kv['missing_gib'], 2)} GiB missing")
        lines.append([r["model"], r["card"], num(r["weight_gib"], 2),
                      f"{r['latent_bytes_per_token']:,} + {r['index_bytes_per_token']:,}",
                      room])
    header = ["model", "node", "fp8 weights GiB per GPU",
              "bytes per token (latents + indexer keys)", "tokens per GPU (= node)"]
    return ["The sparse-attention models as served: block-fp8 weights, the fp8_ds_mla "
            "cache and fp8 indexer keys, tensor parallel 8 without decode context "
            "parallelism (they refuse it), so the node holds what one GPU holds.", "",
            *table(header, lines, left=2)]


def memory_plan_inputs(plan: dict) -> str:
    per_token = ", ".join(f"{cache} {n:,} B" for cache, n in plan["kv_bytes_per_token"].items())
    ranks = {fmt: f"{min(g):.3f}-{max(g):.3f}" if min(g) != max(g) else f"{g[0]:.3f}"
             for fmt, g in plan["weight_gib_by_rank"].items()}
    return (f"Tensor parallel {plan['tensor_parallel']}, {plan['block_size']}-token blocks, "
            f"gpu_memory_utilization {plan['gpu_memory_utilization']}, a "
            f"{plan['model_dtype']} model. A token's latent over {plan['layers']} layers: "
            f"{per_token}. The chunked-prefill workspace: {plan['workspace_rows']:,} rows, "
            f"{num(plan['workspace_gib'], 2)} GiB. Weights per rank (GiB): "
            + "; ".join(f"{fmt} {r}" for fmt, r in ranks.items()) + ".")


def measured_lines(plan: dict) -> list[str]:
    """The check against a measurement, and the step-time extrapolation, when the plan
    was made with --measured."""
    measured = plan.get("measured")
    if not measured:
        return ["Not yet checked against a measurement: `--measured` with a "
                "`bench_v3_layers` result compares the count with the GiB the engine "
                "reported on a GPU."]
    runs = measured["runs"]
    out = [f"Checked against [{measured['source']}](results/{measured['source']}) "
           f"({measured['gpu']}, one GPU, TP 1): the same count for its "
           f"{measured['layers']}-layer and 1-layer models equals the weight GiB the engine "
           f"reported there ({', '.join(runs)}), to 1e-6 GiB.",
           f"Step time, extrapolated: {plan['layers']} × the decode ms per MoE layer "
           "measured on one GPU at TP 1 (all 256 experts and 128 heads on the card). Not a "
           "multi-GPU measurement: at TP 8 a rank runs 16 heads and 32 experts per layer, "
           "plus two all-reduces, and the 3 dense layers are counted as MoE layers.", ""]
    batches = sorted(_by_batch(next(iter(runs.values()))["step_ms_61_layers_estimate"]))
    rows = [[fmt, *(num(_by_batch(r["step_ms_61_layers_estimate"])[b], 1) for b in batches)]
            for fmt, r in runs.items()]
    return out + table(["weights", *(f"ms per step, batch {b}" for b in batches)], rows)

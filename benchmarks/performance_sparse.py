"""The tables of docs/PERFORMANCE.md on sparse attention (DeepSeek-V3.2, GLM-5): the
sparse kernel's decode and prefill (`bench_sparse`, `bench_sparse --prefill`) and the
lightning indexer (`bench_indexer`), and the measurements behind their targets.

Each table function takes a loaded result file and returns markdown lines, as
`performance_tables` does; each target function returns the measured text and, per row
in the target's scope, whether it meets the bound (`performance_report` turns those into
a verdict). Standard library only.
"""

from __future__ import annotations

from benchmarks.performance_tables import num, pct, size, span, table, times

DECODE_TFLOPS = 400.0  # sparse decode at N = 128
GATHER_PCT = 70.0  # sparse decode at N = 16: % of a plain gather of the same rows
PREFILL_RATIO = 0.8  # sparse prefill's TFLOP/s over the dense prefill's (bench_sparse's)


# -- the sparse kernel -------------------------------------------------------------------

def decode_rows(sparse: dict) -> list[dict]:
    return [r for r in sparse["results"]
            if r["kernel"] == "sparse_attention" and r.get("mode", "decode") == "decode"]


def prefill_rows(sparse: dict) -> list[dict]:
    return [r for r in sparse["results"]
            if r["kernel"] == "sparse_attention" and r.get("mode") == "prefill"]


def decode_label(row: dict) -> str:
    return f"{row['cache']}, B {row['B']}, q_len {row['q_len']}"


def prefill_label(row: dict) -> str:
    return f"{row['cache']}, S {size(row['S'])}, C {size(row['C'])}, N {row['N']}"


def decode_table(sparse: dict) -> list[str]:
    """One line per cache, B and q_len (the rows gathered, so the plain gathers' times),
    one group of columns per N."""
    rows = decode_rows(sparse)
    heads = list(dict.fromkeys(r["N"] for r in rows))
    by = {(r["cache"], r["B"], r["q_len"], r["N"]): r for r in rows}
    lines = []
    for cache, batch, q_len in dict.fromkeys((r["cache"], r["B"], r["q_len"]) for r in rows):
        r0 = next(r for r in rows if (r["cache"], r["B"], r["q_len"]) == (cache, batch, q_len))
        line = [cache, str(batch), str(q_len), num(r0["gather_read_us"]),
                num(r0["index_select_us"])]
        for n in heads:
            r = by.get((cache, batch, q_len, n))
            line += ["", "", "", ""] if r is None else [
                num(r["us"]), num(r["tflops"], 0), num(r["tbps"], 2), pct(r["pct_of_gather"])]
        lines.append(line)
    header = ["cache", "B", "q_len", "gather read µs", "index_select µs"]
    for n in heads:
        header += [f"N {n}: µs", "TFLOP/s", "TB/s of rows", "% of gather"]
    return table(header, lines)


def prefill_table(sparse: dict) -> list[str]:
    """One line per S, C and N (the dense prefill's shape is S and N), one group of
    columns per cache."""
    rows = prefill_rows(sparse)
    caches = list(dict.fromkeys(r["cache"] for r in rows))
    by = {(r["S"], r["C"], r["N"], r["cache"]): r for r in rows}
    lines = []
    for tokens, context, heads in dict.fromkeys((r["S"], r["C"], r["N"]) for r in rows):
        r0 = next(r for r in rows if (r["S"], r["C"], r["N"]) == (tokens, context, heads))
        line = [str(tokens), str(context), str(heads), num(r0["dense_us"], 0),
                num(r0["dense_tflops"], 0)]
        for cache in caches:
            r = by.get((tokens, context, heads, cache))
            line += ["", "", ""] if r is None else [
                num(r["us"], 0), num(r["tflops"], 0), times(r["ratio"])]
        lines.append(line)
    header = ["S", "C", "N", "dense µs", "dense TFLOP/s"]
    for cache in caches:
        header += [f"{cache}: µs", "TFLOP/s", "ratio"]
    return table(header, lines, left=0)


def decode_tflops(sparse: dict) -> tuple[str, list[bool]]:
    """Every N = 128 decode row's TFLOP/s against DECODE_TFLOPS."""
    rows = [r for r in decode_rows(sparse) if r["N"] == 128]
    return ("; ".join(f"{decode_label(r)}: {num(r['tflops'], 0)}" for r in rows),
            [r["tflops"] >= DECODE_TFLOPS for r in rows])


def decode_gather(sparse: dict) -> tuple[str, list[bool]]:
    """Every N = 16 decode row's rate over the faster plain gather's, against GATHER_PCT."""
    rows = [r for r in decode_rows(sparse) if r["N"] == 16]
    return ("; ".join(f"{decode_label(r)}: {pct(r['pct_of_gather'])}" for r in rows),
            [r["pct_of_gather"] >= GATHER_PCT for r in rows])


def prefill_ratio(sparse: dict) -> tuple[str, list[bool]]:
    """Every prefill row's TFLOP/s over the dense prefill's, against PREFILL_RATIO."""
    rows = prefill_rows(sparse)
    return ("; ".join(f"{prefill_label(r)}: {times(r['ratio'])}" for r in rows),
            [r["ratio"] >= PREFILL_RATIO for r in rows])


# -- the lightning indexer ---------------------------------------------------------------

def indexer_label(row: dict) -> str:
    """"decode, 64 × 64k", "prefill, 1 × 16k": the case, requests × positions."""
    return f"{row['case'].split('_')[0]}, {row['requests']} × {size(row['positions'])}"


def indexer_met(row: dict) -> bool:
    return row["total_ms"] <= row["target_ms"]


def indexer_table(indexer: dict) -> list[str]:
    rows = []
    for r in indexer["results"]:
        read = r.get("key_read_fraction")
        rows.append([indexer_label(r), str(r["tokens"]), str(r["chunk_rows"]),
                     num(r["prepare_ms"], 3), num(r["logits_ms"], 3), num(r["topk_ms"], 3),
                     num(r["total_ms"], 3), num(r["target_ms"], 2),
                     pct(100 * read) if read is not None else "",
                     num(r["logits_tflops"], 0), "met" if indexer_met(r) else "missed"])
    return table(["case", "tokens", "chunk rows", "prepare ms", "logits ms", "topk ms",
                  "total ms", "target ms", "key read % HBM", "logits TFLOP/s", "verdict"],
                 rows)


def indexer_totals(indexer: dict) -> tuple[str, list[bool]]:
    """Each case's total against its target, and the parts that explain a miss: the
    query preparation and torch.topk around the logits kernel, and the kernel's rates."""
    rows = indexer["results"]
    reads = [100 * r["key_read_fraction"] for r in rows if "key_read_fraction" in r]
    rates = [r["logits_tflops"] for r in rows if "key_read_fraction" not in r]
    measured = "; ".join(f"{indexer_label(r)}: {num(r['total_ms'], 3)} ms" for r in rows)
    measured += (f" (per chunk: preparation {span([r['prepare_ms'] for r in rows], 2)} ms, "
                 f"torch.topk {span([r['topk_ms'] for r in rows], 2)} ms; the logits kernel "
                 f"reads keys at {span(reads, 0, '%')} of HBM in decode, "
                 f"{span(rates)} TFLOP/s in prefill)")
    return measured, [indexer_met(r) for r in rows]

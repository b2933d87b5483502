"""The start-up tables of docs/PERFORMANCE.md (`bench_startup`, with an empty and then a
filled on-disk compile cache) and the measurements behind their targets.

As in `performance_sparse`: table functions return markdown lines, target functions the
measured text and, per row in scope, whether it meets the bound. Standard library only.
"""

from __future__ import annotations

from benchmarks.performance_tables import num, table, times

FIRST_CALL_RATIO = 1.2  # the first generate after LLM(...) over the same call later
WARM_START_S = 15.0  # LLM(...) with the compiled kernels on disk
# LLM(...)'s phases in the table; kv_scales: an fp8 cache's calibration prefill, where the
# checkpoint ships no scales (empty where it did not run).
PHASES = ("load", "kv_scales", "graphs", "warmup")


def _runs(result: dict) -> list[tuple[str, str, dict]]:
    """(cache, workload, its runs) of one bench_startup result."""
    return [(cache, name, run) for cache in result["args"]["caches"]
            for name, run in result[cache]["workloads"].items()]


def phases_table(cold: dict, warm: dict) -> list[str]:
    rows = []
    for label, result in (("empty", cold), ("filled", warm)):
        for cache in result["args"]["caches"]:
            r = result[cache]
            rows.append([label, cache, num(r["start_s"]),
                         *(num(r["phases"].get(p)) for p in PHASES),
                         str(r["start_compiles"])])
    return table(["compile cache", "KV cache", "LLM(...) s", "load", "fp8 scales", "graphs",
                  "warm-up", "kernel variants"], rows, left=2)


def first_call_table(cold: dict, warm: dict) -> list[str]:
    """One row per workload, one group of columns per run (compile cache, KV cache): the
    first call, the later one, their ratio and the kernel variants each built; a column
    names the kernels built in any of them."""
    results = (("empty", cold), ("filled", warm))
    runs = [(label, cache) for label, result in results for cache in result["args"]["caches"]]
    by = {(label, cache, name): run for label, result in results
          for cache, name, run in _runs(result)}
    rows = []
    for name in dict.fromkeys(name for _, _, name in by):
        cells: list[str] = []
        kernels: set[str] = set()
        for label, cache in runs:
            run = by.get((label, cache, name))
            if run is None:
                cells += ["", "", "", ""]
                continue
            built = [sum(calls.values()) for calls in run["compiled"]]
            kernels.update(k for calls in run["compiled"] for k in calls)
            cells += [num(run["first_s"], 3), num(run["steady_s"], 3), times(run["ratio"]),
                      f"{built[0]} / {sum(built[1:])}"]
        rows.append([name, ", ".join(f"`{k}`" for k in sorted(kernels)), *cells])
    header = ["workload", "kernels built"]
    for label, cache in runs:
        header += [f"{label}, {cache}: first s", "later s", "ratio", "built: first / later"]
    return table(header, rows, left=2)


def first_call(cold: dict, warm: dict) -> tuple[str, list[bool]]:
    ratios = [(label, run["ratio"]) for label, result in (("empty", cold), ("filled", warm))
              for _, _, run in _runs(result)]
    passes = [ratio <= FIRST_CALL_RATIO for _, ratio in ratios]
    worst = {label: max(r for lab, r in ratios if lab == label) for label, _ in ratios}
    return (f"worst {times(worst['empty'])} (empty compile cache), "
            f"{times(worst['filled'])} (filled)"), passes


def warm_start(warm: dict) -> tuple[str, list[bool]]:
    seconds = [warm[cache]["start_s"] for cache in warm["args"]["caches"]]
    return (f"{num(max(seconds))} s on {warm['device']}",
            [s <= WARM_START_S for s in seconds])

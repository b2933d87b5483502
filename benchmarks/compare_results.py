"""Two `bench_kernels` results compared row by row.

    python -m benchmarks.compare_results OLD.json NEW.json [--tolerance 0.03] [--field us]

Rows (decode, merge, prefill) are matched by their shape keys: the kernel, then cache,
B, N, context, lengths, q_len and page for decode; T, N and D for merge; the shape's
label, N, qk, v and causal for prefill. One table shows each row's old and new time and
their ratio new / old. The exit status is 1 where any matched row's ratio is off 1 by
more than the tolerance (either way), where a row has no partner in the other file or
its fields differ (the results' schema changed), or where the two runs report
different kernel configs; else 0. Compare only runs made on the same card, one after
the other on one machine.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

# The fields that identify a row, in the order its label shows them.
KEY_FIELDS = ("kernel", "shape", "cache", "B", "N", "context", "lengths", "q_len", "page", "T",
              "D", "qk", "v", "causal")
# Top-level fields that describe the kernels' choices and must agree.
CHOICE_FIELDS = ("configs", "decode_regimes")

RowKey = tuple[tuple[str, object], ...]


def row_key(row: dict) -> RowKey:
    """The row's identifying (field, value) pairs, those of KEY_FIELDS it has."""
    return tuple((name, row[name]) for name in KEY_FIELDS if name in row)


def row_label(key: RowKey) -> str:
    """A short text for a row key: the kernel's name, then name=value pairs."""
    values = dict(key)
    kernel = values.pop("kernel", "?")
    return " ".join([str(kernel), *(f"{k}={v}" for k, v in values.items())])


@dataclass
class Comparison:
    """What `compare` found; `failed` says whether the exit status is 1."""

    rows: list[tuple[str, float, float, float, bool]] = field(default_factory=list)
    only_old: list[str] = field(default_factory=list)
    only_new: list[str] = field(default_factory=list)
    schema: list[str] = field(default_factory=list)

    @property
    def outside(self) -> int:
        """Matched rows whose ratio is outside the tolerance."""
        return sum(1 for *_, out in self.rows if out)

    @property
    def failed(self) -> bool:
        return bool(self.outside or self.only_old or self.only_new or self.schema)


def match_rows(old: Sequence[dict], new: Sequence[dict]
               ) -> tuple[list[tuple[dict, dict]], list[dict], list[dict]]:
    """(pairs of old and new rows with the same key, in the old file's order; old rows
    without a partner; new rows without one). A key that appears twice in one file is
    an error."""
    for rows, name in ((old, "old"), (new, "new")):
        keys = [row_key(r) for r in rows]
        if len(set(keys)) != len(keys):
            dup = next(k for k in keys if keys.count(k) > 1)
            raise ValueError(f"{name} results: two rows for {row_label(dup)}")
    by_key = {row_key(r): r for r in new}
    pairs = [(r, by_key[row_key(r)]) for r in old if row_key(r) in by_key]
    old_keys = {row_key(r) for r in old}
    return (pairs, [r for r in old if row_key(r) not in by_key],
            [r for r in new if row_key(r) not in old_keys])


def compare(old: dict, new: dict, tolerance: float = 0.03, metric: str = "us") -> Comparison:
    """Match the `results` rows of two reports and compare their `metric` (a time)."""
    result = Comparison()
    pairs, only_old, only_new = match_rows(old.get("results", []), new.get("results", []))
    result.only_old = [row_label(row_key(r)) for r in only_old]
    result.only_new = [row_label(row_key(r)) for r in only_new]
    for before, after in pairs:
        label = row_label(row_key(before))
        if set(before) != set(after):
            result.schema.append(f"{label}: fields differ "
                                 f"(old only {sorted(set(before) - set(after))}, "
                                 f"new only {sorted(set(after) - set(before))})")
        if not (before.get(metric) and after.get(metric)):
            continue  # a field this row does not measure (a missing baseline, say)
        ratio = after[metric] / before[metric]
        result.rows.append((label, before[metric], after[metric], ratio,
                            abs(ratio - 1) > tolerance))
    if set(old) != set(new):
        result.schema.append(f"report fields differ (old only {sorted(set(old) - set(new))}, "
                             f"new only {sorted(set(new) - set(old))})")
    result.schema += [f"{name} differ" for name in CHOICE_FIELDS
                      if name in old and name in new and old[name] != new[name]]
    return result


def render(result: Comparison, metric: str, tolerance: float) -> str:
    """The comparison as a markdown table and a verdict."""
    lines = [f"| row | old {metric} | new {metric} | new / old | |", "|---|---:|---:|---:|---|"]
    for label, before, after, ratio, out in result.rows:
        lines.append(f"| {label} | {before:.1f} | {after:.1f} | {ratio:.3f} "
                     f"| {'OUTSIDE' if out else ''} |")
    lines += [f"only in old: {label}" for label in result.only_old]
    lines += [f"only in new: {label}" for label in result.only_new]
    lines += result.schema
    verdict = "FAIL" if result.failed else "PASS"
    lines.append(f"{verdict}: {len(result.rows)} rows compared, {result.outside} outside "
                 f"{100 * tolerance:g}%, {len(result.only_old) + len(result.only_new)} "
                 f"unmatched, {len(result.schema)} schema differences")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", help="the baseline's bench_kernels JSON")
    parser.add_argument("new", help="the candidate's bench_kernels JSON")
    parser.add_argument("--tolerance", type=float, default=0.03,
                        help="largest accepted |new / old - 1| (default 0.03)")
    parser.add_argument("--field", default="us",
                        help="the row field to compare (default us; e.g. clean_l2_us)")
    args = parser.parse_args(argv)
    with open(args.old) as f:
        old = json.load(f)
    with open(args.new) as f:
        new = json.load(f)
    for name, report in (("old", old), ("new", new)):
        ceil = report.get("ceilings", {})
        print(f"{name}: {report.get('gpu')} commit {report.get('commit')} "
              f"kernels {report.get('kernel_sources_sha256')} {report.get('date')}; "
              f"HBM read {ceil.get('hbm_read_tbps', 0):.2f} TB/s, bf16 matmul "
              f"{ceil.get('bf16_matmul_tflops', 0):.0f} TFLOP/s")
    result = compare(old, new, args.tolerance, args.field)
    print(render(result, args.field, args.tolerance))
    return 1 if result.failed else 0


if __name__ == "__main__":
    sys.exit(main())

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


def test_documents_match_their_results() -> None:
    """Fails when a result file or the report's text changed and the documents were not
    rendered again (`python -m benchmarks.performance_report`)."""
    assert report.main(["--check"]) == 0


def test_documents_stay_short() -> None:
    rendered = report.render()
    assert len(rendered[report.PERFORMANCE].splitlines()) <= 400
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

"""The command line runs end to end on the CPU: generate, bench and check, as `pagedmla`
(`main`) and as `python -m pagedmla`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import pagedmla
from pagedmla.cli import build_parser, main


def test_generate_tiny(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--device", "cpu", "--max-tokens", "5", "--prompt", "hello",
                 "--prompt", "a longer prompt about latent attention"]) == 0
    out = capsys.readouterr().out
    assert out.count("completion:") == 2
    assert "prefill:" in out and "decode:" in out


def test_generate_fp8_cache_sampling(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--device", "cpu", "--max-tokens", "4", "--kv-cache-dtype", "fp8",
                 "--temperature", "0.7", "--top-p", "0.9", "--block-size", "4"]) == 0
    assert "completion:" in capsys.readouterr().out


def test_generate_prompts_file(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first\n\nsecond\n")
    assert main(["generate", "--device", "cpu", "--max-tokens", "2",
                 "--prompts-file", str(prompts)]) == 0
    assert capsys.readouterr().out.count("completion:") == 2


def test_bench_tiny(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--device", "cpu", "--num-requests", "6", "--input-len", "40",
                 "--output-len", "6", "--max-num-batched-tokens", "64"]) == 0
    out = capsys.readouterr().out
    assert "req/s" in out and "time to first token" in out


def test_check_passes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check"]) == 0
    out = capsys.readouterr().out
    assert out.count("PASS") == 2 and "continuation" in out


def _python_m_pagedmla(*args: str) -> subprocess.CompletedProcess[str]:
    """`python -m pagedmla *args` in a fresh interpreter, on this checkout's package."""
    source = str(Path(pagedmla.__file__).resolve().parents[1])
    env = {**os.environ, "COLUMNS": "80", "PYTHONPATH": os.pathsep.join(
        [source, *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run([sys.executable, "-m", "pagedmla", *args], capture_output=True,
                          text=True, env=env, timeout=300)


def test_python_m_help_is_the_command_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")  # help wraps at the terminal's width
    done = _python_m_pagedmla("--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout == build_parser().format_help()


def test_python_m_generate() -> None:
    done = _python_m_pagedmla("generate", "--device", "cpu", "--max-tokens", "2",
                              "--prompt", "hello")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("completion:") == 1


def test_bench_has_no_kernel_benchmarks(capsys: pytest.CaptureFixture[str]) -> None:
    # They are benchmarks/bench_kernels.py of the repository, not part of the package.
    with pytest.raises(SystemExit):
        main(["bench", "--kernels"])
    assert "unrecognized arguments: --kernels" in capsys.readouterr().err

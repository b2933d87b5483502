"""The command line runs end to end on the CPU: generate, bench and check, as `pagedmla`
(`main`) and as `python -m pagedmla`; bad flags and inputs are refused without a traceback."""

from __future__ import annotations

import codecs
import importlib.metadata
import os
import re
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


def test_check_reports_what_an_fp8_cache_clips(capsys: pytest.CaptureFixture[str]) -> None:
    """The batch's latents are N(0, 1) draws, largest about 4.8: scale 1 keeps them all;
    scale 0.004 (a range of 448 x 0.004 = 1.8) clips those past 1.8, about 7% of them."""
    assert main(["check", "--kv-cache-dtype", "fp8"]) == 0
    assert capsys.readouterr().out.count(", 0 values clipped (> 448 x scale)") == 2
    assert main(["check", "--kv-cache-dtype", "fp8", "--kv-cache-scale", "0.004"]) == 0
    found = re.findall(r"(\d+) values clipped \(> 448 x scale\) of (\d+)",
                       capsys.readouterr().out)
    assert len(found) == 2
    for clipped, written in found:
        assert 0.05 < int(clipped) / int(written) < 0.1


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


def _no_engine(*args: object, **kwargs: object) -> None:
    raise AssertionError("the engine was built for a command line that should be refused")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "--max-tokens", "0"], "argument --max-tokens: must be an integer >= 1"),
        (["generate", "--max-tokens", "-1"], "argument --max-tokens: must be an integer >= 1"),
        (["generate", "--max-tokens", "abc"], "argument --max-tokens: expected an integer"),
        (["generate", "--max-tokens", "2.5"], "argument --max-tokens: expected an integer"),
        (["generate", "--temperature", "-1"], "argument --temperature: must be a finite number"),
        (["generate", "--temperature", "nan"], "argument --temperature: must be a finite number"),
        (["generate", "--temperature", "inf"], "argument --temperature: must be a finite number"),
        (["generate", "--temperature", "hot"], "argument --temperature: expected a number"),
        (["generate", "--top-p", "0"], "argument --top-p: must be a number in (0, 1]"),
        (["generate", "--top-p", "2"], "argument --top-p: must be a number in (0, 1]"),
        (["generate", "--top-p", "nan"], "argument --top-p: must be a number in (0, 1]"),
        (["generate", "--top-k", "0"], "argument --top-k: must be -1 (off) or an integer >= 1"),
        (["generate", "--top-k", "-2"], "argument --top-k: must be -1 (off) or an integer >= 1"),
        (["bench", "--num-requests", "0"], "argument --num-requests: must be an integer >= 1"),
        (["bench", "--input-len", "0"], "argument --input-len: must be an integer >= 1"),
        (["bench", "--output-len", "0"], "argument --output-len: must be an integer >= 1"),
        (["check", "--device", "gpu0"], "argument --device: not a torch device: 'gpu0'"),
    ],
)
def test_bad_flag_values_are_usage_errors(
    argv: list[str], message: str, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr("pagedmla.cli.LLM", _no_engine)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: pagedmla ")
    assert message in err


def test_version(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"pagedmla {importlib.metadata.version('pagedmla')}\n"

    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert pagedmla.__version__ == "unknown"


def test_python_m_version() -> None:
    done = _python_m_pagedmla("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"pagedmla {pagedmla.__version__}\n"


def _prompts_of(path: Path) -> list[str]:
    return build_parser().parse_args(["generate", "--prompts-file", str(path)]).prompts_file


def test_prompts_file_drops_a_byte_order_mark(tmp_path: Path) -> None:
    path = tmp_path / "prompts.txt"
    path.write_bytes(codecs.BOM_UTF8 + "héllo\r\n\r\nworld\rform\x0cfeed\u2028kept\n".encode())
    assert _prompts_of(path) == ["héllo", "world", "form\x0cfeed\u2028kept"]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"fine\nbad \xff byte\n", "{path} is not UTF-8 text: byte 0xff at offset 9"),
        (codecs.BOM_UTF8 + b"\xe9t\xe9\n", "{path} is not UTF-8 text: byte 0xe9 at offset 3"),
        ("UTF-16".encode("utf-16"), "{path} is not UTF-8 text: byte 0xff at offset 0"),
        (None, "cannot read {path}: No such file or directory"),
    ],
)
def test_unreadable_prompts_file_is_a_usage_error(
    tmp_path: Path, data: bytes | None, message: str, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr("pagedmla.cli.LLM", _no_engine)
    path = tmp_path / "prompts.txt"
    if data is not None:
        path.write_bytes(data)
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--prompts-file", str(path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: pagedmla generate")
    assert f"argument --prompts-file: {message.format(path=path)}" in err


def _refused_by_engine(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The message of an input the engine refuses: printed without a traceback, status 2."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("pagedmla: error: ") and "Traceback" not in err
    return err


def test_engine_errors_are_printed_without_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nowhere"
    err = _refused_by_engine(["generate", "--device", "cpu", "--model", str(missing)], capsys)
    assert str(missing) in err
    (tmp_path / "config.json").write_text('{"model_type": ')
    err = _refused_by_engine(["bench", "--device", "cpu", "--model", str(tmp_path)], capsys)
    assert f"{tmp_path / 'config.json'} is not valid JSON" in err
    # Refused by generate(), after the model is built.
    err = _refused_by_engine(["generate", "--device", "cpu", "--max-model-len", "32",
                              "--prompt", "x" * 40], capsys)
    assert "max_model_len 32" in err


def test_bugs_keep_their_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr("pagedmla.cli.LLM", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["generate", "--device", "cpu"])

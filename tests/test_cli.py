"""The command line runs end to end on the CPU: generate, bench and check."""

from __future__ import annotations

import pytest

from pagedmla.cli import main


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

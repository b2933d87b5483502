"""Shared pytest setup."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton runs kernels on CPU tensors only in its interpreter, which it chooses when
    # a kernel is decorated (at import): set it before any test imports
    # pagedmla.ops.triton, so that the triton backend's tests run on CPU-only machines.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def v3_checkpoint(tmp_path_factory):
    """(a transformers DeepSeek-V3 of tests/tiny_hf.py's V3 options, its checkpoint
    directory as a str)."""
    from tests.tiny_hf import V3, make_hf_model, save_hf_checkpoint

    hf = make_hf_model("v3", **V3)
    return hf, str(save_hf_checkpoint(hf, tmp_path_factory.mktemp("v3")))

"""Shared pytest setup."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # Triton runs kernels on CPU tensors only in its interpreter, which it chooses when
    # a kernel is decorated (at import): set it before any test imports
    # pagedmla.ops.triton, so that the triton backend's tests run on CPU-only machines.
    os.environ.setdefault("TRITON_INTERPRET", "1")

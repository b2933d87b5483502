"""What an `LLM`'s start-up did: its phases' times, the kernels it compiled, and where
compiled kernels are kept across processes.

Triton compiles a kernel once per specialization (its constexprs, its arguments' dtypes,
whether an integer argument is 1 or a multiple of 16, pointer alignment) on first launch,
and keeps the binary in an on-disk cache (`TRITON_CACHE_DIR`, by default
~/.triton/cache), so a later process loads it instead of compiling it again.
`CompileLog` counts both: every specialization a process builds, from source or disk.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

CACHE_ENV = "TRITON_CACHE_DIR"


def use_compile_cache(directory: str | None) -> str:
    """Keep compiled kernels in `directory` (None: leave Triton's choice); returns the
    directory in use. Process-wide: Triton reads TRITON_CACHE_DIR at each compile."""
    if directory is not None:
        os.makedirs(directory, exist_ok=True)
        os.environ[CACHE_ENV] = os.path.abspath(directory)
    return os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("TRITON_HOME") or os.path.expanduser("~"), ".triton", "cache")


def _runtime_knobs() -> Any | None:
    """triton.knobs.runtime where Triton has it (3.4 and later), else None."""
    try:
        import triton
    except ImportError:
        return None
    knobs = getattr(triton, "knobs", None)
    return None if knobs is None else knobs.runtime


class CompileLog:
    """Counts, by kernel name, the Triton and Gluon kernel specializations built (compiled,
    or loaded from the on-disk cache) while it is entered. Counts nothing where Triton has
    no compile hook (before 3.4) or runs kernels in its interpreter."""

    def __init__(self) -> None:
        self.kernels: Counter[str] = Counter()
        self._knobs = _runtime_knobs()
        self._previous: Any = None

    @property
    def supported(self) -> bool:
        return self._knobs is not None

    def __enter__(self) -> CompileLog:
        if self._knobs is not None:
            self._previous = self._knobs.jit_cache_hook
            self._knobs.jit_cache_hook = self._hook
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._knobs is not None:
            self._knobs.jit_cache_hook = self._previous

    def _hook(self, *, fn: Any, **kwargs: Any) -> bool | None:
        self.kernels[fn.name] += 1
        # A hook returning True skips the compilation: defer to the one installed before.
        return self._previous(fn=fn, **kwargs) if self._previous is not None else False

    def take(self) -> Counter[str]:
        """The specializations counted since the last take, by kernel name."""
        kernels, self.kernels = self.kernels, Counter()
        return kernels


@dataclass
class StartupReport:
    """The phases of one `LLM(...)` in seconds, in order (load: plan and read the weights;
    kv_cache: allocate it; kv_scales: an fp8 cache's scales; graphs: capture the CUDA
    graphs; warmup: run every kernel variant once), the kernel specializations built in
    all (None where not counted), and the on-disk compile cache."""

    phases: dict[str, float] = field(default_factory=dict)
    kernels_built: int | None = None
    compile_cache_dir: str = ""

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = time.perf_counter() - start

    @property
    def total(self) -> float:
        return sum(self.phases.values())

    def __str__(self) -> str:
        parts = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.phases.items())
        built = "" if self.kernels_built is None else (
            f"; {self.kernels_built} kernel variants built")
        return (f"start-up {self.total:.1f} s ({parts}){built}; compiled kernels kept in "
                f"{self.compile_cache_dir}")

"""The package's version: the installed distribution's (pyproject.toml's), or "unknown"
when the package runs from a source tree that was never installed."""

from __future__ import annotations

import importlib.metadata


def package_version() -> str:
    try:
        return importlib.metadata.version("pagedmla")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"

"""Checks of user-given numbers and files shared by the public entry points."""

from __future__ import annotations

import json
import math
import numbers
from pathlib import Path
from typing import Any


def positive_finite(name: str, value: float) -> float:
    """`value` as a float; ValueError naming `name` unless it is finite and > 0."""
    value = float(value)
    if not (0.0 < value < math.inf):
        raise ValueError(f"{name} must be a finite positive number, got {value}")
    return value


def integer(name: str, value: object, minimum: int | None = None,
            maximum: int | None = None) -> int:
    """`value` as an int: TypeError naming `name` unless it is an integer (a bool, a float
    or a str is not), ValueError unless minimum <= value <= maximum (where given)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r} of type {type(value).__name__}")
    value = int(value)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        bounds = (f">= {minimum}" if maximum is None
                  else f"<= {maximum}" if minimum is None
                  else f"in [{minimum}, {maximum}]")
        raise ValueError(f"{name} must be an int {bounds}, got {value}")
    return value


def real(name: str, value: object) -> float:
    """`value` as a float; TypeError naming `name` unless it is a real number (a bool or
    a str is not). NaN and infinities pass: the caller states its range."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r} of type {type(value).__name__}")
    return float(value)


def boolean(name: str, value: object) -> bool:
    """`value` itself; TypeError naming `name` unless it is a bool."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r} of type {type(value).__name__}")
    return value


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in the file `path`; ValueError naming the file if it is anything
    else (not UTF-8, not JSON, or JSON but not an object)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from err
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data

"""Typed reads of config.json values: each raises ValueError naming the key."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


def required_int(d: Mapping[str, Any], key: str, minimum: int = 1) -> int:
    if d.get(key) is None:
        raise ValueError(f"missing required key {key!r}")
    return checked_int(key, d[key], minimum)


def optional_int(
    d: Mapping[str, Any], key: str, default: int | None, minimum: int = 1
) -> int | None:
    value = d.get(key)
    return default if value is None else checked_int(key, value, minimum)


def checked_int(key: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{key!r} must be an integer >= {minimum}, got {value!r}")
    return value


def positive_number(d: Mapping[str, Any], key: str, default: float | None) -> float | None:
    value = d.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ValueError(f"{key!r} must be a finite positive number, got {value!r}")
    return float(value)


def flag(d: Mapping[str, Any], key: str, default: bool) -> bool:
    value = d.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"{key!r} must be true or false, got {value!r}")
    return value

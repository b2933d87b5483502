"""Checks of user-given numbers shared by the public entry points."""

from __future__ import annotations

import math


def positive_finite(name: str, value: float) -> float:
    """`value` as a float; ValueError naming `name` unless it is finite and > 0."""
    value = float(value)
    if not (0.0 < value < math.inf):
        raise ValueError(f"{name} must be a finite positive number, got {value}")
    return value

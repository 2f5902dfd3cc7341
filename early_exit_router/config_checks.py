"""Validation helpers shared by `RouterConfig`'s field groups: each raises a ValueError that says what to use."""

from __future__ import annotations

import dataclasses
from typing import Any


def check_unit_interval(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and 0.0 <= value <= 1.0):
        raise ValueError(f"{name} must be in [0, 1], got {value!r}.")


def check_exit_layers(layers: list[int]) -> None:
    if any(e < 0 for e in layers):
        raise ValueError(f"Exit layers must be 0-based non-negative indices, got {layers}.")
    if len(set(layers)) != len(layers):
        raise ValueError(f"Exit layers contain duplicates: {layers}. List each layer once.")
    if layers != sorted(layers):
        raise ValueError(f"Exit layers must be sorted in increasing order, got {layers}; use {sorted(layers)}.")


def check_integers(config: Any, lowest: dict[str, int]) -> None:
    """Each named field must be an integer (not a bool) at or above its bound."""
    for name, low in lowest.items():
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}.")


def check_booleans(config: Any) -> None:
    """Every field annotated `bool` must hold True or False (a JSON or form "false" would otherwise count as true)."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.type in ("bool", bool) and not isinstance(value, bool):
            raise ValueError(f"{f.name} must be true or false, got {value!r}.")

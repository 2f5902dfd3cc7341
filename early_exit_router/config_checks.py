"""Validation helpers shared by `RouterConfig`'s field groups: each raises a ValueError that says what to use."""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any


def check_unit_interval(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and 0.0 <= value <= 1.0):
        raise ValueError(f"{name} must be in [0, 1], got {value!r}.")


def as_layers(name: str, value: Any) -> list[int]:
    """`value` as a list of layer indices: a list or tuple of integers (integral floats, as JSON may hold, pass);
    anything else (a string, one number, fractions) is refused rather than read as something else."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise ValueError(f"{name} must be a list of layer indices, e.g. [10, 20], got {value!r}.")
    layers = []
    for e in value:
        if isinstance(e, float) and e.is_integer():
            e = int(e)
        if not isinstance(e, numbers.Integral) or isinstance(e, bool):
            raise ValueError(f"{name} must be a list of layer indices, e.g. [10, 20], got {value!r}.")
        layers.append(int(e))
    return layers


def as_exit_adapters(value: Any, exit_layers: list[int] | None, kinds: Sequence[str]) -> dict[int, str]:
    """`exit_adapters` as {layer: adapter kind} in depth order (JSON's string keys back to indices); every layer it
    names must be an exit layer, every kind one of `kinds`."""
    if not isinstance(value, Mapping):
        raise ValueError(f"exit_adapters maps exit layers to adapters, e.g. {{16: 'block'}}, got {value!r}.")
    layers = as_layers("exit_adapters' layers", [int(e) if isinstance(e, str) and e.isdigit() else e for e in value])
    adapters = dict(sorted(zip(layers, value.values())))
    for e, kind in adapters.items():
        if kind not in kinds:
            raise ValueError(f"Unknown adapter {kind!r} for exit {e}: use one of {', '.join(kinds)}.")
    stray = sorted(set(adapters) - set(exit_layers or []))
    if stray:
        raise ValueError(
            f"exit_adapters names layers {stray} that are not exit layers {exit_layers}: give every layer it names "
            "in exit_layers too."
        )
    return adapters


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


def check_drafting(options: Any, choices: Mapping[str, Sequence[str]]) -> None:
    """`DraftingOptions`' fields: the named choices, the priors and the n-gram tier's sizes."""
    for name, allowed in choices.items():
        if getattr(options, name) not in allowed:
            raise ValueError(f"Unknown {name} {getattr(options, name)!r}: use one of {', '.join(allowed)}.")
    check_unit_interval("acceptance_prior", options.acceptance_prior)
    if options.exit_acceptance_prior is not None:
        check_unit_interval("exit_acceptance_prior", options.exit_acceptance_prior)
    check_integers(options, {"probe_interval": 0, "ngram_size": 2, "ngram_min_size": 1, "ngram_draft": 1,
                             "ngram_store_tokens": 0, "ngram_tree_nodes": 0, "exit_branches": 0})  # fmt: skip
    if options.ngram_min_size > options.ngram_size:
        raise ValueError(
            f"ngram_min_size ({options.ngram_min_size}) is above ngram_size ({options.ngram_size}): set min <= size."
        )


def check_cascade(options: Any) -> None:
    """`CascadeOptions`' fields: the thresholds, the entropy bound and the window rules."""
    if options.active_exit_layers is not None:
        options.active_exit_layers = as_layers("active_exit_layers", options.active_exit_layers)
    for name in ("high_conf_threshold", "low_conf_threshold", "gate_threshold", "window_min_confidence"):
        check_unit_interval(name, getattr(options, name))
    if options.low_conf_threshold > options.high_conf_threshold:
        raise ValueError(
            f"low_conf_threshold ({options.low_conf_threshold}) is above high_conf_threshold "
            f"({options.high_conf_threshold}): set low <= high."
        )
    if options.entropy_normalized:
        check_unit_interval("entropy_threshold (normalized)", options.entropy_threshold)
    elif not (options.entropy_threshold >= 0 and math.isfinite(options.entropy_threshold)):
        raise ValueError(f"entropy_threshold must be a finite number of nats >= 0, got {options.entropy_threshold}.")
    check_integers(options, {"block_size": 1, "max_pending": 1, "confidence_window": 0, "repeat_guard": 0})


def check_monitoring(options: Any) -> None:
    """`MonitoringOptions`' fields: the checks, the monitor, the quality target, the holdback and the controller."""
    for name in ("monitor_min_agreement", "check_fraction"):
        check_unit_interval(name, getattr(options, name))
    if options.target_agreement is not None:
        check_unit_interval("target_agreement", options.target_agreement)
        if not options.check_agreement or options.check_fraction == 0:
            raise ValueError(
                "target_agreement needs the exit checks to watch the output's quality: keep check_agreement "
                "and a check_fraction above 0, or set target_agreement=None to turn the quality target off."
            )
    held = options.holdback
    if held is not None and (not isinstance(held, int) or isinstance(held, bool) or held < 0):
        raise ValueError(f"holdback must be None (no unchecked token) or an integer >= 0, got {held!r}.")
    if not 0 < options.controller_step <= 1:
        raise ValueError(f"controller_step must be in (0, 1], got {options.controller_step!r}.")
    check_integers(options, {"monitor_window": 1, "controller_window": 1})


def check_booleans(config: Any) -> None:
    """Every field annotated `bool` must hold True or False (a JSON or form "false" would otherwise count as true)."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.type in ("bool", bool) and not isinstance(value, bool):
            raise ValueError(f"{f.name} must be true or false, got {value!r}.")


def split_config(config: Any, overrides: dict[str, Any], config_type: type) -> tuple[Any, dict[str, Any]]:
    """A `config` argument as (a `config_type` (RouterConfig) or None, field changes): a mapping of fields joins
    `overrides` (which win); anything else is refused with what to pass."""
    if config is None or isinstance(config, config_type):
        return config, overrides
    if isinstance(config, Mapping):
        return None, {**config, **overrides}
    raise TypeError(f"config must be a RouterConfig or a mapping of its fields, got {type(config).__name__}.")


def check_exit_depth(exit_layers: list[int], num_layers: int) -> None:
    """Raise a clear error when an exit layer does not fit a model with `num_layers` layers."""
    bad = [e for e in exit_layers if not 0 <= e < num_layers - 1]
    if bad:
        raise ValueError(
            f"Exit layers {bad} are out of range for a model with {num_layers} layers: use 0-based indices "
            f"from 0 to {num_layers - 2} (layer {num_layers - 1} is the full depth)."
        )


def check_active_subset(active: list[int] | None, exit_layers: list[int] | None) -> None:
    if active is not None and exit_layers is not None and not set(active) <= set(exit_layers):
        raise ValueError(f"active_exit_layers {active} must be a subset of exit_layers {exit_layers}.")


def check_saved_fields(data: Mapping[str, Any], names: Sequence[str]) -> None:
    """A saved config's field names that this version does not know raise a clear error."""
    if unknown := sorted(set(data) - set(names)):
        raise ValueError(
            f"Saved router config has unknown fields {unknown}; it was written by a newer early-exit-router. "
            "Upgrade the package to load it."
        )

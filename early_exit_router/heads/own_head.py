"""Checkpoints trained to exit through their own head (LayerSkip's), recognised by name and served at their
recommended exit with identity heads: the model's own final norm and LM head, no trained head.

Which checkpoints, and where they exit, is data (`data/own_head_checkpoints.json`). A checkpoint is recognised by its
Hub name anywhere in the path it was loaded from (a `--local-dir` named after it, or the Hub cache's
`models--facebook--<name>` folder) or in its config's `_name_or_path`, and only where its model type and depth are
the named checkpoint's: a renamed other model is not served at another model's exit.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import PurePath
from typing import Any

TABLE = "own_head_checkpoints.json"


@dataclass(frozen=True)
class OwnHeadCheckpoint:
    """A checkpoint whose shallow layers were trained to predict through its own head."""

    hub_name: str
    model_type: str
    num_hidden_layers: int
    exit_layer: int  # 0-based: the draft runs layers 0..exit_layer


@lru_cache(maxsize=1)
def own_head_checkpoints() -> dict[str, OwnHeadCheckpoint]:
    """Hub name (lower case) -> checkpoint, from the shipped table."""
    table = json.loads((resources.files("early_exit_router.data") / TABLE).read_text())["checkpoints"]
    return {name.lower(): OwnHeadCheckpoint(name, **entry) for name, entry in table.items()}


def _named(names: list[str]) -> OwnHeadCheckpoint | None:
    """The checkpoint one of `names` (Hub names or paths) names, by its Hub name or a path part named after it."""
    table = own_head_checkpoints()
    for name in names:
        key = name.replace("\\", "/").lower().rstrip("/")
        if key in table:
            return table[key]
        for part in PurePath(key).parts:
            for hub, found in table.items():
                if part in (hub.rsplit("/", 1)[-1], "models--" + hub.replace("/", "--")):
                    return found
    return None


def recognise(model: Any, names: list[str]) -> OwnHeadCheckpoint | None:
    """The own-head checkpoint `model` is (named by one of `names` or its config's `_name_or_path`), None if it is
    none; a model named like one whose model type or depth differ is not, with a warning saying why."""
    config = getattr(model, "config", None)
    found = _named([n for n in [*names, getattr(config, "_name_or_path", "")] if n])
    if found is None:
        return None
    mine = (getattr(config, "model_type", None), getattr(config, "num_hidden_layers", None))
    if mine != (found.model_type, found.num_hidden_layers):
        warnings.warn(
            f"The model is named like {found.hub_name} but is a {mine[0]} of {mine[1]} layers (that checkpoint: "
            f"{found.model_type}, {found.num_hidden_layers}): it gets fresh heads, not that checkpoint's exit. Pass "
            "exit_layers=[...] and adapter='identity' to exit through its own head anyway.",
            stacklevel=3,
        )
        return None
    return found


def own_head_config(model: Any, name: str, config: Any, overrides: dict[str, Any]) -> tuple[Any, bool]:
    """The config a router on `model` starts from, and whether its identity exits are trained: a recognised own-head
    checkpoint's (its recommended exit through the model's own head) where the caller gave no config; else the
    caller's config, or the defaults."""
    from early_exit_router.config import RouterConfig

    found = recognise(model, [name]) if config is None else None
    if found is None:
        return (config or RouterConfig()).replace(**overrides), False
    config = RouterConfig(exit_layers=[found.exit_layer], adapter="identity").replace(**overrides)
    exits = config.resolved_exit_layers(found.num_hidden_layers)
    return config, all(config.adapter_for(e) == "identity" for e in exits)

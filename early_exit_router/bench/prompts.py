"""The bench's prompt records: checking one and encoding it, and grouping the records into the units a bench runs
(a lone prompt, or the calls of one sequence of requests)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from early_exit_router.bench.checks import validate_check


def request_units(prompts: Sequence[dict[str, Any]]) -> list[list[int]]:
    """The prompts' indices as the bench runs them: a lone prompt alone, and the prompts that name one `sequence`
    together, in file order (similar requests through one router, in the order a client sends them)."""
    units: list[list[int]] = []
    sequences: dict[str, list[int]] = {}
    for k, item in enumerate(prompts):
        name = item.get("sequence")
        if name is None:
            units.append([k])
        elif name in sequences:
            sequences[name].append(k)
        else:
            sequences[name] = [k]
            units.append(sequences[name])
    return units


def encode_record(router: Any, item: dict[str, Any]) -> torch.Tensor:
    """A prompt record's token ids (1, n), its fields checked first: id, category, kind (text or chat), prompt, an
    optional sequence name and an optional `check` (`checks.validate_check`)."""
    for key in ("id", "category", "kind", "prompt"):
        if key not in item:
            raise ValueError(f"Prompt record {item!r} lacks the field {key!r} (needed: id, category, kind, prompt).")
    if item["kind"] not in ("text", "chat"):
        raise ValueError(f"Prompt {item['id']!r}: kind must be 'text' or 'chat', got {item['kind']!r}.")
    if not isinstance(item.get("sequence", ""), str):
        raise ValueError(f"Prompt {item['id']!r}: sequence must name the sequence of requests it belongs to.")
    if item.get("check") is not None:
        try:
            validate_check(item["check"])
        except ValueError as exc:
            raise ValueError(f"Prompt {item['id']!r}: {exc}") from None
    return router.encode(item["prompt"], chat=item["kind"] == "chat")

"""The LayerSkip recipe's parts (Elhoushi et al. 2024): early-exit loss scales, exit curricula and layer dropout.

- **Loss scales**: the weight of each supervised layer's loss, by the layer's depth (`uniform`, `linear` in l + 1,
  `sum_l`: the paper's 0 + 1 + ... + l, so deeper exits weigh more), the exits' terms times `e_scale` and the last
  layer's times `last_weight`, normalised to sum to one.
- **Curricula**: which exits are supervised at a step. `none`: all of them. `rotational`: every `rotation`-th exit,
  the set moving by one exit each step. `gradual`: exits switch on from the deepest to the shallowest over the first
  `gradual_share` of training.
- **Layer dropout**: each layer skipped per sequence with a probability rising with depth, from 0 at the first layer
  to `p_max` at the last (`exp`: 2^(l/(L-1)) - 1, or `linear`), so the deep layers learn to be optional and the
  shallow ones to carry the answer.

`LayerTaps` runs all of it inside the model's own forward through hooks on its decoder layers (removed on exit).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from early_exit_router.models._compat import layer_output_hidden, with_layer_hidden

LOSS_SCALES = ("uniform", "linear", "sum_l")
CURRICULA = ("none", "rotational", "gradual")
DROPOUT_SHAPES = ("exp", "linear")


def loss_scales(
    layers: Sequence[int], num_layers: int, kind: str = "sum_l", e_scale: float = 1.0, last_weight: float = 1.0
) -> torch.Tensor:
    """(len(layers),) weights summing to one for the losses read at 0-based `layers` (the last is the model's last
    layer, `num_layers - 1`, when it is supervised).

    `sum_l` is the paper's: e_scale x (0 + 1 + ... + l) at an exit, (L - 1) + e_scale x (0 + ... + L - 2) at the last
    layer; `linear`: e_scale x (l + 1) and L; `uniform`: e_scale and 1. The last layer's term is then multiplied by
    `last_weight`, and the weights are normalised over the supervised layers."""
    if kind not in LOSS_SCALES:
        raise ValueError(f"Unknown loss scale {kind!r}: use one of {', '.join(LOSS_SCALES)}.")
    last = num_layers - 1

    def weight(layer: int) -> float:
        if kind == "uniform":
            return 1.0 * last_weight if layer == last else e_scale
        if kind == "linear":
            return num_layers * last_weight if layer == last else e_scale * (layer + 1)
        if layer == last:
            return (last + e_scale * (last - 1) * last / 2) * last_weight
        return e_scale * layer * (layer + 1) / 2

    weights = torch.tensor([weight(layer) for layer in layers])
    if float(weights.sum()) <= 0:
        raise ValueError("Every supervised layer has weight 0: raise e_scale or last_weight above 0.")
    return weights / weights.sum()


def curriculum_exits(
    kind: str, exits: Sequence[int], step: int, total_steps: int, rotation: int = 2, gradual_share: float = 0.5
) -> list[int]:
    """The exits (a subset of `exits`, shallow first) whose losses count at `step` of `total_steps`."""
    exits = sorted(exits)
    if kind == "none" or not exits:
        return exits
    if kind == "rotational":
        return [e for i, e in enumerate(exits) if (i + step) % max(1, rotation) == 0]
    if kind == "gradual":
        done = step / max(1, total_steps)
        n = len(exits)
        # exit i (0 = shallowest) switches on once `done` reaches gradual_share * (n - 1 - i) / n: deepest first
        return [e for i, e in enumerate(exits) if done >= gradual_share * (n - i - 1) / n]
    raise ValueError(f"Unknown curriculum {kind!r}: use one of {', '.join(CURRICULA)}.")


def dropout_rates(num_layers: int, p_max: float, shape: str = "exp") -> list[float]:
    """Per-layer skip probabilities, 0 at the first layer rising to `p_max` at the last."""
    if shape not in DROPOUT_SHAPES:
        raise ValueError(f"Unknown layer dropout shape {shape!r}: use one of {', '.join(DROPOUT_SHAPES)}.")
    if not 0.0 <= p_max < 1.0:
        raise ValueError(f"layer_dropout is {p_max}: give a probability in [0, 1).")
    period = max(1, num_layers - 1)
    if shape == "exp":
        return [p_max * (math.exp(layer * math.log(2) / period) - 1) for layer in range(num_layers)]
    return [p_max * layer / period for layer in range(num_layers)]


def _hidden_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


class LayerTaps:
    """Hooks on a model's decoder layers for one forward pass: keep the outputs of `exits` (for their losses) and,
    where `rates` are given, skip layers per sequence (the layer's output replaced by its input)."""

    def __init__(self, layers: Sequence[nn.Module], generator: torch.Generator | None = None) -> None:
        self.layers = list(layers)
        self.generator = generator
        self.outputs: dict[int, torch.Tensor] = {}

    @contextmanager
    def tapping(self, exits: Sequence[int], rates: Sequence[float] | None = None) -> Iterator[dict[int, torch.Tensor]]:
        self.outputs = {}
        handles = []
        try:
            for index, layer in enumerate(self.layers):
                rate = rates[index] if rates else 0.0
                if index in exits or rate > 0:
                    handles.append(layer.register_forward_hook(self._hook(index, rate), with_kwargs=True))
            yield self.outputs
        finally:
            for handle in handles:
                handle.remove()

    def _hook(self, index: int, rate: float) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
            hidden = layer_output_hidden(output)
            if rate > 0:
                # (batch,) True where this sequence skips the layer this pass
                skip = torch.rand(hidden.shape[0], generator=self.generator) < rate
                if skip.any():
                    before = _hidden_of(args, kwargs)
                    hidden = torch.where(skip.to(hidden.device).view(-1, 1, 1), before, hidden)
                    output = with_layer_hidden(output, hidden)
            self.outputs[index] = hidden
            return output

        return hook

"""Compute accounting that does not depend on the machine: multiply-adds of layer passes and head evaluations.

`ComputeMeter` hooks the model's decoder layers, its LM head, and the exit heads' adapters and gates, and counts
the positions each of them processes. Weighting every position by the module's matrix parameters (one
multiply-add per weight per position) gives the compute of a whole generation. It sees whatever calls the
modules: plain HF generation, HF's assisted and prompt-lookup decoding, and the router alike.

Attention-score products (which grow with the context) are not counted; at the bench's lengths they are a small
share of a layer's matrix products, and they are the same per position for every method.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from early_exit_router.heads.exit_heads import ExitHeads
from early_exit_router.models.architecture import LayerStack


def matrix_macs(module: nn.Module) -> int:
    """Multiply-adds per position: the number of weights in the module's matrices (biases and norms excluded),
    counted by their dense shape for quantized weights."""
    return sum(_dense_numel(p) for p in module.parameters() if p.dim() >= 2)


def _dense_numel(weight: torch.Tensor) -> int:
    """Weights in a matrix as the model computes with it: torchao's tensor subclasses report their dense shape;
    bitsandbytes' 4-bit parameters pack two values per byte and keep the dense shape in `quant_state`."""
    state = getattr(weight, "quant_state", None)
    shape = getattr(state, "shape", None)
    return math.prod(shape) if shape is not None else weight.numel()


@dataclass
class ComputeCount:
    """Multiply-adds counted between `ComputeMeter.reset()` calls, split by kind."""

    layer_macs: int = 0
    head_macs: int = 0  # the shared LM head, whether the full model's or an exit's
    adapter_macs: int = 0  # exit adapters and learned gates
    layer_positions: int = 0  # (layer, position) pairs processed
    head_rows: int = 0  # rows through the LM head
    by_layer: dict[int, int] = field(default_factory=dict)  # layer -> positions

    @property
    def total(self) -> int:
        return self.layer_macs + self.head_macs + self.adapter_macs


class ComputeMeter:
    """Counts multiply-adds through forward hooks; a context manager that removes its hooks on exit.

    `full_token_macs` is the cost of one decode step of the plain model: every layer once plus one head row.
    """

    def __init__(self, stack: LayerStack, heads: ExitHeads | None = None) -> None:
        self.stack = stack
        self.heads = heads
        self.hidden_size = stack.hidden_size
        self.layer_costs = [matrix_macs(layer) for layer in stack.layers]
        self.head_cost = int(stack.lm_head.weight.numel())  # (vocab, hidden), tied or not
        self.full_token_macs = sum(self.layer_costs) + self.head_cost
        self.count = ComputeCount()
        self._handles: list = []

    def __enter__(self) -> ComputeMeter:
        for idx, layer in enumerate(self.stack.layers):
            self._handles.append(layer.register_forward_pre_hook(self._layer_hook(idx), with_kwargs=True))
        self._handles.append(self.stack.lm_head.register_forward_pre_hook(self._head_hook))
        if self.heads is not None:
            for module in list(self.heads.adapters.values()) + list(self.heads.gates.values()):
                self._handles.append(module.register_forward_pre_hook(self._adapter_hook(matrix_macs(module))))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Nothing counted inside, the hooks removed: a compiled model would trace them into its graph (and compile
        again whenever a count changes)."""
        self.__exit__()
        try:
            yield
        finally:
            self.__enter__()

    def reset(self) -> ComputeCount:
        """Return the count so far and start a new one."""
        count, self.count = self.count, ComputeCount()
        return count

    def prefill_macs(self, prompt_len: int) -> int:
        """The plain model's prefill: every layer over the prompt, and one head row (HF keeps only the last)."""
        return prompt_len * sum(self.layer_costs) + self.head_cost

    def _positions(self, tensor: torch.Tensor) -> int:
        return tensor.numel() // self.hidden_size  # (..., hidden) -> number of positions

    def _layer_hook(self, idx: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            hidden = args[0] if args else kwargs["hidden_states"]
            n = self._positions(hidden)
            self.count.layer_macs += n * self.layer_costs[idx]
            self.count.layer_positions += n
            self.count.by_layer[idx] = self.count.by_layer.get(idx, 0) + n

        return hook

    def _head_hook(self, module: nn.Module, args: tuple) -> None:
        n = self._positions(args[0])
        self.count.head_macs += n * self.head_cost
        self.count.head_rows += n

    def _adapter_hook(self, cost: int):
        def hook(module: nn.Module, args: tuple) -> None:
            self.count.adapter_macs += self._positions(args[0]) * cost

        return hook

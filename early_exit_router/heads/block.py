"""Block adapters: one decoder block at the exit (Kangaroo's adapter), with a KV cache of its own per sequence.

The `block` adapter is a copy of the model's own layer after the exit, trained to stand in for all the layers after
it. Its attention needs the context, so it keeps a small KV cache of its own per sequence (`BlockContext`) and is run
over whole chunks in training. The `residual_block` scales that block's residual writes per channel from zero and adds
a post-norm map, so it starts as exactly a `postnorm` head.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from early_exit_router.heads.adapters import PostNormAdapter
from early_exit_router.models import _compat

BLOCK_KINDS = ("block", "residual_block")  # adapter kinds built from a copy of the model's own layer


class BlockAdapter(nn.Module):
    """One decoder block of the model's own class at the exit, with the model's final norm and LM head after it.

    Built as a copy of the layer after the exit (so that it starts as "one more layer" rather than as the logit
    lens) and trained by self-distillation to predict the full model's next token. Its attention reads its own KV
    cache (layer 0 of a cache of its own), never the model's.

    With `writers` (a `residual_block`), the outputs of the block's projections that write into the residual stream
    (attention's output projection, the MLP's down projection: `residual_writers`) are scaled per channel by `mix`,
    zero at the start, and a post-norm map (`post`) follows the final norm. The adapter then starts as exactly a
    `postnorm` head (which it can be warm-started from), training only adds what the block contributes, and both
    scales fold into the layer's own weights (`folded_block_state`), so export-draft writes a stock layer.
    """

    post_norm = False
    needs_context = True

    def __init__(self, block: nn.Module, mask_kind: str, writers: list[str] | None = None, width: int = 0) -> None:
        super().__init__()
        self.block = block
        self.mask_kind = mask_kind
        self.writers = list(writers or [])
        self.mix = nn.Parameter(torch.zeros(len(self.writers), width)) if self.writers else None
        self.post = PostNormAdapter(width) if self.writers else None
        for module in block.modules():  # the block's keys and values go to layer 0 of its own cache
            if hasattr(module, "layer_idx"):
                module.layer_idx = 0

    def forward(
        self, hidden: torch.Tensor, stack: Any, cache: Any = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(b, m, hidden) exit states -> (b, m, hidden). `cache` holds the block's keys and values of the positions
        before these (None: the chunk is the whole context); `positions` (b, m) default to the ones after them."""
        if positions is None:
            first = 0 if cache is None else cache.get_seq_length(0)
            positions = torch.arange(first, first + hidden.shape[1], device=hidden.device).unsqueeze(0)
        # The scales act through hooks that live only for this call, so the block stays a stock module otherwise
        # (its state_dict, deep copies and export see plain weights and `mix` beside them).
        handles = [
            self.block.get_submodule(name).register_forward_hook(_ScaleOutput(self.mix[i]))
            for i, name in enumerate(self.writers)
        ]
        try:
            return stack.run_module(self.block, self.mask_kind, hidden, cache, positions)
        finally:
            for handle in handles:
                handle.remove()

    def folded_block_state(self) -> dict[str, torch.Tensor]:
        """The block's state_dict with `mix` folded into its residual writers' weights (and biases): a stock layer
        that computes exactly what this adapter's block does."""
        state = dict(self.block.state_dict())
        with torch.no_grad():
            for i, name in enumerate(self.writers):
                module = self.block.get_submodule(name)
                scale = self.mix[i].to(module.weight.dtype)
                axis = _output_axis(module, scale.numel())
                state[f"{name}.weight"] = module.weight * (scale[:, None] if axis == 0 else scale[None, :])
                if getattr(module, "bias", None) is not None:
                    state[f"{name}.bias"] = module.bias * scale
        return state


class _ScaleOutput:
    """Forward hook: the module's output times a per-channel scale."""

    def __init__(self, scale: torch.Tensor) -> None:
        self.scale = scale

    def __call__(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return output * self.scale.to(output.dtype)


def _projections(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, leaf module) of every leaf inside `module` with a 2-D weight, in registration order."""
    return [
        (name, m)
        for name, m in module.named_modules()
        if not any(True for _ in m.children()) and getattr(getattr(m, "weight", None), "ndim", 0) == 2
    ]


def _output_axis(module: nn.Module, width: int) -> int:
    """Which axis of a projection's 2-D weight indexes its `width` outputs (0 for nn.Linear, 1 for GPT-2's Conv1D),
    found by probing: scaling the weight along that axis (and the bias) must scale the output per channel."""
    weight, bias = module.weight.detach(), getattr(module, "bias", None)
    scale = _probe((width,), weight.dtype, weight.device) + 0.5
    for axis in (0, 1):
        if weight.shape[axis] != width:
            continue
        x = _probe((3, weight.shape[1 - axis]), weight.dtype, weight.device)
        params = {"weight": weight * (scale[:, None] if axis == 0 else scale[None, :])}
        if bias is not None:
            params["bias"] = bias.detach() * scale
        try:
            with torch.no_grad():
                scaled = torch.func.functional_call(module, params, (x,))
                expected = module(x) * scale
        except RuntimeError:  # the input width of the other axis: not this one
            continue
        if torch.allclose(scaled, expected, rtol=1e-3, atol=1e-4):
            return axis
    raise ValueError(f"Cannot tell which axis of {type(module).__name__}'s weight holds its {width} outputs.")


def _probe(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Seeded random values in [0, 1) for a numerical check, drawn without touching the global RNG (a user's seeds
    stay theirs)."""
    g = torch.Generator().manual_seed(0)
    return torch.rand(shape, generator=g).to(dtype=dtype, device=device)


def residual_writers(block: nn.Module, stack: Any, mask_kind: str) -> list[str]:
    """Names of the block's projections that write into the residual stream (`self_attn.o_proj`, `mlp.down_proj` on
    Llama-like layers), found by running the block once: per direct child, in registration order, the projection
    (leaf with a 2-D weight) it calls last, where that one returns a tensor of `hidden_size` outputs. A child whose
    last call returns something else (an MoE router's scores) has none. `block_source` then checks numerically that
    zeroing their outputs makes the block the identity."""
    last: dict[str, tuple[str, bool]] = {}  # child -> (its last projection called, whether it writes the stream)

    def record(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            writes = isinstance(output, torch.Tensor) and output.shape[-1] == stack.hidden_size
            last[name.split(".")[0]] = (name, writes)

        return hook

    hidden = _probe((1, 4, stack.hidden_size), stack.dtype, stack.device)
    positions = torch.arange(4, device=stack.device).unsqueeze(0)
    handles = [module.register_forward_hook(record(name)) for name, module in _projections(block)]
    try:
        with torch.no_grad():
            stack.run_module(block, mask_kind, hidden, None, positions)
    finally:
        for handle in handles:
            handle.remove()
    children = [name for name, _ in block.named_children()]
    return [last[c][0] for c in children if c in last and last[c][1]]


def block_source(stack: Any) -> Callable[..., BlockAdapter]:
    """Makes the block adapter of exit `e`: a copy of layer e + 1 (the last layer for an exit at the last one)."""

    def make(exit_layer: int, residual: bool = False) -> BlockAdapter:
        idx = min(exit_layer + 1, stack.num_layers - 1)
        block = copy.deepcopy(stack.layers[idx])
        if not residual:
            return BlockAdapter(block, stack.mask_kinds[idx])
        writers = residual_writers(block, stack, stack.mask_kinds[idx])
        # `mix` and `post` are made on the CPU; the identity check runs on the model's device (a GPU run failed here)
        adapter = BlockAdapter(block, stack.mask_kinds[idx], writers, stack.hidden_size).to(stack.device)
        _check_starts_as_identity(adapter, stack)
        return adapter

    return make


def _check_starts_as_identity(adapter: BlockAdapter, stack: Any) -> None:
    """A fresh `residual_block` must pass its input through unchanged (every residual write scaled to zero); a layer
    that writes into the residual stream some other way cannot host one."""
    starts_as_identity = len(adapter.writers) >= 2
    if starts_as_identity:
        hidden = _probe((1, 4, stack.hidden_size), stack.dtype, stack.device) * 2 - 1
        with torch.no_grad():
            out = adapter(hidden, stack)
        starts_as_identity = torch.allclose(out.float(), hidden.float(), atol=1e-5)
    if not starts_as_identity:
        raise ValueError(
            f"A 'residual_block' adapter needs a layer whose attention and MLP each write into the residual stream "
            f"through one projection; {type(adapter.block).__name__} does not (found {adapter.writers}). Use the "
            "'block' or 'postnorm' adapter for this model."
        )


class BlockContext:
    """A block adapter's own KV cache for one sequence, and the exit states queued for it.

    Every position passes the exit once, in order: `push` queues its state, and `run` feeds the queue through the
    block (one batched call) when a draft needs the block's output. `rollback(keep)` forgets every position from
    `keep` on, in the cache and the queue alike, so the cache always holds exactly the block's keys and values of
    the sequence's accepted positions, as a full pass over them would.
    """

    MAX_QUEUE = 256  # queued positions kept before they are run anyway (bounded memory when nothing drafts)

    def __init__(self) -> None:
        self.cache = _compat.new_block_cache()
        self.seen = 0  # positions in the cache
        self.queue: torch.Tensor | None = None  # (1, m, hidden): positions seen..seen+m-1

    @property
    def end(self) -> int:
        return self.seen + (0 if self.queue is None else self.queue.shape[1])

    def push(self, hidden: torch.Tensor, start: int, stack: Any, adapter: nn.Module) -> None:
        """Queue exit states (1, m, hidden) of positions start..start+m-1 (which must follow the queued ones)."""
        if start != self.end:
            raise RuntimeError(f"Block adapter context out of step: got position {start}, expected {self.end}.")
        self.queue = hidden if self.queue is None else torch.cat([self.queue, hidden], dim=1)
        if self.queue.shape[1] > self.MAX_QUEUE:  # run all but the newest, which a draft may still ask about
            newest = self.queue[:, -1:]
            self.queue = self.queue[:, :-1]
            self.run(stack, adapter)
            self.queue = newest

    def run(self, stack: Any, adapter: nn.Module) -> torch.Tensor | None:
        """The block's outputs (1, m, hidden) for the queued positions, whose keys and values it now holds."""
        if self.queue is None:
            return None
        positions = torch.arange(self.seen, self.end, device=self.queue.device).unsqueeze(0)
        out = adapter(self.queue, stack, self.cache, positions)
        self.seen, self.queue = self.end, None
        return out

    def rollback(self, keep: int) -> None:
        if keep <= self.seen:
            _compat.crop_cache_layer(self.cache, 0, keep)
            self.seen, self.queue = keep, None
        elif self.queue is not None:
            self.queue = self.queue[:, : keep - self.seen] if keep < self.end else self.queue

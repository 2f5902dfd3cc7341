"""`ExitHeads`: the adapter (and optional learned gate) of every exit layer, and the trimmed draft head's ranking.

Only the adapters and gates are parameters of their own: the final norm and LM head are the base model's, shared and
never copied. Each exit has its own adapter kind (`RouterConfig.exit_adapters`): the shipped heads spend a block where
it buys the most.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from early_exit_router.heads.adapters import (
    IdentityAdapter,
    LinearAdapter,
    LowRankAdapter,
    PostNormAdapter,
    needs_context,
)
from early_exit_router.heads.block import BLOCK_KINDS, BlockAdapter, block_source
from early_exit_router.heads.draft import DraftHead, keeps_half_rows
from early_exit_router.heads.gates import LearnedGate
from early_exit_router.models.sizes import tensor_bytes

DRAFT_RANKING = "draft_ranking"  # state_dict key of ExitHeads' token ranking for the trimmed draft head
UNTRAINED_EXIT_MODE = (
    "Exit mode with UNTRAINED exit heads (the logit lens) and a holdback that releases exited tokens unchecked: "
    "shallow layers of off-the-shelf models are confidently wrong, so exited tokens often differ from the full "
    "model's. Load trained heads, or keep holdback=None (every exited token checked, wrong ones repaired)."
)


def make_adapter(kind: str, hidden_size: int, rank: int, block: Callable[..., BlockAdapter] | None = None) -> nn.Module:
    """A fresh adapter of `kind`; "block" and "residual_block" need `block`, which builds them from the base
    model's layers."""
    if kind in BLOCK_KINDS:
        if block is None:
            raise ValueError(f"A {kind!r} adapter is built from the base model's layers: pass block_source(stack).")
        return block(residual=kind == "residual_block")
    if kind == "identity":
        return IdentityAdapter()
    if kind == "linear":
        return LinearAdapter(hidden_size)
    if kind == "lowrank":
        return LowRankAdapter(hidden_size, rank)
    if kind == "postnorm":
        return PostNormAdapter(hidden_size)
    raise ValueError(f"Unknown adapter kind {kind!r}")


class ExitHeads(nn.Module):
    """The adapters (and optional gates) of every exit layer, keyed by the layer index as a string."""

    def __init__(
        self,
        exit_layers: list[int],
        hidden_size: int,
        adapter: str | dict[int, str],
        rank: int,
        blocks: Callable[..., BlockAdapter] | None = None,
    ) -> None:
        """`adapter`: one kind for every exit, or the kind of each exit ({layer: kind})."""
        super().__init__()
        self.exit_layers = list(exit_layers)
        self.kinds = {e: adapter if isinstance(adapter, str) else adapter[e] for e in self.exit_layers}

        def block(e: int) -> Callable[..., BlockAdapter] | None:
            return None if blocks is None else lambda **kw: blocks(e, **kw)

        self.adapters = nn.ModuleDict(
            {str(e): make_adapter(self.kinds[e], hidden_size, rank, block(e)) for e in exit_layers}
        )
        self.gates = nn.ModuleDict()

    def kinds_summary(self) -> str:
        """The adapter kind, or each exit's where they differ ("L16 residual_block, L24 postnorm")."""
        if len(set(self.kinds.values())) == 1:
            return next(iter(self.kinds.values()))
        return ", ".join(f"L{e} {kind}" for e, kind in self.kinds.items())

    def adapter(self, layer: int) -> nn.Module:
        return self.adapters[str(layer)]

    def context_exits(self) -> list[int]:
        """Exit layers whose adapter reads the context (block adapters)."""
        return [e for e in self.exit_layers if needs_context(self.adapter(e))]

    def block_layers(self) -> list[nn.Module]:
        """The decoder layers of the block adapters (those exits' `BlockAdapter.block`), which the stack runs."""
        return [self.adapter(e).block for e in self.context_exits()]

    def gate(self, layer: int) -> nn.Module | None:
        key = str(layer)
        return self.gates[key] if key in self.gates else None

    def set_gate(self, layer: int, gate: nn.Module | None, device: torch.device) -> None:
        """Install (or remove, with None) the gate before exit `layer`, moved to `device`."""
        if layer not in self.exit_layers:
            raise ValueError(f"Layer {layer} has no exit head; exit layers are {self.exit_layers}.")
        if gate is None:
            self.gates.pop(str(layer), None)
        else:
            self.gates[str(layer)] = gate.to(device=device)

    def follow(self, weight: torch.Tensor) -> ExitHeads:
        """These heads on the device and in the dtype of the LM head's `weight` (moved when the model was; an
        integer-stored quantized head leaves the dtype as it is)."""
        first = next(self.parameters(), None)
        if first is None:
            return self
        dtype = weight.dtype if weight.dtype.is_floating_point else first.dtype
        if first.device != weight.device or first.dtype != dtype:
            self.to(device=weight.device, dtype=dtype)
        return self

    def draft_head(self, stack: Any, size: int, half: bool = False) -> DraftHead | None:
        """The trimmed draft head over `size` token ids (None when `size` covers the vocabulary); `half`: its rows in
        float16 where they pay (`keeps_half_rows`), as decodes run it under `half_draft_head`.

        The ids are the first `size` of `draft_ranking` (the model's own most frequent next tokens, measured when
        the heads were trained), or else the first `size` ids, whose BPE merge order follows frequency roughly.
        Built once per size, precision, device, dtype and head weight, and kept outside the module tree (a plain
        attribute), so that it never enters a state_dict."""
        if size <= 0 or size >= stack.vocab_size:
            return None
        weight = stack.lm_head.weight
        half = keeps_half_rows(stack, half)
        key = (size, half, weight.device, weight.dtype, weight.data_ptr())
        cached = self.__dict__.setdefault("_draft_heads", {})
        if key not in cached:
            # one size of one weight at a time (a stale slice is memory for nothing), in either precision: training
            # reads the float32 rows, decodes the float16 ones
            for stale in [k for k in cached if k[:1] + k[2:] != key[:1] + key[2:]]:
                del cached[stale]
            ranking = self.draft_token_ranking()
            ids = torch.arange(size) if ranking is None else ranking[:size].sort().values.cpu()
            cached[key] = DraftHead(stack.lm_head, ids, half)
        return cached[key]

    def draft_token_ranking(self) -> torch.Tensor | None:
        """(vocab,) every token id, most frequent model prediction first; None when none was measured."""
        return self._buffers.get(DRAFT_RANKING)

    def set_draft_token_ranking(self, ranking: torch.Tensor, vocab_size: int) -> None:
        """Store the token ranking the trimmed draft head takes its ids from (saved with the heads)."""
        ranking = torch.as_tensor(ranking).detach().to(torch.long).flatten().cpu()
        if ranking.numel() != vocab_size or not torch.equal(ranking.sort().values, torch.arange(vocab_size)):
            raise ValueError(f"A draft token ranking must order every one of the {vocab_size} token ids exactly once.")
        device = next((p.device for p in self.parameters()), ranking.device)
        self.register_buffer(DRAFT_RANKING, ranking.to(device))
        self.__dict__.pop("_draft_heads", None)

    def add_gates(self, hidden_size: int, context: bool = False, head: bool = False) -> None:
        """Give every exit a (zero-initialised) learned gate, with context and head features or not; training fills
        them."""
        with keep_global_rng():
            for e in self.exit_layers:
                self.gates[str(e)] = LearnedGate(hidden_size, context, head)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def nbytes(self, stack: Any, draft_vocab_size: int, half: bool = False) -> tuple[int, int]:
        """Bytes these heads add to the model: (exit adapters and gates, the trimmed draft head's copy of the LM
        head's rows, in float16 with `half`; 0 where the draft head is the full head)."""
        draft = self.draft_head(stack, draft_vocab_size, half)
        return tensor_bytes(list(self.parameters())), 0 if draft is None else tensor_bytes([draft.weight, draft.bias])

    def describe(self, name: str, stack: Any, config: Any, share: float) -> str:
        """One line about these heads on `stack`'s model (`name`) under `config`: exit layers, adapters, whether
        trained, their size (`share` of the base model's parameters), and the stack's prepacked weights, where used."""
        trained = "trained" if config.heads_trained else "UNTRAINED (logit lens)"
        adapters = self.kinds_summary() if self.kinds else config.adapter
        packed = stack.packed_weights
        return (
            f"{name}: {stack.num_layers} layers, exits at {self.exit_layers} ({adapters} adapters, {trained}); "
            f"added parameters {self.num_parameters():,} ({share:.2%} of the base model)"
            + (
                f"; {len(packed)} weights prepacked ({packed.nbytes / 2**20:.0f} MiB, "
                f"{'/'.join(packed.kernels)} products over {packed.served_rows})"
                if packed
                else ""
            )
        )


def build_heads(stack: Any, config: Any, exit_layers: list[int]) -> ExitHeads:
    """Fresh (untrained) heads at `exit_layers` with the config's adapter kinds, on the model's device and dtype: the
    logit lens until trained or loaded."""
    kinds = {e: config.adapter_for(e) for e in exit_layers}
    with keep_global_rng():
        heads = ExitHeads(exit_layers, stack.hidden_size, kinds, config.adapter_rank, block_source(stack))
    return heads.to(device=stack.device, dtype=stack.dtype).eval()


def fresh_heads(stack: Any, config: Any) -> tuple[Any, ExitHeads]:
    """`config` with the exit layers it resolves to on `stack` and `heads_trained` False, and fresh heads there: the
    logit lens, whatever `config` said of the heads it came with."""
    exit_layers = config.resolved_exit_layers(stack.num_layers)
    config = config.replace(exit_layers=exit_layers, heads_trained=False)
    return config, build_heads(stack, config, exit_layers)


def keep_global_rng() -> Any:
    """New layers draw their initial weights (zeroed or loaded after) from torch's global CPU generator: patching a
    model must leave the caller's `manual_seed` stream as it was, or its next sampled `generate` would change."""
    return torch.random.fork_rng(devices=[])

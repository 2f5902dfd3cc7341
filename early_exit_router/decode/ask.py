"""An exit's greedy ask as one function of tensors: its adapter, the final norm, the trimmed draft head, the head gate,
the top-1 token, the exit rule and the rows' combined decision (`ask_signals`). Eager decodes call it as it is;
compiled decodes of one sequence (`RouterConfig.compile`) run it as one graph (`CompiledLayers.call`), so an ask is
one graph call and one host sync instead of some forty small operators, each with its own dispatch.

It serves the ask `drafting.try_exit` makes most often: greedy rows at the trimmed head's K columns (`asks_trimmed`),
an exit without a block adapter and without a gate that runs before the head. Other asks run `exit_flags` eagerly.
Thresholds reach the graph as a tensor (`bars`): the per-token break-even changes at every ask, and a float would be
a constant there, one graph each.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from early_exit_router.config import RouterConfig
from early_exit_router.decode.drafters import ExitDrafter
from early_exit_router.decode.state import DecodeState
from early_exit_router.heads.draft import draft_logits, trimmed_top1
from early_exit_router.heads.gates import gate_probability, uses_head
from early_exit_router.models.compiled import compiled_layers, compiles_here, warm_passes
from early_exit_router.routing.exit_rule import ExitRule

NO_THRESHOLD = float("inf")  # bars[2] where no per-token threshold lets a token draft


def ask_signals(
    stack: Any,
    adapter: torch.nn.Module | None,
    draft: torch.nn.Module,
    gate: torch.nn.Module | None,
    rule: Any,
    last: torch.Tensor,
    bars: torch.Tensor | tuple[float, float, float],
    context: torch.Tensor | None,
    proposed: torch.Tensor | None,
    active: torch.Tensor | None,
    alternatives: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One greedy ask of an exit for (b, hidden) exit states `last`: ((b, K) trimmed logits, (b,) top-1 ids,
    signals). `bars`: the exit rule's shifted (high, low) thresholds and a per-token threshold that also lets a token
    draft (`NO_THRESHOLD`: none), a (3,) tensor in a graph, floats where the function runs eagerly.
    `context`/`proposed`: a head gate's context features (b, 2) and n-gram tokens (b,). `active`: (b,) which rows
    still decide (None: all). Signals, float64 for one host sync: whether every deciding row may leave, the lowest
    confidence among them, each row's token, then the first row's `alternatives` + 1 best ids where `alternatives`
    (an exit tree's)."""
    logits = draft_logits(stack, adapter, draft, last, trimmed=True)  # (b, K)
    tokens = trimmed_top1(logits, draft.token_ids)
    learned = None
    if gate is not None:
        learned = gate_probability(gate, last, context, logits, proposed, draft, True).reshape(-1)
    flags, confidence = rule.head_signal(logits, learned=learned, bars=(bars[0], bars[1]))
    ok, low = every_row(flags | (confidence >= bars[2]), confidence, active)
    signals = [ok.double().reshape(1), low.double().reshape(1), tokens.double()]
    if alternatives:
        signals.append(draft.token_ids[logits[0].topk(alternatives + 1).indices].double())
    return logits, tokens, torch.cat(signals)


def every_row(
    flags: torch.Tensor, confidence: torch.Tensor, active: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(b,) exit flags and confidences -> (whether every deciding row may leave, the lowest confidence among them;
    1 where none decides). `active`: (b,) bool, which rows decide (None: all)."""
    if active is None:
        return flags.all(), confidence.min()
    low = confidence.masked_fill(~active, 1.0).min()  # confidences are probabilities: 1 changes no minimum
    return (flags | ~active).all(), low


def fusable(gate: torch.nn.Module | None, block: bool) -> bool:
    """Whether an exit's greedy asks at the trimmed head run as `ask_signals`: an exit without a block adapter
    (`block`) whose gate, if it has one, reads the head's output (a gate before the head decides first, eagerly)."""
    return not block and (gate is None or uses_head(gate))


def fused_ask(
    dec: DecodeState,
    i: int,
    last: torch.Tensor,
    threshold: float | None,
    alternatives: int,
    gate_inputs: tuple[torch.Tensor | None, torch.Tensor | None],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exit `i`'s greedy ask at the trimmed head (`fusable`) for the current slot's exit states `last` (b, hidden),
    with its gate's (context features, n-gram tokens): `ask_signals`, as a graph in compiled decodes (eagerly where
    the graph does not compile here)."""
    bars = (*dec.rule.bars(dec.routing.threshold_shift), threshold)
    active = deciding_rows(dec, last.device)
    return _run(dec.stack, dec.exit_drafter, dec.rule, i, last, bars, gate_inputs, active, alternatives)


def deciding_rows(dec: DecodeState, device: torch.device) -> torch.Tensor | None:
    """(b,) bool on `device`: which rows still decide (None: all of them)."""
    rows = [not row.done for row in dec.rows]
    return None if all(rows) else torch.tensor(rows, device=device)


def _run(
    stack: Any,
    drafter: ExitDrafter,
    rule: ExitRule,
    i: int,
    last: torch.Tensor,
    bars: tuple[float, float, float | None],
    gate_inputs: tuple[torch.Tensor | None, torch.Tensor | None],
    active: torch.Tensor | None,
    alternatives: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`ask_signals` for exit `i` of `drafter`, as a graph where one sequence's asks compile, else eagerly."""
    high, low, threshold = bars[0], bars[1], NO_THRESHOLD if bars[2] is None else bars[2]
    args = [stack, drafter.heads.adapter(drafter.exits[i]), drafter.draft, drafter.gate(i), rule, last,
            (high, low, threshold), *gate_inputs, active, alternatives]  # fmt: skip
    # One sequence's asks alone: a batch's rows join and leave, each batch size and row mask would be a graph (its
    # passes run eagerly too)
    if drafter.config.compile and last.shape[0] == 1 and compiles_here(stack):
        args[5] = last.clone(memory_format=torch.contiguous_format)  # a slice's strides: another shape to the guards
        args[6] = torch.tensor([high, low, threshold], device=last.device)  # a float would be a constant there
        # everything the graph specialises on, so that a new graph is timed as compiling where it is one
        entropy = (rule.entropy_decides, rule.config.entropy_threshold, rule.config.entropy_normalized)
        key = ("ask", drafter.exits[i], alternatives, active is None, gate_inputs[0] is None, *entropy,
               tuple(drafter.draft.weight.shape), drafter.draft.weight.dtype)  # fmt: skip
        out = compiled_layers(stack).call(ask_signals, key, *args)
        if out is not None:
            return out
    return ask_signals(*args)


@torch.inference_mode()
def warm_asks(stack: Any, heads: Any, config: RouterConfig) -> None:
    """Compile now the ask graph of each exit whose greedy asks run as one (`fusable`), as a decode of one sequence
    asks them (with and without an exit tree's alternatives), so that no decode compiles it at its first ask."""
    if not (config.compile and compiles_here(stack)):
        return
    drafter = ExitDrafter(stack, heads, config, config.consulted_exit_layers())
    if not drafter.can_trim:
        return
    rule = ExitRule(config, stack.vocab_size)
    last = torch.zeros(1, stack.hidden_size, dtype=stack.dtype, device=stack.device)
    blocks = heads.context_exits()
    for i, layer in enumerate(drafter.exits):
        gate = drafter.gate(i)
        if not fusable(gate, layer in blocks):
            continue
        inputs = drafter.gate_inputs(gate, last, [-1], 0.5)  # as a context with no n-gram match gives them
        for alternatives in sorted({0, config.exit_branches}):
            _run(stack, drafter, rule, i, last, (*rule.bars(), None), inputs, None, alternatives)


def warm_graphs(stack: Any, heads: Any, config: RouterConfig, widths: Iterable[int]) -> None:
    """Compile now what a compiled decode would compile at first use: the passes over chunks of `widths` positions
    (`warm_passes`) and the exits' asks (`warm_asks`)."""
    warm_passes(stack, widths)
    warm_asks(stack, heads, config)

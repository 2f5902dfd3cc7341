"""An exit's greedy ask as one function (`decode/ask.py`): the same decisions as the step-by-step ask, eagerly and
as one compiled graph that every threshold and shift reuses."""

from __future__ import annotations

import pytest
import torch

from early_exit_router import EarlyExitRouter
from early_exit_router.config import RouterConfig
from early_exit_router.decode.ask import NO_THRESHOLD, ask_signals, every_row, warm_asks
from early_exit_router.heads.draft import draft_logits, trimmed_top1
from early_exit_router.heads.gates import gate_probability
from early_exit_router.models.compiled import compiled_layers
from early_exit_router.routing.exit_rule import ExitRule
from early_exit_router.routing.gate_context import context_features
from early_exit_router.routing.policy import DraftPolicy

from .conftest import prompt, tiny_llama

ASK = dict(exit_layers=[1, 3], high_conf_threshold=0.05, low_conf_threshold=0.05, draft_vocab_size=32)


def gated_router(**overrides) -> EarlyExitRouter:
    router = EarlyExitRouter.from_model(tiny_llama(0), **{**ASK, **overrides})
    router.heads.add_gates(32, context=True, head=True)  # reads the context features and the head's output
    with torch.no_grad():  # a gate that weighs its features: probabilities across (0, 1)
        for gate in router.heads.gates.values():
            for p in gate.parameters():
                p.normal_(std=0.5)
    return router


def stepwise(router, rule, exit_layer, last, shift, threshold, ngram, agreement, active, half):
    """The ask as `try_exit` makes it without `ask_signals`: head, top-1, gate, exit rule, threshold, rows."""
    stack, draft = router.stack, router.heads.draft_head(router.stack, 32, half)
    gate = router.heads.gate(exit_layer)
    logits = draft_logits(stack, router.heads.adapter(exit_layer), draft, last, trimmed=True)
    tokens = trimmed_top1(logits, draft.token_ids)
    context = context_features(ngram, agreement, last.device)
    learned = gate_probability(gate, last, context, logits, torch.tensor(ngram), draft, True).reshape(-1)
    flags, confidence = rule.head_signal(logits, shift, learned)
    if threshold is not None:
        flags = flags | (confidence >= threshold)
    ok = (flags | ~active).all()
    low = confidence[active].min() if active.any() else torch.ones(())
    return [float(ok), float(low), *tokens.tolist()]


@pytest.mark.parametrize("entropy, half", [(False, False), (True, False), (False, True)])
@torch.inference_mode()  # as decodes run
def test_the_fused_ask_decides_as_the_stepwise_ask_eagerly_and_compiled(entropy, half):
    router = gated_router()
    config = RouterConfig(**{**ASK, **({"low_conf_threshold": 0.02, "entropy_threshold": 0.99} if entropy else {})})
    rule = ExitRule(config, router.stack.vocab_size)
    stack, draft = router.stack, router.heads.draft_head(router.stack, 32, half)
    compiled = compiled_layers(stack)
    entries = len(torch._dynamo.eval_frame._debug_get_cache_entry_list(ask_signals.__code__))
    generator = torch.Generator().manual_seed(0)
    for trial in range(12):
        rows = 1 + trial % 3
        last = torch.randn(rows, stack.hidden_size, generator=generator) * 4
        shift, threshold = (0.0, 0.01, -0.03)[trial % 3], (None, 0.3, 0.6, 0.05)[trial % 4]
        ngram, agreement = [(-1, 7, 12)[(trial + r) % 3] for r in range(rows)], 0.1 * (trial % 7)
        active = torch.tensor([r != 1 or trial % 2 == 0 for r in range(rows)])
        if trial % 4 == 3:
            active[:] = True
        expected = stepwise(router, rule, 1, last, shift, threshold, ngram, agreement, active, half)
        bars = torch.tensor([*rule.bars(shift), NO_THRESHOLD if threshold is None else threshold])
        context = context_features(ngram, agreement, last.device)
        heads = router.heads
        args = (stack, heads.adapter(1), draft, heads.gate(1), rule, last, bars, context, torch.tensor(ngram), active,
                2 if rows == 1 else 0)  # fmt: skip
        if trial % 4 == 3:  # every row decides: no mask, as one sequence's asks
            args = (*args[:-2], None, args[-1])
        for signals in (ask_signals(*args)[2], compiled.call(ask_signals, ("ask", rows, half), *args)[2]):
            assert signals[: 2 + rows].tolist() == pytest.approx(expected, abs=1e-6)
            assert signals[0].item() == expected[0] and signals[2:].tolist()[:rows] == expected[2:]
            if rows == 1:  # an exit tree's alternatives: the head's best ids, the first the token itself
                assert signals[3:].tolist() == draft.token_ids[ask_signals(*args)[0][0].topk(3).indices].tolist()
    assert ask_signals not in compiled._broken
    # thresholds and shifts reach the graph as a tensor: one graph a row count and row-mask form, not one a value
    assert len(torch._dynamo.eval_frame._debug_get_cache_entry_list(ask_signals.__code__)) - entries <= 6


def test_every_row_reads_only_the_rows_that_decide():
    flags, confidence = torch.tensor([True, False, True]), torch.tensor([0.9, 0.2, 0.7])
    assert [float(x) for x in every_row(flags, confidence, None)] == [0.0, pytest.approx(0.2)]
    ok, low = every_row(flags, confidence, torch.tensor([True, False, True]))
    assert bool(ok) and float(low) == pytest.approx(0.7)
    ok, low = every_row(flags, confidence, torch.tensor([False, False, False]))
    assert bool(ok) and float(low) == 1.0


@pytest.mark.parametrize("mode", ["verify", "exit"])
def test_compiled_decodes_ask_as_one_graph_and_decide_as_step_by_step_asks(mode, monkeypatch):
    """The same decisions fused or step by step (`exit_flags`), eagerly or compiled; verify mode stays the model's
    greedy output; a compiled decode's asks run as the graphs `warm_asks` compiled, with no new one."""
    from early_exit_router.decode import drafting
    from early_exit_router.models.compiled import CompiledLayers

    monkeypatch.setattr(DraftPolicy, "observe_ask", lambda self, i, ms: None)  # asks priced alike: no timing
    ids = prompt(3, 8)
    runs, fusable = {}, drafting.fusable
    for arm in ("step by step", "fused", "compiled"):
        monkeypatch.setattr(drafting, "fusable", fusable if arm != "step by step" else lambda *args: False)
        router = gated_router(compile=arm == "compiled", ngram_tier=False, holdback=0)
        if arm == "compiled":
            warm_asks(router.stack, router.heads, router.config)
            compiled = router.stack.compiled_layers()
            warmed = {key for key in compiled._seen if key[0] == "ask"}
            entries = len(torch._dynamo.eval_frame._debug_get_cache_entry_list(ask_signals.__code__))
            calls = []
            call = CompiledLayers.call
            counted = lambda self, *a, seen=calls, real=call: seen.append(a[1]) or real(self, *a)  # noqa: E731
            monkeypatch.setattr(CompiledLayers, "call", counted)
        runs[arm] = router.generate(ids, max_new_tokens=30, mode=mode)
    for arm in ("fused", "compiled"):
        assert torch.equal(runs[arm].sequences, runs["step by step"].sequences), arm
        assert runs[arm].stats.exit_histogram == runs["step by step"].stats.exit_histogram, arm
        assert runs[arm].stats.repeat_refusals == runs["step by step"].stats.repeat_refusals, arm
    assert sum(v for k, v in runs["compiled"].stats.exit_histogram.items() if 0 <= k < 5) > 0  # exits took part
    assert calls and {key for key in calls} <= warmed  # the decode's asks ran as the warmed graphs ...
    assert len(torch._dynamo.eval_frame._debug_get_cache_entry_list(ask_signals.__code__)) == entries  # ... reused
    if mode == "verify":
        assert torch.equal(runs["compiled"].sequences, tiny_llama(0).generate(ids, max_new_tokens=30, do_sample=False))

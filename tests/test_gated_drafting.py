"""Verify mode's per-token exit drafting: a chain asks its exit's gate at every position, the policy prices a chain by
how often the gate fires and how often a fired draft is accepted (apart), the threshold a draft needs is the cost
model's break-even for that token, and the exit's top-1 agreement (the gate's `recent_acceptance` feature) is judged
at every position the exit was asked about."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from early_exit_router import EarlyExitRouter
from early_exit_router.decode import drafting
from early_exit_router.heads.draft import trimmed_top1
from early_exit_router.heads.gates import head_features
from early_exit_router.routing.costs import CostModel
from early_exit_router.routing.ngram import NO_PROPOSAL
from early_exit_router.routing.policy import AcceptanceTracker, DraftPolicy, expected_tokens

from .conftest import prompt, tiny_costs, tiny_llama

TINY = tiny_costs()


def _tracker(fire: float, a: float) -> AcceptanceTracker:
    return AcceptanceTracker(prior=0.5, kind_priors={"exit": a, "fire": fire})


def test_a_gate_that_always_fires_prices_the_chain_as_before():
    policy = DraftPolicy(TINY["quirky"], [1, 3], [False, True])
    for i in range(2):
        chains = policy.gated_chains(i, 1.0, 0.7, 8)
        for m, (tokens, ms) in enumerate(chains, 1):
            assert tokens == pytest.approx(expected_tokens(0.7, m))
            assert ms == pytest.approx(policy.exit_cycle_ms(i, m))


def test_a_gate_that_never_fires_costs_a_plain_step_and_one_ask():
    policy = DraftPolicy(TINY["flat"], [1, 3], [False, False])
    for tokens, ms in policy.gated_chains(0, 0.0, 0.9, 8):
        assert tokens == 1.0
        assert ms == pytest.approx(TINY["flat"].plain_step() + policy.consult_ms(0))
    assert policy.plan(_tracker(0.0, 0.9), 8, [NO_PROPOSAL]).kind == "plain"


def test_a_gate_that_fires_seldom_but_is_right_is_not_mistaken_for_an_exit_that_is_often_wrong():
    """The motivating case: a shallow exit whose gate fires at 20% of positions and is right 95% of the time there.
    One running estimate over asks (0.2 x 0.95 = 0.19 per position) says a chain does not pay; priced apart, a chain
    that stops at the first refusal does."""
    policy = DraftPolicy(TINY["quirky"], [1, 3], [False, False])
    conflated = policy.plan(_tracker(1.0, 0.19), 8, [NO_PROPOSAL])
    gated = policy.plan(_tracker(0.2, 0.95), 8, [NO_PROPOSAL])
    assert conflated.kind == "plain"
    assert gated.kind == "exit" and gated.rate > policy.plain_rate * (1 + policy.margin)
    assert policy.draft_pays(gated.tier, _tracker(0.2, 0.95)) and not policy.draft_pays(0, _tracker(1.0, 0.19))


def test_the_draft_threshold_is_the_tokens_break_even_and_rises_as_the_chain_gets_riskier():
    costs = TINY["quirky"]
    policy = DraftPolicy(costs, [1, 3], [False, False])
    rest = costs.num_layers - 2
    extra = costs.layers(2, 1) + policy.consult_ms(0) + costs.layers(rest, 2) - costs.layers(rest, 1)
    extra += costs.head(2) - costs.head(1)
    assert policy.draft_threshold(0, 0) == pytest.approx(extra / costs.plain_step())
    assert policy.draft_threshold(0, 0, survival=0.5) == pytest.approx(2 * policy.draft_threshold(0, 0))
    assert policy.draft_threshold(1, 0) > policy.draft_threshold(0, 0)  # a deeper exit saves less
    before = policy.draft_threshold(0, 0)
    policy.observe_ask(0, policy.consult_ms(0) + 5.0)  # asks cost more in situ than their parts
    assert policy.consult_ms(0) == pytest.approx(policy.costs.draft_head_ms + 5.0)
    assert policy.draft_threshold(0, 0) == pytest.approx(before + 5.0 / costs.plain_step())
    policy.observe_ask(0, 0.0)  # a running estimate, not the last ask alone
    assert 0.0 < policy.consult_ms(0) < policy.costs.draft_head_ms + 5.0


def _eager_router(model, costs: CostModel = TINY["flat"], **config) -> EarlyExitRouter:
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], ngram_tier=False, **config)
    router.cost_model = costs  # drafting pays
    return router


def test_the_break_even_lets_a_token_draft_below_the_exit_rules_bar_and_output_stays_greedy():
    model = tiny_llama(0)
    ids = prompt(2, 8)
    ref = model.generate(ids, max_new_tokens=24, do_sample=False)
    unreachable = {"high_conf_threshold": 1.0, "low_conf_threshold": 1.0, "exit_acceptance_prior": 0.9}
    # a head that dominates the step: a draft pays at a P(agree) the tiny heads' largest probabilities reach
    costs = CostModel.synthetic(6, [0.05] * 16, [50.0] * 16, draft_head_ms=0.01)
    assert DraftPolicy(costs, [1, 3], [False, False]).draft_threshold(0, 0) < 0.01
    out = _eager_router(model, costs, **unreachable).generate(ids, max_new_tokens=24, mode="verify")
    assert torch.equal(out.sequences, ref)
    assert out.stats.drafts_judged > 0  # the rule never fires, the break-even did
    fixed = _eager_router(tiny_llama(0), costs, policy="fixed", **unreachable).generate(
        ids, max_new_tokens=24, mode="verify"
    )
    assert torch.equal(fixed.sequences, ref) and fixed.stats.drafts_judged == 0  # no cost model: the rule alone


def test_a_refused_ask_ends_the_chain_as_a_gate_verdict_and_its_top1_is_judged_by_the_deep_pass(monkeypatch):
    """A chain's refused ask is booked as the gate's "no" (fire), never as a rejected draft (exit), and the exit's
    top-1 there is compared with the token the full model then chose (agree)."""
    seen: dict[str, list[bool]] = {"exit": [], "fire": [], "agree": []}
    observe = AcceptanceTracker.observe

    def spy(self, key, accepted):
        if key[0] in seen:
            seen[key[0]].append(bool(accepted))
        observe(self, key, accepted)

    monkeypatch.setattr(AcceptanceTracker, "observe", spy)
    refused: list[tuple[int, int, int]] = []
    judge = drafting.judge_refusals

    def spy_refusals(dec):
        for row, length, token, i in dec.refusals:
            if len(row.tokens) > length and row.depth[length - row.prompt_len] == dec.full_layer:
                refused.append((row.tokens[length], token, i))
        judge(dec)

    monkeypatch.setattr("early_exit_router.decode.loop.judge_refusals", spy_refusals)
    model = tiny_llama(0)
    ids = prompt(1, 8)
    ref = model.generate(ids, max_new_tokens=40, do_sample=False)
    # the gate's bar sits among the tiny heads' confidences: some asks fire, some are refused
    config = {"high_conf_threshold": 0.1, "low_conf_threshold": 0.1, "exit_acceptance_prior": 0.9, "probe_interval": 0}
    router = _eager_router(model, **config)  # no probes: every verdict comes from a draft or an ask
    monkeypatch.setattr(DraftPolicy, "draft_threshold", lambda self, i, pending, survival=1.0: 2.0)
    out = router.generate(ids, max_new_tokens=40, mode="verify")
    assert torch.equal(out.sequences, ref)
    fires = seen["fire"]
    assert True in fires and False in fires
    assert len(seen["exit"]) == out.stats.drafts_judged  # drafts' verdicts only: no refusal counts as a rejection
    assert refused and len(seen["agree"]) == out.stats.drafts_judged + len(refused)
    estimates = out.stats.policy_estimates
    assert any(k.startswith("exit fires L") for k in estimates)
    assert any(k.startswith("exit agreement L") for k in estimates)


def test_the_gate_reads_the_exits_running_agreement_not_its_drafts_acceptance():
    """Training replays the exit's agreement over every position as the gate's `recent_acceptance`; online the gate
    reads the same estimate, not the acceptance of the drafts it let through (higher, since it chose them)."""
    tracker = AcceptanceTracker(prior=0.5)
    tracker.estimates[("agree", 0)], tracker.estimates[("exit", 0)] = 0.123, 0.987
    captured = {}

    def gate_probability(gate, last, ngram_tokens, acceptance, logits=None, trimmed=False):
        captured["acceptance"] = acceptance
        return torch.zeros(last.shape[0])

    drafter = SimpleNamespace(needs_context=lambda gate: False, gate_probability=gate_probability)
    dec = SimpleNamespace(exit_drafter=drafter, tracker=tracker, rows=[])
    drafting.gate_probability_at(dec, 0, object(), torch.zeros(1, 8))
    assert captured["acceptance"] == 0.123


def test_a_trimmed_ask_picks_the_full_rows_top1_even_on_ties_and_reads_the_same_features():
    token_ids = torch.tensor([7, 3, 11, 5, 13, 0])  # a trimmed head's ids, in frequency order (not id order)
    trimmed = torch.tensor([[1.0, 2.0, 2.0, 0.5, 0, 0], [4.0, -1.0, 0.0, 4.0, 0, 0], [0.0, 0.0, 0.0, 9.0, 0, 0]])
    full = torch.full((3, 16), float("-inf")).index_copy_(-1, token_ids, trimmed)
    assert trimmed_top1(trimmed, token_ids).tolist() == full.argmax(dim=-1).tolist() == [3, 5, 5]
    proposed = torch.tensor([3, -1, 5])
    assert torch.equal(
        head_features(trimmed, proposed, token_ids, trimmed=True), head_features(full, proposed, token_ids)
    )


@pytest.mark.parametrize("mode", ["exit", "verify"])
def test_an_ask_decides_the_same_whether_or_not_the_caller_wants_the_logits(mode, monkeypatch):
    """A greedy ask stays at the trimmed head's columns; a caller that asks for the logits gets full rows, and the
    same decisions: the same tokens from the same exits."""
    monkeypatch.setattr(DraftPolicy, "observe_ask", lambda self, i, ms: None)  # asks priced alike: no timing
    config = {"high_conf_threshold": 0.05, "low_conf_threshold": 0.05, "draft_vocab_size": 32, "probe_interval": 2}
    runs = []
    for output_logits in (False, True):
        model = tiny_llama(0)
        router = _eager_router(model, **config)
        router.heads.add_gates(32, head=True)
        runs.append(router.generate(prompt(3, 8), max_new_tokens=30, mode=mode, output_logits=output_logits))
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    assert runs[0].stats.exit_histogram == runs[1].stats.exit_histogram
    assert sum(v for k, v in runs[0].stats.exit_histogram.items() if 0 <= k < 5) > 0  # exits took part
    if mode == "verify":
        assert torch.equal(runs[0].sequences, tiny_llama(0).generate(prompt(3, 8), max_new_tokens=30, do_sample=False))

"""Exit trees: each token an exit drafts brings its head's next choices as alternatives, verified as leaves of a
token tree in the pass that verifies the chain."""

from __future__ import annotations

import pytest
import torch

from early_exit_router import EarlyExitRouter
from early_exit_router.decode.sampling import SamplingParams, TokenSelector
from early_exit_router.decode.stopping import DecodeRequest
from early_exit_router.decode.tree import exit_tree_supported
from early_exit_router.routing.policy import AcceptanceTracker, DraftPolicy, expected_tokens

from .conftest import assert_cache_matches_full_forward, prompt, tiny_llama
from .test_token_trees import FLAT, SLOPED

# Every exit drafts at every token (no confidence bar) and is trusted at first: cycles are exit cycles.
EAGER = {"high_conf_threshold": 0.0, "exit_acceptance_prior": 0.9, "ngram_tier": False}


def _branch_verdicts(monkeypatch) -> list[bool]:
    """Record every verdict on an exit's alternatives (True: the full model's token was one of them)."""
    seen: list[bool] = []
    observe = AcceptanceTracker.observe

    def spy(self, key, accepted):
        if key[0] == "exit branch":
            seen.append(bool(accepted))
        observe(self, key, accepted)

    monkeypatch.setattr(AcceptanceTracker, "observe", spy)
    return seen


def test_the_policy_branches_an_exits_drafts_where_positions_are_cheap():
    # a gate that always fires: every chain runs to its cap, as the tree's cost assumes
    tracker = AcceptanceTracker(prior=0.5, kind_priors={"exit": 0.6, "exit branch": 0.5, "fire": 1.0})
    flat = DraftPolicy(FLAT, [1], [False], tree_nodes=16, exit_branches=1)
    plan = flat.plan(tracker, 8, [None], branching=[0])
    assert plan.kind == "exit" and plan.exit_tree and plan.branches == 1 and 1 <= plan.max_draft <= 8
    # the leaves add b x (1 - a^d) expected tokens to the chain's, for the pass over 2d + 1 positions
    gain = expected_tokens(0.6, plan.max_draft) + 0.5 * (1 - 0.6**plan.max_draft)
    assert plan.rate == pytest.approx(gain / flat.exit_cycle_ms(0, plan.max_draft, plan.max_draft))
    assert not flat.plan(tracker, 8, [None]).exit_tree  # the decode cannot verify exit trees: a chain
    assert DraftPolicy(FLAT, [1], [False], tree_nodes=16).plan(tracker, 8, [None], branching=[0]).branches == 0
    assert flat.plan(tracker, 8, [None]).branches == 0  # nor keep alternatives to judge
    sloped = DraftPolicy(SLOPED, [1], [False], tree_nodes=16, exit_branches=1).plan(tracker, 8, [None], branching=[0])
    # where every position costs 30% of a step, alternatives right half the time do not pay: a chain, which keeps
    # them only to judge them
    assert not sloped.exit_tree and sloped.branches == 1
    capped = DraftPolicy(FLAT, [1], [False], tree_nodes=4, exit_branches=1).plan(tracker, 8, [None], branching=[0])
    assert not capped.exit_tree or capped.max_draft * 2 <= 4  # chain and leaves within the tree's nodes


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(("exits", "adapters"), [([1, 3], {}), ([2], {}), ([1, 3], {3: "residual_block"})])
def test_exit_trees_are_token_identical_to_greedy_with_the_cache_of_a_full_pass(seed, exits, adapters, monkeypatch):
    model = tiny_llama(seed % 3)
    ids = prompt(seed, 8)
    ref = model.generate(ids, max_new_tokens=40, do_sample=False)
    verdicts = _branch_verdicts(monkeypatch)
    router = EarlyExitRouter.from_model(model, exit_layers=exits, adapter="postnorm", exit_adapters=adapters, **EAGER)
    router.cost_model = FLAT  # where positions cost nothing, every exit cycle brings its alternatives
    out = router.generate(ids, max_new_tokens=40, mode="verify")
    assert any(k.startswith("exit tree") for k in out.stats.policy_cycles), out.stats.policy_cycles
    assert torch.equal(out.sequences, ref)
    assert_cache_matches_full_forward(model, out.sequences, out.cache)
    chains = router.generate(ids, max_new_tokens=40, mode="verify", config={"exit_branches": 0})
    assert not any(k.startswith("exit tree") for k in chains.stats.policy_cycles)
    assert torch.equal(chains.sequences, ref)
    if adapters:  # a block adapter's exit brings none (its context would see them), an exit before it does
        assert "exit tree L3" not in out.stats.policy_cycles
    verdicts_seen = list(verdicts)
    assert verdicts_seen, "no draft was refused where an alternative stood beside it"


def test_an_accepted_alternative_is_kept_with_the_full_models_token_after_it(monkeypatch):
    """Over several models, some refused draft had the full model's token among its alternatives: the kept path
    then ran through that leaf, and the output still equals greedy."""
    verdicts = _branch_verdicts(monkeypatch)
    for seed in range(6):
        model = tiny_llama(seed % 3)
        ids = prompt(seed, 8)
        ref = model.generate(ids, max_new_tokens=32, do_sample=False)
        router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **EAGER)
        router.cost_model = FLAT
        out = router.generate(ids, max_new_tokens=32, mode="verify")
        assert torch.equal(out.sequences, ref)
        assert_cache_matches_full_forward(model, out.sequences, out.cache)
        router.unpatch()
    assert any(verdicts) and not all(verdicts)


def test_chains_judge_their_alternatives_so_the_estimate_follows_the_text(monkeypatch):
    """Where the policy drafts chains, each refused draft still says whether an alternative was right (a chain that
    stops at an unconfident ask drafted nothing there, and is no verdict on them): the alternatives' estimate keeps
    learning while no tree is drafted, and output stays greedy's."""
    verdicts = _branch_verdicts(monkeypatch)
    model = tiny_llama(0)
    ids = prompt(1, 8)
    ref = model.generate(ids, max_new_tokens=40, do_sample=False)
    config = {**EAGER, "exit_branches": 1}
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **config)
    router.cost_model = SLOPED  # exit trees never pay here
    out = router.generate(ids, max_new_tokens=40, mode="verify")
    assert torch.equal(out.sequences, ref)
    assert not any(k.startswith("exit tree") for k in out.stats.policy_cycles)
    assert any(k.startswith("exit L") for k in out.stats.policy_cycles), out.stats.policy_cycles
    assert verdicts and not all(verdicts)
    assert len(verdicts) == out.stats.rejected_drafts  # one verdict per refused draft, none at the gate's stops
    verdicts.clear()
    router.generate(ids, max_new_tokens=40, mode="verify", config={"exit_branches": 0})
    assert not verdicts  # no alternatives kept: nothing to judge


def test_exit_trees_keep_a_stop_left_padding_and_processors_exact():
    from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

    model = tiny_llama(1)
    ids = prompt(3, 8)
    greedy = model.generate(ids, max_new_tokens=30, do_sample=False)[0, ids.shape[1] :].tolist()
    penalty = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.3)])
    ref = model.generate(ids, max_new_tokens=30, do_sample=False, logits_processor=penalty)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **EAGER)
    router.cost_model = FLAT
    stop = greedy[12]
    out = router.generate(ids, max_new_tokens=30, mode="verify", eos_token_id=stop)
    assert out.sequences[0, ids.shape[1] :].tolist() == greedy[: greedy.index(stop) + 1]
    padded = torch.cat([torch.full((1, 3), 7), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones_like(ids)], dim=1)
    out = router.generate(padded, max_new_tokens=30, mode="verify", attention_mask=mask)
    assert any(k.startswith("exit tree") for k in out.stats.policy_cycles)
    assert out.sequences[0, padded.shape[1] :].tolist() == greedy
    out = router.generate(ids, max_new_tokens=30, mode="verify", logits_processor=penalty)
    assert any(k.startswith("exit tree") for k in out.stats.policy_cycles) and torch.equal(out.sequences, ref)


def test_sampling_and_block_exits_draft_chains():
    model = tiny_llama(0)
    router = EarlyExitRouter.from_model(
        model, exit_layers=[1, 3], adapter="postnorm", exit_adapters={1: "residual_block"}, **EAGER
    )
    router.cost_model = FLAT
    ids = prompt(2, 8)
    request = DecodeRequest(max_new_tokens=8, eos_token_ids=frozenset())
    greedy = router.decoder(mode="verify")
    greedy.join(ids, request, TokenSelector(SamplingParams(), router.stack.device))
    assert not exit_tree_supported(greedy, 0) and not exit_tree_supported(greedy, 1)  # a block at or before each
    sampled = router.decoder(mode="verify")
    sampled.join(ids, request, TokenSelector(SamplingParams(do_sample=True, seed=0), router.stack.device))
    assert not exit_tree_supported(sampled, 0)
    plain = EarlyExitRouter.from_model(tiny_llama(1), exit_layers=[1, 3], **EAGER)
    decoder = plain.decoder(mode="verify")
    decoder.join(ids, request, TokenSelector(SamplingParams(), plain.stack.device))
    assert exit_tree_supported(decoder, 0) and exit_tree_supported(decoder, 1)
    sampled = plain.generate(ids, max_new_tokens=16, mode="verify", do_sample=True, seed=0)
    assert not any(k.startswith("exit tree") for k in sampled.stats.policy_cycles)

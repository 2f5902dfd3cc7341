"""The measured cost model, the expected-gain policy, the trimmed draft head and the cross-call n-gram store."""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
import torch

from early_exit_router import EarlyExitRouter
from early_exit_router.decode.sampling import SamplingParams, TokenSelector
from early_exit_router.decode.stopping import DecodeRequest
from early_exit_router.routing import costs, table_key
from early_exit_router.routing.costs import CostModel, cost_model_for
from early_exit_router.routing.ngram import NO_PROPOSAL, Proposal, SuffixStore
from early_exit_router.routing.policy import (
    MAX_PROBE_BACKOFF,
    AcceptanceTracker,
    DraftPolicy,
    ProbeSchedule,
    expected_tokens,
)

from .conftest import VOCAB, assert_cache_matches_full_forward, prompt, tiny_costs, tiny_llama


@pytest.fixture(autouse=True)
def _idle_cpus(monkeypatch):
    """Other work on the machine is its own test's subject (below): here measurements are taken as if idle."""
    monkeypatch.setattr(costs, "other_work_share", lambda before, after: 0.0)


@pytest.fixture
def plausible_tables(monkeypatch):
    """For tests of caching, not of a table's checks: a real table measured while other work loads the CPU can fail
    `problems()` and is then, rightly, not cached; here every measured table passes."""
    monkeypatch.setattr(CostModel, "problems", lambda self: [])


FLAT = CostModel.synthetic(30, layer_ms=[1.0] * 16, head_ms=[6.0] * 16, draft_head_ms=0.1)  # bandwidth-bound GPU
STEEP = CostModel.synthetic(  # a small CPU: every extra position in a chunk costs almost as much as the first
    30, layer_ms=[0.9 * m + 0.1 for m in range(1, 17)], head_ms=[5.0 * m + 1.0 for m in range(1, 17)], draft_head_ms=1
)
TINY = tiny_costs()  # 6-layer tables for the tiny models


def test_expected_tokens_is_the_geometric_sum():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


@pytest.mark.usefixtures("plausible_tables")
def test_the_cost_model_is_measured_once_cached_and_invalidated_by_its_key(tmp_path, monkeypatch):
    monkeypatch.setenv("EARLY_EXIT_ROUTER_CACHE", str(tmp_path))
    router = EarlyExitRouter.from_model(tiny_llama(0), exit_layers=[1, 3])
    stack, heads = router.stack, router.heads
    first = cost_model_for(stack, heads, 32)
    assert len(first.layer_ms) == len(first.head_ms) == len(costs.MEASURED_CHUNKS) and all(
        t > 0 for t in first.layer_ms
    )
    assert first.draft_head_ms > 0 and first.num_layers == 6 and first.real_step_ms > 0
    assert len(list((tmp_path / "costs").glob("*.json"))) == 1

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured again although a cached table matches")

    monkeypatch.setattr(costs, "measure", no_measuring)
    assert cost_model_for(stack, heads, 32) == first  # reloaded from disk, equal in every field
    with pytest.raises(AssertionError, match="measured again"):
        cost_model_for(stack, heads, 16)  # another draft head size: another key
    monkeypatch.setattr(torch, "get_num_threads", lambda: 97)
    with pytest.raises(AssertionError, match="measured again"):
        cost_model_for(stack, heads, 32)  # another thread count: another key


@pytest.mark.parametrize("head", [False, True], ids=["pre-head gates", "head gates"])
def test_the_gate_is_timed_as_the_engine_calls_it(head):
    """A head gate reads the head's output: the measurement feeds it the draft logits, as the engine does."""
    router = EarlyExitRouter.from_model(tiny_llama(0), exit_layers=[1, 3])
    router.heads.add_gates(router.stack.hidden_size, context=True, head=head)
    assert costs.measure(router.stack, router.heads, 32, chunks=(1, 2)).gate_ms > 0


@pytest.mark.usefixtures("plausible_tables")
def test_a_table_from_an_older_measuring_method_is_measured_again(tmp_path, monkeypatch):
    import json

    monkeypatch.setenv("EARLY_EXIT_ROUTER_CACHE", str(tmp_path))
    router = EarlyExitRouter.from_model(tiny_llama(0), exit_layers=[1, 3])
    model = cost_model_for(router.stack, router.heads, 0)
    (path,) = (tmp_path / "costs").glob("*.json")
    old = json.loads(path.read_text())
    old["format_version"] = 1  # a single sweep per chunk length, no real-step check
    path.write_text(json.dumps(old))
    assert costs.load_cached(model.key) is None


@pytest.mark.usefixtures("plausible_tables")
def test_a_corrupt_cache_file_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv("EARLY_EXIT_ROUTER_CACHE", str(tmp_path))
    router = EarlyExitRouter.from_model(tiny_llama(0), exit_layers=[1, 3])
    model = cost_model_for(router.stack, router.heads, 0)
    costs.cache_path(model.key).write_text("{not json")
    assert costs.load_cached(model.key) is None
    assert cost_model_for(router.stack, router.heads, 0).key == model.key


def test_flat_chunk_costs_lead_to_long_drafts():
    policy = DraftPolicy(FLAT, [10, 20], [False, False])
    plan = policy.plan(AcceptanceTracker(prior=0.8), 8, [Proposal(list(range(8)), 3)])
    assert plan.kind == "ngram" and plan.max_draft == 8
    plan = policy.plan(AcceptanceTracker(prior=0.95), 8, [NO_PROPOSAL])
    assert plan.kind == "exit" and plan.tier == 0 and plan.max_draft >= 5
    steep = DraftPolicy(STEEP, [10, 20], [False, False]).plan(
        AcceptanceTracker(prior=0.95), 8, [Proposal(list(range(8)), 3)]
    )
    assert steep.kind == "ngram" and steep.max_draft < 8  # the same acceptance drafts shorter where chunks cost


def test_steep_chunk_costs_with_low_acceptance_lead_to_plain_decoding():
    policy = DraftPolicy(STEEP, [10, 20], [False, False])
    plan = policy.plan(AcceptanceTracker(prior=0.3), 8, [Proposal(list(range(8)), 2)])
    assert plan.kind == "plain" and plan.max_draft == 0
    # ...and the same costs with near-certain copies do draft, but shorter than on flat costs
    plan = policy.plan(AcceptanceTracker(prior=0.97), 8, [Proposal(list(range(8)), 4)])
    assert plan.kind == "ngram" and 1 <= plan.max_draft


def test_a_copy_under_way_is_its_own_match_class():
    from early_exit_router.routing.ngram import RUN_LIMIT, ContextIndex, match_class, ngram_match

    span = list(range(100, 140))
    tokens = span + [1] + span[:20]  # copying the span again, 20 tokens in
    found = ngram_match(tokens, 4, 30)
    assert found == (span[20:] + [1] + span[:9], 4, 20) and found.match_class == 16
    assert ContextIndex(4, 2).lookup(tokens, 30) == found
    assert ngram_match(span + [1] + span, 4, 8).run == RUN_LIMIT  # counted back no further
    assert ngram_match([7, *span[:4], 8, *span[:4]], 4, 2) == ([8, span[0]], 4, 4)  # agrees over the match only
    assert [match_class(r) for r in (2, 4, 7, 8, 15, 16, 31, 32)] == [2, 4, 7, 8, 8, 16, 16, 32]
    # each class learns its own acceptance, and a long run with a high one drafts past the exits' budget
    tracker = AcceptanceTracker(prior=0.3, estimates={("ngram", 16): 0.97})
    long_run = DraftPolicy(FLAT, [10, 20], [False, False]).plan(tracker, 8, [found])
    # (FLAT is flat up to its longest measured chunk, 16 positions, and grows linearly past it)
    assert long_run.kind == "ngram" and long_run.max_draft == 15 and long_run.proposals[0].run == 20
    short_run = DraftPolicy(STEEP, [10, 20], [False, False]).plan(tracker, 8, [found._replace(run=4)])
    assert short_run.kind == "plain"


@pytest.mark.parametrize("policy", ["cost", "fixed"])
def test_the_cost_policy_lets_a_copy_draft_past_the_window(policy):
    """The window rule bounds exited tokens waiting; verified copies under the cost policy, which sizes them, reach
    `ngram_draft` (a long copy drafts long), and greedy output stays the full model's."""
    from early_exit_router.decode.drafting import propose_rows

    model = tiny_llama(0)
    span = prompt(7, length=30)
    ids = torch.cat([span, torch.tensor([[1]]), span[:, :10]], dim=1)
    router = EarlyExitRouter.from_model(
        model, exit_layers=[1, 3], policy=policy, ngram_draft=24, max_pending=4, ngram_tree_nodes=0
    )
    decoder = router.decoder(mode="verify")
    request = DecodeRequest(max_new_tokens=40, eos_token_ids=frozenset())
    row = decoder.join(ids, request, TokenSelector(SamplingParams(), router.stack.device))
    row.tokens[:] = ids[0].tolist()  # the context before the first new token: a copy 10 tokens in
    (proposal,), _ = propose_rows(decoder, [4], trees=False)
    assert proposal.tokens == ids[0, 10:34].tolist()[: 24 if policy == "cost" else 4] and proposal.run == 10
    out = router.generate(ids, max_new_tokens=40, mode="verify")
    assert torch.equal(out.sequences, model.generate(ids, max_new_tokens=40, do_sample=False))
    assert_cache_matches_full_forward(model, out.sequences, out.cache)


def counting_hooks(router):
    """Forward-call counters on the LM head, every adapter, gate and the trimmed draft head."""
    calls = {"lm_head_rows": 0, "adapters": 0, "gates": 0}
    stack = router.stack

    def head(module, args):
        calls["lm_head_rows"] += args[0].reshape(-1, args[0].shape[-1]).shape[0]

    def named(key):
        def hook(module, args):
            calls[key] += 1

        return hook

    handles = [stack.lm_head.register_forward_pre_hook(head)]
    handles += [m.register_forward_pre_hook(named("adapters")) for m in router.heads.adapters.values()]
    handles += [m.register_forward_pre_hook(named("gates")) for m in router.heads.gates.values()]
    return calls, handles


def generate_counting(router, ids, max_new_tokens: int, mode: str):
    """(output, forward-call counts of `counting_hooks`) of one generate call; the hooks are removed after it."""
    calls, handles = counting_hooks(router)
    try:
        return router.generate(ids, max_new_tokens=max_new_tokens, mode=mode), calls
    finally:
        for h in handles:
            h.remove()


def test_plain_fallback_is_token_identical_and_runs_no_head_and_no_gate():
    model = tiny_llama(0)
    ids = prompt(0)
    ref = model.generate(ids, max_new_tokens=20, do_sample=False)
    router = EarlyExitRouter.from_model(
        model, exit_layers=[1, 3], probe_interval=0, acceptance_prior=0.2, high_conf_threshold=0.0, low_conf_threshold=0
    )
    router.heads.add_gates(32)
    router.cost_model = TINY["steep"]
    out, calls = generate_counting(router, ids, 20, "verify")
    assert torch.equal(out.sequences, ref)
    assert out.stats.plain_share == pytest.approx(19 / 20)  # every decode step; the prefill's token is not one
    assert out.stats.policy_cycles == {"plain": 19}
    assert calls == {"lm_head_rows": 20, "adapters": 0, "gates": 0}  # one row per token, nothing at the exits
    assert_cache_matches_full_forward(model, out.sequences, out.cache)


def test_probes_score_the_exits_at_a_bounded_rate_and_back_off_from_exits_that_cannot_pay():
    model = tiny_llama(0)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], probe_interval=4, acceptance_prior=0.2)
    router.cost_model = TINY["steep"]
    policy = DraftPolicy.for_config(router.cost_model, router.config, router.heads)
    assert all(0.2 < policy.draft_break_even(i) for i in range(2))  # the prior is below where drafting pays
    out, calls = generate_counting(router, prompt(0), 21, "verify")
    assert out.stats.probes == 2  # plain steps 0 and 8 of 20: gaps of 8, then 16, while the estimates stay low
    assert calls["adapters"] == 2 * 2  # both exits' draft heads, on probe steps only
    ref = model.generate(prompt(0), max_new_tokens=21, do_sample=False)
    assert torch.equal(out.sequences, ref)


def test_the_probe_schedule_doubles_an_unpaying_exits_gap_up_to_a_bound_and_restores_it_once_it_pays():
    schedule, seen = ProbeSchedule(4), []
    for step in range(200):
        for i in schedule.due(step, 2):
            seen.append((i, step))
            schedule.probed(i, step, pays=i == 0 or step >= 100)
    exit_1 = [step for i, step in seen if i == 1]
    assert [step for i, step in seen if i == 0] == list(range(0, 200, 4))  # it pays: every interval
    assert exit_1[:6] == [0, 8, 24, 56, 88, 120] and 32 == 4 * MAX_PROBE_BACKOFF  # doubling, then capped at 32
    assert exit_1[6:9] == [124, 128, 132]  # it pays again: back to every interval
    assert ProbeSchedule(0).due(0, 2) == set()  # probe_interval 0: never


def test_an_exits_break_even_acceptance_is_where_its_best_draft_starts_beating_plain_decoding():
    policy = DraftPolicy(TINY["quirky"], [1, 3], [False, False])
    threshold = policy.plain_rate * (1 + policy.margin)
    for i in range(2):
        a = policy.draft_break_even(i)
        rate = [policy.best_draft(x, lambda d, i=i: policy.exit_cycle_ms(i, d), 8)[1] for x in (a - 1e-3, a)]
        assert 0 < a <= 1 and rate[0] <= threshold < rate[1]
    assert DraftPolicy(TINY["steep"], [1, 3], [False, False]).draft_break_even(1) == float("inf")  # never pays


@pytest.mark.parametrize("trial", range(6))
def test_trimmed_drafts_in_verify_mode_equal_greedy_across_random_thresholds(trial):
    rng = random.Random(700 + trial)
    model = tiny_llama(trial % 3)
    ids = prompt(trial, length=rng.randint(3, 9))
    n = rng.randint(8, 30)
    ref = model.generate(ids, max_new_tokens=n, do_sample=False)
    router = EarlyExitRouter.from_model(
        model,
        exit_layers=[1, 3],
        draft_vocab_size=rng.choice([8, 32, 64]),
        high_conf_threshold=rng.uniform(0.05, 0.2),  # the tiny heads reach it: exits draft
        low_conf_threshold=0.0,
        max_pending=rng.randint(1, 8),
        acceptance_prior=rng.choice([0.6, 0.9]),
        ngram_tier=rng.random() < 0.5,
    )
    router.cost_model = TINY["flat"]  # drafting pays
    out = router.generate(ids, max_new_tokens=n, mode="verify")
    assert torch.equal(out.sequences, ref)
    assert any(k.startswith("exit") for k in out.stats.policy_cycles), out.stats.policy_cycles
    assert out.stats.drafts_judged > 0  # drafts happened and the deep pass judged them
    assert_cache_matches_full_forward(model, out.sequences, out.cache)


def test_the_draft_head_covers_only_its_token_set():
    model = tiny_llama(0)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], draft_vocab_size=16)
    from early_exit_router.heads.draft import draft_logits

    draft = router.heads.draft_head(router.stack, 16)
    logits = draft_logits(router.stack, router.heads.adapter(1), draft, torch.randn(1, 32))
    assert logits.shape == (1, VOCAB)
    assert torch.isfinite(logits[0, :16]).all() and torch.isinf(logits[0, 16:]).all()
    full = router.stack.unembed(router.stack.final_norm(router.heads.adapter(1)(torch.randn(1, 32))))
    assert full.shape == (1, VOCAB)
    assert router.heads.draft_head(router.stack, VOCAB) is None  # the whole vocabulary: the full head


def test_single_token_matches_are_opt_in_and_reported_with_their_length():
    from early_exit_router import RouterConfig
    from early_exit_router.routing.ngram import ngram_match

    assert ngram_match([5, 9, 3, 5], 4, 2) == ([], 0, 0)  # no repeated pair
    assert ngram_match([5, 9, 3, 5], 4, 2, min_ngram=1) == ([9, 3], 1, 1)
    assert ngram_match([1, 2, 7, 1, 2], 4, 3, min_ngram=1) == ([7, 1, 2], 2, 2)  # the longest match wins
    with pytest.raises(ValueError, match="ngram_min_size"):
        RouterConfig(ngram_size=3, ngram_min_size=4)


@pytest.mark.parametrize("sizes", [(4, 2), (3, 1), (2, 2)])
def test_the_context_index_answers_as_a_scan_of_the_context_as_it_grows_and_is_cut_back(sizes):
    """The decoder's n-gram lookups come from an index kept up to date (cut back before rejected drafts are
    dropped): every answer must be `ngram_match`'s on the context as it is then."""
    from early_exit_router.routing.ngram import ContextIndex, ngram_match

    rng = random.Random(sum(sizes))
    tokens = [rng.randrange(4) for _ in range(12)]  # four ids: many repeats, long matches
    index = ContextIndex(*sizes)
    for _ in range(400):
        draft = rng.choice([1, 3, 8])
        assert index.lookup(tokens, draft) == ngram_match(tokens, sizes[0], draft, sizes[1]), tokens
        if rng.random() < 0.3 and len(tokens) > 3:  # a rejection: the newest tokens go
            count = rng.randrange(1, min(6, len(tokens) - 2))
            index.cut(tokens, len(tokens) - count)
            del tokens[-count:]
        else:
            tokens += [rng.randrange(4) for _ in range(rng.randrange(1, 4))]
    assert len(tokens) > 100  # it grew well past the prompt


def test_a_lookup_in_a_long_context_does_not_scan_it():
    """A lookup costs the same dictionary reads at 200 and at 8,000 tokens: the context is never walked."""
    from early_exit_router.routing.ngram import ContextIndex

    class Counting(list):
        reads = 0

        def __getitem__(self, key):
            Counting.reads += 1
            return super().__getitem__(key)

        def __iter__(self):  # a walk over the context reads every token
            Counting.reads += len(self)
            return super().__iter__()

    reads = []
    for length in (200, 8000):
        tokens = Counting(random.Random(length).randrange(50_000) for _ in range(length))
        index = ContextIndex(4, 2)
        index.lookup(tokens, 8)  # the first lookup indexes the prompt, once
        tokens.append(7)
        Counting.reads = 0
        index.lookup(tokens, 8)
        reads.append(Counting.reads)
    assert reads[0] == reads[1] < 20, reads


def test_the_store_respects_its_memory_bound():
    store = SuffixStore(max_tokens=100, max_ngram=4)
    rng = random.Random(0)
    sequences = [[rng.randrange(1000) for _ in range(30)] for _ in range(50)]
    for seq in sequences:
        store.add(seq)
        assert store.num_tokens <= 100
        assert store.index_size <= (4 - 2 + 1) * 100
    assert store.lookup(sequences[-1][:10], 5) == (sequences[-1][10:15], 4, 10)  # the newest is remembered
    assert store.lookup(sequences[0][:10], 5) == ([], 0, 0)  # the oldest was dropped
    store.add(list(range(500)))  # longer than the bound: its end is kept
    assert store.num_tokens == 100 and len(store) == 1


def test_the_store_drafts_across_calls_and_stays_exact():
    model = tiny_llama(1)
    ids = prompt(3, length=5)
    ref = model.generate(ids, max_new_tokens=24, do_sample=False)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], acceptance_prior=0.9)
    router.cost_model = TINY["flat"]
    router.config = router.config.replace(active_exit_layers=[])  # the n-gram tier alone
    first = router.generate(ids, max_new_tokens=24, mode="verify")
    second = router.generate(ids, max_new_tokens=24, mode="verify")
    assert torch.equal(first.sequences, ref) and torch.equal(second.sequences, ref)
    assert second.stats.exit_histogram.get(-1, 0) > first.stats.exit_histogram.get(-1, 0)
    assert second.stats.exit_histogram.get(-1, 0) >= 12  # the earlier answer is copied, and verified
    other = EarlyExitRouter.from_model(tiny_llama(1), exit_layers=[1, 3], acceptance_prior=0.9)
    other.cost_model = TINY["flat"]
    assert other.ngram_store() is not router.ngram_store()  # never shared between routers
    router.config = router.config.replace(ngram_store_tokens=0)
    assert router.ngram_store() is None


def test_a_calls_own_config_decides_whether_it_reads_and_adds_to_the_store():
    model = tiny_llama(1)
    ids = prompt(3, length=5)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], acceptance_prior=0.9, active_exit_layers=[])
    router.cost_model = TINY["flat"]
    router.generate(ids, max_new_tokens=24, mode="verify")
    store = router.ngram_store()
    held = store.num_tokens
    apart = router.generate(ids, max_new_tokens=24, mode="verify", config={"ngram_store_tokens": 0})
    assert router.ngram_store() is store and store.num_tokens == held  # not added to
    copied = router.generate(ids, max_new_tokens=24, mode="verify")  # the same request, reading the store
    assert apart.stats.exit_histogram.get(-1, 0) < copied.stats.exit_histogram.get(-1, 0)  # it did not read it
    router.config = router.config.replace(ngram_tier=False)
    assert router.ngram_store() is None
    on = router.generate(ids, max_new_tokens=24, mode="verify", config={"ngram_tier": True})
    assert on.stats.exit_histogram.get(-1, 0) >= 12  # it read the store the router keeps


QUIRKY = TINY["quirky"]  # slow at 2-4 positions and 2-7 head rows, as this project's 2-core CPU measured


def test_padding_picks_the_cheapest_measured_length_at_or_above_the_chunk():
    assert [QUIRKY.layer_pad(m) for m in range(1, 10)] == [1, 5, 5, 5, 5, 6, 7, 8, 9]  # 8 is only 6% below 7
    assert [QUIRKY.head_pad(m) for m in range(1, 9)] == [1, 8, 8, 8, 8, 8, 8, 8]
    assert QUIRKY.layers(6, 3) == pytest.approx(6 * 1.2) and QUIRKY.head(2) == pytest.approx(1.5)
    # a single position is never padded, even where 2 rows measured cheaper (bf16 on this project's CPU)
    cheaper_pair = CostModel.synthetic(6, [1.5, 1.2, 1.3], [3.7, 3.4, 4.2])
    assert cheaper_pair.layer_pad(1) == 1 and cheaper_pair.head_pad(1) == 1


@pytest.mark.parametrize("family", ["llama", "mistral-sliding", "qwen2-sliding", "gemma3_text"])
@pytest.mark.parametrize("mode", ["exit", "verify"])
def test_padded_chunks_keep_verify_exact_and_the_cache_equal_to_a_full_pass(family, mode):
    from .test_architectures import build

    model = tiny_llama(0) if family == "llama" else build(family)
    ids = prompt(2, length=6)
    ref = model.generate(ids, max_new_tokens=24, do_sample=False)
    router = EarlyExitRouter.from_model(
        model, exit_layers=[1, 3], acceptance_prior=0.9, high_conf_threshold=0.06, low_conf_threshold=0.0
    )
    router.cost_model = QUIRKY  # every deep chunk of 2-4 positions runs padded to 5, its head rows to 8
    out = router.generate(ids, max_new_tokens=24, mode=mode)
    assert out.stats.mean_fill_chunk > 1  # chunks of several positions ran (and were padded)
    if mode == "verify":
        assert torch.equal(out.sequences, ref)
    assert_cache_matches_full_forward(model, out.sequences, out.cache)


def test_an_exit_prior_below_break_even_keeps_the_exits_off_until_evidence():
    tracker = AcceptanceTracker(prior=0.5, kind_priors={"exit": 0.1})
    assert tracker.estimate(("exit", 0)) == 0.1 and tracker.estimate(("ngram", 2)) == 0.5
    tracker.observe(("exit", 0), True)
    assert tracker.estimate(("exit", 0)) == pytest.approx(0.1 + 0.15 * 0.9)
    policy = DraftPolicy(tiny_costs()["flat"], [1, 3], [False, False])
    assert (
        policy.plan(AcceptanceTracker(prior=0.5), 8, [NO_PROPOSAL]).kind == "exit"
    )  # flat costs: drafting pays at 0.5
    assert policy.plan(AcceptanceTracker(prior=0.5, kind_priors={"exit": 0.0}), 8, [NO_PROPOSAL]).kind == "plain"
    router = EarlyExitRouter.from_model(tiny_llama(0), exit_layers=[1, 3], ngram_tier=False, exit_acceptance_prior=0.0)
    router.cost_model = tiny_costs()["flat"]
    ids = prompt(0)
    out = router.generate(ids, max_new_tokens=3, mode="verify")
    assert not any(kind.startswith("exit") for kind in out.stats.policy_cycles)  # chains or exit trees
    assert torch.equal(out.sequences, tiny_llama(0).generate(ids, max_new_tokens=3, do_sample=False))
    with pytest.raises(ValueError, match="exit_acceptance_prior"):
        router.call_config({"exit_acceptance_prior": 1.5})


def test_an_exit_is_worth_asking_in_exit_mode_when_its_exit_rate_covers_the_asking():
    """STEEP at an exit after layer 10 of 30: an exit saves 19 layers (19 ms) and a head row (6 ms), less the fill's
    extra position in those layers (19 x 0.9 ms) and its checked head row (5 ms): 2.9 ms; asking costs 1 ms."""
    policy = DraftPolicy(STEEP, [10, 20], [False, False])
    assert policy.exit_saving_ms(0) == pytest.approx(2.9) and policy.consult_ms(0) == pytest.approx(1.0)
    assert policy.worth_consulting(0, 0.35) and not policy.worth_consulting(0, 0.34)
    assert policy.break_even_exit_rate(0) == pytest.approx(1.0 / 2.9)
    unchecked = DraftPolicy(STEEP, [10, 20], [False, False], check_share=0.0)
    assert unchecked.exit_saving_ms(0) == pytest.approx(7.9)  # no head row for the check
    gated_block = DraftPolicy(STEEP, [10, 20], [True, False], has_block=[True, False])
    assert gated_block.consult_ms(0) == pytest.approx(1.0 + STEEP.gate_ms + 1.0)  # and the block's layer


def count_asks(probe_interval: int, costs: CostModel, **overrides):
    model = tiny_llama(0)
    router = EarlyExitRouter.from_model(
        model,
        exit_layers=[1, 3],
        ngram_tier=False,
        probe_interval=probe_interval,
        high_conf_threshold=0.0,
        low_conf_threshold=0.0,
        holdback=0,  # exited tokens final at once: every ask is one token's (repairs would ask again)
        **overrides,
    )
    router.cost_model = costs
    return (model, *generate_counting(router, prompt(0), 21, "exit"))


def test_exit_mode_asks_no_exit_that_cannot_pay_and_probes_at_a_bounded_rate():
    never_pays = CostModel.synthetic(6, [1.0] * 16, [6.0] * 16, draft_head_ms=1000.0)
    model, out, calls = count_asks(0, never_pays)
    assert calls["adapters"] == 0 and out.stats.exit_histogram == {5: 21}  # every token ran the full depth
    assert out.stats.asks_skipped == {1: 20, 3: 20} and "tokens not asked at L1 20, L3 20" in out.stats.summary()
    assert torch.equal(out.sequences, model.generate(prompt(0), max_new_tokens=21, do_sample=False))
    # Probing every 4th skipped token: L1 is asked at steps 4, 8, ..., 20 (and, at threshold 0, every token asked
    # leaves there); L3 sees the other 15 tokens and is asked on every 4th of them.
    _, out, calls = count_asks(4, never_pays)
    assert calls["adapters"] == 5 + 3 and out.stats.exit_histogram == {1: 5, 3: 3, 5: 13}  # and the prefill's token
    assert out.stats.asks_skipped == {1: 20 - 5, 3: 15 - 3} and "exit rate L1" in out.stats.policy_estimates
    # Blocks of tokens follow their first token's decision, which the per-token rule does not price: all asked.
    _, out, calls = count_asks(0, never_pays, block_size=2)
    assert out.stats.asks_skipped == {} and calls["adapters"] > 0
    # Where asking pays, every token is asked at the first exit (and leaves there at threshold 0).
    _, out, calls = count_asks(4, tiny_costs()["flat"])
    assert out.stats.exit_histogram.get(1, 0) >= 17 and calls["adapters"] >= 17


def test_measured_lengths_are_fixed_and_between_them_costs_are_interpolated():
    table = CostModel([1.0, 2.0, 4.0, 8.0], [10.0, 12.0, 16.0, 24.0], 0.1, 0.0, 6, chunks=[1, 2, 4, 8])
    assert table.layers(1, 3) == pytest.approx(3.0) and table.layers(1, 6) == pytest.approx(6.0)
    assert table.head(16) == pytest.approx(48.0)  # past the longest: linear in the rows
    assert table.max_chunk == 8 and table.problems() == []
    quirky = CostModel([1.0, 3.0, 3.0, 1.2], [1.0, 3.0, 3.0, 1.5], 0.1, 0.0, 6, chunks=[1, 2, 3, 8])
    assert quirky.layer_pad(2) == 8 and quirky.layer_pad(1) == 1  # the cheapest measured length above


@pytest.mark.measured_costs
@pytest.mark.usefixtures("plausible_tables")
def test_cold_start_is_bounded_whatever_the_config_and_says_what_it_does(tmp_path, monkeypatch, caplog):
    """A config without a window (max_pending 10,000) measures the same fixed chunk lengths as any other, once, and
    one log line says so and where the table is kept; a later call (another max_pending) measures nothing."""
    import logging

    monkeypatch.setenv("EARLY_EXIT_ROUTER_CACHE", str(tmp_path))
    model = tiny_llama(0)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], max_pending=10_000)
    with caplog.at_level(logging.WARNING, logger="early_exit_router"):
        out = router.generate(prompt(0), max_new_tokens=8, mode="verify")
    assert list(router.costs().chunk_lengths) == list(costs.MEASURED_CHUNKS)
    lines = [r.getMessage() for r in caplog.records if "measuring" in r.getMessage()]
    assert len(lines) == 1 and str(tmp_path / "costs") in lines[0] and "(once;" in lines[0]
    assert torch.equal(out.sequences, model.generate(prompt(0), max_new_tokens=8, do_sample=False))
    monkeypatch.setattr(costs, "measure", lambda *a, **k: pytest.fail("measured again"))
    router.generate(prompt(0), max_new_tokens=4, mode="verify", config={"max_pending": 3})


SKEWED = CostModel.synthetic(6, [62.0] + [9.9] * 15, [6.0] * 16, draft_head_ms=0.1)  # measured while the CPU was busy


@pytest.mark.parametrize("mode", ["verify", "exit"])
def test_a_table_that_looks_wrong_is_not_drafted_from(mode):
    assert SKEWED.problems() and "under 0.5x one position" in SKEWED.problems()[0]
    model = tiny_llama(0)
    ids = prompt(0)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], high_conf_threshold=0.0, low_conf_threshold=0.0)
    router.cost_model = SKEWED
    out, calls = generate_counting(router, ids, 20, mode)
    assert torch.equal(out.sequences, model.generate(ids, max_new_tokens=20, do_sample=False))  # plain, so exact
    assert out.stats.exit_histogram == {5: 20} and out.stats.policy_cycles == {}
    assert calls["adapters"] == 0 and calls["lm_head_rows"] == 20
    assert "cost model looks wrong" in out.stats.fallback and "decoded plainly" in out.stats.summary()
    router.cost_model = TINY["flat"]
    assert router.generate(ids, max_new_tokens=20, mode=mode).stats.fallback is None


def test_a_measurement_that_looks_wrong_is_taken_again_and_never_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("EARLY_EXIT_ROUTER_CACHE", str(tmp_path))

    router = EarlyExitRouter.from_model(tiny_llama(0), exit_layers=[1, 3])
    key = costs.cost_key(router.stack, 0)
    skewed, flat = (dataclasses.replace(table, key=key) for table in (SKEWED, TINY["flat"]))
    tables = [skewed, flat]
    monkeypatch.setattr(costs, "measure", lambda *a, **k: tables.pop(0))
    assert cost_model_for(router.stack, router.heads, 0) == flat  # the second try
    assert len(list((tmp_path / "costs").glob("*.json"))) == 1
    refreshed = [skewed, skewed]
    monkeypatch.setattr(costs, "measure", lambda *a, **k: refreshed.pop(0))
    assert cost_model_for(router.stack, router.heads, 0, refresh=True) is skewed  # kept for this process only
    assert costs.load_cached(key) == flat and not refreshed


def test_a_table_the_decoders_steps_do_not_fit_is_measured_again(monkeypatch):
    """Decoders time their plain steps; when the table predicts steps far from what they take, the router measures
    it again on the next call."""
    from early_exit_router import api

    slow = CostModel.synthetic(6, [100.0] * 16, [600.0] * 16)  # predicts a 1.2 s step; the tiny model takes ~1 ms
    asked = []

    def measured(stack, heads, config, refresh=False):
        asked.append(refresh)
        return slow

    monkeypatch.setattr(api, "config_costs", measured)
    router = EarlyExitRouter.from_model(tiny_llama(0), exit_layers=[1, 3], active_exit_layers=[], ngram_tier=False)
    router.generate(prompt(0), max_new_tokens=40, mode="verify")
    assert asked == [False] and slow.stale  # 39 plain steps, each far below the table's
    router.generate(prompt(0), max_new_tokens=4, mode="verify")
    assert asked == [False, True]


def test_a_table_measured_on_another_processor_is_not_reused(monkeypatch):
    """A virtual machine may come back on another host's processor: the cost key names the CPU model, so a cached
    table from one model of processor is never read on another."""
    router = EarlyExitRouter.from_model(tiny_llama(0), exit_layers=[1, 3])
    monkeypatch.setattr(table_key, "cpu_model", lambda: "Vendor A 9000")
    first = costs.cost_key(router.stack, 0)
    monkeypatch.setattr(table_key, "cpu_model", lambda: "Vendor B 7000")
    second = costs.cost_key(router.stack, 0)
    assert first["device"] == f"cpu:Vendor A 9000 x{os.cpu_count()}" and second["device"].startswith("cpu:Vendor B")
    assert costs.cache_path(first) != costs.cache_path(second)
    monkeypatch.undo()
    assert costs.cpu_model().strip() and costs.cpu_model() in costs.cost_key(router.stack, 0)["device"]


def test_chunks_from_prepacked_weights_may_cost_less_than_one_position_and_are_held_to_the_shortest_chunk():
    """Where a pass's products run from prepacked weights and a plain step's do not (float32 on some CPUs), a chunk
    may cost less than one position: the table is plausible then, and a chunk is compared with the shortest chunk."""
    cheap_chunks = CostModel.synthetic(6, [2.0] + [0.8] * 15, [8.0] + [3.0] * 15)
    assert cheap_chunks.problems()  # no packing named in its key: one position is the reference
    packed = dataclasses.replace(cheap_chunks, key={"packed_min_rows": 2})
    assert packed.problems() == []
    skewed = dataclasses.replace(packed, layer_ms=[2.0, 3.0] + [0.8] * 14)
    assert "under 0.5x 2 positions' 3 ms" in skewed.problems()[0]


def test_a_table_measured_while_other_work_held_the_cpus_is_measured_again_a_bounded_number_of_times(
    tmp_path, monkeypatch, caplog
):
    """It can pass every check of its own with the contention's prices: the next process measures again, until a
    measurement is not busy or BUSY_RETRIES busy ones in a row make it the machine's table (a bounded cold start)."""
    import logging

    monkeypatch.setenv("EARLY_EXIT_ROUTER_CACHE", str(tmp_path))
    router = EarlyExitRouter.from_model(tiny_llama(0), exit_layers=[1, 3])
    flat = dataclasses.replace(TINY["flat"], key=costs.cost_key(router.stack, 0))
    measured = []
    monkeypatch.setattr(costs, "measure", lambda *a, **k: measured.append(1) or flat)
    monkeypatch.setattr(costs, "other_work_share", lambda before, after: 0.6)
    with caplog.at_level(logging.WARNING, logger="early_exit_router"):
        for count in range(1, costs.BUSY_RETRIES + 1):
            assert cost_model_for(router.stack, router.heads, 0).busy_measurements == count
            assert costs.load_cached(flat.key).busy_measurements == count and len(measured) == count
    messages = [r.getMessage() for r in caplog.records if "held 60% of the CPUs" in r.getMessage()]
    assert len(messages) == costs.BUSY_RETRIES and "the next process measures again" in messages[0]
    assert "kept as this machine's" in messages[-1] and "profile --refresh" in messages[-1]
    measuring = [r.getMessage() for r in caplog.records if "measuring this model's costs" in r.getMessage()]
    assert "(once;" in measuring[0] and all("(again: the cached table was measured beside" in m for m in measuring[1:])
    assert cost_model_for(router.stack, router.heads, 0).busy_measurements == costs.BUSY_RETRIES
    assert len(measured) == costs.BUSY_RETRIES  # the machine's table now: not measured again
    monkeypatch.setattr(costs, "other_work_share", lambda before, after: 0.01)  # an idle machine
    assert cost_model_for(router.stack, router.heads, 0, refresh=True).busy_measurements == 0
    assert costs.load_cached(flat.key) == flat
    monkeypatch.setattr(costs, "other_work_share", lambda before, after: 0.6)
    cost_model_for(router.stack, router.heads, 0, refresh=True)
    monkeypatch.setattr(costs, "other_work_share", lambda before, after: None)  # not known (not Linux): not busy
    assert cost_model_for(router.stack, router.heads, 0) == flat and costs.load_cached(flat.key) == flat


def test_the_cpu_accounting_sees_other_work_and_says_nothing_over_a_span_too_short_to_count():
    from early_exit_router.routing.cpu_load import MIN_SPAN_S, CpuReading, other_work_share, read_cpu

    before = CpuReading(busy_s=10.0, own_s=1.0, wall_s=100.0, cpus=2)
    # over 2 s of 2 CPUs: 3 s busy, 1 of them this process's: other work held half
    assert other_work_share(before, CpuReading(13.0, 2.0, 102.0, 2)) == pytest.approx(0.5)
    assert other_work_share(before, CpuReading(12.0, 3.0, 102.0, 2)) == 0.0  # this process alone
    assert other_work_share(before, CpuReading(10.5, 1.0, 100.0 + MIN_SPAN_S / 2, 2)) is None
    assert other_work_share(None, before) is None
    reading = read_cpu()
    if reading is None:
        pytest.skip("this system does not provide /proc/stat")
    assert reading.cpus >= 1 and reading.busy_s > 0 and reading.own_s > 0

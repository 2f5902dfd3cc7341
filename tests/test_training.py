"""Self-distillation of exit heads and gates, on tiny random models."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from early_exit_router import EarlyExitRouter
from early_exit_router.training.config import TrainingConfig
from early_exit_router.training.distill import distillation_loss, train_heads, warm_start
from early_exit_router.training.gates import train_gates
from early_exit_router.training.head_report import (
    cascade,
    exit_signals,
    format_table,
    quality_table,
    suggest_high_threshold,
)
from early_exit_router.training.hidden_states import HiddenStateCache, build_cache, head_logits

from .conftest import MIXED, VOCAB, prompt, tiny_llama, tiny_tokenizer


def corpus(n_seqs: int = 12, length: int = 64, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (n_seqs, length), generator=g).tolist()


def mean_kl(router, cache, layer) -> float:
    stack = router.stack
    with torch.no_grad():
        teacher = stack.unembed(cache.final_normed).float()
        student = head_logits(stack, router.heads.adapter(layer), cache.exits[layer], cache.chunk_len)
        return distillation_loss(student, teacher, cache.next_token, 0.0).item()


def test_cache_holds_the_model_own_hidden_states():
    model = tiny_llama(0)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3])
    seqs = corpus(4, 32)
    cache = build_cache(router.stack, [1, 3], seqs, chunk_len=32, progress=False)
    assert len(cache) == 4 * 32
    with torch.no_grad():
        out = model(torch.tensor(seqs[:1]), output_hidden_states=True)
        final = model.model(torch.tensor(seqs[:1])).last_hidden_state  # after the final norm
    torch.testing.assert_close(cache.exits[3][:32], out.hidden_states[4][0], atol=1e-5, rtol=0)
    torch.testing.assert_close(cache.final_normed[:32], final[0], atol=1e-5, rtol=0)
    assert cache.next_token[:31].tolist() == seqs[0][1:] and cache.next_token[31] == -1


@pytest.mark.parametrize("adapter", ["linear", "lowrank", "postnorm", "block", "residual_block"])
def test_a_few_steps_lower_the_distillation_loss_and_leave_the_base_frozen(adapter):
    model = tiny_llama(0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], adapter=adapter)
    cache = build_cache(router.stack, [1, 3], corpus(), chunk_len=64, progress=False)
    start = {e: mean_kl(router, cache, e) for e in (1, 3)}
    report = train_heads(router, cache, TrainingConfig(max_steps=40, batch_tokens=128, lr=1e-2), progress=False)
    for e in (1, 3):
        assert mean_kl(router, cache, e) < 0.8 * start[e], (e, start[e], mean_kl(router, cache, e))
    assert report.steps == 40 and set(report.loss_last) == {1, 3}
    for k, v in router.unpatch().state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.requires_grad for p in model.parameters())  # frozen only while training


def test_a_warm_started_residual_block_trains_alone_and_the_other_exits_keep_their_heads():
    """The shipped recipe: postnorm heads at every exit, then a residual block at one exit that starts as exactly
    its postnorm head, trains alone, and has its warm post-norm map learn at the reduced rate."""
    model = tiny_llama(0)
    source = EarlyExitRouter.from_model(model, exit_layers=[1, 3], adapter="postnorm")
    cache = build_cache(source.stack, [1, 3], corpus(), chunk_len=64, progress=False)
    train_heads(source, cache, TrainingConfig(max_steps=20, batch_tokens=128, lr=1e-2), progress=False)
    source.heads.set_draft_token_ranking(torch.randperm(VOCAB), VOCAB)
    router = EarlyExitRouter.from_model(
        tiny_llama(0), exit_layers=[1, 3], adapter="postnorm", exit_adapters={1: "residual_block"}
    )
    warm = warm_start(router, source.heads, [1, 3])
    assert torch.equal(router.heads.draft_token_ranking(), source.heads.draft_token_ranking())
    assert {id(p) for p in warm} == {
        id(p) for p in [*router.heads.adapter(1).post.parameters(), *router.heads.adapter(3).parameters()]
    }
    assert mean_kl(router, cache, 1) == pytest.approx(mean_kl(source, cache, 1), abs=1e-5)  # the same head
    kept = {k: v.clone() for k, v in router.heads.adapter(3).state_dict().items()}
    start = mean_kl(router, cache, 1)
    cfg = TrainingConfig(max_steps=40, batch_tokens=128, lr=1e-2, train_exits=[1], warm_lr_scale=0.1)
    report = train_heads(router, cache, cfg, progress=False, warm=warm)
    assert set(report.loss_last) == {1} and mean_kl(router, cache, 1) < start
    for k, v in router.heads.adapter(3).state_dict().items():
        assert torch.equal(v, kept[k]), k
    assert router.heads.adapter(1).mix.abs().sum() > 0  # the block came in
    with pytest.raises(ValueError, match="Cannot warm-start a 'postnorm' adapter at exit 1 from a 'residual_block'"):
        warm_start(source, router.heads, [1])


def test_the_hidden_state_cache_saves_and_loads_the_exits_asked_for(tmp_path):
    router = EarlyExitRouter.from_model(tiny_llama(0), exit_layers=[1, 3])
    cache = build_cache(router.stack, [1, 3], corpus(2, 32), chunk_len=32, progress=False)
    cache.save(tmp_path / "states.pt")
    loaded = HiddenStateCache.load(tmp_path / "states.pt", [3])
    assert set(loaded.exits) == {3} and loaded.chunk_len == 32
    assert torch.equal(loaded.exits[3], cache.exits[3]) and torch.equal(loaded.next_token, cache.next_token)
    with pytest.raises(ValueError, match="do not cover exit layers \\[2\\]"):
        HiddenStateCache.load(tmp_path / "states.pt", [2, 3])
    joined = HiddenStateCache.concat([cache, cache])
    assert joined.num_chunks == 4 and torch.equal(joined.exits[1][64:], cache.exits[1])
    with pytest.raises(ValueError, match="different exit layers"):
        HiddenStateCache.concat([cache, HiddenStateCache.load(tmp_path / "states.pt", [3])])
    with pytest.raises(ValueError, match="chunks of \\[16, 32\\]"):
        HiddenStateCache.concat([cache, build_cache(router.stack, [1, 3], corpus(2, 32), chunk_len=16, progress=False)])
    with pytest.raises(ValueError, match="less than one 256-token chunk"):
        build_cache(router.stack, [1, 3], corpus(2, 32), chunk_len=256, progress=False)


def test_cross_entropy_mixing_trains_and_changes_what_is_learned():
    trained = {}
    for ce_weight in (0.0, 0.5):
        router = EarlyExitRouter.from_model(tiny_llama(0), exit_layers=[2])
        cache = build_cache(router.stack, [2], corpus(), chunk_len=64, progress=False)
        start = mean_kl(router, cache, 2)
        cfg = TrainingConfig(max_steps=40, batch_tokens=128, lr=1e-2, ce_weight=ce_weight, seed=0)
        report = train_heads(router, cache, cfg, progress=False)
        assert report.loss_last[2] < report.loss_first[2], report  # the mixed loss goes down
        if ce_weight == 0.0:
            assert mean_kl(router, cache, 2) < 0.9 * start  # pure distillation moves toward the full model
        trained[ce_weight] = router.heads.adapter(2).proj.weight.detach().clone()
    assert not torch.allclose(trained[0.0], trained[0.5], atol=1e-4)  # the CE term changes the heads


def trained_router():
    """A tiny router with trained heads, its training and held-out caches and its training config."""
    router = EarlyExitRouter.from_model(tiny_llama(0), exit_layers=[1, 3], **MIXED)
    cache = build_cache(router.stack, [1, 3], corpus(), chunk_len=64, progress=False)
    train, holdout = cache.split(0.2, seed=0)
    cfg = TrainingConfig(max_steps=20, batch_tokens=128, lr=1e-2, gate_steps=50)
    train_heads(router, train, cfg, progress=False)
    return router, train, holdout, cfg


def test_gates_train_and_switching_them_off_equals_having_none():
    router, train, holdout, cfg = trained_router()
    without_gates = router.generate(prompt(0), max_new_tokens=30)
    quality = train_gates(router, train, holdout, cfg)
    assert set(quality) == {1, 3}
    assert all(0 <= q[k] <= 1 for q in quality.values() for k in ("accuracy", "auc", "saved_at_recall"))
    assert set(router.heads.gates) == {"1", "3"}
    assert {q["fit_positions"] for q in quality.values()} == {len(train)}
    capped = train_gates(router, train, holdout, dataclasses.replace(cfg, gate_max_positions=train.chunk_len + 1))
    assert {q["fit_positions"] for q in capped.values()} == {train.chunk_len}  # the cap draws whole chunks
    router.config = router.config.replace(use_gate=False)
    off = router.generate(prompt(0), max_new_tokens=30)
    assert torch.equal(off.sequences, without_gates.sequences)
    assert off.stats.exit_histogram == without_gates.stats.exit_histogram


def test_quality_report_replays_the_cascade():
    router = EarlyExitRouter.from_model(tiny_llama(0), exit_layers=[1, 3], **MIXED)
    cache = build_cache(router.stack, [1, 3], corpus(6), chunk_len=64, progress=False)
    signals = exit_signals(router, cache)
    rows = quality_table(signals)
    # Untrained adapters are the logit lens: both agreement columns agree exactly.
    for row in rows:
        assert row.lens_agreement == row.trained_agreement
        # the full model's token among the head's k highest: at least as often as at its top, more so as k grows
        top = row.top_k_agreement
        assert row.trained_agreement <= top[2] <= top[3] <= top[5] <= 1.0 and top[5] > row.trained_agreement
    for sig in signals:  # the rank is 0 exactly where the head's top-1 is the full model's (no ties in float logits)
        assert torch.equal(sig.teacher_rank == 0, sig.agree)
    assert "top-2 / top-3 / top-5" in format_table("t", rows)
    assert 0 < sum(r.exit_share for r in rows) <= 1
    # The cascade lets a position leave once, at its first accepting exit.
    everything = cascade(signals, [torch.ones(len(cache), dtype=torch.bool)] * 2)
    assert everything[0][1] == 1.0 and everything[1][1] == 0.0
    assert suggest_high_threshold(signals, router.config, VOCAB, target=0.0)[0] == 0.30  # lowest in the sweep
    assert suggest_high_threshold(signals, router.config, VOCAB, target=1.01) == (1.0, 0.0, 1.0)  # unreachable


def test_auc_and_saved_share_on_known_scores():
    from early_exit_router.training.gates import roc_auc, saved_at_recall

    positive = torch.tensor([True, True, False, False])
    assert roc_auc(torch.tensor([0.9, 0.8, 0.2, 0.1]), positive) == 1.0
    assert roc_auc(torch.tensor([0.1, 0.2, 0.8, 0.9]), positive) == 0.0
    assert roc_auc(torch.tensor([0.5, 0.5, 0.5, 0.5]), positive) == 0.5  # ties count half
    assert roc_auc(torch.tensor([0.9, 0.3, 0.5, 0.1]), positive) == 0.75
    # Keeping both positives means a threshold at 0.8: the two negatives below it are skipped.
    assert saved_at_recall(torch.tensor([0.9, 0.8, 0.2, 0.1]), positive, 0.95) == 0.5


def test_gate_context_replays_ngram_matches_and_running_acceptance():
    from early_exit_router.training.gates import gate_context, ngram_proposals
    from early_exit_router.training.hidden_states import HiddenStateCache

    tokens = [1, 2, 3, 1, 2, 3, 1, 2]
    cache = HiddenStateCache({}, torch.zeros(8, 4), torch.tensor(tokens[1:] + [-1]), chunk_len=8)
    features = gate_context(cache, torch.ones(8), ngram_proposals(cache, 2, 2), prior=0.5, rate=0.5)
    # known tokens: [?, 2, 3, 1, 2, 3, 1, 2]; "2 3" recurs at 5, "3 1" at 6, "1 2" at 7
    assert features[:, 0].tolist() == [0, 0, 0, 0, 0, 1, 1, 1]
    assert features[:, 1].tolist() == [0.5, 0.75, 0.875, 0.9375, 0.96875, 0.984375, 0.9921875, 0.99609375]


def test_gates_with_context_train_save_and_steer_nothing_in_verify_mode(tmp_path):
    from early_exit_router.heads.checkpoint import load_router

    router, train, holdout, cfg = trained_router()
    model = router.model
    quality = train_gates(router, train, holdout, cfg, context=True)
    assert all(0 <= q["confidence_auc"] <= 1 for q in quality.values())
    gate = router.heads.gate(1)
    assert gate.uses_context and gate.context.weight.abs().sum() > 0  # the context weights were fitted
    expected = model.generate(prompt(0), max_new_tokens=20, do_sample=False)
    out = router.generate(prompt(0), max_new_tokens=20, mode="verify")
    assert torch.equal(out.sequences, expected)
    exit_out = router.generate(prompt(0), max_new_tokens=20, mode="exit")
    router.save_pretrained(tmp_path / "r")
    fresh = EarlyExitRouter._from_saved(tiny_llama(0), None, load_router(tmp_path / "r"), None, "tiny")
    assert fresh.heads.gate(1).uses_context
    assert torch.equal(fresh.generate(prompt(0), max_new_tokens=20, mode="exit").sequences, exit_out.sequences)


def test_context_gates_see_the_ngram_match_of_the_current_context(monkeypatch):
    """The decoder memoises the gates' n-gram features per position (from the step's own proposal scan when there
    is one); every gate call must still see what a fresh scan of the context would say, rollbacks included."""
    from early_exit_router.decode import drafting
    from early_exit_router.routing.ngram import ngram_match

    router, train, holdout, cfg = trained_router()
    train_gates(router, train, holdout, cfg, context=True)
    original, calls = drafting.gate_probability_at, []

    def checked(dec, i, gate, last, logits=None):
        out = original(dec, i, gate, last, logits)
        row = dec.rows[0]
        found = ngram_match(row.tokens, dec.config.ngram_size, 1, dec.config.ngram_min_size).tokens
        assert row.ngram_memo == (len(row.tokens), found[0] if found else -1)
        calls.append(bool(found))
        return out

    monkeypatch.setattr(drafting, "gate_probability_at", checked)
    repetitive = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    for mode in ("exit", "verify"):
        for policy in ("fixed", "cost"):
            config = {"mode": mode, "policy": policy, "gate_threshold": 0.0}
            router.generate(repetitive, max_new_tokens=24, config=config)
    assert calls and any(calls) and not all(calls)


def test_a_rollback_forgets_the_gates_ngram_memo():
    """A rolled-back context can regrow to the same length with another tail: the gate must then see the new
    context's n-gram match, not the one memoised before the rollback."""
    from early_exit_router.decode.drafting import gate_probability_at
    from early_exit_router.decode.sampling import SamplingParams, TokenSelector
    from early_exit_router.decode.stopping import DecodeRequest

    router, train, holdout, cfg = trained_router()
    train_gates(router, train, holdout, cfg, context=True)
    decoder = router.decoder({"policy": "fixed"}, "verify")
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7]])
    decoder.prefill(ids, torch.ones_like(ids), [DecodeRequest(4)], [TokenSelector(SamplingParams(), ids.device)])
    row, gate, last = decoder.rows[0], router.heads.gate(router.config.exit_layers[0]), torch.zeros(1, 32)
    row.tokens[-1] = 8  # the context now ends in a repeated bigram (7, 8): the tier proposes 5
    seen = []
    original = type(gate).forward

    def recording(self, hidden, context=None, *rest):
        seen.append(None if context is None else float(context[0, 0]))
        return original(self, hidden, context, *rest)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(gate), "forward", recording)
        gate_probability_at(decoder, 0, gate, last)  # memoises "a match" for this length
        row.drop(2)  # a rollback
        row.tokens.extend([40, 41])  # the same length again, now without any repeated suffix
        gate_probability_at(decoder, 0, gate, last)
    assert seen == [1.0, 0.0]


def test_gate_features_replayed_offline_equal_those_the_decoder_computed_online():
    """Both go through `routing/gate_context.py`: every context feature a gate saw while decoding (the n-gram tier's
    next copy, the exit's running top-1 agreement) is what training's replay computes from the same text and the same
    verdicts, from the same prior (the config's exit prior, not a constant of its own)."""
    from early_exit_router.decode import drafters, drafting
    from early_exit_router.routing import gate_context
    from early_exit_router.routing.policy import AcceptanceTracker

    router, train, holdout, cfg = trained_router()
    train_gates(router, train, holdout, cfg, context=True)
    router.config = router.config.replace(exit_acceptance_prior=0.3, gate_threshold=0.0, mode="exit", policy="fixed")
    calls, seen, verdicts = [], [], {}  # per gate call: where, and what it saw; per exit: the verdicts so far
    original_gate, original_features = drafting.gate_probability_at, gate_context.context_features
    original_observe = AcceptanceTracker.observe

    def gate_at(dec, i, gate, last, *args):
        calls.append((i, len(dec.rows[0].tokens), len(verdicts.get(i, []))))
        return original_gate(dec, i, gate, last, *args)

    def features(tokens, acceptance, device):
        seen.append((tokens[0], acceptance))
        return original_features(tokens, acceptance, device)

    def observe(self, key, accepted):
        if key[0] == "agree":  # at the exit's drafts and at the asks its gate refused
            verdicts.setdefault(key[1], []).append(bool(accepted))
        return original_observe(self, key, accepted)

    repetitive = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(drafters, "context_features", features)
        patch.setattr(drafting, "gate_probability_at", gate_at)
        patch.setattr(AcceptanceTracker, "observe", observe)
        out = router.generate(repetitive, max_new_tokens=30)
    tokens = out.sequences[0].tolist()
    copies = gate_context.replay_next_copies(tokens, router.config.ngram_size, router.config.ngram_min_size)
    prior = gate_context.exit_prior(router.config)
    assert len(seen) == len(calls) > 10
    for (i, length, judged), (ngram_token, acceptance) in zip(calls, seen):
        assert ngram_token == copies[length - 1]  # the context ends at position length - 1
        replayed = gate_context.replay_acceptance(verdicts.get(i, []) + [False], prior)
        assert acceptance == pytest.approx(replayed[judged])
    assert any(t >= 0 for t, _ in seen) and any(t < 0 for t, _ in seen)
    assert any(a != prior for _, a in seen)  # verdicts moved the estimate


def test_ngram_proposals_replay_the_tiers_match_on_every_prefix():
    from early_exit_router.routing.ngram import ngram_match
    from early_exit_router.training.gates import ngram_proposals
    from early_exit_router.training.hidden_states import HiddenStateCache

    n, chunks = 48, 3
    nexts = torch.randint(0, 4, (n * chunks,), generator=torch.Generator().manual_seed(5))  # few ids: many repeats
    cache = HiddenStateCache({}, torch.zeros(n * chunks, 4), nexts, chunk_len=n)
    proposals = ngram_proposals(cache, ngram_max=4, ngram_min=2)
    for c in range(chunks):
        tokens = [-1] + nexts[c * n : (c + 1) * n - 1].tolist()
        for t in range(n):
            found = ngram_match(tokens[: t + 1], 4, 1, 2)[0]
            assert proposals[c * n + t] == (found[0] if found else -1), (c, t)
    assert (proposals >= 0).float().mean() > 0.5


def test_head_gates_are_the_confidence_the_router_compares(tmp_path):
    """A head gate runs after the head; its P(agree) replaces the maximum probability in the thresholds, in the
    engine, in batches and in the offline replay; it saves and loads; verify mode stays exact."""
    from early_exit_router.heads.checkpoint import load_router
    from tests.test_batching import left_padded, row_alone

    router, train, holdout, cfg = trained_router()
    quality = train_gates(router, train, holdout, cfg, head=True)
    assert all(q["saved_at_recall"] == 0.0 and 0 <= q["exit_share_at_95"] <= 1 for q in quality.values())
    gate = router.heads.gate(1)
    assert gate.uses_head and gate.uses_context and gate.head.weight.abs().sum() > 0
    assert not torch.equal(gate.head_mean, torch.zeros_like(gate.head_mean))  # standardised on the training set
    with router.disabled() as plain:  # the patched model.generate would route in the config's (exit) mode
        expected = plain.generate(prompt(0), max_new_tokens=20, do_sample=False)
    assert torch.equal(router.generate(prompt(0), max_new_tokens=20, mode="verify").sequences, expected)

    signals = exit_signals(router, holdout)  # offline: the confidence is the gate's, and the gate stops nothing
    assert all(bool(s.gate_ok.all()) for s in signals)
    assert not torch.allclose(signals[0].confidence, signals[0].confidence.round())

    halfway = {"high_conf_threshold": 0.5, "low_conf_threshold": 0.5, "max_pending": 64}
    exit_out = router.generate(prompt(0), max_new_tokens=20, mode="exit", config=halfway)
    router.save_pretrained(tmp_path / "r")
    fresh = EarlyExitRouter._from_saved(tiny_llama(0), None, load_router(tmp_path / "r"), None, "tiny")
    assert fresh.heads.gate(1).uses_head and torch.equal(fresh.heads.gate(1).head_scale, gate.head_scale)
    assert torch.equal(fresh.generate(prompt(0), 20, mode="exit", config=halfway).sequences, exit_out.sequences)

    for bias, exited in ((30.0, True), (-30.0, False)):  # the gate alone now decides every consultation
        with torch.no_grad():
            for e in (1, 3):
                router.heads.gate(e).linear.bias.fill_(bias)
        out = router.generate(prompt(0), max_new_tokens=20, mode="exit", config=halfway)
        assert all((d == 1) == exited for d in out.depths[1:]), (bias, out.depths)
        if exited:  # a batch where every row exits equals each row run alone
            ids, mask = left_padded([4, 6], 2)
            batch = router.generate(ids, 12, mode="exit", attention_mask=mask, config=halfway)
            for r in range(2):
                alone = router.generate(row_alone(ids, mask, r), 12, mode="exit", config=halfway)
                assert torch.equal(batch.sequences[r, ids.shape[1] :], alone.sequences[0, -12:])


def test_generated_prompts_are_seeded_mixed_and_never_held_out_text():
    from early_exit_router.training.corpus import generated_prompts

    prompts = generated_prompts(120, seed=3)
    assert prompts == generated_prompts(120, seed=3) and prompts != generated_prompts(120, seed=4)
    assert len(prompts) == 120 and len({p["id"] for p in prompts}) == 120
    kinds = {(p["kind"], p["category"]) for p in prompts}
    assert {("chat", "dialogue"), ("chat", "reasoning"), ("chat", "templated")} <= kinds
    for p in prompts:  # held out for evaluation: license texts and the standard library are never prompts
        assert "licen" not in p["prompt"].lower() or p["kind"] == "chat"
        assert "Licensed under the Apache License" not in p["prompt"]


def test_fresh_prompts_are_none_of_the_excluded_ones_and_never_repeat():
    from early_exit_router.training.corpus import fresh_prompts, generated_prompts

    training = generated_prompts(100, seed=0)
    fresh = fresh_prompts(60, seed=0, exclude=training)
    texts = [p["prompt"] for p in fresh]
    assert len(fresh) == 60 and len(set(texts)) == 60 and fresh == fresh_prompts(60, seed=0, exclude=training)
    assert not set(texts) & {p["prompt"] for p in training}
    assert len({p["id"] for p in fresh}) == 60
    assert "readme" not in {p["source"] for p in fresh}  # the training corpus holds the READMEs themselves
    every = ("subjects", "code tasks", "stories", "package summaries", "readme", "code")
    with pytest.raises(ValueError, match="No fresh prompt is left"):
        fresh_prompts(5, seed=0, skip_sources=every)


def test_sampled_self_generation_is_seeded_and_differs_from_greedy():
    from early_exit_router.training.corpus import self_generated

    model, tokenizer = tiny_llama(0), tiny_tokenizer()
    tokenizer.pad_token = "<unk>"  # batches are padded
    prompts = [{"prompt": "w5 w6 w7", "kind": "text"}, {"prompt": "w9 w10", "kind": "chat"}]
    greedy = self_generated(model, tokenizer, prompts, 12)
    sampled = self_generated(model, tokenizer, prompts, 12, sample=True, seed=1)
    assert sampled == self_generated(model, tokenizer, prompts, 12, sample=True, seed=1)
    assert sampled != greedy and all(len(s) > 2 for s in sampled)


def test_cli_warm_starts_one_exit_from_saved_heads_and_reuses_saved_hidden_states(tmp_path, capsys):
    """`train-heads --init-from --train-exits --hidden-states`: the shipped recipe's command on a tiny model."""
    import json

    from early_exit_router.cli import main
    from early_exit_router.heads.checkpoint import load_router

    base = tmp_path / "base"
    tiny_llama(0).save_pretrained(base)
    tiny_tokenizer().save_pretrained(base)
    source = EarlyExitRouter.from_pretrained(base, exit_layers=[1, 3], adapter="postnorm", draft_vocab_size=0)
    with torch.no_grad():
        for p in source.heads.parameters():
            p.normal_(std=0.05)
    source.config = source.config.replace(heads_trained=True)
    source.save_pretrained(tmp_path / "source")
    states = tmp_path / "states.pt"
    build_cache(source.stack, [1, 3], corpus(4, 64), chunk_len=64, progress=False).save(states)
    args = [
        "train-heads",
        "--model",
        str(base),
        "--out",
        str(tmp_path / "out"),
        "--init-from",
        str(tmp_path / "source"),
    ]
    args += ["--exit-layers", "1,3", "--exit-adapters", "1:residual_block", "--train-exits", "1", "--draft-vocab-size"]
    args += ["0", "--hidden-states", str(states), "--max-steps", "3", "--target-agreement", "0", "--quiet"]
    gate_states = tmp_path / "gate_states.pt"  # gate-only text: the model's answers to 4 fresh prompts
    gate_args = ["--gate-prompts", "4", "--gate-hidden-states", str(gate_states), "--self-gen-tokens", "40"]
    assert main(args + gate_args) == 0
    report = json.loads((tmp_path / "out" / "training_report.json").read_text())
    assert report["training"]["steps"] == 3 and set(report["training"]["loss_last"]) == {"1"}
    assert "reused" in report["corpus"]["note"]
    assert report["gate_corpus"]["prompts"] == 4 and gate_states.exists()
    gate_text = len(HiddenStateCache.load(gate_states, [1, 3]))
    # ...beside the training chunks: 4 chunks of 64 are too few to hold two out for the gates
    assert report["gate_fit_positions"] == gate_text + 3 * 64
    trained = load_router(tmp_path / "out")
    assert trained.config.exit_adapters == {1: "residual_block"} and trained.has_gates
    for key, value in source.heads.adapter(3).state_dict().items():  # exit 3 was loaded, not trained
        assert torch.equal(trained.tensors[f"adapters.3.{key}"], value), key
    assert main(args + gate_args) == 0  # the gate text's states are read back, not generated again
    assert "reused" in json.loads((tmp_path / "out" / "training_report.json").read_text())["gate_corpus"]["note"]
    assert main(args[:3] + ["--out", str(tmp_path / "x"), "--exit-layers", "1,3", "--train-exits", "1"]) == 2
    assert "--init-from" in capsys.readouterr().err
    # The heads' agreement on their own training text, for the trained exit alone
    own = json.loads((tmp_path / "out" / "training_report.json").read_text())["own_text_agreement"]
    assert set(own) == {"1"} and 0.0 <= own["1"] <= 1.0
    assert main(args[:3] + ["--out", str(tmp_path / "y"), "--train-share", "1.5"]) == 2  # before the model loads
    assert "(0, 1]" in capsys.readouterr().err and not (tmp_path / "y").exists()


def test_gates_fit_on_held_out_chunks_the_adapters_never_saw(monkeypatch):
    """A head is right more often on its own training text, so a gate fit there trusts it too much: `distill_router`
    fits the gates on part of the held-out chunks and scores them on the rest."""
    from early_exit_router.training import distill as training

    seen = {}
    real_heads, real_gates = training.train_heads, training.train_gates

    def spy_heads(router, cache, cfg, **kw):
        seen["adapters"] = cache
        return real_heads(router, cache, cfg, **kw)

    def spy_gates(router, fit, scored, cfg, **kw):
        seen["gates"], seen["scored"] = fit, scored
        return real_gates(router, fit, scored, cfg, **kw)

    monkeypatch.setattr(training, "train_heads", spy_heads)
    monkeypatch.setattr(training, "train_gates", spy_gates)
    router = EarlyExitRouter.from_model(tiny_llama(0), exit_layers=[1, 3], draft_vocab_size=0)
    cfg = TrainingConfig(max_steps=2, batch_tokens=64, chunk_len=32, holdout_share=0.3, gate_steps=5)
    result = training.distill_router(router, corpus(12, 64), cfg, target_agreement=None, progress=False)
    # Each 32-token chunk of random text is unique: a chunk's token sequence names it.
    chunks = {k: {tuple(c) for c in seen[k].next_token.view(-1, 32).tolist()} for k in ("adapters", "gates", "scored")}
    assert chunks["gates"] and chunks["scored"] and result["holdout_positions"] == 32 * len(chunks["scored"])
    assert not chunks["gates"] & chunks["adapters"] and not chunks["scored"] & chunks["adapters"]
    assert not chunks["gates"] & chunks["scored"]
    # Text for the gates alone joins their share of the held-out chunks, and nothing else.
    gate_text = build_cache(router.stack, [1, 3], corpus(3, 64, seed=9), chunk_len=32, progress=False)
    router = EarlyExitRouter.from_model(tiny_llama(0), exit_layers=[1, 3], draft_vocab_size=0)
    result = training.distill_router(
        router, corpus(12, 64), cfg, target_agreement=None, progress=False, gate_cache=gate_text
    )
    extra = {tuple(c) for c in gate_text.next_token.view(-1, 32).tolist()}
    assert chunks["gates"] | extra == {tuple(c) for c in seen["gates"].next_token.view(-1, 32).tolist()}
    assert result["gate_fit_positions"] == len(seen["gates"]) and not extra & chunks["scored"]


def test_a_share_of_the_training_text_keeps_the_held_out_text(monkeypatch):
    """`train_share`: the heads learn from a seeded share of the training chunks, and are scored on the same held-out
    chunks as with all of them, so that a learning curve over the corpus' size compares like with like."""
    from early_exit_router.training import distill as training

    seen = []
    real_heads = training.train_heads

    def spy_heads(router, cache, cfg, **kw):
        seen.append({tuple(c) for c in cache.next_token.view(-1, 32).tolist()})
        return real_heads(router, cache, cfg, **kw)

    monkeypatch.setattr(training, "train_heads", spy_heads)
    cfg = TrainingConfig(max_steps=2, batch_tokens=64, chunk_len=32, holdout_share=0.25)
    results = []
    for share in (1.0, 0.5, 0.5):
        router = EarlyExitRouter.from_model(tiny_llama(0), exit_layers=[1, 3], draft_vocab_size=0)
        cfg = dataclasses.replace(cfg, train_share=share)
        results.append(training.distill_router(router, corpus(16, 64), cfg, gates=False, target_agreement=None))
    whole, half, again = seen
    assert len(whole) == 24 and len(half) == 12 and half < whole and half == again  # seeded: the same half
    assert results[0]["holdout_positions"] == results[1]["holdout_positions"] == 8 * 32
    for result in results:
        assert set(result["own_text_agreement"]) == {1, 3}
        assert all(0.0 <= a <= 1.0 for a in result["own_text_agreement"].values())
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match=r"\(0, 1\]"):
            TrainingConfig(train_share=bad)


@pytest.mark.slow
def test_the_shipped_heads_recipe_runs_end_to_end_as_one_command(tmp_path):
    """`examples/train_shipped_heads.sh`, every step of it, on a tiny 26-layer model with trial-sized budgets."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from early_exit_router.heads.checkpoint import load_router

    base = tmp_path / "base"
    tiny_llama(0, layers=26).save_pretrained(base)
    tiny_tokenizer().save_pretrained(base)
    prompts = tmp_path / "prompts.jsonl"
    words = [" ".join(f"w{5 + (i * 7 + j) % 80}" for j in range(6)) for i in range(4)]
    records = [{"id": f"p{i}", "category": "c", "kind": "text", "prompt": w} for i, w in enumerate(words)]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
    script = Path(__file__).parent.parent / "examples" / "train_shipped_heads.sh"
    env = {
        **os.environ,
        "EER_CLI": f"{sys.executable} -m early_exit_router.cli",
        "EER_CALIBRATE_ARGS": f"--prompts {prompts} --max-new-tokens 4 --candidates 0.5,0.05 --method empirical "
        "--target-agreement 0.01 --quiet",
    }
    trial = ["--model", str(base), "--max-tokens", "3000", "--generated-prompts", "2", "--self-gen-tokens", "24"]
    trial += ["--max-steps", "2", "--gate-prompts", "24", "--draft-vocab-size", "0", "--no-docs", "--quiet"]
    trial += ["--threads", "1"]
    out = tmp_path / "heads"
    done = subprocess.run(["bash", str(script), str(out), *trial], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    saved = load_router(out)
    assert saved.exit_layers == [4, 16, 24] and saved.config.exit_adapters == {16: "residual_block"}
    assert saved.config.mode == "verify" and saved.config.exit_acceptance_prior == 0.3 and saved.has_gates
    report = json.loads((out / "training_report.json").read_text())
    assert report["training"]["steps"] == 0 and report["gate_corpus"]["prompts"] == 24  # step 3 fits gates only
    assert json.loads((out / "calibration_report.json").read_text())["chosen_threshold"] is not None
    block = load_router(Path(f"{out}.work") / "block")  # step 2 trained L16 alone, from step 1's heads
    postnorm = load_router(Path(f"{out}.work") / "postnorm")
    other = subprocess.run(["bash", str(script), str(out), *trial, "--max-steps", "3"], env=env, capture_output=True)
    assert other.returncode == 2 and b"cached for other options" in other.stderr  # the trial's states stay apart
    for key, value in postnorm.tensors.items():
        if key.startswith(("adapters.4.", "adapters.24.")):
            assert torch.equal(block.tensors[key], value), key
    assert any(key.startswith("adapters.16.") and key not in postnorm.tensors for key in block.tensors)

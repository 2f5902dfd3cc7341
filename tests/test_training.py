"""Self-distillation of exit heads and gates, on tiny random models."""

from __future__ import annotations

import pytest
import torch

from early_exit_router import EarlyExitRouter
from early_exit_router.tools.head_report import cascade, exit_signals, quality_table, suggest_high_threshold
from early_exit_router.tools.training import (
    TrainingConfig,
    build_cache,
    distillation_loss,
    head_logits,
    train_gates,
    train_heads,
)

from .conftest import MIXED, VOCAB, prompt, tiny_llama, tiny_tokenizer


def corpus(n_seqs: int = 12, length: int = 64, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (n_seqs, length), generator=g).tolist()


def mean_kl(router, cache, layer) -> float:
    stack = router._stack
    with torch.no_grad():
        teacher = stack.unembed(cache.final_normed).float()
        student = head_logits(stack, router.heads.adapter(layer), cache.exits[layer], cache.chunk_len)
        return distillation_loss(student, teacher, cache.next_token, 0.0).item()


def test_cache_holds_the_model_own_hidden_states():
    model = tiny_llama(0)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3])
    seqs = corpus(4, 32)
    cache = build_cache(router._stack, [1, 3], seqs, chunk_len=32, progress=False)
    assert len(cache) == 4 * 32
    with torch.no_grad():
        out = model(torch.tensor(seqs[:1]), output_hidden_states=True)
        final = model.model(torch.tensor(seqs[:1])).last_hidden_state  # after the final norm
    torch.testing.assert_close(cache.exits[3][:32], out.hidden_states[4][0], atol=1e-5, rtol=0)
    torch.testing.assert_close(cache.final_normed[:32], final[0], atol=1e-5, rtol=0)
    assert cache.next_token[:31].tolist() == seqs[0][1:] and cache.next_token[31] == -1


@pytest.mark.parametrize("adapter", ["linear", "lowrank", "postnorm", "block"])
def test_a_few_steps_lower_the_distillation_loss_and_leave_the_base_frozen(adapter):
    model = tiny_llama(0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], adapter=adapter)
    cache = build_cache(router._stack, [1, 3], corpus(), chunk_len=64, progress=False)
    start = {e: mean_kl(router, cache, e) for e in (1, 3)}
    report = train_heads(router, cache, TrainingConfig(max_steps=40, batch_tokens=128, lr=1e-2), progress=False)
    for e in (1, 3):
        assert mean_kl(router, cache, e) < 0.8 * start[e], (e, start[e], mean_kl(router, cache, e))
    assert report.steps == 40 and set(report.loss_last) == {1, 3}
    for k, v in router.unpatch().state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.requires_grad for p in model.parameters())  # frozen only while training


def test_cross_entropy_mixing_trains_and_changes_what_is_learned():
    trained = {}
    for ce_weight in (0.0, 0.5):
        router = EarlyExitRouter.from_model(tiny_llama(0), exit_layers=[2])
        cache = build_cache(router._stack, [2], corpus(), chunk_len=64, progress=False)
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
    cache = build_cache(router._stack, [1, 3], corpus(), chunk_len=64, progress=False)
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
    router.config = router.config.replace(use_gate=False)
    off = router.generate(prompt(0), max_new_tokens=30)
    assert torch.equal(off.sequences, without_gates.sequences)
    assert off.stats.exit_histogram == without_gates.stats.exit_histogram


def test_quality_report_replays_the_cascade():
    router = EarlyExitRouter.from_model(tiny_llama(0), exit_layers=[1, 3], **MIXED)
    cache = build_cache(router._stack, [1, 3], corpus(6), chunk_len=64, progress=False)
    signals = exit_signals(router, cache)
    rows = quality_table(signals)
    # Untrained adapters are the logit lens: both agreement columns agree exactly.
    for row in rows:
        assert row.lens_agreement == row.trained_agreement
    assert 0 < sum(r.exit_share for r in rows) <= 1
    # The cascade lets a position leave once, at its first accepting exit.
    everything = cascade(signals, [torch.ones(len(cache), dtype=torch.bool)] * 2)
    assert everything[0][1] == 1.0 and everything[1][1] == 0.0
    assert suggest_high_threshold(signals, router.config, VOCAB, target=0.0)[0] == 0.30  # lowest in the sweep
    assert suggest_high_threshold(signals, router.config, VOCAB, target=1.01) == (1.0, 0.0, 1.0)  # unreachable


def test_auc_and_saved_share_on_known_scores():
    from early_exit_router.tools.training import roc_auc, saved_at_recall

    positive = torch.tensor([True, True, False, False])
    assert roc_auc(torch.tensor([0.9, 0.8, 0.2, 0.1]), positive) == 1.0
    assert roc_auc(torch.tensor([0.1, 0.2, 0.8, 0.9]), positive) == 0.0
    assert roc_auc(torch.tensor([0.5, 0.5, 0.5, 0.5]), positive) == 0.5  # ties count half
    assert roc_auc(torch.tensor([0.9, 0.3, 0.5, 0.1]), positive) == 0.75
    # Keeping both positives means a threshold at 0.8: the two negatives below it are skipped.
    assert saved_at_recall(torch.tensor([0.9, 0.8, 0.2, 0.1]), positive, 0.95) == 0.5


def test_gate_context_replays_ngram_matches_and_running_acceptance():
    from early_exit_router.tools.training import HiddenStateCache, gate_context

    tokens = [1, 2, 3, 1, 2, 3, 1, 2]
    cache = HiddenStateCache({}, torch.zeros(8, 4), torch.tensor(tokens[1:] + [-1]), chunk_len=8)
    features = gate_context(cache, torch.ones(8), ngram_min=2, rate=0.5)
    # known tokens: [?, 2, 3, 1, 2, 3, 1, 2]; "2 3" recurs at 5, "3 1" at 6, "1 2" at 7
    assert features[:, 0].tolist() == [0, 0, 0, 0, 0, 1, 1, 1]
    assert features[:, 1].tolist() == [0.5, 0.75, 0.875, 0.9375, 0.96875, 0.984375, 0.9921875, 0.99609375]


def test_gates_with_context_train_save_and_steer_nothing_in_verify_mode(tmp_path):
    from early_exit_router.runtime.checkpoint import load_router

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


def test_generated_prompts_are_seeded_mixed_and_never_held_out_text():
    from early_exit_router.tools.corpus import generated_prompts

    prompts = generated_prompts(120, seed=3)
    assert prompts == generated_prompts(120, seed=3) and prompts != generated_prompts(120, seed=4)
    assert len(prompts) == 120 and len({p["id"] for p in prompts}) == 120
    kinds = {(p["kind"], p["category"]) for p in prompts}
    assert {("chat", "dialogue"), ("chat", "reasoning"), ("chat", "templated")} <= kinds
    for p in prompts:  # held out for evaluation: license texts and the standard library are never prompts
        assert "licen" not in p["prompt"].lower() or p["kind"] == "chat"
        assert "Licensed under the Apache License" not in p["prompt"]


def test_sampled_self_generation_is_seeded_and_differs_from_greedy():
    from early_exit_router.tools.corpus import self_generated

    model, tokenizer = tiny_llama(0), tiny_tokenizer()
    tokenizer.pad_token = "<unk>"  # batches are padded
    prompts = [{"prompt": "w5 w6 w7", "kind": "text"}, {"prompt": "w9 w10", "kind": "chat"}]
    greedy = self_generated(model, tokenizer, prompts, 12)
    sampled = self_generated(model, tokenizer, prompts, 12, sample=True, seed=1)
    assert sampled == self_generated(model, tokenizer, prompts, 12, sample=True, seed=1)
    assert sampled != greedy and all(len(s) > 2 for s in sampled)

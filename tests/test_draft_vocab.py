"""The frequency-ranked draft vocabulary (FR-Spec) and the exit-layer survey, on tiny random models."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from early_exit_router import EarlyExitRouter
from early_exit_router.heads.checkpoint import WEIGHTS_NAME, load_router
from early_exit_router.heads.draft import draft_token_ranking
from early_exit_router.heads.exit_heads import DRAFT_RANKING
from early_exit_router.routing.policy import DraftPolicy
from early_exit_router.training.config import TrainingConfig
from early_exit_router.training.distill import distill_router
from early_exit_router.training.gates import coverage_at
from early_exit_router.training.hidden_states import build_cache
from early_exit_router.training.survey import break_even_acceptance, survey_exits

from .conftest import MIXED, VOCAB, prompt, tiny_costs, tiny_llama

RANKED = dict(MIXED, draft_vocab_size=32)


def corpus(n: int = 8, length: int = 64) -> list[list[int]]:
    return torch.randint(1, VOCAB, (n, length), generator=torch.Generator().manual_seed(0)).tolist()


def test_ranking_orders_by_prediction_count_then_id():
    top1 = torch.tensor([7, 7, 7, 3, 3, 90, 5])
    ranking = draft_token_ranking(top1, VOCAB)
    assert ranking[:5].tolist() == [7, 3, 5, 90, 0]  # 5 and 90 tie: lower id first; then never-predicted ids
    assert sorted(ranking.tolist()) == list(range(VOCAB))


def test_the_entropy_rule_works_on_trimmed_draft_logits():
    """Draft logits are -inf outside the draft ids: their entropy is that of the finite part, never NaN."""
    from early_exit_router.config import RouterConfig
    from early_exit_router.routing.exit_rule import ExitRule

    router = ExitRule(RouterConfig(entropy_normalized=False, high_conf_threshold=0.99, low_conf_threshold=0.2), VOCAB)
    finite = torch.tensor([2.0, 1.0, 0.5, -1.0])
    trimmed = torch.full((VOCAB,), float("-inf"))
    trimmed[[3, 9, 17, 40]] = finite
    confidence, entropy = router.confidence_entropy(trimmed)
    p = torch.softmax(finite, -1)
    torch.testing.assert_close(entropy, -(p * p.log()).sum())
    torch.testing.assert_close(confidence, p.max())
    # Below high but above low: only the entropy rule can let it exit.
    assert bool(router.exit_rule(confidence, entropy)) == bool(entropy <= router.config.entropy_threshold)
    loose = ExitRule(router.config.replace(entropy_threshold=float(entropy) + 0.01), VOCAB)
    assert bool(loose.exit_rule(*loose.confidence_entropy(trimmed)))


def test_head_features_on_the_draft_ids_equal_those_on_the_full_width_logits():
    from early_exit_router.heads.gates import head_features

    ids = torch.tensor([3, 9, 17, 40, 41, 60, 77])
    trimmed = torch.full((2, VOCAB), float("-inf"))
    trimmed[:, ids] = torch.randn(2, len(ids), generator=torch.Generator().manual_seed(1))
    proposed = torch.tensor([int(ids[trimmed[0, ids].argmax()]), -1])  # row 0 agrees with the n-gram tier
    full = head_features(trimmed, proposed)
    torch.testing.assert_close(head_features(trimmed, proposed, ids), full)
    assert full[:, -1].tolist() == [1.0, 0.0]


def test_the_draft_head_takes_the_ranked_ids_and_verify_stays_exact(tmp_path):
    model = tiny_llama(0)
    ids = prompt(0)
    ref = model.generate(ids, max_new_tokens=16, do_sample=False)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **RANKED)
    ranking = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))
    router.heads.set_draft_token_ranking(ranking, VOCAB)
    draft = router.heads.draft_head(router.stack, 32)
    assert draft.token_ids.tolist() == sorted(ranking[:32].tolist())
    out = router.generate(ids, max_new_tokens=16, mode="verify")
    assert torch.equal(out.sequences, ref)
    # Saved and loaded with the heads, as integers.
    router.save_pretrained(tmp_path / "r")
    assert torch.equal(load_file(str(tmp_path / "r" / WEIGHTS_NAME))[DRAFT_RANKING], ranking)
    router.unpatch()
    again = EarlyExitRouter._from_saved(model, None, load_router(tmp_path / "r"), None, "tiny")
    assert torch.equal(again.heads.draft_token_ranking().cpu(), ranking)
    assert torch.equal(again.heads.draft_head(again.stack, 32).token_ids.cpu(), draft.token_ids.cpu())


@pytest.mark.parametrize("bad", [torch.arange(VOCAB - 1), torch.zeros(VOCAB, dtype=torch.long)])
def test_a_ranking_that_is_not_a_permutation_is_refused(tmp_path, bad):
    router = EarlyExitRouter.from_model(tiny_llama(0), exit_layers=[1, 3], **RANKED)
    with pytest.raises(ValueError, match="every one of the 96 token ids exactly once"):
        router.heads.set_draft_token_ranking(bad, VOCAB)
    router.save_pretrained(tmp_path / "r")
    path = tmp_path / "r" / WEIGHTS_NAME
    tensors = load_file(str(path))
    save_file({**tensors, DRAFT_RANKING: bad}, str(path))
    model = tiny_llama(0)
    with pytest.raises(ValueError, match="draft token ranking"):
        EarlyExitRouter._from_saved(model, None, load_router(tmp_path / "r"), None, "tiny")
    assert "_early_exit_router" not in model.__dict__


def test_training_ranks_the_draft_vocabulary_by_the_model_own_predictions():
    router = EarlyExitRouter.from_model(tiny_llama(0), exit_layers=[1, 3], **RANKED)
    distill_router(router, corpus(), TrainingConfig(max_steps=2, batch_tokens=32, gate_steps=2), progress=False)
    ranking = router.heads.draft_token_ranking()
    assert ranking is not None and sorted(ranking.tolist()) == list(range(VOCAB))


def test_coverage_and_break_even():
    confidence = torch.tensor([0.9, 0.8, 0.7, 0.6])
    assert coverage_at(confidence, torch.tensor([True, True, False, True]), 0.95) == 0.5
    assert coverage_at(confidence, torch.tensor([False, True, True, True]), 0.95) == 0.0
    costs = tiny_costs()
    flat = break_even_acceptance(DraftPolicy(costs["flat"], [1], [False]), 0, 8)
    steep = break_even_acceptance(DraftPolicy(costs["steep"], [1], [False]), 0, 8)
    assert 0.0 < flat < steep <= 1.0  # drafting pays at lower acceptance where extra positions are cheap


@pytest.mark.parametrize("adapter", ["postnorm", "block", "residual_block"])
def test_survey_fits_every_layer_and_leaves_the_router_heads_alone(adapter):
    router = EarlyExitRouter.from_model(tiny_llama(0), exit_layers=[1, 3], **RANKED)
    before = {k: v.clone() for k, v in router.heads.state_dict().items()}
    cache = build_cache(router.stack, [0, 1, 2, 3, 4], corpus(), chunk_len=64, progress=False)
    rows = survey_exits(router, cache, tiny_costs()["flat"], adapter=adapter, steps=5, batch_tokens=32, chunk_len=64)
    assert [r.layer for r in rows] == [0, 1, 2, 3, 4]
    for r in rows:
        assert 0 <= r.lens_agreement <= 1 and 0 <= r.trained_agreement <= 1 and 0 <= r.coverage <= 1
        assert r.draft_ms > 0 and 0 < r.break_even <= 1 and r.speedup > 0
    assert [r.draft_ms for r in rows] == sorted(r.draft_ms for r in rows)  # deeper drafts cost more
    assert all(torch.equal(v, router.heads.state_dict()[k]) for k, v in before.items())
    with pytest.raises(ValueError, match="--max-tokens"):  # one chunk: none to hold out
        survey_exits(router, cache.select(torch.arange(64)), tiny_costs()["flat"], adapter=adapter, chunk_len=64)


def test_survey_cli_fits_several_adapter_kinds_on_one_corpus_and_refuses_an_unknown_kind(tmp_path, capsys):
    """`survey --adapter postnorm,residual_block`: one table per kind, the same layers, corpus and cost table."""
    import json

    from early_exit_router.cli import main

    from .conftest import tiny_tokenizer

    base = tmp_path / "base"
    tiny_llama(0).save_pretrained(base)
    tiny_tokenizer().save_pretrained(base)
    out = tmp_path / "survey.json"
    args = ["survey", "--model", str(base), "--layers", "1,2", "--steps", "2", "--max-tokens", "1200", "--quiet"]
    assert main(args + ["--adapter", "postnorm,residual_block", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.index("'postnorm' adapters") < printed.index("'residual_block' adapters")
    report = json.loads(out.read_text())
    assert [t["adapter"] for t in report["tables"]] == ["postnorm", "residual_block"]
    assert [[r["layer"] for r in t["rows"]] for t in report["tables"]] == [[1, 2], [1, 2]]
    assert report["costs"] and report["corpus"]
    block, postnorm = report["tables"][1]["rows"], report["tables"][0]["rows"]
    assert all(b["draft_ms"] > p["draft_ms"] for b, p in zip(block, postnorm))  # a block costs one more layer
    with pytest.raises(SystemExit):
        main(args + ["--adapter", "postnorm,bogus"])
    assert "unknown adapter kind(s) ['bogus']" in capsys.readouterr().err


def test_the_head_signal_reads_the_draft_columns_alone_and_skips_the_softmax_where_entropy_cannot_decide():
    from early_exit_router.config import RouterConfig
    from early_exit_router.routing.exit_rule import ExitRule

    columns = torch.tensor([3, 7, 11, 40])
    full = torch.full((2, VOCAB), float("-inf"))
    full[:, columns] = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.1, 0.2, 0.0, 0.3]])
    cascade = ExitRule(RouterConfig(high_conf_threshold=0.6, low_conf_threshold=0.2, entropy_threshold=0.3), VOCAB)
    assert cascade.entropy_decides
    flags, confidence = cascade.head_signal(full)
    trimmed_flags, trimmed_confidence = cascade.head_signal(full, columns=columns)
    assert torch.equal(flags, trimmed_flags)
    torch.testing.assert_close(confidence, trimmed_confidence)
    learned = torch.tensor([0.7, 0.5])
    calibrated = ExitRule(RouterConfig(high_conf_threshold=0.6, low_conf_threshold=0.6), VOCAB)
    assert not calibrated.entropy_decides
    nan = torch.full((2, VOCAB), float("nan"))  # never read: the learned confidence decides alone
    flags, confidence = calibrated.head_signal(nan, 0.0, learned)
    assert flags.tolist() == [True, False] and torch.equal(confidence, learned)
    assert calibrated.head_signal(nan, -0.15, learned)[0].tolist() == [True, True]  # thresholds shift together

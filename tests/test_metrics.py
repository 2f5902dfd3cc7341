"""Quality metrics and the calibration bound on hand-made cases."""

from __future__ import annotations

import math

import pytest
import torch

from early_exit_router.bench.metrics import first_divergence, nll_ratio, rouge_l, teacher_forced_score, token_match
from early_exit_router.training.calibrate import QualityTarget, binomial_cdf, split_prompts

from .conftest import prompt, tiny_llama


def test_rouge_l_on_hand_made_cases():
    # LCS "the cat on the mat" = 5 words; precision 5/5, recall 5/6 -> F1 = 10/11
    assert rouge_l("the cat sat on the mat", "the cat on the mat") == pytest.approx(10 / 11)
    assert rouge_l("a b c", "a b c") == 1.0
    assert rouge_l("a b c", "x y z") == 0.0
    assert rouge_l("", "") == 1.0
    assert rouge_l("a", "") == 0.0
    # order matters: LCS of (a b c d) and (d c b a) is 1 -> P = R = 1/4
    assert rouge_l("a b c d", "d c b a") == pytest.approx(0.25)
    assert rouge_l([1, 2, 3, 4], [1, 3, 4, 9, 9]) == pytest.approx(2 * (3 / 5) * (3 / 4) / (3 / 5 + 3 / 4))


def test_first_divergence_and_token_match():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2  # stopping early is a divergence
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    assert first_divergence([], []) is None
    assert token_match([1, 2, 3, 4], [1, 0, 3, 0]) == 0.5
    assert token_match([1, 2], [1, 2, 3]) == 1.0
    assert token_match([], []) == 1.0


def test_nll_ratio():
    assert nll_ratio(1.02, 1.0) == pytest.approx(1.02)
    assert nll_ratio(0.5, 1.0) == 0.5
    assert nll_ratio(0.0, 0.0) == 1.0
    assert math.isinf(nll_ratio(0.1, 0.0))


def test_binomial_cdf_matches_the_direct_sum():
    for n, k, p in [(10, 3, 0.2), (50, 0, 0.05), (200, 12, 0.05), (7, 7, 0.5)]:
        direct = sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k + 1))
        assert binomial_cdf(k, n, p) == pytest.approx(direct, rel=1e-9)
    assert binomial_cdf(5, 1000, 0.05) < 1e-15  # far below the expected 50: the bound rejects "risk > 5%"


def test_teacher_forced_score_of_greedy_output_is_full_agreement_and_the_right_nll():
    model = tiny_llama(2)
    ids = prompt(3)
    out = model.generate(ids, max_new_tokens=10, do_sample=False, return_dict_in_generate=True, output_logits=True)
    new = out.sequences[0, ids.shape[1] :].tolist()
    score = teacher_forced_score(model, ids[0].tolist(), new)
    assert score.tokens == 10 and score.agreement == 1.0 and score.disagreements == 0
    step_logits = torch.cat(out.logits)  # (10, vocab): the logits each greedy token was chosen from
    expected = -torch.log_softmax(step_logits, -1).gather(1, torch.tensor(new)[:, None]).mean()
    assert score.mean_nll == pytest.approx(float(expected), abs=1e-4)
    # replacing a token with another one: that position disagrees
    changed = list(new)
    changed[4] = (changed[4] + 1) % 96
    assert teacher_forced_score(model, ids[0].tolist(), changed).disagreements >= 1


def test_quality_target_needs_exactly_one_bound():
    with pytest.raises(ValueError, match="exactly one"):
        QualityTarget()
    with pytest.raises(ValueError, match="exactly one"):
        QualityTarget(min_agreement=0.9, max_nll_increase=0.02)
    assert QualityTarget(max_nll_increase=0.02).met(0.0, 1.019)
    assert not QualityTarget(max_nll_increase=0.02).met(1.0, 1.03)
    with pytest.raises(ValueError, match="exactly one"):
        QualityTarget(min_agreement=0.9, min_consistency=0.9)
    with pytest.raises(ValueError, match="min_consistency must be in"):
        QualityTarget(min_consistency=1.5)
    consistent = QualityTarget(min_consistency=0.8)  # per output, whatever the tokens' agreement
    assert consistent.met(0.5, 2.0, 0.8) and not consistent.met(1.0, 1.0, 0.7) and not consistent.met(1.0, 1.0)
    assert consistent.risk_bound() == pytest.approx(0.2) and QualityTarget(max_nll_increase=0.1).risk_bound() is None


def test_split_prompts_alternates_within_categories():
    prompts = [{"id": f"{c}{i}", "category": c} for c in "ab" for i in range(3)]
    calibration, heldout = split_prompts(prompts)
    assert [p["id"] for p in calibration] == ["a0", "a2", "b0", "b2"]
    assert [p["id"] for p in heldout] == ["a1", "b1"]
    with pytest.raises(ValueError, match="at least two"):
        split_prompts(prompts[:1])

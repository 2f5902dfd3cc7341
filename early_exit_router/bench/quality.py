"""Scoring a bench run's outputs: against the control's output on the same prompt, under the full model
(teacher-forced), under a reference model at a higher precision, and, where the prompt carries a `check`, whether
the answer is correct (`checks`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from early_exit_router.bench.checks import check_answer
from early_exit_router.bench.metrics import first_divergence, nll_ratio, rouge_l, teacher_forced_score, token_match


def score_quality(
    router: Any,
    prompts: Sequence[dict],
    encoded: list[torch.Tensor],
    records: Sequence[Any],
    reference: torch.nn.Module | None = None,
    control_arm: str = "plain HF generate",
) -> None:
    """Quality of every record against the control's output on the same prompt, under the full model, (with a
    `reference` model) under that model, and (where the prompt record carries a `check`, and the router a tokenizer)
    `correct`: whether its decoded new text passes the check."""
    by_prompt = {item["id"]: ids[0].tolist() for item, ids in zip(prompts, encoded)}
    checks = {item["id"]: item["check"] for item in prompts if item.get("check") is not None}
    control = {r.prompt_id: r.new_ids for r in records if r.arm == control_arm and r.repeat == 0}
    scores: dict[tuple, Any] = {}
    tokenizer = router.tokenizer
    with router.disabled() as model:
        for r in records:
            key = (r.prompt_id, tuple(r.new_ids))
            if key not in scores:
                scores[key] = teacher_forced_score(model, by_prompt[r.prompt_id], r.new_ids)
            wanted = control[r.prompt_id]
            ref_key = (r.prompt_id, tuple(wanted))
            if ref_key not in scores:
                scores[ref_key] = teacher_forced_score(model, by_prompt[r.prompt_id], wanted)
            score, ref_score = scores[key], scores[ref_key]
            text = None if tokenizer is None else tokenizer.decode(r.new_ids, skip_special_tokens=True)
            if text is not None:
                rouge = rouge_l(tokenizer.decode(wanted, skip_special_tokens=True), text)
            else:
                rouge = rouge_l(wanted, r.new_ids)
            r.quality = {
                "identical": r.new_ids == wanted,
                "token_match": token_match(wanted, r.new_ids),
                "first_divergence": first_divergence(wanted, r.new_ids),
                "teacher_forced_agreement": score.agreement,
                "disagreements": score.disagreements,
                "mean_nll": score.mean_nll,
                "nll_ratio": nll_ratio(score.mean_nll, ref_score.mean_nll),
                "rouge_l": rouge,
            }
            if text is not None and r.prompt_id in checks:
                r.quality["correct"] = check_answer(checks[r.prompt_id], text)
    if reference is not None:
        judged: dict[tuple, int] = {}
        for r in records:
            key = (r.prompt_id, tuple(r.new_ids))
            if key not in judged:
                judged[key] = teacher_forced_score(reference, by_prompt[r.prompt_id], r.new_ids).disagreements
            r.quality["reference_disagreements"] = judged[key]


def correct_fields(runs: Sequence[Any], control: Sequence[Any]) -> dict[str, int | None]:
    """A summary row's correctness: the runs whose answer passed its prompt's check (`correct`) of those on prompts
    with one (`checked`), and the control's runs beside them (None where no run had a check)."""
    fields: dict[str, int | None] = {}
    for prefix, group in (("", runs), ("control_", control)):
        verdicts = [r.quality["correct"] for r in group if r.quality.get("correct") is not None]
        fields[prefix + "correct"] = sum(verdicts) if verdicts else None
        fields[prefix + "checked"] = len(verdicts) if verdicts else None
    return fields

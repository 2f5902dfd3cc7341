"""Head quality on cached hidden states: agreement with the full model before and after training, and routing.

Heads are evaluated as the engine drafts: through the trimmed draft head where the config has one. For every
position the router's cascade is replayed offline: gate (when present and enabled; a head gate's P(agree) is the
confidence instead), then the confidence/entropy rule, exit after exit. Reported per exit: top-1 agreement of the
logit lens and of the trained head over all positions, the trained head's top-k agreement (the full model's token
among its k highest: what an exit tree whose drafts keep k - 1 alternatives could find), the share of positions the
cascade lets exit there, and the agreement among those.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from early_exit_router.config import RouterConfig
from early_exit_router.heads.gates import gate_probability, uses_head
from early_exit_router.routing.exit_rule import ExitRule
from early_exit_router.routing.gate_context import exit_prior
from early_exit_router.training.gates import gate_context, ngram_proposals
from early_exit_router.training.hidden_states import HiddenStateCache, batch_size_for, head_logits, teacher_top1


@dataclass
class ExitSignals:
    """Per-position signals of one exit, computed once and replayed under any thresholds."""

    layer: int
    lens_agree: torch.Tensor  # (N,) bool
    agree: torch.Tensor  # (N,) bool, trained head
    logits_flag: torch.Tensor  # (N,) bool, confidence/entropy rule at the config's thresholds
    gate_ok: torch.Tensor  # (N,) bool, all True without a gate
    confidence: torch.Tensor  # (N,) float
    entropy: torch.Tensor  # (N,) float, normalised or raw as configured
    teacher_rank: torch.Tensor  # (N,) long: how many of the head's logits beat the full model's token


TOP_K = (2, 3, 5)  # the top-k agreements the report gives beside top-1


@dataclass
class ExitQuality:
    layer: int
    lens_agreement: float
    trained_agreement: float
    exit_share: float  # share of all positions the cascade lets exit here
    agreement_when_exiting: float | None
    top_k_agreement: dict[int, float] | None = None  # k -> share of positions with the full model's token in the top k


@torch.no_grad()
def exit_signals(router, cache: HiddenStateCache, batch: int = 1024) -> list[ExitSignals]:
    stack, config = router.stack, router.config
    decide = ExitRule(config, stack.vocab_size)
    target = teacher_top1(router, cache, batch)
    batch = batch_size_for(cache, batch)
    draft = router.heads.draft_head(stack, config.draft_vocab_size, config.half_draft_head)  # as the engine drafts
    out, proposals = [], None  # the n-gram tier's replayed proposals depend on the text alone: computed once
    for layer in router.heads.exit_layers:
        lens, agree, flags, gates, confs, ents, ranks = [], [], [], [], [], [], []
        gate = router.heads.gate(layer) if config.use_gate else None
        for s in range(0, len(cache), batch):
            h = cache.exits[layer][s : s + batch]
            t = target[s : s + batch]
            lens.append(head_logits(stack, None, h, draft=draft).argmax(-1).cpu() == t)
            logits = head_logits(stack, router.heads.adapter(layer), h, cache.chunk_len, draft)
            agree.append(logits.argmax(-1).cpu() == t)
            at_teacher = logits.gather(-1, t.to(logits.device).unsqueeze(-1))  # (n, 1); -inf outside a trimmed head
            ranks.append((logits > at_teacher).sum(-1).cpu())
            conf, ent = decide.confidence_entropy(logits)
            flags.append(decide.exit_rule(conf, ent).cpu())
            confs.append(conf.cpu())
            ents.append(ent.cpu())
        # A context or head gate sees the features replayed from the verdicts (see `routing/gate_context.py`).
        context = None
        if getattr(gate, "uses_context", False) or uses_head(gate):
            if proposals is None:
                proposals = ngram_proposals(cache, config.ngram_size, config.ngram_min_size)
            context = gate_context(cache, torch.cat(agree).float(), proposals, exit_prior(config))
        for s in range(0, len(cache), batch):
            if gate is None or uses_head(gate):  # a head gate never stops the head: it is the confidence
                gates.append(torch.ones(min(batch, len(cache) - s), dtype=torch.bool))
            if gate is None:
                continue
            h = cache.exits[layer][s : s + batch].to(stack.device, stack.dtype)
            part = None if context is None else context[s : s + batch].to(stack.device)
            if not uses_head(gate):
                gates.append(decide.gate_allows(gate_probability(gate, h, part)).cpu())
                continue
            logits = head_logits(stack, router.heads.adapter(layer), h, cache.chunk_len, draft)
            learned = gate_probability(gate, h, part, logits, proposals[s : s + batch], draft).float()
            k = s // batch
            confs[k] = learned.cpu()
            flags[k] = decide.exit_rule(learned, ents[k].to(learned.device)).cpu()
        out.append(
            ExitSignals(
                layer,
                torch.cat(lens),
                torch.cat(agree),
                torch.cat(flags),
                torch.cat(gates),
                torch.cat(confs),
                torch.cat(ents),
                torch.cat(ranks),
            )
        )
    return out


def cascade(signals: list[ExitSignals], flags: list[torch.Tensor]) -> list[tuple[int, float, float | None]]:
    """(layer, exit share, agreement among exited) when each position leaves at the first exit whose flag is set."""
    n = flags[0].shape[0]
    remaining = torch.ones(n, dtype=torch.bool)
    rows = []
    for sig, flag in zip(signals, flags):
        exits_here = remaining & flag & sig.gate_ok
        remaining &= ~exits_here
        count = int(exits_here.sum())
        rows.append((sig.layer, count / n, float(sig.agree[exits_here].float().mean()) if count else None))
    return rows


def quality_table(signals: list[ExitSignals]) -> list[ExitQuality]:
    rows = cascade(signals, [s.logits_flag for s in signals])
    return [
        ExitQuality(
            layer=sig.layer,
            lens_agreement=float(sig.lens_agree.float().mean()),
            trained_agreement=float(sig.agree.float().mean()),
            exit_share=share,
            agreement_when_exiting=agreement,
            top_k_agreement=top_k_agreement(sig.teacher_rank),
        )
        for sig, (_, share, agreement) in zip(signals, rows)
    ]


def top_k_agreement(teacher_rank: torch.Tensor) -> dict[int, float]:
    """k -> the share of positions whose full-model token is among the head's k highest logits (`TOP_K`)."""
    return {k: float((teacher_rank < k).float().mean()) for k in TOP_K}


def suggest_high_threshold(
    signals: list[ExitSignals], config: RouterConfig, vocab_size: int, target: float
) -> tuple[float, float, float]:
    """The lowest threshold whose cascade keeps agreement among exited positions >= `target`.

    The confidence rule alone (`high_conf_threshold = low_conf_threshold`), as `calibrate` sweeps it, so that one
    number orders the candidates. Returns (threshold, exit share, agreement). A plain sweep on the data given.
    """
    best = (1.0, 0.0, 1.0)
    for high in [x / 100 for x in range(30, 100, 2)]:
        rule = ExitRule(config.replace(high_conf_threshold=high, low_conf_threshold=high), vocab_size)
        flags = [rule.exit_rule(s.confidence, s.entropy) for s in signals]
        rows = cascade(signals, flags)
        exited = sum(share for _, share, _ in rows)
        agreed = sum(share * (agreement or 0.0) for _, share, agreement in rows)
        agreement = agreed / exited if exited else 1.0
        if agreement >= target:
            return high, exited, agreement
    return best


def format_table(title: str, rows: list[ExitQuality]) -> str:
    lines = [
        f"### {title}",
        "",
        "| exit layer | logit lens agreement | trained agreement | top-2 / top-3 / top-5 | exits here (cascade) "
        "| agreement when exiting |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        when = "n/a" if r.agreement_when_exiting is None else f"{r.agreement_when_exiting:.3f}"
        top = " / ".join(f"{r.top_k_agreement[k]:.3f}" for k in TOP_K) if r.top_k_agreement else "n/a"
        lines.append(
            f"| {r.layer} | {r.lens_agreement:.3f} | {r.trained_agreement:.3f} | {top} | {r.exit_share:.3f} | {when} |"
        )
    return "\n".join(lines)


def as_dicts(rows: list[Any]) -> list[dict[str, Any]]:
    """Report rows (dataclasses: ExitQuality, SurveyRow) as plain dicts for JSON."""
    return [asdict(r) for r in rows]

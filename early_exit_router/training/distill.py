"""Training exit heads by self-distillation.

The base model stays frozen. Training runs only the adapters, the shared final norm and the LM head over cached hidden
states (`hidden_states.py`): the loss at exit `e` is KL(full model || exit head), optionally mixed with cross-entropy
on the corpus' next token.

Where the router drafts from a trimmed head (`draft_vocab_size`), the KL runs over those token ids only: that is the
distribution the decoder drafts from, and it costs a fraction of the full vocabulary (so the same time buys many more
steps). Position-wise adapters train on random positions; block adapters (which attend to the context) on whole
chunks. `distill_router` runs the whole recipe: cache, adapters, gates (`gates.py`), a suggested threshold and a
report.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from early_exit_router.heads.draft import DraftHead, draft_token_ranking, exit_normed
from early_exit_router.training.config import TrainingConfig
from early_exit_router.training.gates import train_gates
from early_exit_router.training.head_report import as_dicts, exit_signals, quality_table, suggest_high_threshold
from early_exit_router.training.hidden_states import (
    HiddenStateCache,
    build_cache,
    chunk_positions,
    exit_top1,
    teacher_top1,
)

OWN_TEXT_CHUNKS = 50  # chunks of a head's own training text its agreement there is measured on


def distillation_loss(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, next_token: torch.Tensor, ce_weight: float
) -> torch.Tensor:
    """Mean over positions of KL(teacher || student), plus `ce_weight` x cross-entropy on the next token."""
    teacher_logp = torch.log_softmax(teacher_logits, dim=-1)
    student_logp = torch.log_softmax(student_logits, dim=-1)
    loss = (teacher_logp.exp() * (teacher_logp - student_logp)).sum(-1).mean()
    if ce_weight:
        valid = next_token >= 0
        if valid.any():
            loss = loss + ce_weight * nn.functional.nll_loss(
                student_logp[valid], next_token[valid].to(student_logp.device)
            )
    return loss


@dataclass
class TrainingReport:
    steps: int = 0
    seconds: float = 0.0
    train_positions: int = 0
    loss_first: dict[int, float] = field(default_factory=dict)
    loss_last: dict[int, float] = field(default_factory=dict)
    gate_accuracy: dict[int, float] = field(default_factory=dict)
    gate_auc: dict[int, float] = field(default_factory=dict)  # held out: P(score of an agreeing > a disagreeing)
    gate_saved_at_recall: dict[int, float] = field(default_factory=dict)  # head calls skipped at 0.95 recall
    confidence_auc: dict[int, float] = field(default_factory=dict)  # held out: the same for the head's confidence
    gate_kind: str = ""  # "head" (after the head) or "pre-head"
    gate_exit_share_at_95: dict[int, float] = field(default_factory=dict)  # held out, ranked by the gate
    confidence_exit_share_at_95: dict[int, float] = field(default_factory=dict)  # ranked by the head's confidence
    config: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def train_heads(
    router: Any,
    cache: HiddenStateCache,
    cfg: TrainingConfig,
    progress: bool = True,
    warm: Iterable[nn.Parameter] = (),
) -> TrainingReport:
    """Fit the exits' adapters (`cfg.train_exits`, default all) to the full model's next-token distribution. The
    base model stays frozen; `warm` parameters (loaded by `warm_start`) learn at `cfg.warm_lr_scale` of the rate."""
    stack, heads = router.stack, router.heads
    torch.manual_seed(cfg.seed)
    g = torch.Generator().manual_seed(cfg.seed)
    trained = heads.exit_layers if cfg.train_exits is None else [e for e in heads.exit_layers if e in cfg.train_exits]
    params = [p for e in trained for p in heads.adapter(e).parameters()]
    warm_ids = {id(p) for p in warm}
    # With a trimmed draft head, teacher and student are both renormalised over its ids.
    draft = heads.draft_head(stack, router.config.draft_vocab_size) if cfg.draft_vocab_only else None
    context = any(e in heads.context_exits() for e in trained)
    if context and not cache.chunk_len:
        raise ValueError("Block adapters train on whole chunks: build the cache with build_cache (chunk_len > 0).")
    report = TrainingReport(train_positions=len(cache), config=asdict(cfg))
    if not params:  # identity adapters: nothing to train
        return report
    # The base model is frozen for the run and given back exactly as it was, whatever happens in between.
    frozen = [p for p in router.model.parameters() if p.requires_grad]  # the heads are not the model's
    was_training = heads.training
    start = time.perf_counter()
    try:
        for p in frozen:
            p.requires_grad_(False)
        groups = [{"params": [p for p in params if id(p) not in warm_ids]}]
        if warm_ids:
            groups.append({"params": [p for p in params if id(p) in warm_ids], "lr": cfg.lr * cfg.warm_lr_scale})
        optimizer = torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=cfg.weight_decay)
        horizon = [cfg.max_steps]  # the cosine schedule's length; a time budget resets it after the first steps
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda step: min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(step / horizon[0], 1.0))),
        )
        heads.train()
        bar = tqdm(total=cfg.max_steps, desc="training exit heads", disable=not progress)
        step = 0
        while step < horizon[0]:
            if cfg.max_seconds is not None and step == 3:  # 3 steps timed: as many as the budget allows
                per_step = (time.perf_counter() - start) / 3
                horizon[0] = max(4, int(cfg.max_seconds / per_step))
                bar.reset(total=horizon[0])
                bar.update(3)
            if context:  # whole chunks: the block attends to the positions before
                chunks = torch.randint(cache.num_chunks, (max(1, cfg.batch_tokens // cache.chunk_len),), generator=g)
                idx = chunk_positions(chunks, cache.chunk_len)
            else:
                idx = torch.randint(len(cache), (cfg.batch_tokens,), generator=g)
            with torch.no_grad():
                final = cache.final_normed[idx].to(stack.device, stack.dtype)
                teacher = _sub_logits(stack, draft, final)
            next_token = cache.next_token[idx]
            if draft is not None:  # the corpus' next token as an index into the trimmed ids (-1 outside them)
                next_token = _sub_index(draft, next_token)
            losses = {}
            total = torch.zeros((), device=stack.device)
            for e in trained:
                hidden = cache.exits[e][idx].to(stack.device, stack.dtype)
                if context:
                    hidden = hidden.view(-1, cache.chunk_len, hidden.shape[-1])
                student = _sub_logits(stack, draft, exit_normed(stack, heads.adapter(e), hidden).reshape(final.shape))
                loss = distillation_loss(student, teacher, next_token, cfg.ce_weight)
                losses[e] = loss.item()
                total = total + loss
            optimizer.zero_grad(set_to_none=True)
            total.backward()
            optimizer.step()
            schedule.step()
            if step == 0:
                report.loss_first = losses
            report.loss_last = losses
            bar.update(1)
            bar.set_postfix({f"L{e}": f"{v:.2f}" for e, v in losses.items()})
            step += 1
    finally:
        heads.train(was_training)
        for p in frozen:
            p.requires_grad_(True)
    report.steps = step
    report.seconds = time.perf_counter() - start
    return report


def own_text_agreement(router: Any, train: HiddenStateCache, cfg: TrainingConfig) -> dict[int, float]:
    """Each trained exit's top-1 agreement with the full model on its own training text (`OWN_TEXT_CHUNKS` chunks of
    it; without chunks, as many positions as 256-position chunks would hold): beside the held-out agreement, the gap
    says how far a head learned its text rather than the model (`train_share` draws the learning curve)."""
    chunks = train.num_chunks or max(1, len(train) // 256)
    sample = train.sample(min(1.0, OWN_TEXT_CHUNKS / chunks), cfg.seed)
    teacher = teacher_top1(router, sample)
    exits = [e for e in router.heads.exit_layers if cfg.train_exits is None or e in cfg.train_exits]
    return {e: round((exit_top1(router, sample, e) == teacher).float().mean().item(), 4) for e in exits}


def _sub_logits(stack: Any, draft: DraftHead | None, normed: torch.Tensor) -> torch.Tensor:
    """(N, hidden) -> float32 logits over the trimmed ids (N, K), or over the whole vocabulary without `draft`."""
    if draft is None:
        return stack.unembed(normed).float()
    return stack.finish_logits(draft(normed)).float()


def _sub_index(draft: DraftHead, tokens: torch.Tensor) -> torch.Tensor:
    """Token ids (N,) -> their index among the draft head's sorted ids, -1 where absent (or already -1)."""
    ids = draft.token_ids.cpu()
    where = torch.searchsorted(ids, tokens.clamp(min=0)).clamp(max=len(ids) - 1)
    return torch.where((ids[where] == tokens) & (tokens >= 0), where, torch.full_like(tokens, -1))


def warm_start(router: Any, source: Any, exits: Iterable[int]) -> list[nn.Parameter]:
    """Load `source`'s trained adapters (an `ExitHeads`) into `router`'s heads at `exits`; return the parameters
    that now hold trained values.

    An exit of the same kind loads whole; a `residual_block` loads a `postnorm` head into its post-norm map (it then
    starts as exactly that head, and training adds what its block contributes)."""
    warm: list[nn.Parameter] = []
    for e in exits:
        if e not in source.exit_layers:
            raise ValueError(f"Exit {e} has no head in the warm-start heads (exits {source.exit_layers}).")
        kind, theirs = router.heads.kinds[e], source.kinds[e]
        target = router.heads.adapter(e)
        if kind == theirs:
            target.load_state_dict(source.adapter(e).state_dict())
        elif kind == "residual_block" and theirs == "postnorm":
            target = target.post
            target.load_state_dict(source.adapter(e).state_dict())
        else:
            raise ValueError(
                f"Cannot warm-start a {kind!r} adapter at exit {e} from a {theirs!r} one: same kinds load whole, and a "
                "'residual_block' loads a 'postnorm' head."
            )
        warm += list(target.parameters())
    ranking = source.draft_token_ranking()
    if ranking is not None:
        router.heads.set_draft_token_ranking(ranking, router.stack.vocab_size)
    return warm


def distill_router(
    router: Any,
    sequences: list[list[int]] | None,
    cfg: TrainingConfig,
    gates: bool = True,
    target_agreement: float | None = 0.9,
    progress: bool = True,
    cache: HiddenStateCache | None = None,
    warm: Iterable[nn.Parameter] = (),
    gate_cache: HiddenStateCache | None = None,
) -> dict[str, Any]:
    """Cache hidden states (or take `cache`), train adapters (and gates), mark the heads trained, and return a
    report. `warm` parameters were loaded by `warm_start` and learn more slowly; `gate_cache` holds text that only
    the gates fit on (`gate_sequences`), beside their share of the held-out chunks.

    With `target_agreement`, the confidence rule's threshold (`high_conf_threshold = low_conf_threshold`) is set to
    the lowest value whose replayed cascade keeps that agreement on the held-out positions.
    """

    start = time.perf_counter()
    if cache is None:
        if sequences is None:
            raise ValueError("distill_router needs token sequences or a hidden-state cache.")
        cache = build_cache(router.stack, router.heads.exit_layers, sequences, cfg.chunk_len, progress=progress)
    cache_s = time.perf_counter() - start
    train, holdout = cache.split(cfg.holdout_share, cfg.seed)
    train = train.sample(cfg.train_share, cfg.seed)
    # The trimmed draft head keeps the model's most frequent predictions (warm-started heads keep the ranking they
    # were trained with).
    if router.config.draft_vocab_size and router.heads.draft_token_ranking() is None:
        vocab = router.stack.vocab_size
        router.heads.set_draft_token_ranking(draft_token_ranking(teacher_top1(router, train), vocab), vocab)
    report = train_heads(router, train, cfg, progress=progress, warm=warm)
    own_text = own_text_agreement(router, train, cfg)
    if gates:
        gate_fit = train
        if holdout.num_chunks >= 2:  # else (a tiny corpus) the gates fit on the training text
            holdout, gate_fit = holdout.split(cfg.gate_share, cfg.seed)
        if gate_cache is not None:
            gate_fit = HiddenStateCache.concat([gate_fit, gate_cache])
        quality = train_gates(router, gate_fit, holdout, cfg, head=cfg.head_gates)
        report.gate_accuracy = {e: q["accuracy"] for e, q in quality.items()}
        report.gate_auc = {e: q["auc"] for e, q in quality.items()}
        report.gate_saved_at_recall = {e: q["saved_at_recall"] for e, q in quality.items()}
        report.confidence_auc = {e: q["confidence_auc"] for e, q in quality.items()}
        report.gate_kind = "head" if cfg.head_gates else "pre-head"
        report.gate_exit_share_at_95 = {e: q["exit_share_at_95"] for e, q in quality.items()}
        report.confidence_exit_share_at_95 = {e: q["confidence_exit_share_at_95"] for e, q in quality.items()}
    router.config = router.config.replace(heads_trained=True)
    result: dict[str, Any] = {"training": report.to_dict(), "cache_seconds": round(cache_s, 1)}
    result["own_text_agreement"] = own_text
    signals = exit_signals(router, holdout)
    if target_agreement is not None:
        high, share, agreement = suggest_high_threshold(
            signals, router.config, router.stack.vocab_size, target_agreement
        )
        router.config = router.config.replace(high_conf_threshold=high, low_conf_threshold=high)
        result["thresholds"] = {
            "high_conf_threshold": high,
            "holdout_exit_share": share,
            "holdout_agreement": agreement,
        }
        signals = exit_signals(router, holdout)
    result["holdout_quality"] = as_dicts(quality_table(signals))
    result["holdout_positions"] = len(holdout)  # what the report and the threshold were measured on
    if gates:
        result["gate_fit_positions"] = next(iter(quality.values()))["fit_positions"]  # after the cap's draw
    result["total_seconds"] = round(time.perf_counter() - start, 1)
    return result

"""Training exit heads by self-distillation, and the learned gates in front of them.

The base model stays frozen. One no-grad pass over the corpus stores, per token, the hidden state at every exit
and the final normed hidden state (`HiddenStateCache`). Training then only runs the adapters, the shared final
norm and the LM head: the loss at exit `e` is KL(full model || exit head) over the whole vocabulary, optionally
mixed with cross-entropy on the corpus' next token. The teacher's logits are recomputed from the stored final
state, which is exact and far smaller than storing them.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from early_exit_router.runtime.heads import LearnedGate, draft_token_ranking, exit_logits


@dataclass
class TrainingConfig:
    """Budget and optimiser settings of `train_heads`."""

    max_steps: int = 600  # optimiser steps; each sees `batch_tokens` positions at every exit
    batch_tokens: int = 512
    lr: float = 2e-3
    weight_decay: float = 0.0
    ce_weight: float = 0.0  # 0: pure KL to the full model; >0 adds cross-entropy on the corpus' next token
    seed: int = 0
    holdout_share: float = 0.05  # positions kept out of training, for the report and the gate check
    gate_steps: int = 300
    chunk_len: int = 256  # positions per forward pass when caching hidden states


@dataclass
class HiddenStateCache:
    """Per-position hidden states of a frozen model over a corpus."""

    exits: dict[int, torch.Tensor]  # layer -> (N, hidden), output of that layer
    final_normed: torch.Tensor  # (N, hidden): final norm applied to the last layer's output
    next_token: torch.Tensor  # (N,) the corpus' next token, -1 at the end of a chunk

    def __len__(self) -> int:
        return self.final_normed.shape[0]

    def split(self, holdout_share: float, seed: int) -> tuple[HiddenStateCache, HiddenStateCache]:
        g = torch.Generator().manual_seed(seed)
        perm = torch.randperm(len(self), generator=g)
        n_hold = max(1, int(len(self) * holdout_share))
        return self.select(perm[n_hold:]), self.select(perm[:n_hold])

    def select(self, idx: torch.Tensor) -> HiddenStateCache:
        return HiddenStateCache(
            {e: h[idx] for e, h in self.exits.items()}, self.final_normed[idx], self.next_token[idx]
        )


@torch.no_grad()
def build_cache(
    stack: Any,
    exit_layers: list[int],
    sequences: list[list[int]],
    chunk_len: int = 256,
    batch_size: int = 4,
    progress: bool = True,
) -> HiddenStateCache:
    """Run the frozen model over `sequences` (concatenated, cut into chunks) and keep the states training needs."""
    stream = torch.tensor([t for seq in sequences for t in seq], dtype=torch.long)
    n_chunks = max(1, len(stream) // chunk_len)
    chunks = stream[: n_chunks * chunk_len].view(n_chunks, chunk_len)  # (chunks, chunk_len)
    exits: dict[int, list[torch.Tensor]] = {e: [] for e in exit_layers}
    finals, nexts = [], []
    bounds = [0] + [e + 1 for e in exit_layers] + [stack.num_layers]
    positions = torch.arange(chunk_len, device=stack.device).unsqueeze(0)
    for start in tqdm(range(0, n_chunks, batch_size), desc="caching hidden states", disable=not progress):
        ids = chunks[start : start + batch_size].to(stack.device)
        hidden = stack.embed(ids)
        for i, e in enumerate(exit_layers):
            hidden = stack.run(hidden, bounds[i], bounds[i + 1], None, positions)
            exits[e].append(hidden.reshape(-1, stack.hidden_size).float().cpu())
        hidden = stack.run(hidden, bounds[-2], bounds[-1], None, positions)
        finals.append(stack.final_norm(hidden).reshape(-1, stack.hidden_size).float().cpu())
        nxt = torch.full_like(ids, -1)
        nxt[:, :-1] = ids[:, 1:]
        nexts.append(nxt.reshape(-1).cpu())
    return HiddenStateCache({e: torch.cat(v) for e, v in exits.items()}, torch.cat(finals), torch.cat(nexts))


def head_logits(stack: Any, adapter: nn.Module | None, hidden: torch.Tensor) -> torch.Tensor:
    """Exit-head logits (N, vocab) in float32 for cached hidden states (N, hidden); adapter None is the logit lens."""
    return exit_logits(stack, adapter, hidden.to(device=stack.device, dtype=stack.dtype)).float()


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
    config: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def train_heads(router: Any, cache: HiddenStateCache, cfg: TrainingConfig, progress: bool = True) -> TrainingReport:
    """Fit every exit's adapter to the full model's next-token distribution. The base model stays frozen."""
    stack, heads = router._stack, router.heads
    torch.manual_seed(cfg.seed)
    g = torch.Generator().manual_seed(cfg.seed)
    params = [p for p in heads.adapters.parameters()]
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
        optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda step: min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / cfg.max_steps)),
        )
        heads.train()
        bar = tqdm(range(cfg.max_steps), desc="training exit heads", disable=not progress)
        for step in bar:
            idx = torch.randint(len(cache), (cfg.batch_tokens,), generator=g)
            with torch.no_grad():
                teacher = stack.unembed(cache.final_normed[idx].to(stack.device, stack.dtype)).float()
            losses = {}
            total = torch.zeros((), device=stack.device)
            for e in heads.exit_layers:
                student = head_logits(stack, heads.adapter(e), cache.exits[e][idx])
                loss = distillation_loss(student, teacher, cache.next_token[idx], cfg.ce_weight)
                losses[e] = loss.item()
                total = total + loss
            optimizer.zero_grad(set_to_none=True)
            total.backward()
            optimizer.step()
            schedule.step()
            if step == 0:
                report.loss_first = losses
            report.loss_last = losses
            bar.set_postfix({f"L{e}": f"{v:.2f}" for e, v in losses.items()})
    finally:
        heads.train(was_training)
        for p in frozen:
            p.requires_grad_(True)
    report.steps = cfg.max_steps
    report.seconds = time.perf_counter() - start
    return report


@torch.no_grad()
def teacher_top1(router: Any, cache: HiddenStateCache, batch: int = 1024) -> torch.Tensor:
    """(N,) the full model's top-1 token at every cached position."""
    stack = router._stack
    return torch.cat(
        [
            stack.unembed(cache.final_normed[s : s + batch].to(stack.device, stack.dtype)).argmax(-1).cpu()
            for s in range(0, len(cache), batch)
        ]
    )


@torch.no_grad()
def exit_top1(
    router: Any, cache: HiddenStateCache, layer: int, trained: bool = True, batch: int = 1024
) -> torch.Tensor:
    """(N,) the exit head's top-1 token (trained adapter, or the logit lens when `trained` is False)."""
    adapter = router.heads.adapter(layer) if trained else None
    return torch.cat(
        [
            head_logits(router._stack, adapter, cache.exits[layer][s : s + batch]).argmax(-1).cpu()
            for s in range(0, len(cache), batch)
        ]
    )


def train_gates(
    router: Any, train: HiddenStateCache, holdout: HiddenStateCache, cfg: TrainingConfig, max_positions: int = 20_000
) -> dict[int, dict[str, float]]:
    """Fit a logistic gate per exit predicting agreement with the full model.

    Returns, per exit, held-out `accuracy` at 0.5, `auc`, and `saved_at_recall`: the share of head calls the gate
    skips at a threshold that still lets 95% of the agreeing positions through."""
    g = torch.Generator().manual_seed(cfg.seed)
    train = train.select(torch.randperm(len(train), generator=g)[:max_positions])
    target, target_hold = teacher_top1(router, train), teacher_top1(router, holdout)
    router.heads.add_gates(router._stack.hidden_size)
    quality = {}
    for layer in router.heads.exit_layers:
        gate: LearnedGate = router.heads.gate(layer).float()
        y = (exit_top1(router, train, layer) == target).float()
        x = train.exits[layer]
        optimizer = torch.optim.Adam(gate.parameters(), lr=1e-2)
        # Weigh the rarer class up, so that the gate neither always says yes nor always no.
        pos = y.mean().clamp(1e-3, 1 - 1e-3)
        weights = torch.where(y > 0, 0.5 / pos, 0.5 / (1 - pos))
        for _ in range(cfg.gate_steps):
            prob = gate(x).clamp(1e-6, 1 - 1e-6)
            loss = nn.functional.binary_cross_entropy(prob, y, weight=weights)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            y_hold = exit_top1(router, holdout, layer) == target_hold
            score = gate(holdout.exits[layer])
            quality[layer] = {
                "accuracy": float(((score >= 0.5) == y_hold).float().mean()),
                "auc": roc_auc(score, y_hold),
                "saved_at_recall": saved_at_recall(score, y_hold, 0.95),
            }
        gate.to(device=router._stack.device, dtype=router._stack.dtype)
    return quality


def roc_auc(score: torch.Tensor, positive: torch.Tensor) -> float:
    """Area under the ROC curve: the chance that a random positive scores above a random negative (ties: half)."""
    pos, neg = score[positive].float(), score[~positive].float()
    if len(pos) == 0 or len(neg) == 0:
        return float("nan")
    both = torch.cat([pos, neg])
    # Mann-Whitney U from ranks; tied scores share their average rank, so a tie counts half.
    _, inverse, counts = torch.unique(both, return_inverse=True, return_counts=True)  # sorted distinct values
    ends = counts.cumsum(0).to(both.dtype)
    ranks = (ends - (counts.to(both.dtype) - 1) / 2)[inverse]
    u = ranks[: len(pos)].sum() - len(pos) * (len(pos) + 1) / 2
    return float(u / (len(pos) * len(neg)))


def saved_at_recall(score: torch.Tensor, positive: torch.Tensor, recall: float) -> float:
    """Share of all positions scored below the threshold that keeps `recall` of the positives above it."""
    pos = score[positive].float().sort().values
    if len(pos) == 0:
        return 1.0
    threshold = pos[int((1 - recall) * len(pos))]
    return float((score.float() < threshold).float().mean())


def corpus_sequences(
    router: Any,
    max_tokens: int,
    self_gen_tokens: int = 96,
    prompts_path: str | None = None,
    use_docs: bool = True,
    self_gen_repeats: int = 2,
    progress: bool = True,
) -> tuple[list[list[int]], dict[str, Any]]:
    """Token sequences to train on (the model's own answers, repeated, then package READMEs) and their manifest."""
    from early_exit_router.tools.corpus import load_prompts, package_descriptions, self_generated

    tokenizer = router.tokenizer
    if tokenizer is None:
        raise ValueError("Training needs the model's tokenizer: build the router with one.")
    sequences: list[list[int]] = []
    manifest: dict[str, Any] = {}
    if self_gen_tokens > 0:
        prompts = load_prompts(prompts_path)
        start = time.perf_counter()
        with router.disabled() as model:
            answers = self_generated(model, tokenizer, prompts, self_gen_tokens)
        manifest["self_generated"] = {
            "prompts": len(prompts),
            "tokens": sum(map(len, answers)),
            "repeats": self_gen_repeats,
            "seconds": round(time.perf_counter() - start, 1),
        }
        sequences += answers * self_gen_repeats
    used = sum(map(len, sequences))
    if use_docs and used < max_tokens:
        texts, sources = package_descriptions(max_chars=4 * (max_tokens - used))  # ~4 characters per token
        docs = [tokenizer(t, add_special_tokens=False).input_ids + [tokenizer.eos_token_id] for t in texts]
        sequences += docs
        manifest["package_descriptions"] = {"packages": sources, "tokens": sum(map(len, docs))}
    stream_len = sum(map(len, sequences))
    if progress:
        print(f"training corpus: {min(stream_len, max_tokens)} tokens ({manifest})")
    # Cut to the budget without reordering: answers first, then documents.
    out, total = [], 0
    for seq in sequences:
        if total >= max_tokens:
            break
        out.append(seq[: max_tokens - total])
        total += len(out[-1])
    return out, manifest


def distill_router(
    router: Any,
    sequences: list[list[int]],
    cfg: TrainingConfig,
    gates: bool = True,
    target_agreement: float | None = 0.9,
    progress: bool = True,
) -> dict[str, Any]:
    """Cache hidden states, train adapters (and gates), mark the heads trained, and return a report.

    With `target_agreement`, `high_conf_threshold` is set to the lowest value whose replayed cascade keeps that
    agreement on the held-out positions.
    """
    from early_exit_router.tools.head_report import as_dicts, exit_signals, quality_table, suggest_high_threshold

    start = time.perf_counter()
    cache = build_cache(router._stack, router.heads.exit_layers, sequences, cfg.chunk_len, progress=progress)
    cache_s = time.perf_counter() - start
    train, holdout = cache.split(cfg.holdout_share, cfg.seed)
    if router.config.draft_vocab_size:  # the trimmed draft head keeps the model's most frequent predictions
        vocab = router._stack.vocab_size
        router.heads.set_draft_token_ranking(draft_token_ranking(teacher_top1(router, train), vocab), vocab)
    report = train_heads(router, train, cfg, progress=progress)
    if gates:
        quality = train_gates(router, train, holdout, cfg)
        report.gate_accuracy = {e: q["accuracy"] for e, q in quality.items()}
        report.gate_auc = {e: q["auc"] for e, q in quality.items()}
        report.gate_saved_at_recall = {e: q["saved_at_recall"] for e, q in quality.items()}
    router.config = router.config.replace(heads_trained=True)
    result: dict[str, Any] = {"training": report.to_dict(), "cache_seconds": round(cache_s, 1)}
    signals = exit_signals(router, holdout)
    if target_agreement is not None:
        high, share, agreement = suggest_high_threshold(
            signals, router.config, router._stack.vocab_size, target_agreement
        )
        router.config = router.config.replace(
            high_conf_threshold=high, low_conf_threshold=min(router.config.low_conf_threshold, high)
        )
        result["thresholds"] = {
            "high_conf_threshold": high,
            "holdout_exit_share": share,
            "holdout_agreement": agreement,
        }
        signals = exit_signals(router, holdout)
    result["holdout_quality"] = as_dicts(quality_table(signals))
    result["total_seconds"] = round(time.perf_counter() - start, 1)
    return result

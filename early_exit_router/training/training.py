"""Training exit heads by self-distillation, and the learned gates in front of them.

The base model stays frozen. One no-grad pass over the corpus stores, per token, the hidden state at every exit
and the final normed hidden state (`HiddenStateCache`, chunk after chunk of consecutive positions). Training then
only runs the adapters, the shared final norm and the LM head: the loss at exit `e` is KL(full model || exit head),
optionally mixed with cross-entropy on the corpus' next token. The teacher's logits are recomputed from the stored
final state, which is exact and far smaller than storing them.

Where the router drafts from a trimmed head (`draft_vocab_size`), the KL runs over those token ids only: that is
the distribution the engine drafts from, and it costs a fraction of the full vocabulary (so the same time buys
many more steps). Position-wise adapters train on random positions; block adapters (which attend to the context)
on whole chunks.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from early_exit_router.heads.adapters import needs_context
from early_exit_router.heads.draft import DraftHead, draft_token_ranking, exit_normed, logits_from_normed
from early_exit_router.heads.gates import LearnedGate, head_features
from early_exit_router.routing.policy import AcceptanceTracker


@dataclass
class TrainingConfig:
    """Budget and optimiser settings of `train_heads`."""

    max_steps: int = 600  # optimiser steps; each sees `batch_tokens` positions at every exit
    max_seconds: float | None = None  # a wall-clock budget instead: the step count is set from the first steps' time
    batch_tokens: int = 512
    lr: float = 2e-3
    weight_decay: float = 0.0
    ce_weight: float = 0.0  # 0: pure KL to the full model; >0 adds cross-entropy on the corpus' next token
    seed: int = 0
    holdout_share: float = 0.05  # positions kept out of training, for the report and the gate check
    gate_steps: int = 1000  # held-out AUC at L4 / 16 / 24: 0.841 / 0.850 / 0.869 after 300 steps, 0.843 / 0.853 / 0.869
    # Gates fit on this share of the held-out chunks, text the adapters never saw, and are scored on the rest. Fit
    # on the adapters' own training text, where a head that has learned the text is right far more often (measured:
    # a residual block at L16 agreed 0.91 there and 0.69 held out), a gate learns to trust the head too much.
    gate_share: float = 0.5
    # Positions a gate fits on at most (whole chunks, drawn at random). The gates' held-out AUC rose steeply with
    # data (measured, L4 / 16 / 24: 0.78 / 0.80 / 0.82 from 3k positions, 0.84 / 0.85 / 0.87 from 6.4k), so text for
    # the gates alone (`distill_router`'s `gate_cache`) is worth having and this bound is generous.
    gate_max_positions: int = 200_000
    # Gates after the head (a learned confidence from the head's output, the state and the context), or, when False,
    # before it (they can skip the head, but see less).
    head_gates: bool = True
    chunk_len: int = 256  # positions per forward pass when caching hidden states
    draft_vocab_only: bool = True  # distil over the router's trimmed draft vocabulary, when it has one
    train_exits: list[int] | None = None  # the exits whose adapters train (None: all); the others stay as loaded
    warm_lr_scale: float = 0.1  # warm-started parameters (`warm_start`) learn at this fraction of `lr`


@dataclass
class HiddenStateCache:
    """Per-position hidden states of a frozen model over a corpus."""

    exits: dict[int, torch.Tensor]  # layer -> (N, hidden), output of that layer
    final_normed: torch.Tensor  # (N, hidden): final norm applied to the last layer's output
    next_token: torch.Tensor  # (N,) the corpus' next token, -1 at the end of a chunk
    chunk_len: int = 0  # positions come in chunks of this many consecutive ones (0: single positions, no order)

    def __len__(self) -> int:
        return self.final_normed.shape[0]

    @property
    def num_chunks(self) -> int:
        return len(self) // self.chunk_len if self.chunk_len else 0

    def split(self, holdout_share: float, seed: int) -> tuple[HiddenStateCache, HiddenStateCache]:
        """(train, held out): a seeded share of whole chunks held out (of positions, without chunks), so that no
        held-out position sits between training positions of the same text."""
        g = torch.Generator().manual_seed(seed)
        if self.chunk_len:
            perm = torch.randperm(self.num_chunks, generator=g)
            n_hold = max(1, int(self.num_chunks * holdout_share))
            return self.select_chunks(perm[n_hold:]), self.select_chunks(perm[:n_hold])
        perm = torch.randperm(len(self), generator=g)
        n_hold = max(1, int(len(self) * holdout_share))
        return self.select(perm[n_hold:]), self.select(perm[:n_hold])

    def save(self, path: str | Path) -> None:
        """Write the cache to one file (reloaded by `load`, memory-mapped)."""
        torch.save(
            {"exits": self.exits, "final": self.final_normed, "next": self.next_token, "chunk_len": self.chunk_len},
            path,
        )

    @classmethod
    def load(cls, path: str | Path, exit_layers: list[int]) -> HiddenStateCache:
        """The cache saved at `path`, memory-mapped, keeping `exit_layers` (which it must cover)."""
        data = torch.load(path, mmap=True)
        missing = sorted(set(exit_layers) - set(data["exits"]))
        if missing:
            raise ValueError(
                f"The hidden states in {path} do not cover exit layers {missing} (they have {sorted(data['exits'])}): "
                "remove the file or pass another path, so that they are computed again."
            )
        exits = {e: data["exits"][e] for e in exit_layers}
        return cls(exits, data["final"], data["next"], data["chunk_len"])

    @classmethod
    def concat(cls, caches: list[HiddenStateCache]) -> HiddenStateCache:
        """The caches' positions one after the other; they must come in chunks of one length (or none)."""
        layers = [sorted(c.exits) for c in caches]
        if any(other != layers[0] for other in layers):
            raise ValueError(f"Cannot join hidden states of different exit layers ({layers}): build them alike.")
        lens = sorted({c.chunk_len for c in caches})
        if len(lens) > 1:
            raise ValueError(f"Cannot join hidden states cut in chunks of {lens} positions: build them alike.")
        chunk_len = lens[0]
        return cls(
            {e: torch.cat([c.exits[e] for c in caches]) for e in caches[0].exits},
            torch.cat([c.final_normed for c in caches]),
            torch.cat([c.next_token for c in caches]),
            chunk_len,
        )

    def select(self, idx: torch.Tensor) -> HiddenStateCache:
        """Positions `idx` (their chunk structure is lost)."""
        return HiddenStateCache(
            {e: h[idx] for e, h in self.exits.items()}, self.final_normed[idx], self.next_token[idx]
        )

    def select_chunks(self, chunks: torch.Tensor) -> HiddenStateCache:
        """Whole chunks, in the order given."""
        idx = chunk_positions(chunks, self.chunk_len)
        picked = self.select(idx)
        picked.chunk_len = self.chunk_len
        return picked


def chunk_positions(chunks: torch.Tensor, chunk_len: int) -> torch.Tensor:
    """(c,) chunk indices -> (c * chunk_len,) their positions, chunk after chunk."""
    return (chunks.unsqueeze(1) * chunk_len + torch.arange(chunk_len)).flatten()


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
    if len(stream) < chunk_len:
        raise ValueError(f"The text is {len(stream)} tokens, less than one {chunk_len}-token chunk: give more text.")
    n_chunks = len(stream) // chunk_len
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
    exits_cat = {e: torch.cat(v) for e, v in exits.items()}
    return HiddenStateCache(exits_cat, torch.cat(finals), torch.cat(nexts), chunk_len)


def head_logits(
    stack: Any,
    adapter: nn.Module | None,
    hidden: torch.Tensor,
    chunk_len: int = 0,
    draft: DraftHead | None = None,
) -> torch.Tensor:
    """Exit-head logits (N, vocab) in float32 for cached hidden states (N, hidden); adapter None is the logit lens.

    A block adapter reads the context: `hidden` is then whole chunks of `chunk_len` consecutive positions. With
    `draft`, the logits are the trimmed draft head's (-inf outside its ids), as the engine drafts."""
    hidden = hidden.to(device=stack.device, dtype=stack.dtype)
    if needs_context(adapter):
        if not chunk_len or hidden.shape[0] % chunk_len:
            raise ValueError("A block adapter runs over whole chunks: pass positions in chunks of chunk_len.")
        normed = exit_normed(stack, adapter, hidden.view(-1, chunk_len, hidden.shape[-1])).flatten(0, 1)
    else:
        normed = exit_normed(stack, adapter, hidden)
    return logits_from_normed(stack, draft, normed).float()


def batch_size_for(cache: HiddenStateCache, target: int = 1024) -> int:
    """Positions per evaluation batch: whole chunks when the cache has them."""
    return cache.chunk_len * max(1, target // cache.chunk_len) if cache.chunk_len else target


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


@torch.no_grad()
def teacher_top1(router: Any, cache: HiddenStateCache, batch: int = 1024) -> torch.Tensor:
    """(N,) the full model's top-1 token at every cached position."""
    stack = router.stack
    return torch.cat(
        [
            stack.unembed(cache.final_normed[s : s + batch].to(stack.device, stack.dtype)).argmax(-1).cpu()
            for s in range(0, len(cache), batch)
        ]
    )


@torch.no_grad()
def exit_top1(
    router: Any, cache: HiddenStateCache, layer: int, trained: bool = True, with_confidence: bool = False
) -> Any:
    """(N,) the exit head's top-1 token (trained adapter, or the logit lens when `trained` is False), from the
    trimmed draft head where the router drafts from one; with `with_confidence`, also (N,) its probability."""
    adapter = router.heads.adapter(layer) if trained else None
    stack, batch = router.stack, batch_size_for(cache)
    draft = router.heads.draft_head(stack, router.config.draft_vocab_size)
    tops, confidences = [], []
    for s in range(0, len(cache), batch):
        logits = head_logits(stack, adapter, cache.exits[layer][s : s + batch], cache.chunk_len, draft)
        confidence, top = torch.softmax(logits, dim=-1).max(dim=-1)
        tops.append(top.cpu())
        confidences.append(confidence.cpu())
    return (torch.cat(tops), torch.cat(confidences)) if with_confidence else torch.cat(tops)


def ngram_proposals(cache: HiddenStateCache, ngram_max: int = 4, ngram_min: int = 2) -> torch.Tensor:
    """(N,) the token the n-gram tier would copy at every cached position (-1: no match), replayed within each
    chunk as `ngram.ngram_match` finds it: the latest earlier occurrence of the longest suffix of `ngram_max` down
    to `ngram_min` tokens. Without chunks: -1 everywhere."""
    proposals = torch.full((len(cache),), -1, dtype=torch.long)
    if not cache.chunk_len:
        return proposals
    n = cache.chunk_len
    sizes = range(ngram_max, ngram_min - 1, -1)
    for c in range(cache.num_chunks):
        tokens = [-1] + cache.next_token[c * n : (c + 1) * n - 1].tolist()  # the token at each position
        latest: dict[tuple[int, ...], int] = {}  # n-gram -> its latest start whose follower is known
        out = proposals[c * n : (c + 1) * n]
        for t in range(n):
            for k in sizes:
                if t - k >= 0:
                    latest[tuple(tokens[t - k : t])] = t - k
            for k in sizes:
                if t + 1 > k and (start := latest.get(tuple(tokens[t - k + 1 : t + 1]))) is not None:
                    out[t] = tokens[start + k]
                    break
    return proposals


def gate_context(
    cache: HiddenStateCache,
    agree: torch.Tensor,
    ngram_min: int = 2,
    rate: float = 0.15,
    proposals: torch.Tensor | None = None,
) -> torch.Tensor:
    """(N, 2) the gate's context features at every cached position, replayed as the engine sees them:
    whether the n-gram tier would match here (`proposals` from `ngram_proposals`, or a match of the last `ngram_min`
    tokens earlier in the chunk), and the exit's running acceptance (an exponential average of the previous
    positions' verdicts `agree`, from 0.5 at a chunk's start, updated at `rate` as the policy's tracker is).
    Without chunks: no match, acceptance 0.5."""
    features = torch.zeros(len(cache), 2)
    features[:, 1] = 0.5
    if not cache.chunk_len:
        return features
    if proposals is None:
        proposals = ngram_proposals(cache, ngram_min, ngram_min)
    features[:, 0] = (proposals >= 0).float()
    n = cache.chunk_len
    for c in range(cache.num_chunks):
        acceptance = 0.5
        for t, verdict in enumerate(agree[c * n : (c + 1) * n].tolist()):
            features[c * n + t, 1] = acceptance
            acceptance += rate * (float(verdict) - acceptance)
    return features


@torch.no_grad()
def exit_head_features(router: Any, cache: HiddenStateCache, layer: int, proposals: torch.Tensor) -> torch.Tensor:
    """(N, len(HEAD_FEATURES)) what a head gate reads off exit `layer`'s draft head at every cached position, with
    the n-gram tier's replayed `proposals` (N,)."""
    stack, batch = router.stack, batch_size_for(cache)
    draft = router.heads.draft_head(stack, router.config.draft_vocab_size)
    adapter = router.heads.adapter(layer)
    return torch.cat(
        [
            head_features(
                head_logits(stack, adapter, cache.exits[layer][s : s + batch], cache.chunk_len, draft),
                proposals[s : s + batch],
                None if draft is None else draft.token_ids,
            ).cpu()
            for s in range(0, len(cache), batch)
        ]
    )


def train_gates(
    router: Any,
    train: HiddenStateCache,
    holdout: HiddenStateCache,
    cfg: TrainingConfig,
    context: bool = True,
    head: bool = False,
) -> dict[int, dict[str, float]]:
    """Fit a logistic gate per exit predicting agreement with the full model (with the context features of
    `gate_context` unless `context` is False; with `head`, also the head's output: a head gate, see `LearnedGate`).

    Returns, per exit, held-out `accuracy` at 0.5, `auc`, `saved_at_recall` (the share of head calls the gate skips
    at a threshold that still lets 95% of the agreeing positions through; 0 for a head gate, which runs after the
    head), `confidence_auc`: the AUC of the head's own confidence, and the share of positions that can exit at 0.95
    agreement when ranked by the gate (`exit_share_at_95`) and by the confidence (`confidence_exit_share_at_95`);
    `fit_positions`: how many positions the gate fit on (at most `cfg.gate_max_positions`, whole chunks)."""
    g = torch.Generator().manual_seed(cfg.seed)
    max_positions = cfg.gate_max_positions
    if train.chunk_len:
        train = train.select_chunks(
            torch.randperm(train.num_chunks, generator=g)[: max(1, max_positions // train.chunk_len)]
        )
    else:
        train = train.select(torch.randperm(len(train), generator=g)[:max_positions])
    config = router.config
    target, target_hold = teacher_top1(router, train), teacher_top1(router, holdout)
    # What the n-gram tier would copy depends on the text alone: replayed once per cache, shared by every exit.
    proposals = [ngram_proposals(c, config.ngram_size, config.ngram_min_size) for c in (train, holdout)]
    router.heads.add_gates(router.stack.hidden_size, context, head)
    quality = {}
    for layer in router.heads.exit_layers:
        gate: LearnedGate = router.heads.gate(layer).float()
        inputs = {}
        for name, cache, teacher, replayed in (
            ("train", train, target, proposals[0]),
            ("holdout", holdout, target_hold, proposals[1]),
        ):
            top, confidence = exit_top1(router, cache, layer, with_confidence=True)
            agree = top == teacher
            features = (
                gate_context(cache, agree.float(), config.ngram_min_size, AcceptanceTracker.rate, replayed)
                if context
                else None
            )
            heads = exit_head_features(router, cache, layer, replayed) if head else None
            inputs[name] = (cache.exits[layer], features, heads, agree, confidence)
        x, features, heads, agree, _ = inputs["train"]
        y = agree.float()
        if heads is not None:  # standardised with the training set's statistics, kept in the gate's buffers
            gate.head_mean.copy_(heads.mean(0))
            gate.head_scale.copy_(heads.std(0).clamp(min=1e-3))
        optimizer = torch.optim.Adam(gate.parameters(), lr=1e-2)
        # A pre-head gate weighs the rarer class up, so that it neither always says yes nor always no. A head gate
        # is a confidence the thresholds compare, so it stays an unweighted (calibrated) estimate of P(agree).
        pos = y.mean().clamp(1e-3, 1 - 1e-3)
        weights = None if head else torch.where(y > 0, 0.5 / pos, 0.5 / (1 - pos))
        for _ in range(cfg.gate_steps):
            prob = gate(x, features, heads).clamp(1e-6, 1 - 1e-6)
            loss = nn.functional.binary_cross_entropy(prob, y, weight=weights)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            x, features, heads, y_hold, confidence = inputs["holdout"]
            score = gate(x, features, heads)
            quality[layer] = {
                "accuracy": float(((score >= 0.5) == y_hold).float().mean()),
                "auc": roc_auc(score, y_hold),
                "saved_at_recall": 0.0 if head else saved_at_recall(score, y_hold, 0.95),
                "confidence_auc": roc_auc(confidence, y_hold),
                "exit_share_at_95": coverage_at(score, y_hold, 0.95),
                "confidence_exit_share_at_95": coverage_at(confidence, y_hold, 0.95),
                "fit_positions": len(train),
            }
        gate.to(device=router.stack.device, dtype=router.stack.dtype)
    return quality


def coverage_at(score: torch.Tensor, correct: torch.Tensor, precision: float) -> float:
    """Largest share of positions that, taken highest score first, agree with the full model at `precision`."""
    order = score.argsort(descending=True)
    running = correct[order].float().cumsum(0) / torch.arange(1, len(order) + 1)
    ok = (running >= precision).nonzero()
    return float(ok.max() + 1) / len(order) if len(ok) else 0.0


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
    extra_prompts: int = 0,
    sampled: bool = False,
    seed: int = 0,
) -> tuple[list[list[int]], dict[str, Any]]:
    """Token sequences to train on and their manifest: the model's own greedy answers to the prompt set (repeated
    `self_gen_repeats` times), to `extra_prompts` generated prompts, and with `sampled` a sampled answer to every
    prompt; then package READMEs up to `max_tokens`."""
    from early_exit_router.training.corpus import generated_prompts, load_prompts, package_descriptions, self_generated

    tokenizer = router.tokenizer
    if tokenizer is None:
        raise ValueError("Training needs the model's tokenizer: build the router with one.")
    sequences: list[list[int]] = []
    manifest: dict[str, Any] = {}
    if self_gen_tokens > 0:
        prompts = load_prompts(prompts_path)
        extra = generated_prompts(extra_prompts, seed) if extra_prompts > 0 else []
        start = time.perf_counter()
        with router.disabled() as model:
            answers = self_generated(model, tokenizer, prompts, self_gen_tokens)
            sequences += answers * self_gen_repeats
            if extra:
                sequences += self_generated(model, tokenizer, extra, self_gen_tokens)
            if sampled:
                sequences += self_generated(model, tokenizer, prompts + extra, self_gen_tokens, sample=True, seed=seed)
        manifest["self_generated"] = {
            "prompts": len(prompts),
            "generated_prompts": len(extra),
            "sampled": sampled,
            "tokens": sum(map(len, sequences)),
            "repeats": self_gen_repeats,
            "seconds": round(time.perf_counter() - start, 1),
        }
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


def gate_sequences(
    router: Any,
    count: int,
    answer_tokens: int,
    seed: int,
    exclude: Iterable[dict[str, Any]],
    progress: bool = True,
) -> tuple[list[list[int]], dict[str, Any]]:
    """Text for fitting the gates alone, and its manifest: the model's own greedy and sampled answers to `count`
    fresh prompts (`corpus.fresh_prompts`: seeded, none of them in `exclude`, the training prompts). No adapter
    trains on it, so a gate fit there learns how often a head is right on text it never saw."""
    from early_exit_router.training.corpus import fresh_prompts, self_generated

    prompts = fresh_prompts(count, seed, exclude)
    start = time.perf_counter()
    with router.disabled() as model:
        sequences = self_generated(model, router.tokenizer, prompts, answer_tokens)
        sequences += self_generated(model, router.tokenizer, prompts, answer_tokens, sample=True, seed=seed)
    manifest = {
        "prompts": len(prompts),
        "answers": "greedy and sampled",
        "tokens": sum(map(len, sequences)),
        "seconds": round(time.perf_counter() - start, 1),
    }
    if progress:
        print(f"gate corpus: {manifest}")
    return sequences, manifest


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
    from early_exit_router.training.head_report import as_dicts, exit_signals, quality_table, suggest_high_threshold

    start = time.perf_counter()
    if cache is None:
        if sequences is None:
            raise ValueError("distill_router needs token sequences or a hidden-state cache.")
        cache = build_cache(router.stack, router.heads.exit_layers, sequences, cfg.chunk_len, progress=progress)
    cache_s = time.perf_counter() - start
    train, holdout = cache.split(cfg.holdout_share, cfg.seed)
    # The trimmed draft head keeps the model's most frequent predictions (warm-started heads keep the ranking they
    # were trained with).
    if router.config.draft_vocab_size and router.heads.draft_token_ranking() is None:
        vocab = router.stack.vocab_size
        router.heads.set_draft_token_ranking(draft_token_ranking(teacher_top1(router, train), vocab), vocab)
    report = train_heads(router, train, cfg, progress=progress, warm=warm)
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

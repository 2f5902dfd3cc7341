"""The exit-layer survey: how good a cheap exit head can be at every layer, and whether drafting from it pays.

One no-grad pass caches the hidden state after every surveyed layer; then a fresh adapter per layer is fitted by
self-distillation, on the trimmed draft vocabulary the engine drafts from (the loss is KL over those ids, so a
layer costs a fraction of a full-vocabulary fit and the head is trained for what it is used for). Per layer the
report gives, on held-out positions: the logit lens' and the trained head's top-1 agreement with the full model,
the share of positions that can exit at a target precision when sorted by confidence (the confidence-coverage
curve's operating point), and, from the measured cost model, what a draft from that layer costs, the acceptance
at which drafting breaks even with plain decoding, and the speed-up over plain decoding at the measured agreement
(the policy's own tokens-per-ms arithmetic, `policy.py`). Exits are then chosen from these numbers.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from early_exit_router.heads.adapters import needs_context
from early_exit_router.heads.block import BLOCK_KINDS, block_source
from early_exit_router.heads.draft import exit_normed
from early_exit_router.heads.exit_heads import make_adapter
from early_exit_router.models.architecture import dense
from early_exit_router.routing.costs import CostModel
from early_exit_router.routing.policy import DraftPolicy
from early_exit_router.training.distill import distillation_loss
from early_exit_router.training.gates import coverage_at
from early_exit_router.training.hidden_states import HiddenStateCache, chunk_positions


@dataclass
class SurveyRow:
    layer: int
    lens_agreement: float  # top-1 of the (trimmed) logit lens equals the full model's top-1
    trained_agreement: float  # the same for the fitted adapter
    coverage: float  # share of positions that exit at >= `precision` agreement, most confident first
    draft_ms: float  # one draft token from this exit: its layers for one position + adapter, norm, draft head
    break_even: float  # acceptance at which drafting from this exit equals plain decoding
    speedup: float  # best cycle's tokens per ms over plain decoding's, at acceptance = trained_agreement
    seconds: float  # fitting time


def break_even_acceptance(policy: DraftPolicy, tier: int, max_draft: int) -> float:
    """The acceptance at which the best draft cycle from exit `tier` is exactly as fast as plain decoding."""

    def rate(a: float) -> float:
        return policy.best_draft(a, lambda d: policy.exit_cycle_ms(tier, d), max_draft)[1]

    if rate(1.0) <= policy.plain_rate:
        return 1.0  # even perfect drafts do not pay here
    lo, hi = 0.0, 1.0
    for _ in range(30):  # rate(a) grows with a: bisect
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if rate(mid) < policy.plain_rate else (lo, mid)
    return hi


def survey_exits(
    router: Any,
    cache: HiddenStateCache,
    costs: CostModel,
    *,
    adapter: str = "postnorm",
    steps: int = 300,
    batch_tokens: int = 512,
    lr: float = 2e-3,
    precision: float = 0.95,
    holdout_share: float = 0.2,
    seed: int = 0,
    max_draft: int = 8,
    chunk_len: int = 256,
) -> list[SurveyRow]:
    """Fit a fresh `adapter` at every layer cached in `cache` and report each layer (see the module docstring).

    The router's own heads are not touched. Held-out positions are a seeded `holdout_share` of the cache's chunks
    (whole chunks, so that no held-out position sits between training positions of the same text)."""
    stack = router.stack
    draft = router.heads.draft_head(stack, router.config.draft_vocab_size)
    ids = draft.token_ids.cpu() if draft is not None else torch.arange(stack.vocab_size)
    weight = dense(stack.lm_head.weight.detach())[ids.to(stack.device)].float()  # (K, hidden): the trimmed head
    n_chunks = len(cache) // chunk_len
    if n_chunks < 2:
        raise ValueError(
            f"The survey holds whole chunks of {chunk_len} positions out, and {len(cache)} cached positions make "
            f"{n_chunks}: give it at least {2 * chunk_len} corpus tokens (--max-tokens)."
        )
    order = torch.randperm(n_chunks, generator=torch.Generator().manual_seed(seed))
    n_hold = max(1, int(n_chunks * holdout_share))
    # (N,) positions: training chunks first, held-out chunks last
    positions = chunk_positions(order, chunk_len)
    cache = cache.select(positions)
    n = len(cache)
    n_train = n - n_hold * chunk_len

    def unembed(normed: torch.Tensor) -> torch.Tensor:  # (N, hidden) -> (N, K) trimmed logits
        return stack.finish_logits(normed.float() @ weight.T)

    with torch.no_grad():
        final = cache.final_normed.to(stack.device)
        teacher_sub = torch.cat([unembed(final[s : s + 2048]) for s in range(0, n, 2048)])  # (N, K)
        precise = router.config.precise_logits  # the target is the token decoding chooses
        target = torch.cat(
            [stack.unembed(final[s : s + 2048].to(stack.dtype), precise).argmax(-1) for s in range(0, n, 2048)]
        )
    hold_target = target[n_train:].cpu()
    no_next = torch.full((batch_tokens,), -1)
    rows = []
    for layer in sorted(cache.exits):
        policy = DraftPolicy(costs, [layer], [False], has_block=[adapter in BLOCK_KINDS])
        states = cache.exits[layer]
        torch.manual_seed(seed)
        block = functools.partial(block_source(stack), layer) if adapter in BLOCK_KINDS else None
        head = make_adapter(adapter, stack.hidden_size, router.config.adapter_rank, block)
        head = head.to(stack.device).float()
        context = needs_context(head)  # a block attends to the context: it trains and is scored on whole chunks
        g = torch.Generator().manual_seed(seed)
        start = time.perf_counter()
        params = list(head.parameters())
        if params:
            optimizer = torch.optim.AdamW(params, lr=lr)
            schedule = torch.optim.lr_scheduler.LambdaLR(
                optimizer, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / steps))
            )
            for _ in range(steps):
                if context:
                    chunks = torch.randint(n_train // chunk_len, (max(1, batch_tokens // chunk_len),), generator=g)
                    idx = chunk_positions(chunks, chunk_len)
                else:
                    idx = torch.randint(n_train, (batch_tokens,), generator=g)
                student = unembed(_normed(stack, head, states[idx], chunk_len if context else 0))
                loss = distillation_loss(student, teacher_sub[idx], no_next, 0.0)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                schedule.step()
        seconds = time.perf_counter() - start
        with torch.no_grad():
            held = states[n_train:]
            lens = ids[unembed(stack.final_norm(held.to(stack.device, stack.dtype))).argmax(-1).cpu()]
            probs = torch.softmax(unembed(_normed(stack, head, held, chunk_len if context else 0)), -1)
            confidence, arg = probs.max(-1)
            correct = ids[arg.cpu()] == hold_target
        agreement = float(correct.float().mean())
        _, rate = policy.best_draft(agreement, lambda d, p=policy: p.exit_cycle_ms(0, d), max_draft)
        rows.append(
            SurveyRow(
                layer=layer,
                lens_agreement=float((lens == hold_target).float().mean()),
                trained_agreement=agreement,
                coverage=coverage_at(confidence.cpu(), correct, precision),
                draft_ms=costs.layers(layer + 1 + int(context), 1) + costs.draft_head_ms,
                break_even=break_even_acceptance(policy, 0, max_draft),
                speedup=rate / policy.plain_rate,
                seconds=seconds,
            )
        )
    return rows


def _normed(stack: Any, adapter: torch.nn.Module, hidden: torch.Tensor, chunk_len: int = 0) -> torch.Tensor:
    """The adapter and the model's final norm, in float32 (the adapter is trained in float32); (N, hidden) states
    in whole chunks of `chunk_len` for a block adapter."""
    hidden = hidden.to(stack.device).float()
    if chunk_len:
        return exit_normed(stack, adapter, hidden.view(-1, chunk_len, hidden.shape[-1])).flatten(0, 1)
    return exit_normed(stack, adapter, hidden)


def format_survey(rows: list[SurveyRow], precision: float, title: str) -> str:
    lines = [
        f"### {title}",
        "",
        f"| layer | lens agreement | trained agreement | exits at >= {precision:.2f} | draft ms "
        "| break-even acceptance | speed-up at measured agreement |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.layer} | {r.lens_agreement:.3f} | {r.trained_agreement:.3f} | {r.coverage:.3f} | {r.draft_ms:.1f} "
            f"| {r.break_even:.2f} | {r.speedup:.2f}x |"
        )
    return "\n".join(lines)

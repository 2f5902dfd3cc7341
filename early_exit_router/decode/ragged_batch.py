"""Batched verify mode, per row: every sequence drafts from the n-gram tier and keeps its own accepted prefix.

The batch-synchronous design (`batch_engine.py`) keeps one length for every row, so a verify pass keeps the batch's
shortest accepted prefix. Here each row keeps its own, in a cache that stays one rectangular tensor per layer:

- Slots are columns shared by all rows. A pass runs every row over the same K + 1 slots: its current token, then its
  own drafts (up to K). The drafts the full model rejects, and the slots a row had no draft for, become holes:
  masked out of attention for good (the 2D attention mask is 0 there), like left padding in the middle of a row.
- Each row's positions count its real tokens only (`offset`: the masked slots before its newest one), so RoPE sees
  the positions the row alone would have, and every accepted token is the one the row alone would get.
- When holes make the cache much longer than its longest row, it is compacted: each row's real slots are gathered
  to the right end (left padding again), in order.

Draft width: a batch of b rows over K + 1 slots costs about what b (K + 1) positions cost (compute-bound once
batching fills the device). Each pass takes the K with the most expected tokens per millisecond, from the cost
model and each row's proposal (acceptance per match length, tracked online, also on the proposals a pass did not
draft); K = 0 is a plain batched step. Without a cost model (policy 'fixed') every proposal is drafted in full.

Sampling: a row accepts draft x with probability p(x) (the n-gram tier proposes deterministically: q(x) = 1), and
otherwise samples from p without x, renormalised: each row's tokens follow the full model's distribution
(speculative sampling, Leviathan et al. 2023).

Exits stay batch-synchronous (`batch_engine.py`): on rectangular layers a step runs the deep layers for every row as
soon as one row needs them, so a row that left early saves no compute and loses the full model's token; only a step
that every row leaves saves anything. Drafts differ: each accepted draft is a token its row gains.
"""

from __future__ import annotations

import torch

from early_exit_router.config import RouterConfig
from early_exit_router.decode.batch_engine import BatchDecode, BatchRow
from early_exit_router.decode.engine import NGRAM_LAYER
from early_exit_router.heads.exit_heads import ExitHeads
from early_exit_router.models import _compat
from early_exit_router.models.architecture import LayerStack
from early_exit_router.routing.costs import CostModel
from early_exit_router.routing.exit_rule import Router
from early_exit_router.routing.ngram import SuffixStore, ngram_match, prefer_stored
from early_exit_router.routing.policy import MARGIN, AcceptanceTracker, TierKey, expected_tokens

COMPACT_WASTE = 0.25  # compact when holes make the cache this share longer than its longest row's real slots
COMPACT_MIN = 16  # ... and at least this many slots longer


class RaggedVerifyDecode(BatchDecode):
    """A verify-mode batch in flight, per row (see the module docstring): `step` until `finished`; rows join and
    leave between steps as in the synchronous batch."""

    def __init__(
        self,
        stack: LayerStack,
        heads: ExitHeads,
        router: Router,
        config: RouterConfig,
        mode: str,
        pad_token_id: int,
        costs: CostModel | None = None,
        store: SuffixStore | None = None,
    ) -> None:
        if mode != "verify":
            raise ValueError("The per-row batch design is verify mode's: exit-mode batches run batch-synchronously.")
        super().__init__(stack, heads, router, config, mode, pad_token_id)
        self.costs, self.store = costs, store
        self.tracker = AcceptanceTracker(prior=config.acceptance_prior)
        self.compactions = 0

    def _new_like(self) -> RaggedVerifyDecode:
        return RaggedVerifyDecode(self.stack, self.heads, self.router, self.config, self.mode, self.pad_token_id,
                                  self.costs, self.store)  # fmt: skip

    # ---------------------------------------------------------------------------------------------------- steps
    @torch.no_grad()
    def step(self) -> None:
        """One verify pass for every row: each gains its accepted drafts and the full model's next token."""
        if not self.rows or all(row.done for row in self.rows):
            return
        self.steps += 1
        q = self.length - 1  # every row's current token sits in this slot
        contexts = [[] if row.done else self._context(r) for r, row in enumerate(self.rows)]
        proposals = [self._proposal(row, tokens) for row, tokens in zip(self.rows, contexts)]
        width = self._draft_width(proposals)
        drafts = [proposal[:width] for proposal, _ in proposals]
        end = q + width + 1
        self._grow(end + 1)
        if width:
            block = self.seq.new_full((len(self.rows), width), self.pad_token_id)  # (b, width)
            real = self.mask.new_zeros((len(self.rows), width))
            for r, draft in enumerate(drafts):
                block[r, : len(draft)] = torch.tensor(draft, dtype=block.dtype)
                real[r, : len(draft)] = 1
            self.seq[:, q + 1 : end], self.mask[:, q + 1 : end] = block, real
        positions = self._positions(q, end)  # (b, width + 1)
        hidden = self.stack.embed(self.seq[:, q:end], positions=positions)
        hidden = self.stack.run(hidden, 0, self.stack.num_layers, self.cache, positions,
                                attention_mask=self.mask[:, :end])  # fmt: skip
        logits = self._checked(self.stack.logits(hidden))  # (b, width + 1, vocab)
        self.deep_passes += 1
        self.fill_positions += width + 1
        greedy = logits.argmax(dim=-1).tolist()  # (b, width + 1): used by plain greedy rows (one host sync)
        tokens = []
        for r, row in enumerate(self.rows):
            if row.done:
                tokens.append(self.pad_token_id)
                self.offset[r] += width
                self.mask[r, q + 1 : end] = 0
                continue
            draft = drafts[r]
            accepted, token = self._verify(r, row, draft, logits[r], greedy[r])
            self._observe(proposals[r], accepted, token)
            row.checked += min(accepted + 1, len(draft))
            row.agreed += accepted
            row.rejected += len(draft) - accepted
            self.mask[r, q + 1 + accepted : end] = 0  # rejected drafts and unused slots: holes from now on
            self.offset[r] += width - accepted
            row.depth.extend([NGRAM_LAYER] * accepted + [self.full_layer])
            tokens.append(token)
        self.seq[:, end] = torch.tensor(tokens, dtype=self.seq.dtype)
        self.mask[:, end] = 1
        self.length = end + 1
        self.deep_len = end
        self.update_done()
        self._maybe_compact()

    def _context(self, r: int) -> list[int]:
        """Row r's real tokens (prompt and generated, its current token last)."""
        return self.seq[r, : self.length][self.mask[r, : self.length].bool()].tolist()

    def _proposal(self, row: BatchRow, tokens: list[int]) -> tuple[list[int], int]:
        """The n-gram tier's proposal for a row and its match length (none for finished rows or at the budget)."""
        cfg = self.config
        budget = min(cfg.ngram_draft, row.request.max_new_tokens - len(row.depth) - 1)  # depth: a layer per token
        if row.done or not cfg.ngram_tier or budget <= 0:
            return [], 0
        found = ngram_match(tokens, cfg.ngram_size, budget, cfg.ngram_min_size)
        return prefer_stored(found, self.store, tokens, budget)

    def _draft_width(self, proposals: list[tuple[list[int], int]]) -> int:
        """K for this pass: the most expected tokens per millisecond (see the module docstring)."""
        longest = max((len(p) for p, _ in proposals), default=0)
        if longest == 0 or self.costs is None:
            return longest
        rows = len(self.rows)
        active = [(p, self.tracker.estimate(("ngram", m))) for (p, m), row in zip(proposals, self.rows) if not row.done]
        best, best_rate = 0, len(active) / self.costs.batch_pass(rows, 1) * (1.0 + MARGIN)
        for k in range(1, longest + 1):
            tokens = sum(expected_tokens(a, min(len(p), k)) for p, a in active)
            rate = tokens / self.costs.batch_pass(rows, k + 1)
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def _verify(self, r: int, row: BatchRow, draft: list[int], logits: torch.Tensor,
                greedy: list[int]) -> tuple[int, int]:  # fmt: skip
        """(accepted drafts, the next token) for row r from its logits (width + 1, vocab) over the pass."""
        selector = row.selector
        if not selector.processors and not selector.params.do_sample:
            accepted = next((j for j, t in enumerate(draft) if greedy[j] != t), len(draft))
            return accepted, greedy[accepted]
        # Processors see what HF would pass them for this row alone: its padded prompt, then its tokens so far.
        ids = torch.cat([self._row_ids(r, row, self._new_tokens(r, row, self.length)),
                         torch.tensor([draft], dtype=torch.long, device=logits.device)], dim=1)  # fmt: skip
        base = ids.shape[1] - len(draft)
        for j in range(len(draft) + 1):
            scores = selector.scores(ids[:, : base + j], logits[j : j + 1])  # (1, vocab)
            if not selector.params.do_sample:
                best = int(scores.argmax())
                if j == len(draft) or best != draft[j]:
                    return j, best
                continue
            p = torch.softmax(scores[0], dim=-1)
            if j == len(draft):
                return j, int(torch.multinomial(p, 1, generator=selector.generator))
            u = torch.rand((), device=p.device, generator=selector.generator)
            if float(u) <= float(p[draft[j]]):  # accept x with probability min(1, p(x) / q(x)), q(x) = 1
                continue
            residual = p.clone()
            residual[draft[j]] = 0.0  # max(0, p - q): p without x
            residual = residual if float(residual.sum()) > 0 else p
            return j, int(torch.multinomial(residual, 1, generator=selector.generator))
        raise AssertionError("unreachable")

    def _observe(self, proposal: tuple[list[int], int], accepted: int, token: int) -> None:
        """Acceptance per match length: the drafted tokens' verdicts, and the first proposed token the pass did not
        draft (checked against the token the full model chose), so a length switched off is noticed again."""
        tokens, match = proposal
        if not tokens:
            return
        key: TierKey = ("ngram", match)
        for _ in range(accepted):
            self.tracker.observe(key, True)
        if accepted < len(tokens):
            self.tracker.observe(key, tokens[accepted] == token)

    # ------------------------------------------------------------------------------------------- bookkeeping
    def update_done(self) -> None:
        """As the synchronous batch does; a row that finishes leaves its text to the n-gram store, as a single
        sequence does."""
        running = [not row.done for row in self.rows]
        super().update_done()
        if self.store is None:
            return
        for r, row in enumerate(self.rows):
            if running[r] and row.done:
                context = self._context(r)
                prompt = context[: len(context) - len(self._new_tokens(r, row, self.length))]
                self.store.add(prompt + self.output(row))

    def _new_tokens(self, r: int, row: BatchRow, final: int) -> list[int]:
        real = self.mask[r, row.start : final].bool()
        return self.seq[r, row.start : final][real].tolist()

    def _row_ids(self, r: int, row: BatchRow, new: list[int]) -> torch.Tensor:
        prompt = row.prompt
        assert prompt is not None
        return torch.cat([prompt, torch.tensor([new], dtype=prompt.dtype, device=prompt.device)], dim=1)

    def _maybe_compact(self) -> None:
        """Gather each row's real slots to the right end when holes have made the cache much longer than needed."""
        cached = self.length - 1  # slots in the cache (the current token's is not yet)
        real = self.mask[:, :cached].sum(dim=1)  # (b,)
        widest = int(real.max())
        if cached - widest < max(COMPACT_MIN, COMPACT_WASTE * widest):
            return
        # A stable sort puts each row's masked slots first and its real ones after, both in slot order; the last
        # `widest` entries are then the row's real slots, right-aligned, behind masked (padding) slots.
        order = torch.sort(self.mask[:, :cached], dim=1, stable=True).indices[:, cached - widest :]  # (b, widest)
        prompt_real = [int(self.mask[r, : row.start].sum()) for r, row in enumerate(self.rows)]
        _compat.gather_cache_slots(self.cache, order)
        self.seq = torch.cat([self.seq.gather(1, order), self.seq[:, cached:]], dim=1)
        self.mask = torch.cat([self.mask.gather(1, order), self.mask[:, cached:]], dim=1)
        self.offset = (widest - real).unsqueeze(1)
        for r, row in enumerate(self.rows):
            row.start = int(self.offset[r]) + prompt_real[r]
        self.length, self.deep_len = widest + 1, widest
        self.compactions += 1

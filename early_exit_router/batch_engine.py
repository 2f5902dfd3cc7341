"""Batched decoding, batch-synchronous: b left-padded sequences share one decode loop and one rectangular cache.

Every step feeds each row's last token. At an exit, the rows leave together or not at all: the step exits only
when every unfinished row may exit (its gate allows it and its head passes the confidence -> entropy cascade),
so all rows keep the same waiting positions in front of every segment and every layer's cache stays rectangular.
A deep pass fills the waiting positions of all rows at once, exactly as `engine.py` does for one row.

Verify mode (greedy) accepts, for the whole batch, the shortest accepted prefix among the unfinished rows: every
row's drafts up to there are the full model's own predictions, the token after them is the full model's too, and
every layer is cropped back to the same length. So each row's output is the full model's greedy output, as in HF
batched `generate`.

Rows finish on their own (EOS, stop strings, stopping criteria): like HF, a finished row is fed the pad token
from then on, its attention mask stays 1, and it no longer takes part in exit or acceptance decisions.

Left-padded slots are masked out with a 2D attention mask, and each row's positions count its real tokens only
(HF's `cumsum(mask) - 1`). The n-gram tier and the cost policy are batch-1 features: batches route with the
confidence cascade (the router's thresholds and window rule).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from . import _compat
from .architecture import LayerStack
from .config import RouterConfig
from .engine import DecodeRequest
from .heads import ExitHeads, draft_logits
from .routing import Router
from .sampling import TokenSelector
from .stats import GenerationStats


@dataclass
class _Row:
    """One row's own record: where each new token left, and what the deep passes said about its drafts."""

    depth: list[int] = field(default_factory=list)
    checked: int = 0
    agreed: int = 0
    rejected: int = 0
    accepted: int = 0
    finished_at: int | None = None  # new tokens when the row finished


class BatchEngine:
    """Batch-synchronous early exit for left-padded batches (see the module docstring)."""

    def __init__(self, stack: LayerStack, heads: ExitHeads, router: Router, config: RouterConfig) -> None:
        self.stack, self.heads, self.router, self.config = stack, heads, router, config
        self.exits = config.consulted_exit_layers()
        self.starts = [0] + [e + 1 for e in self.exits] + [stack.num_layers]  # segment s: [starts[s], starts[s+1])
        self.full_layer = stack.num_layers - 1
        self.draft = heads.draft_head(stack, config.draft_vocab_size)

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        request: DecodeRequest,
        selector: TokenSelector,
        pad_token_id: int,
    ) -> tuple[torch.Tensor, list[GenerationStats], Any, list[list[int]]]:
        """(b, n) left-padded ids and mask -> (b, n + new) sequences, per-row stats, the cache and per-row depths
        (the layer each new token left at, up to the row's stop)."""
        if request.mode == "verify" and selector.params.do_sample:
            raise ValueError("Batched verify mode decodes greedily: use do_sample=False, mode='exit', or batch size 1.")
        start = time.perf_counter()
        self._prefill(input_ids, attention_mask, request, selector, pad_token_id)
        prefill_s = time.perf_counter() - start
        while True:
            self._update_done(request)
            if bool(self.done.all()) or self.length - self.prompt_len >= request.max_new_tokens:
                if self.pending == 0:
                    break
                self._flush(request, selector)  # drafts still waiting: verify or fill them, with no new token
                continue
            self._step(request, selector)
        self._pad_finished_rows(request)
        _compat.trim_sliding(self.cache)
        wall = time.perf_counter() - start
        sequences = self.seq[:, : self.length].clone()
        stats = [self._stats(r, request, wall, prefill_s) for r in self.rows]
        depths = [row.depth[: row.finished_at] if row.finished_at is not None else list(row.depth) for row in self.rows]
        return sequences, stats, self.cache, depths

    # ------------------------------------------------------------------------------------------------ prefill
    def _prefill(self, ids: torch.Tensor, mask: torch.Tensor, request: DecodeRequest, selector, pad: int) -> None:
        stack = self.stack
        b, n = ids.shape
        capacity = n + request.max_new_tokens + self.config.max_pending + 1
        self.pad_token_id = pad
        self.seq = torch.full((b, capacity), pad, dtype=torch.long, device=stack.device)
        self.seq[:, :n] = ids
        self.mask = torch.ones((b, capacity), dtype=torch.long, device=stack.device)  # generated slots are real
        self.mask[:, :n] = mask
        self.offset = (n - mask.sum(dim=1)).unsqueeze(1)  # (b, 1): left padding per row
        self.prompt_len = n
        self.cache = stack.new_cache()
        if request.mode == "verify":
            _compat.prepare_for_rollback(self.cache)
        self.buffers: list[torch.Tensor | None] = [None] * (len(self.exits) + 1)
        self.rows = [_Row() for _ in range(b)]
        self.done = torch.zeros(b, dtype=torch.bool, device=stack.device)
        self.routing = self.router.new_state()
        self.deep_passes = self.fill_positions = self.forced = 0
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)  # (b, n): padded slots get position 0, masked out
        hidden = stack.run(stack.embed(ids, positions=positions), 0, stack.num_layers, self.cache, positions,
                           attention_mask=self.mask[:, :n])  # fmt: skip
        logits = self._checked(stack.logits(hidden[:, -1:]))[:, -1]  # (b, vocab)
        self.deep_len = n
        self.length = n
        self._append(selector.choose(self.seq[:, :n], logits), self.full_layer)
        self._update_done(request)

    # -------------------------------------------------------------------------------------------------- steps
    @property
    def pending(self) -> int:
        """Fed slots the last layer has not seen (the same for every row)."""
        return self.length - 1 - self.deep_len

    def _positions(self, first: int, end: int) -> torch.Tensor:
        """(b, end - first) positions of slots first..end-1: each row counts its real tokens only."""
        slots = torch.arange(first, end, device=self.seq.device).unsqueeze(0)
        return slots - self.offset

    def _step(self, request: DecodeRequest, selector: TokenSelector) -> None:
        q = self.length - 1  # the slot fed now
        forced = self.router.forced_deep(self.routing, self.pending)
        self.forced += int(forced)
        hidden: torch.Tensor | None = self.stack.embed(self.seq[:, q : q + 1], positions=self._positions(q, q + 1))
        chunk_start = q
        for i in range(len(self.exits) + 1):
            hidden, chunk_start = self._fill_segment(i, hidden, chunk_start, q + 1)
            if i < len(self.exits) and not forced and self._try_exit(i, hidden, q, selector):
                return
        self._finish_deep(hidden, chunk_start, True, request, selector)

    def _fill_segment(
        self, i: int, hidden: torch.Tensor | None, chunk_start: int, end: int
    ) -> tuple[torch.Tensor | None, int]:
        """Segment `i` over the positions waiting in front of it plus `hidden` (slots chunk_start..end-1)."""
        waiting = self.buffers[i]
        if waiting is not None:
            chunk_start -= waiting.shape[1]
            hidden = waiting if hidden is None else torch.cat([waiting, hidden], dim=1)  # (b, m, hidden)
            self.buffers[i] = None
        if hidden is None:
            return None, chunk_start
        positions = self._positions(chunk_start, end)
        out = self.stack.run(hidden, self.starts[i], self.starts[i + 1], self.cache, positions,
                             attention_mask=self.mask[:, :end])  # fmt: skip
        return out, chunk_start

    def _try_exit(self, i: int, hidden: torch.Tensor, q: int, selector: TokenSelector) -> bool:
        """All unfinished rows leave at exit `i`, or none does."""
        layer = self.exits[i]
        last = hidden[:, -1]  # (b, hidden)
        active = ~self.done
        gate = self.heads.gate(layer) if self.config.use_gate else None
        if gate is not None and not bool((self.router.gate_allows(gate(last).reshape(-1)) | ~active).all()):
            return False  # the gate runs first: no head for a step some row cannot take
        logits = draft_logits(self.stack, self.heads.adapter(layer), self.draft, last)  # (b, vocab)
        flags, confidence = self.router.head_signal(logits)  # (b,), (b,)
        if not bool((flags | ~active).all()):
            return False
        self.router.record_exit(self.routing, float(confidence[active].min()) if bool(active.any()) else 1.0)
        token = selector.choose(self.seq[:, : q + 1], logits)
        waiting = self.buffers[i + 1]
        self.buffers[i + 1] = hidden if waiting is None else torch.cat([waiting, hidden], dim=1)
        self._append(token, layer)
        return True

    def _flush(self, request: DecodeRequest, selector: TokenSelector) -> None:
        """Run every waiting position through the rest of the model with no new token."""
        end = self.length - 1
        chunk_start, hidden = end, None
        for i in range(len(self.exits) + 1):
            hidden, chunk_start = self._fill_segment(i, hidden, chunk_start, end)
        assert hidden is not None and chunk_start == self.deep_len
        self._finish_deep(hidden, chunk_start, False, request, selector)

    def _finish_deep(
        self, hidden: torch.Tensor, chunk_start: int, has_current: bool, request: DecodeRequest, selector
    ) -> None:
        """Final-layer logits of a deep chunk (b, m): check (exit mode) or verify (verify mode) the drafts."""
        m = hidden.shape[1]
        n_drafts = m - 1 if has_current else m
        self.deep_passes += 1
        self.fill_positions += m
        self.deep_len = chunk_start + m
        logits = self._checked(self.stack.logits(hidden))  # (b, m, vocab)
        drafts = self.seq[:, chunk_start + 1 : chunk_start + 1 + n_drafts]  # (b, n_drafts)
        # Greedy predictions of the full model for each draft position; sampling (exit mode) uses them for
        # agreement only, as the single-row engine does.
        predicted = logits[:, :n_drafts].argmax(dim=-1)  # (b, n_drafts)
        matches = (predicted == drafts).cpu()
        active = (~self.done).cpu().tolist()
        if request.mode == "exit":
            for r, row in enumerate(self.rows):
                if active[r]:
                    row.checked += n_drafts
                    row.agreed += int(matches[r].sum())
            if has_current:
                self._append(selector.choose(self.seq[:, : chunk_start + m], logits[:, -1]), self.full_layer)
            return
        # verify: the batch keeps the shortest accepted prefix among unfinished rows
        leading = torch.cumprod(matches.long(), dim=1).sum(dim=1).tolist()  # (b,) accepted drafts per row
        accept = min([a for a, on in zip(leading, active) if on], default=n_drafts)
        for r, row in enumerate(self.rows):
            if active[r]:
                row.accepted += accept
                row.rejected += n_drafts - accept if leading[r] < n_drafts else 0
        if accept == n_drafts and not has_current:
            return
        keep = chunk_start + accept + 1  # slots whose KV stays: the chunk's first `accept + 1` inputs
        if accept < n_drafts:
            for layer_idx in range(self.stack.num_layers):
                _compat.crop_cache_layer(self.cache, layer_idx, keep)
            self.deep_len = keep
            self.length = keep
            for row in self.rows:
                del row.depth[len(row.depth) - (n_drafts - accept) :]
        row_logits = logits[:, accept]  # (b, vocab): the full model's prediction after the accepted drafts
        self._append(selector.choose(self.seq[:, :keep], row_logits), self.full_layer)

    # ------------------------------------------------------------------------------------------- bookkeeping
    def _append(self, token: torch.Tensor, layer: int) -> None:
        token = torch.where(self.done, torch.full_like(token, self.pad_token_id), token.reshape(-1))
        self.seq[:, self.length] = token
        self.length += 1
        for row in self.rows:
            row.depth.append(layer)

    def _final_length(self, request: DecodeRequest) -> int:
        """Slots whose tokens are final: all of them in exit mode; up to the last deep prediction in verify."""
        return self.length if request.mode == "exit" else self.deep_len + 1

    def _update_done(self, request: DecodeRequest) -> None:
        """Mark rows whose final tokens hit EOS, a stop string or a stopping criterion."""
        final = self._final_length(request)
        new = final - self.prompt_len
        tokens = self.seq[:, :final]
        done = self.done.clone()
        if request.eos_token_ids:
            eos = torch.tensor(sorted(request.eos_token_ids), device=tokens.device)
            done |= torch.isin(tokens[:, self.prompt_len :], eos).any(dim=1)
        if request.stop_strings:
            for r in range(tokens.shape[0]):
                tail = request.tokenizer.decode(tokens[r, max(self.prompt_len, final - 32) :].tolist())
                done[r] |= any(s in tail for s in request.stop_strings)
        if request.stopping_criteria is not None:
            done |= torch.as_tensor(request.stopping_criteria(tokens, None), device=done.device).reshape(-1)
        for r in torch.nonzero(done & ~self.done).reshape(-1).tolist():
            self.rows[r].finished_at = new
        self.done = done

    def _pad_finished_rows(self, request: DecodeRequest) -> None:
        """Pad each row after its first EOS, as HF does (verify mode may have accepted tokens past it)."""
        for r in range(len(self.rows)):
            stop = self._stop_index(r, request)
            if stop is not None:
                self.seq[r, stop + 1 : self.length] = self.pad_token_id

    def _stop_index(self, r: int, request: DecodeRequest) -> int | None:
        """The slot of row r's first EOS token, or None."""
        if not request.eos_token_ids:
            return None
        new = self.seq[r, self.prompt_len : self.length].tolist()
        for k, token in enumerate(new):
            if token in request.eos_token_ids:
                return self.prompt_len + k
        return None

    def _checked(self, logits: torch.Tensor) -> torch.Tensor:
        if not bool(torch.isfinite(logits).all()):
            raise FloatingPointError(f"The model produced NaN or infinite logits ({self.stack.dtype}).")
        return logits

    def _stats(self, row: _Row, request: DecodeRequest, wall: float, prefill_s: float) -> GenerationStats:
        depths = row.depth[: row.finished_at] if row.finished_at is not None else row.depth  # up to its stop
        histogram: dict[int, int] = {}
        for layer in depths:
            histogram[layer] = histogram.get(layer, 0) + 1
        new = len(depths)
        exited = sum(c for layer, c in histogram.items() if layer != self.full_layer)
        return GenerationStats(
            new_tokens=new,
            exit_histogram=dict(sorted(histogram.items())),
            hit_rate=exited / new if new else 0.0,
            agreement=row.agreed / row.checked if row.checked else None,
            exited_checked=row.checked,
            deep_passes=self.deep_passes,
            mean_fill_chunk=self.fill_positions / self.deep_passes if self.deep_passes else 0.0,
            forced_deep=self.forced,
            rejected_drafts=row.rejected,
            wall_time_s=wall,
            prefill_s=prefill_s,
            tokens_per_s=new / wall if wall > 0 else 0.0,
            mode=request.mode,
            num_layers=self.stack.num_layers,
        )


def combined_stats(rows: list[GenerationStats]) -> GenerationStats:
    """One batch's statistics from its rows': token counts and histograms summed, rates over all tokens."""
    histogram: dict[int, int] = {}
    for row in rows:
        for layer, count in row.exit_histogram.items():
            histogram[layer] = histogram.get(layer, 0) + count
    new = sum(r.new_tokens for r in rows)
    checked = sum(r.exited_checked for r in rows)
    agreed = sum((r.agreement or 0.0) * r.exited_checked for r in rows)
    first = rows[0]
    return GenerationStats(
        new_tokens=new,
        exit_histogram=dict(sorted(histogram.items())),
        hit_rate=sum(r.hit_rate * r.new_tokens for r in rows) / new if new else 0.0,
        agreement=agreed / checked if checked else None,
        exited_checked=checked,
        deep_passes=first.deep_passes,
        mean_fill_chunk=first.mean_fill_chunk,
        forced_deep=first.forced_deep,
        rejected_drafts=sum(r.rejected_drafts for r in rows),
        wall_time_s=first.wall_time_s,
        prefill_s=first.prefill_s,
        tokens_per_s=new / first.wall_time_s if first.wall_time_s > 0 else 0.0,
        mode=first.mode,
        num_layers=first.num_layers,
    )

"""Batched decoding, batch-synchronous: several sequences share one decode loop and one rectangular cache.
(Verify mode's other design, per row, is `ragged_batch.py`: it subclasses `BatchDecode`.)

Every step feeds each row's last token. At an exit, the rows leave together or not at all: the step exits only
when every unfinished row may exit (its gate allows it and its head passes the confidence -> entropy cascade),
so all rows keep the same waiting positions in front of every segment and every layer's cache stays rectangular.
A deep pass fills the waiting positions of all rows at once, exactly as `engine.py` does for one row.

Verify mode (greedy) accepts, for the whole batch, the shortest accepted prefix among the unfinished rows: every
row's drafts up to there are the full model's own predictions, the token after them is the full model's too, and
every layer is cropped back to the same length. So each row's output is the full model's greedy output, as in HF
batched `generate`.

Rows finish on their own (EOS, stop strings, stopping criteria, their own max_new_tokens): like HF, a finished row is
fed the pad token from then on, its attention mask stays 1, and it no longer takes part in exit or acceptance
decisions. Rows can also join and leave between steps (`BatchDecode.join` / `remove`: continuous batching, as the
server does): a joining row is prefilled alone and left-padded into the batch's cache, a leaving row is dropped
from every per-row tensor, and slots that are padding in every row are dropped from the front.

Left-padded slots are masked out with a 2D attention mask, and each row's positions count its real tokens only
(HF's `cumsum(mask) - 1`). Batches route with the confidence cascade (the router's thresholds and window rule); the
n-gram tier drafts in the per-row design (`ragged_batch.py`, verify mode), which `new_batch` picks by the config.
Under the cost policy a batch does no harm where its exits do not fire: an exit
that let the batch leave in fewer than `MIN_EXIT_RATE` of its recent consultations is consulted only every
`probe_interval` steps (no gate, no head in between), so it is noticed again when the text turns predictable.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from early_exit_router.config import RouterConfig
from early_exit_router.decode.engine import DecodeRequest
from early_exit_router.decode.sampling import TokenSelector
from early_exit_router.decode.stats import GenerationStats
from early_exit_router.heads.draft import draft_logits
from early_exit_router.heads.exit_heads import ExitHeads
from early_exit_router.heads.gates import gate_probability, uses_head
from early_exit_router.models import _compat
from early_exit_router.models.architecture import LayerStack
from early_exit_router.routing.exit_rule import Router

MIN_EXIT_RATE = 0.1  # cost policy: below this share of consultations that exit, an exit is only probed
WARMUP = 8  # consultations before that rule applies
MEMORY = 64  # consultations remembered (older ones halve away)


@dataclass(eq=False)  # identity: rows hold tensors
class BatchRow:
    """One sequence in the batch: its request, token chooser and own record."""

    request: DecodeRequest
    selector: TokenSelector
    start: int  # slot of its first generated token (its prompt ends just before)
    started: float = field(default_factory=time.perf_counter)
    prefill_s: float = 0.0
    depth: list[int] = field(default_factory=list)  # per generated slot: the layer it left at
    checked: int = 0
    agreed: int = 0
    rejected: int = 0
    done: bool = False
    stop: int | None = None  # new tokens up to and including the one that stopped it
    streamed: int = 0  # new tokens handed to the request's streamer
    prompt: torch.Tensor | None = None  # (1, n): the prompt as its first batch padded it (what HF's processors see)


class BatchDecode:
    """A batch in flight (see the module docstring): `step` until `finished`, with rows joining and leaving."""

    def __init__(self, stack: LayerStack, heads: ExitHeads, router: Router, config: RouterConfig, mode: str,
                 pad_token_id: int) -> None:  # fmt: skip
        self.stack, self.heads, self.router, self.config, self.mode = stack, heads, router, config, mode
        self.exits = config.consulted_exit_layers()
        self.starts = [0] + [e + 1 for e in self.exits] + [stack.num_layers]  # segment s: [starts[s], starts[s+1])
        self.full_layer = stack.num_layers - 1
        self.draft = heads.draft_head(stack, config.draft_vocab_size)
        self.pad_token_id = pad_token_id
        self.rows: list[BatchRow] = []
        self.cache: Any = None
        self.seq = self.mask = self.offset = None  # (b, capacity), (b, capacity), (b, 1)
        self.length = 0  # slots holding tokens (the same for every row)
        self.deep_len = 0  # slots the last layer has seen
        self.buffers: list[torch.Tensor | None] = [None] * (len(self.exits) + 1)
        self.routing = router.new_state()
        self.deep_passes = self.fill_positions = self.forced = 0
        self.steps = 0
        self.consulted = [0] * len(self.exits)  # recent consultations per exit (halved every MEMORY)
        self.fired = [0] * len(self.exits)  # of them, those where the batch left there

    # ------------------------------------------------------------------------------------------ rows in and out
    @property
    def pending(self) -> int:
        """Fed slots the last layer has not seen (the same for every row)."""
        return self.length - 1 - self.deep_len if self.rows else 0

    @property
    def finished(self) -> bool:
        return all(row.done for row in self.rows) and self.pending == 0

    def can_join(self) -> bool:
        """Rows join only where no drafts wait: then every layer holds the same slots."""
        return self.pending == 0

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, requests: list[DecodeRequest],
                selectors: list[TokenSelector]) -> None:  # fmt: skip
        """Start the batch from (b, n) left-padded prompts, one request and selector per row."""
        stack = self.stack
        started = time.perf_counter()
        b, n = ids.shape
        self.cache = stack.new_cache()
        if self.mode == "verify":
            _compat.prepare_for_rollback(self.cache)
        capacity = n + max(r.max_new_tokens for r in requests) + self.config.max_pending + 1
        self.seq = torch.full((b, capacity), self.pad_token_id, dtype=torch.long, device=stack.device)
        self.seq[:, :n] = ids
        self.mask = torch.ones((b, capacity), dtype=torch.long, device=stack.device)  # generated slots are real
        self.mask[:, :n] = mask
        self.offset = (n - mask.sum(dim=1)).unsqueeze(1)  # (b, 1): left padding per row
        self.rows = [
            BatchRow(request, selector, n, started, prompt=ids[k : k + 1])
            for k, (request, selector) in enumerate(zip(requests, selectors))
        ]
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)  # (b, n): padded slots get position 0, masked out
        hidden = stack.run(stack.embed(ids, positions=positions), 0, stack.num_layers, self.cache, positions,
                           attention_mask=self.mask[:, :n])  # fmt: skip
        logits = self._checked(stack.logits(hidden[:, -1:]))[:, -1]  # (b, vocab)
        self.deep_len = self.length = n
        self._append(self._choose(self.seq[:, :n], logits), self.full_layer)
        for row in self.rows:
            row.prefill_s = time.perf_counter() - started
        self.update_done()

    @torch.no_grad()
    def join(self, ids: torch.Tensor, request: DecodeRequest, selector: TokenSelector) -> BatchRow:
        """Add one sequence (1, n) between steps: prefilled alone, then left-padded into the batch."""
        if not self.rows:
            self.prefill(ids, torch.ones_like(ids), [request], [selector])
            return self.rows[0]
        if not self.can_join():
            raise RuntimeError("Rows join only when no drafts are waiting (see can_join).")
        single = self._new_like()
        single.prefill(ids, torch.ones_like(ids), [request], [selector])
        behind = (self.length - 1) - (single.length - 1)  # slots the newcomer is shorter by (negative: longer)
        if behind < 0:
            self._pad_front(-behind)
        else:
            single._pad_front(behind)
        width = max(self.seq.shape[1], single.seq.shape[1])
        self._grow(width)
        single._grow(width)
        self.seq = torch.cat([self.seq, single.seq])
        self.mask = torch.cat([self.mask, single.mask])
        self.offset = torch.cat([self.offset, single.offset])
        _compat.concat_cache_rows(self.cache, single.cache)
        self.rows.append(single.rows[0])
        self._adopt(single)
        return single.rows[0]

    def _new_like(self) -> BatchDecode:
        """An empty batch of the same kind and settings (a newcomer is prefilled in one before it joins)."""
        return BatchDecode(self.stack, self.heads, self.router, self.config, self.mode, self.pad_token_id)

    def _adopt(self, single: BatchDecode) -> None:
        """Take over per-row state a joining row's own batch kept beside its tensors (none here)."""

    def remove(self, rows: list[BatchRow]) -> None:
        """Drop rows (finished or cancelled) from every per-row tensor, then padding every row shares."""
        keep = [k for k, row in enumerate(self.rows) if row not in rows]
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[k] for k in keep]
        if not self.rows:
            self.cache, self.length, self.deep_len = None, 0, 0
            self.buffers = [None] * (len(self.exits) + 1)
            return
        index = torch.tensor(keep, device=self.seq.device)
        self.seq, self.mask, self.offset = self.seq[index], self.mask[index], self.offset[index]
        self.cache.batch_select_indices(index)
        self.buffers = [None if b is None else b[index] for b in self.buffers]
        self._drop_common_padding()

    def _pad_front(self, count: int) -> None:
        """Prepend `count` padding slots to every row (tokens, mask, cache); positions are unchanged."""
        if count <= 0:
            return
        b = self.seq.shape[0]
        self.seq = torch.cat([self.seq.new_full((b, count), self.pad_token_id), self.seq], dim=1)
        self.mask = torch.cat([self.mask.new_zeros((b, count)), self.mask], dim=1)
        self.offset = self.offset + count
        _compat.pad_cache_front(self.cache, count)
        self.length += count
        self.deep_len += count
        for row in self.rows:
            row.start += count

    def _drop_common_padding(self) -> None:
        """Drop the leading slots that are padding in every row (a long row left): the cache stays small."""
        real = self.mask[:, : self.length].bool()
        first_real = torch.where(real.any(dim=0))[0]
        count = int(first_real[0]) if first_real.numel() else 0
        if count <= 0:
            return
        self.seq, self.mask = self.seq[:, count:], self.mask[:, count:]
        self.offset = self.offset - count
        _compat.drop_cache_front(self.cache, count)
        self.length -= count
        self.deep_len -= count
        for row in self.rows:
            row.start -= count

    def _grow(self, width: int) -> None:
        extra = width - self.seq.shape[1]
        if extra > 0:
            b = self.seq.shape[0]
            self.seq = torch.cat([self.seq, self.seq.new_full((b, extra), self.pad_token_id)], dim=1)
            self.mask = torch.cat([self.mask, self.mask.new_ones((b, extra))], dim=1)

    # ---------------------------------------------------------------------------------------------------- steps
    @torch.no_grad()
    def step(self) -> None:
        """One step for every row: a new token per row, or (once all rows are done) the flush of waiting drafts."""
        if all(row.done for row in self.rows) or not self.rows:
            if self.pending:
                self._flush()
            return
        self._grow(self.length + self.config.max_pending + 2)
        self.steps += 1
        q = self.length - 1  # the slot fed now
        forced = self.router.forced_deep(self.routing, self.pending)
        self.forced += int(forced)
        hidden: torch.Tensor | None = self.stack.embed(self.seq[:, q : q + 1], positions=self._positions(q, q + 1))
        chunk_start = q
        for i in range(len(self.exits) + 1):
            hidden, chunk_start = self._fill_segment(i, hidden, chunk_start, q + 1)
            if i < len(self.exits) and not forced and self._consult(i) and self._try_exit(i, hidden, q):
                self.update_done()
                return
        self._finish_deep(hidden, chunk_start, True)
        self.update_done()

    def _positions(self, first: int, end: int) -> torch.Tensor:
        """(b, end - first) positions of slots first..end-1: each row counts its real tokens only."""
        return torch.arange(first, end, device=self.seq.device).unsqueeze(0) - self.offset

    def _fill_segment(self, i: int, hidden: torch.Tensor | None, chunk_start: int, end: int):
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

    def _consult(self, i: int) -> bool:
        """Whether this step asks exit `i` at all (see the module docstring: the cost policy's batch rule)."""
        if self.config.policy != "cost" or self.consulted[i] < WARMUP:
            return True
        if self.fired[i] >= MIN_EXIT_RATE * self.consulted[i]:
            return True
        return self.config.probe_interval > 0 and self.steps % self.config.probe_interval == 0

    def _try_exit(self, i: int, hidden: torch.Tensor, q: int) -> bool:
        """All unfinished rows leave at exit `i`, or none does."""
        if self.consulted[i] >= MEMORY:
            self.consulted[i], self.fired[i] = self.consulted[i] // 2, self.fired[i] // 2
        self.consulted[i] += 1
        layer = self.exits[i]
        last = hidden[:, -1]  # (b, hidden)
        active = torch.tensor([not row.done for row in self.rows], device=last.device)
        gate = self.heads.gate(layer) if self.config.use_gate else None
        if gate is not None and not uses_head(gate):  # the gate runs first: no head for a step some row cannot take
            if not bool((self.router.gate_allows(gate_probability(gate, last).reshape(-1)) | ~active).all()):
                return False
        logits = draft_logits(self.stack, self.heads.adapter(layer), self.draft, last)  # (b, vocab)
        learned = gate_probability(gate, last, None, logits, None, self.draft) if uses_head(gate) else None
        columns = None if self.draft is None else self.draft.token_ids
        flags, confidence = self.router.head_signal(logits, learned=learned, columns=columns)  # (b,), (b,)
        if not bool((flags | ~active).all()):
            return False
        self.router.record_exit(self.routing, float(confidence[active].min()) if bool(active.any()) else 1.0)
        self.fired[i] += 1
        token = self._choose(self.seq[:, : q + 1], logits)
        waiting = self.buffers[i + 1]
        self.buffers[i + 1] = hidden if waiting is None else torch.cat([waiting, hidden], dim=1)
        self._append(token, layer)
        return True

    def _flush(self) -> None:
        """Run every waiting position through the rest of the model with no new token."""
        end = self.length - 1
        chunk_start, hidden = end, None
        for i in range(len(self.exits) + 1):
            hidden, chunk_start = self._fill_segment(i, hidden, chunk_start, end)
        assert hidden is not None and chunk_start == self.deep_len
        self._finish_deep(hidden, chunk_start, False)
        self.update_done()

    def _finish_deep(self, hidden: torch.Tensor, chunk_start: int, has_current: bool) -> None:
        """Final-layer logits of a deep chunk (b, m): check (exit mode) or verify (verify mode) the drafts."""
        m = hidden.shape[1]
        n_drafts = m - 1 if has_current else m
        self.deep_passes += 1
        self.fill_positions += m
        self.deep_len = chunk_start + m
        logits = self._checked(self.stack.logits(hidden))  # (b, m, vocab)
        drafts = self.seq[:, chunk_start + 1 : chunk_start + 1 + n_drafts]  # (b, n_drafts)
        # The full model's greedy choice at each draft position, after the rows' logits processors (each sees the
        # prefix before its position), as the token would have been chosen without drafting.
        chosen = (
            torch.stack([self._greedy(self.seq[:, : chunk_start + j + 1], logits[:, j]) for j in range(n_drafts)], 1)
            if n_drafts
            else drafts
        )
        matches = (chosen == drafts).cpu()  # the full model's verdict per draft
        active = [not row.done for row in self.rows]
        for r, row in enumerate(self.rows):  # agreement, in both modes: the deep verdict on each early token
            if active[r]:
                row.checked += n_drafts
                row.agreed += int(matches[r].sum())
        if self.mode == "exit":
            if has_current:
                self._append(self._choose(self.seq[:, : chunk_start + m], logits[:, -1]), self.full_layer)
            return
        # verify: the batch keeps the shortest accepted prefix among unfinished rows
        leading = torch.cumprod(matches.long(), dim=1).sum(dim=1).tolist()  # (b,) accepted drafts per row
        accept = min([a for a, on in zip(leading, active) if on], default=n_drafts)
        for r, row in enumerate(self.rows):
            if active[r] and leading[r] < n_drafts:
                row.rejected += n_drafts - accept
        if accept == n_drafts and not has_current:
            return
        keep = chunk_start + accept + 1  # slots whose KV stays: the chunk's first `accept + 1` inputs
        if accept < n_drafts:
            for layer_idx in range(self.stack.num_layers):
                _compat.crop_cache_layer(self.cache, layer_idx, keep)
            self.deep_len = self.length = keep
            for row in self.rows:
                del row.depth[keep - row.start :]
        self._append(self._choose(self.seq[:, :keep], logits[:, accept]), self.full_layer)

    # ------------------------------------------------------------------------------------------- bookkeeping
    def _choose(self, input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """(b, vocab) -> (b,) tokens, each row by its own selector (one call when they are all plain greedy)."""
        first = self.rows[0].selector
        if all(r.selector is first for r in self.rows) or all(_plain_greedy(r.selector) for r in self.rows):
            return first.choose(input_ids, logits).reshape(-1)
        return torch.cat([r.selector.choose(input_ids[k : k + 1], logits[k : k + 1]).reshape(1)
                          for k, r in enumerate(self.rows)])  # fmt: skip

    def _greedy(self, input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """(b, vocab) -> (b,) argmax of each row's processed scores (raw logits when no row has processors).

        Rows sharing one selector are scored as one batch: HF's processors keep per-batch state."""
        if all(not r.selector.processors for r in self.rows):
            return logits.argmax(dim=-1)
        first = self.rows[0].selector
        if all(r.selector is first for r in self.rows):
            return first.scores(input_ids, logits).argmax(dim=-1)
        return torch.cat([r.selector.scores(input_ids[k : k + 1], logits[k : k + 1]).argmax(dim=-1)
                          for k, r in enumerate(self.rows)])  # fmt: skip

    def _append(self, token: torch.Tensor, layer: int) -> None:
        done = torch.tensor([row.done for row in self.rows], device=token.device)
        token = torch.where(done, torch.full_like(token, self.pad_token_id), token.reshape(-1))
        self.seq[:, self.length] = token
        self.length += 1
        for row in self.rows:
            row.depth.append(layer)

    def final_length(self) -> int:
        """Slots whose tokens are final: all of them in exit mode; up to the last deep prediction in verify."""
        return self.length if self.mode == "exit" else self.deep_len + 1

    def update_done(self) -> None:
        """Mark rows whose final tokens hit EOS, a stop string, a stopping criterion or their max_new_tokens."""
        final = self.final_length()
        for r, row in enumerate(self.rows):
            if row.done:
                continue
            request = row.request
            new = self._new_tokens(r, row, final)[: request.max_new_tokens]
            stop = next((k + 1 for k, t in enumerate(new) if t in request.eos_token_ids), None)
            if stop is None and request.stop_strings:
                for k in range(max(1, row.streamed - 8), len(new) + 1):  # the first prefix holding a stop string
                    tail = request.tokenizer.decode(new[max(0, k - 32) : k])
                    if any(s in tail for s in request.stop_strings):
                        stop = k
                        break
            if stop is None and request.stopping_criteria is not None:
                ids = self._row_ids(r, row, new)
                if bool(torch.as_tensor(request.stopping_criteria(ids, None)).any()):
                    stop = len(new)
            if stop is None and len(new) >= request.max_new_tokens:
                stop = request.max_new_tokens
            if stop is not None:
                row.done, row.stop = True, stop
            self._stream(r, row, new if stop is None else new[:stop])

    def _new_tokens(self, r: int, row: BatchRow, final: int) -> list[int]:
        """Row r's generated tokens in slots before `final` (past its stop too: callers cut there)."""
        return self.seq[r, row.start : final].tolist()

    def _row_ids(self, r: int, row: BatchRow, new: list[int]) -> torch.Tensor:
        """(1, n) what HF's stopping criteria see for row r: its (left-padded) prompt and `new`."""
        return self.seq[r : r + 1, : row.start + len(new)]

    def _stream(self, r: int, row: BatchRow, final_new: list[int]) -> None:
        if row.request.streamer is not None and len(final_new) > row.streamed:
            row.request.streamer.put(torch.tensor(final_new[row.streamed :]))
        row.streamed = max(row.streamed, len(final_new))

    def output(self, row: BatchRow) -> list[int]:
        """The row's generated tokens, up to its stop."""
        r = self.rows.index(row)
        new = self._new_tokens(r, row, self.final_length())
        return new[: row.stop] if row.stop is not None else new[: row.request.max_new_tokens]

    def _checked(self, logits: torch.Tensor) -> torch.Tensor:
        if not bool(torch.isfinite(logits).all()):
            raise FloatingPointError(f"The model produced NaN or infinite logits ({self.stack.dtype}).")
        return logits

    def stats(self, row: BatchRow) -> GenerationStats:
        new = len(self.output(row))
        depths = row.depth[:new]
        histogram: dict[int, int] = {}
        for layer in depths:
            histogram[layer] = histogram.get(layer, 0) + 1
        exited = sum(c for layer, c in histogram.items() if layer != self.full_layer)
        wall = time.perf_counter() - row.started
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
            prefill_s=row.prefill_s,
            tokens_per_s=new / wall if wall > 0 else 0.0,
            mode=self.mode,
            num_layers=self.stack.num_layers,
        )


def _plain_greedy(selector: TokenSelector) -> bool:
    return not selector.params.do_sample and not selector.processors


class BatchEngine:
    """A whole left-padded batch in one call (`router.generate` and `model.generate` with batches)."""

    def __init__(self, stack: LayerStack, heads: ExitHeads, router: Router, config: RouterConfig,
                 costs: Any = None, store: Any = None) -> None:  # fmt: skip
        self.stack, self.heads, self.router, self.config = stack, heads, router, config
        self.costs, self.store = costs, store  # the per-row design's cost model and n-gram store

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        request: DecodeRequest,
        selector: TokenSelector,
        pad_token_id: int,
    ) -> tuple[torch.Tensor, list[GenerationStats], Any, list[list[int]]]:
        """(b, n) left-padded ids and mask -> (b, n + new) sequences (rows padded after their stop, as HF does),
        per-row stats, the cache (of every slot but the last) and per-row depths (the layer each new token left
        at)."""
        batch = new_batch(self.stack, self.heads, self.router, self.config, request.mode, pad_token_id,
                          selector.params.do_sample, self.costs, self.store)  # fmt: skip
        b, n = input_ids.shape
        batch.prefill(input_ids, attention_mask, [request] * b, [selector] * b)
        while not batch.finished:
            batch.step()
        outputs = [batch.output(row) for row in batch.rows]
        sequences = padded_sequences(input_ids, outputs, pad_token_id)
        width = sequences.shape[1] - n
        cache = batch.cache
        if type(batch) is BatchDecode:
            for layer_idx in range(self.stack.num_layers):  # drafts accepted past the last stop: not in the output
                _compat.crop_cache_layer(cache, layer_idx, n + width - 1)
            _compat.trim_sliding(cache)
        else:  # per-row slots hold holes: no cache lines up with the padded output
            cache = None
        stats = [batch.stats(row) for row in batch.rows]
        depths = [row.depth[: len(out)] for row, out in zip(batch.rows, outputs)]
        return sequences, stats, cache, depths


def per_row(config: RouterConfig, mode: str, sampling: bool) -> bool:
    """Whether a batch runs in the per-row design (`ragged_batch.py`): verify mode under `batch_design='per_row'`,
    and verify-mode sampling always (one accepted prefix for a batch cannot keep each row's distribution)."""
    return mode == "verify" and (sampling or config.batch_design == "per_row")


def new_batch(stack: LayerStack, heads: ExitHeads, router: Router, config: RouterConfig, mode: str,
              pad_token_id: int, sampling: bool = False, costs: Any = None,
              store: Any = None) -> BatchDecode:  # fmt: skip
    """An empty batch of the design `config`, `mode` and the rows' sampling call for (see `per_row`)."""
    if per_row(config, mode, sampling):
        from early_exit_router.decode.ragged_batch import RaggedVerifyDecode

        return RaggedVerifyDecode(stack, heads, router, config, mode, pad_token_id, costs, store)
    return BatchDecode(stack, heads, router, config, mode, pad_token_id)


def padded_sequences(input_ids: torch.Tensor, outputs: list[Any], pad_token_id: int) -> torch.Tensor:
    """(b, n) prompts and each row's new tokens -> (b, n + longest) sequences, short rows padded after their end."""
    b, n = input_ids.shape
    width = max(len(o) for o in outputs)
    sequences = torch.full((b, n + width), pad_token_id, dtype=torch.long, device=input_ids.device)
    sequences[:, :n] = input_ids
    for r, out in enumerate(outputs):
        sequences[r, n : n + len(out)] = torch.as_tensor(out, dtype=torch.long)
    return sequences


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
    wall = max(r.wall_time_s for r in rows)
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
        wall_time_s=wall,
        prefill_s=first.prefill_s,
        tokens_per_s=new / wall if wall > 0 else 0.0,
        mode=first.mode,
        num_layers=first.num_layers,
    )

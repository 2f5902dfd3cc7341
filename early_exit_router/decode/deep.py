"""The deep pass: what a chunk's final-layer states decide.

A token that goes deep carries every waiting slot with it through the rest of the model (the layer-wise fill,
`segments.py`). The chunk's final-layer logits are then the full model's prediction at every waiting slot:
- outside a verify cycle (exit mode) the exited tokens are final; a `check_fraction` share of them is compared with
  the full model (`judge`: per-tier agreement, acceptance estimates, the monitor and the threshold controller);
- inside one, each row keeps the longest prefix of its drafts the full model agrees with (`verify.py`), the batch
  reconciles its rows (synchronous: the shortest prefix; per row: each its own, with holes), and every layer's cache is
  cut back after the last kept slot, so it holds exactly what a full forward pass would;
- either way the full model's next token follows.
"""

from __future__ import annotations

import torch

from early_exit_router.decode import batch as batching
from early_exit_router.decode.emit import append, choose, make_final, row_ids, stop_slot
from early_exit_router.decode.state import DecodeState, Row
from early_exit_router.decode.verify import accept_greedy, accept_sampled, longest_prefix, shortest_prefix
from early_exit_router.models import _compat


def flush(dec: DecodeState) -> None:
    """Run every waiting slot through the rest of the model, with no new token."""
    end = dec.slots.length - 1  # fed slots are 0..end-1; the waiting ones end the range
    *_, at = dec.fill.walk(None, end, end, dec.slots, set())  # the full depth
    assert at.hidden is not None and at.chunk_start == dec.fill.deep_len
    dec.plan, dec.cycle_drafts = None, 0
    deep_pass(dec, at.hidden, at.chunk_start, has_current=False)


def deep_pass(dec: DecodeState, hidden: torch.Tensor, chunk_start: int, has_current: bool) -> None:
    """Final-layer states (b, m, hidden) of slots chunk_start..chunk_start+m-1: check the exited tokens, verify the
    cycle's drafts, and append the next token. Every slot but the current one (when `has_current`) predicted a
    drafted token."""
    m = hidden.shape[1]
    n_drafts = m - 1 if has_current else m
    dec.passes.deep_passes += 1
    dec.passes.fill_positions += m
    dec.fill.deep_len = chunk_start + m
    cycle = dec.cycle
    # Drafts predicted before the cycle exited (exit mode) and are final: a sample of them is checked.
    final = min(n_drafts, max(0, cycle.start - chunk_start)) if cycle is not None else n_drafts
    checked = _sample_checks(dec, final)  # offsets into the chunk
    # One head call over the checked rows, then the verified rows or the current token's row.
    tail = list(range(final, m)) if cycle is not None else ([m - 1] if has_current else [])
    if cycle is not None and not checked:
        selected = hidden[:, final:]  # contiguous: no copy
    else:
        index = torch.tensor(checked + tail, dtype=torch.long, device=hidden.device)
        selected = hidden.index_select(1, index)  # (b, checked + tail rows, hidden)
    logits = head(dec, selected) if selected.shape[1] else None  # (b, rows, vocab)
    matches = _check_exits(dec, logits[:, : len(checked)], chunk_start, checked) if checked else None
    if cycle is not None:
        if matches is not None:
            judge(dec, chunk_start, checked, matches.tolist(), final=True)
        verify(dec, logits[:, len(checked) :], chunk_start + final, has_current)
        return
    _compat.trim_sliding(dec.fill.cache)
    if has_current:
        row_logits = logits[:, -1]  # (b, vocab)
        tokens = choose(dec, chunk_start + m, row_logits)
        b, c = len(dec.rows), len(checked)
        values = (tokens if matches is None else torch.cat([matches.flatten().long(), tokens])).tolist()
        if matches is not None:  # one host sync for the verdicts and the tokens
            judge(dec, chunk_start, checked, [values[r * c : (r + 1) * c] for r in range(b)], final=True)
        ids = values[-b:]
        _judge_proposals(dec, [0] * b, ids)
        append(dec, tokens, ids, dec.full_layer, row_logits)
    elif matches is not None:
        judge(dec, chunk_start, checked, matches.tolist(), final=True)
    for row in dec.rows:
        row.drafts.clear()


def _check_exits(dec: DecodeState, logits: torch.Tensor, chunk_start: int, checked: list[int]) -> torch.Tensor:
    """(b, c) whether each checked exited token (at slot chunk_start + 1 + c) is the full model's choice there, from
    its predictions `logits` (b, c, vocab): its greedy choice after the row's logits processors, which chose the
    token too, or, sampling, its draw with the position's noise (the token plain sampling draws there)."""
    slots = [chunk_start + 1 + c for c in checked]
    exited = dec.slots.seq[:, slots]  # (b, c)
    if all(not r.selector.processors and not r.selector.params.do_sample for r in dec.rows):
        return logits.argmax(dim=-1) == exited
    choices = []
    for r, row in enumerate(dec.rows):
        scores = torch.cat([row.selector.scores(row_ids(dec, r, s), logits[r, j : j + 1]) for j, s in enumerate(slots)])
        if row.selector.params.do_sample:  # each exited token kept the noise it was drawn with
            drafts = [row.drafts.get(s - 1) for s in slots]  # None: a finished row's padding, which is not judged
            noise = [scores.new_ones(scores.shape[-1]) if d is None else d.noise for d in drafts]
            scores = torch.softmax(scores, dim=-1) / torch.stack(noise)
        choices.append(scores.argmax(dim=-1))
    return torch.stack(choices) == exited


def _sample_checks(dec: DecodeState, n_drafts: int) -> list[int]:
    """Which of a chunk's exited tokens exit mode checks: every one at `check_fraction` 1, none at 0, else an evenly
    spread share (deterministic, so runs repeat)."""
    fraction = dec.config.check_fraction if dec.config.check_agreement else 0.0
    picked = []
    for offset in range(n_drafts):
        before = int(dec.passes.exited_seen * fraction)
        dec.passes.exited_seen += 1
        if int(dec.passes.exited_seen * fraction) > before:
            picked.append(offset)
    return picked


def verify(dec: DecodeState, logits: torch.Tensor, first: int, has_current: bool) -> None:
    """Accept, per row, the longest prefix of its drafts the full model agrees with; emit the full model's token
    after it. `logits` (b, k, vocab): predictions at slots first..first+k-1, the drafts sit at first+1..

    Greedy: a draft is accepted when it equals the deep argmax (after logits processors). Sampling: when it equals
    the full model's draw with its position's noise (`verify.accept_sampled`). The batch design then
    decides what each row keeps (`verify.shortest_prefix` / `longest_prefix`), and every layer is cut back."""
    k = logits.shape[1]
    n = k - 1 if has_current else k
    argmax = _batch_choices(dec, logits, first)  # (b, k) greedy choices where the rows can share the work
    counts, verdicts, picks = [], [], []
    for r, row in enumerate(dec.rows):
        count = 0 if row.done else sum(1 for s in row.drafts if s >= first)
        drafts = row.tokens[len(row.tokens) - count :] if count else []
        used = count + 1 if has_current else count  # the predictions this row reads
        if row.done:
            ok, pick = [], []
        elif row.selector.params.do_sample:
            ok, pick = _sample_row(dec, r, row, logits[r, :used], first, drafts)
        else:
            pick = argmax[r][:used] if argmax is not None else greedy_row(dec, r, row, logits[r, :used], first)
            a = accept_greedy(pick[:count], drafts)
            ok = [True] * a + ([False] if a < count else [])
            if a < count:
                _judge_alternatives(dec, row, first + a, pick[a])
        counts.append(count)
        verdicts.append(ok)
        picks.append(pick)
    judge(dec, first, None, verdicts, final=False)
    accepted = [sum(ok) for ok in verdicts]
    active = [not row.done for row in dec.rows]
    reach = longest_prefix(accepted, active) if dec.per_row else shortest_prefix(accepted, active, n)
    kept_rows = [accepted[r] if dec.per_row else min(accepted[r], reach) for r in range(len(dec.rows))]
    ids = [None if row.done else _next_token(pick, kept) for row, pick, kept in zip(dec.rows, picks, kept_rows)]
    keep = first + reach + 1  # slots whose KV stays
    if not has_current and reach == n and any(t is not None for t in ids):
        # A flush feeds no current token, so its last draft (slot first + n) has no KV; only rows that kept every
        # draft have a token there, and a flush runs once every row has stopped: they have ended. The slot goes, so
        # the next token lands where the cache ends.
        keep -= 1
    # The cache is cut once, below, after the criteria have had their say: a sliding-window layer's cut drops states
    # a second cut would need.
    rolled = keep < dec.slots.length
    if rolled:
        dec.slots.length = keep
    if any(a < c for a, c in zip(accepted, counts)):
        dec.rule.end_block(dec.routing)
    for r, row in enumerate(dec.rows):
        if row.done:
            continue
        _book(row, logits[r], counts[r], accepted[r])
        refused = accepted[r] < counts[r] and kept_rows[r] == accepted[r]  # the full model's token takes its place
        if refused and dec.mode == "exit" and _exited(dec, row, first + accepted[r]):
            row.counters.repaired += 1  # an exited token the caller never saw
        row.drop(counts[r] - kept_rows[r])
        if dec.per_row:
            dec.slots.hole(r, first + kept_rows[r] + 1, keep)
    _judge_proposals(dec, accepted, ids)
    verified = sum(kept + (t is not None) for kept, t, row in zip(kept_rows, ids, dec.rows) if not row.done)
    # Accepted drafts and the full model's token agree with it. Exit mode's controller counts the positions an exited
    # token held, the refused one too, as early: the disagreement it holds to the target (`judge`: the share early
    # times the share refused) is then the rate of repairs.
    early = 0
    if dec.mode == "exit":
        early = sum(_exited(dec, row, first + j) for r, row in enumerate(dec.rows) if not row.done
                    for j in range(min(len(verdicts[r]), kept_rows[r] + 1)))  # fmt: skip
    dec.routing.quality.add_tokens(early, verified - early)
    if any(t is not None for t in ids):
        device = logits.device
        tokens = torch.tensor([dec.pad_token_id if t is None else t for t in ids], device=device)
        rows = torch.tensor([min(kept, k - 1) for kept in kept_rows], device=device)
        append(dec, tokens, ids, dec.full_layer, logits[torch.arange(len(ids), device=device), rows])
    for row in dec.rows:
        row.drafts.clear()
    make_final(dec)
    end = keep if rolled else dec.fill.deep_len
    stop = stop_slot(dec)
    if stop is not None and stop < end:  # a stop the criteria found inside what this pass cached
        end, dec.slots.length = stop, stop + 1
    if rolled or end < dec.fill.deep_len:
        dec.fill.rollback(end)
    _compat.trim_sliding(dec.fill.cache)
    dec.cycle = None
    if dec.per_row:
        batching.maybe_compact(dec)


def _exited(dec: DecodeState, row: Row, slot: int) -> bool:
    """Whether `row`'s draft predicted from `slot` left at an exit (not an n-gram copy)."""
    draft = row.drafts.get(slot)
    return draft is not None and draft.tier < len(dec.exits)


def _next_token(pick: list[int], kept: int) -> int | None:
    """The token a row appends after its kept drafts: the full model's choice there, greedy or its draw with the
    position's noise (None past the last prediction)."""
    return pick[kept] if kept < len(pick) else None


def _judge_alternatives(dec: DecodeState, row: Row, slot: int, token: int) -> None:
    """A refused exit draft that kept its head's next choices (an exit that may draft trees, in a chain's cycle):
    whether the full model's token was among them. The alternatives' estimate thus follows the text while the policy
    drafts chains, as the chain's does while it drafts trees."""
    draft = row.drafts.get(slot)
    if draft is not None and draft.alternatives:
        dec.tracker.observe(("exit branch", draft.tier), token in draft.alternatives)


def _book(row: Row, logits: torch.Tensor, count: int, accepted: int) -> None:
    """A row's verify tallies; an accepted draft's logits (where kept) become the full model's."""
    row.counters.rejected += int(accepted < count)
    if count:
        row.counters.verify_passes += 1
        if row.request.output_logits:
            for j in range(accepted):
                row.logits[len(row.logits) - count + j] = logits[j : j + 1].float().clone()


def _batch_choices(dec: DecodeState, logits: torch.Tensor, first: int) -> list[list[int]] | None:
    """Every row's greedy choice at each predicted slot in one host sync: the raw argmax where no row has
    processors, the processed one where all rows share one selector (HF's processors keep per-batch state); None
    otherwise (rows are then scored one by one)."""
    rows, selector = dec.rows, dec.rows[0].selector
    if any(r.selector.params.do_sample for r in rows):
        return None
    if all(not r.selector.processors for r in rows):
        return logits.argmax(dim=-1).tolist()
    if dec.slots.holes or any(r.selector is not selector for r in rows):
        return None
    scores = [selector.scores(dec.slots.seq[:, : first + j + 1], logits[:, j]) for j in range(logits.shape[1])]
    return torch.stack(scores, dim=1).argmax(dim=-1).tolist()


def greedy_row(dec: DecodeState, r: int, row: Row, logits: torch.Tensor, first: int) -> list[int]:
    """Row r's greedy choice at each predicted slot, after its logits processors (each sees the right prefix)."""
    return _scores(dec, r, row, logits, first).argmax(dim=-1).tolist()


def _sample_row(
    dec: DecodeState, r: int, row: Row, logits: torch.Tensor, first: int, drafts: list[int]
) -> tuple[list[bool], list[int]]:
    """Row r's verdicts and the full model's token at each position when sampling: its draw with the position's
    noise, which keeps a draft where it equals it (`verify.accept_sampled`)."""
    scores = _scores(dec, r, row, logits, first)  # (m, vocab)
    start = len(row.new_tokens) - len(drafts)  # the first draft's position
    noise = torch.stack([row.noise_at(start + j, scores.shape[-1]) for j in range(scores.shape[0])])
    return accept_sampled(torch.softmax(scores, dim=-1), noise, drafts)


def _scores(dec: DecodeState, r: int, row: Row, logits: torch.Tensor, first: int) -> torch.Tensor:
    """(m, vocab) the scores row r chooses from at slots first..first+m-1 (processors see the right prefix)."""
    return torch.cat(
        [row.selector.scores(row_ids(dec, r, first + j + 1), logits[j : j + 1]) for j in range(logits.shape[0])]
    )


def judge(dec: DecodeState, first: int, offsets: list[int] | None, verdicts: list[list[bool]], final: bool) -> None:
    """Book the deep pass's verdicts on each row's drafts (at `offsets` from slot `first`, default 0, 1, ...) in the
    acceptance estimates and per tier: on early tokens that stay `final` (exit mode's checks), whose agreement is the
    quality the rolling monitor watches and the threshold controller steers, or on drafts a verify cycle judged.
    Exit mode's exited tokens that a verify cycle judged (repaired where refused) are the controller's evidence too:
    it then holds the rate of repairs, as it holds the rate of final disagreements without them. A final token
    found wrong is where the output left the full model's (`RowCounters.diverged`, free-running)."""
    seen: list[bool] = []
    exited: list[bool] = []
    for row, oks in zip(dec.rows, verdicts):
        counts = (row.counters.checked, row.counters.agreed) if final else (row.counters.judged, row.counters.accepted)
        for offset, ok in zip(offsets if offsets is not None else range(len(oks)), oks):
            draft = row.drafts.get(first + offset)
            if draft is None:  # a finished row's padding
                continue
            dec.tracker.observe_draft(draft.key, bool(ok))
            counts[0][draft.tier] += 1
            counts[1][draft.tier] += int(ok)
            seen.append(bool(ok))
            if dec.mode == "exit" and draft.tier < len(dec.exits):
                exited.append(bool(ok))
            if final and not ok and dec.mode == "exit":
                _diverged(dec, row, first + offset + 1 - row.start)
    if not final:
        seen = exited
    if seen:
        dec.monitor.observe(seen)
        dec.routing.quality.add_checks(seen)
        dec.rule.adjust(dec.routing)


def _diverged(dec: DecodeState, row: Row, new_index: int) -> None:
    """A final token (released exited token, or an unverified n-gram copy) its check found wrong: the first such
    token of `row`'s output is where it left the full model's. Tokens past the row's end (a batch keeps appending to a
    row whose stop is still tentative) are no part of any output."""
    end = row.stop_at if row.stop_at is not None else row.request.max_new_tokens
    if row.counters.diverged is None and new_index < end:
        row.counters.diverged = new_index
        dec.routing.diverged = True


def _judge_proposals(dec: DecodeState, accepted: list[int], tokens: list[int | None]) -> None:
    """Each row's n-gram proposal of this cycle, judged where it went beyond what was verified: the first undrafted
    token against the token the full model chose (so a match class switched off is noticed again)."""
    for row, a, token in zip(dec.rows, accepted, tokens):
        proposal, row.proposal = row.proposal, None
        if proposal is not None and token is not None and a == row.drafted < len(proposal.tokens):
            dec.tracker.observe(("ngram", proposal.match_class), proposal.tokens[row.drafted] == token)


def head(dec: DecodeState, hidden: torch.Tensor) -> torch.Tensor:
    """Final-layer logits of a deep chunk (one sequence: its rows padded to the cheapest measured count).

    Non-finite logits (an fp16 overflow, typically) would otherwise be argmaxed into garbage silently."""
    pad_to = dec.costs.head_pad(hidden.shape[1]) if dec.costs is not None and len(dec.rows) == 1 else 0
    compiled = _compat.is_static(dec.fill.cache)  # a compiled decode: its head may be a graph (`compiled_logits`)
    logits = dec.stack.logits(hidden, pad_to, precise=dec.config.precise_logits, compiled=compiled)
    if not bool(torch.isfinite(logits).all()):
        raise FloatingPointError(
            f"The model produced NaN or infinite logits ({dec.stack.dtype}); in float16 this is usually an overflow "
            "in the hidden states: load the model in bfloat16 or float32."
        )
    return logits

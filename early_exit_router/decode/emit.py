"""Emitting tokens: each row's next token, one appended slot, and what becomes final.

Every appended token is checked against the stop rules as it lands (`stopping.ends_generation`), drafts included,
the caller's stopping criteria once it is final (`make_final`); a row whose stop is final is done (`settle`): its
streamer ends and its text goes to the n-gram store.
"""

from __future__ import annotations

import time

import torch

from early_exit_router.decode.noise import DONE
from early_exit_router.decode.state import DecodeState
from early_exit_router.decode.stopping import criteria_stop, ends_generation


def embed(dec: DecodeState, first: int, count: int = 1) -> torch.Tensor:
    """(b, count, hidden) embeddings of slots first..first+count-1."""
    positions = dec.slots.positions(first, first + count)
    return dec.stack.embed(dec.slots.seq[:, first : first + count], first, positions=positions)


def row_ids(dec: DecodeState, r: int, end: int) -> torch.Tensor:
    """(1, n) row r's ids before slot `end`, as HF's processors and stopping criteria see them."""
    row = dec.rows[r]
    return dec.slots.row_ids(r, end, row.prompt_ids, row.start, row.new_tokens)


def ids_through(dec: DecodeState, r: int, count: int) -> torch.Tensor:
    """(1, n) row r's ids through its `count`-th new token, as `row_ids` gives them."""
    row = dec.rows[r]
    return dec.slots.ids_through(r, count, row.prompt_ids, row.start, row.new_tokens)


def choose(dec: DecodeState, end: int, logits: torch.Tensor) -> torch.Tensor:
    """(b, vocab) -> (b,) each row's next token, by its own selector (one call when they share one or are all plain
    greedy); processors see the ids before slot `end`. A sampling row draws with its next position's noise."""
    rows, first = dec.rows, dec.rows[0].selector
    sampling = any(r.selector.params.do_sample for r in rows)
    shared = all(r.selector is first for r in rows)
    plain = all(not r.selector.params.do_sample and not r.selector.processors for r in rows)
    if not dec.slots.holes and not sampling and (shared or plain):
        return first.choose(dec.slots.seq[:, :end], logits).reshape(-1)
    return torch.cat([_choose_row(dec, k, end, logits[k : k + 1]).reshape(1) for k in range(len(rows))])


def _choose_row(dec: DecodeState, r: int, end: int, logits: torch.Tensor) -> torch.Tensor:
    """(1, vocab) -> (1,) row r's next token, its processors seeing the ids before slot `end`."""
    row = dec.rows[r]
    if row.done:  # its slot is padded: no draw from a generator rows may share
        return logits.argmax(dim=-1)
    noise = row.noise_at(len(row.new_tokens), logits.shape[-1]) if row.selector.params.do_sample else None
    return row.selector.choose(row_ids(dec, r, end), logits, noise)


def append(
    dec: DecodeState, tokens: torch.Tensor, ids: list[int | None], layer: int, logits: torch.Tensor | None
) -> None:
    """Write one slot: row r's token `ids[r]` (None: a hole, or the pad token of a finished row), with its depth, its
    logits where requested, and every stop rule checked on it."""
    done = [row.done for row in dec.rows]
    if any(done):
        tokens = torch.where(torch.tensor(done, device=tokens.device), dec.pad_token_id, tokens.reshape(-1))
    dec.slots.append(tokens.reshape(-1), [d or t is not None for d, t in zip(done, ids)])
    end = dec.slots.length
    landed = 0
    for r, row in enumerate(dec.rows):
        token = ids[r]
        if row.done or token is None:
            continue
        landed += 1
        row.tokens.append(int(token))
        row.depth.append(layer)
        if row.request.output_logits and logits is not None:
            row.logits.append(logits[r : r + 1].detach().float().reshape(1, -1).clone())
        if dec.cycle is None:  # outside a verify cycle a token is final at once
            row.final = len(row.tokens)
        if row.stop_at is None and ends_generation(
            row.request, row.tokens, row.prompt_len, lambda r=r: row_ids(dec, r, end), dec.cycle is None
        ):
            row.stop_at = len(row.new_tokens)
    if dec.cycle is None:  # final at once: the quality target's token count (verified ones land in `deep.verify`)
        early = layer != dec.full_layer
        dec.routing.quality.add_tokens(landed if early else 0, 0 if early else landed)


def make_final(dec: DecodeState, upto: list[int] | None = None) -> None:
    """Every row's tokens are final now (a deep pass has verified them), or its first `upto[r]` (prompt included:
    `release`): the caller's stopping criteria see each newly final token once, in order, up to a stop, which then
    holds."""
    for r, row in enumerate(dec.rows):
        final = len(row.tokens) if upto is None else min(upto[r], len(row.tokens))
        if not row.done and row.request.stopping_criteria is not None:
            end = len(row.new_tokens) if row.stop_at is None else row.stop_at
            for j in range(max(row.final - row.prompt_len, 0), min(end, final - row.prompt_len)):
                if criteria_stop(row.request, lambda r=r, j=j: ids_through(dec, r, j + 1)):
                    row.stop_at = j + 1
                    break
        row.final = max(row.final, final)


def release(dec: DecodeState) -> None:
    """Exit mode with a `holdback` of k > 0: the oldest exited tokens of the verify cycle beyond the newest k reach
    the caller unchecked. They become final (streamed, seen by the stopping criteria), the cycle starts after them,
    and the deep pass only checks them (`deep._check_exits`) instead of repairing them. An n-gram copy is verified
    before it is released, and the exited tokens after it wait with it."""
    held, cycle = dec.config.holdback, dec.cycle
    if dec.mode != "exit" or not held or cycle is None:
        return
    newest, start = dec.slots.length - 1, cycle.start
    active = [row for row in dec.rows if not row.done]
    while newest - start > held:  # unverified tokens sit at slots start + 1 .. newest
        drafts = [row.drafts.get(start) for row in active]
        if not drafts or any(d is None or d.tier >= len(dec.exits) for d in drafts):
            break
        start += 1
    released = start - cycle.start
    if not released:
        return
    cycle.start = start
    for row in active:
        row.counters.released += released
    dec.routing.quality.add_tokens(released * len(active), 0)  # early tokens final unverified, as at `append`
    make_final(dec, [row.prompt_len + start + 1 - row.start for row in dec.rows])


def stop_slot(dec: DecodeState) -> int | None:
    """A single sequence that has stopped: the slot of its last token, where a full pass over the output leaves the
    cache ending (a pass may have cached tokens after it, as the criteria find a stop only once it is final)."""
    row = dec.rows[0]
    return row.start + row.stop_at - 1 if len(dec.rows) == 1 and row.stop_at is not None else None


def settle(dec: DecodeState) -> None:
    """Release what exit mode's holdback lets through (`release`) and stream each row's final tokens; a row whose stop
    is final is done: its streamer ends, and its text goes to the n-gram store."""
    release(dec)
    ended = []
    for row in dec.rows:
        if row.done:
            continue
        upto = len(row.tokens) if row.stop_at is None else row.prompt_len + row.stop_at
        row.frontier.advance(row.tokens, min(row.final, upto))
        if row.stop_at is not None and row.final >= upto:
            row.done = True
            ended.append(row)
            if row.noise is not None:  # its positions no longer hold the other rows' draws
                row.noise.release(row.noise_row, DONE, len(row.output()))
            row.frontier.end()
            dec.suffix.remember(row.tokens[: row.prompt_len] + row.output())
    if ended and not all(row.done for row in dec.rows):  # the others decode on: these rows' wall time stops here
        now = time.perf_counter()  # (the last ones' stops at `finish`, which flushes what waits)
        for row in ended:
            row.ended = now

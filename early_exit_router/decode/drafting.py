"""The draft phase of a step: an exit asked for every row at once (`try_exit`; `probe_exits` scores exits on plain
steps without drafting), and the n-gram tier's proposals appended as drafts (`append_ngram`).

An exit fires only when every unfinished row may leave (a batch's layers stay rectangular): each row then emits its
head's token and the chunk's states wait in front of the next segment for the deep pass that fills them. A sampling
row's exit draws its draft with the noise of the draft's position, the noise the deep pass then draws with.
"""

from __future__ import annotations

import time

import torch

from early_exit_router.decode.ask import deciding_rows, every_row, fusable, fused_ask
from early_exit_router.decode.drafters import NGRAM_LAYER
from early_exit_router.decode.emit import append, choose, embed
from early_exit_router.decode.state import DecodeState, Draft, Row, VerifyCycle
from early_exit_router.decode.stats import compiled_seconds
from early_exit_router.heads.draft import trimmed_top1
from early_exit_router.heads.gates import uses_head
from early_exit_router.routing.exit_rule import guards_repeats
from early_exit_router.routing.ngram import NO_PROPOSAL, ContextIndex, Proposal
from early_exit_router.routing.policy import Plan, TierKey
from early_exit_router.routing.token_tree import TokenTree


def propose_ngram(dec: DecodeState, row: Row, budget: int, tree: bool = False) -> tuple[Proposal, TokenTree | None]:
    """The n-gram tier's proposal for `row` (up to `budget` tokens) and, with `tree`, its token tree; the scan also
    tells the gates what the context copies here."""
    proposal, copy, token_tree = dec.suffix.propose(row.tokens, context_index(dec, row), budget, tree)
    if budget > 0:
        row.ngram_memo = (len(row.tokens), copy)
    return proposal, token_tree


def propose_rows(dec: DecodeState, budgets: list[int], trees: bool) -> tuple[list[Proposal | None], TokenTree | None]:
    """Each row's n-gram proposal for a planned cycle (None: a finished row; nothing where the tier is off or the
    row's budget is spent), and with `trees` (a batch of one) the row's token tree.

    `budgets`: what each row's exits may draft (the window rule's room). A proposal reaches up to `ngram_draft`
    tokens: under the cost policy, which sizes each draft by its cost and its match class's acceptance, as far as the
    row has tokens left to make (a long copy drafts long); without it, no further than an exit could."""
    proposals: list[Proposal | None] = []
    tree = None
    for row, budget in zip(dec.rows, budgets):
        proposal = NO_PROPOSAL
        if dec.policy is not None:
            budget = row.request.max_new_tokens - len(row.new_tokens)
        if dec.config.ngram_tier and budget > 0 and not row.done:
            proposal, tree = propose_ngram(dec, row, min(dec.config.ngram_draft, budget), trees)
        proposals.append(None if row.done else proposal)
    return proposals, tree


def context_index(dec: DecodeState, row: Row) -> ContextIndex:
    """`row`'s n-gram index (built over the prompt at the first lookup, kept up to date from then on)."""
    if row.index is None:
        row.index = dec.suffix.index()
    return row.index


def ngram_token(dec: DecodeState, row: Row) -> int:
    """The token the tier would copy next in `row`'s own context (-1: none; `ngram_match`'s answer): a
    gate feature, one lookup per context length whichever exits ask."""
    length, token = row.ngram_memo
    if length != len(row.tokens):
        found = context_index(dec, row).lookup(row.tokens, 1).tokens
        token = found[0] if found else -1
        row.ngram_memo = (len(row.tokens), token)
    return token


def try_exit(
    dec: DecodeState,
    i: int,
    hidden: torch.Tensor,
    q: int,
    target: int | None,
    key: TierKey | None = None,
    alternatives: int = 0,
    threshold: float | None = None,
) -> bool:
    """Ask exit `i` about slot `q` for every row; when every unfinished row may leave, emit each row's head token and
    park the chunk in front of the next segment. `target`: a block's decision, taken without asking.
    `alternatives` (one greedy row): the draft keeps the head's next this-many choices, for an exit tree.
    `threshold`: a confidence (a head gate's P(agree), else the head's largest probability) that also lets the token
    draft where the exit rule would not (verify mode's per-token break-even, `DraftPolicy.draft_threshold`); a
    drafted token's confidence then scales `dec.survival`."""
    last = hidden[:, -1]  # (b, hidden): the current token at this exit
    gate = dec.exit_drafter.gate(i)
    if target is None and gate is not None and not uses_head(gate):
        t0 = time.perf_counter()
        allowed = _every_active(dec, dec.rule.gate_allows(gate_probability_at(dec, i, gate, last)))
        dec.passes.routing_s += time.perf_counter() - t0
        if not allowed:
            return False
    trimmed = asks_trimmed(dec)
    # Greedy: choose before deciding, so that one host sync fetches the decision and the tokens together.
    # Sampling: draw only once the tokens exit (each position's noise is its own, drawn when first needed).
    sampling = any(row.selector.params.do_sample for row in dec.rows)
    chosen: list[float] = []
    ranked: list[float] = []
    alternatives = alternatives if (trimmed or not sampling) and len(dec.rows) == 1 else 0
    t0 = time.perf_counter()
    fused = trimmed and target is None and fusable(gate, i in dec.fill.blocks)
    if fused:  # the whole ask as one function (one graph when compiled), booked as routing with its head
        compiling = compiled_seconds(dec.stack)
        logits, tokens, signals = fused_ask(dec, i, last, threshold, alternatives, gate_inputs_at(dec, i, gate, last))
        ok, low, *chosen = signals.tolist()
        t0 += compiled_seconds(dec.stack) - compiling  # a first call's compiling is booked in compile_s
    else:
        logits = dec.exit_drafter.logits(i, last, dec.fill.blocks, trimmed)  # (b, vocab), trimmed (b, K)
        if trimmed:
            tokens = trimmed_top1(logits, dec.exit_drafter.draft_ids)
        else:
            tokens = None if sampling else choose(dec, q + 1, logits)
    if target is None:
        if not fused:
            t0 = time.perf_counter()
            ok, confidence = exit_flags(dec, i, last, logits, False, threshold, trimmed)[1:]
            signals = [ok.double(), confidence.double()] + ([] if tokens is None else list(tokens.double()))
            if alternatives:  # fetched in the same host sync
                ranks = logits[0].topk(alternatives + 1).indices
                signals += list((dec.exit_drafter.draft_ids[ranks] if trimmed else ranks).double())
            ok, low, *chosen = torch.stack(signals).tolist()
        if alternatives:
            chosen, ranked = chosen[: -(alternatives + 1)], chosen[-(alternatives + 1) :]
        # The shallow heads copy an earlier item ("1. Monday 2. Monday"): where an exited token may reach the caller
        # unchecked (a lossy holdback), a word the output already holds goes deeper (repairs catch it otherwise).
        if ok and chosen and guards_repeats(dec.config, dec.mode) and dec.rule.repeats(_deciding(dec), chosen):
            ok = False
            dec.passes.repeat_refusals += int(dec.routing.guarded_at != q)  # once per token, whichever exits asked
            dec.routing.guarded_at = q
        dec.passes.routing_s += time.perf_counter() - t0
        if not ok:
            for row, token in zip(dec.rows, chosen):  # judged once the deep pass has chosen (`judge_refusals`)
                if not row.done:
                    dec.refusals.append((row, len(row.tokens), int(token), i))
            return False
        dec.rule.start_block(dec.routing, i)
        dec.rule.record_exit(dec.routing, low)
        dec.survival *= low
    if tokens is None:
        tokens = choose(dec, q + 1, logits)
    ids = [int(t) for t in chosen] if chosen else tokens.tolist()
    dec.fill.park(i, hidden)
    # Exit mode with a holdback: the token is a draft the next deep pass repairs unless it reached the caller first
    # (`emit.release`); with none, it is final at once.
    verified = dec.mode == "verify" or dec.cycle is not None or dec.config.holdback != 0
    if verified and dec.cycle is None:
        dec.cycle = VerifyCycle(q)
    for r, row in enumerate(dec.rows):
        if not row.done:
            others = tuple(int(t) for t in ranked if int(t) != ids[r])[:alternatives]
            # exit mode: the noise it was drawn with, for the check should it become final unverified
            sampled = dec.mode == "exit" and row.selector.params.do_sample
            noise = row.noise_at(len(row.new_tokens), logits.shape[-1]) if sampled else None
            row.drafts[q] = Draft(i, key or ("exit", i), others, noise)
    append(dec, tokens, ids, dec.exits[i], None if trimmed else logits)
    return True


def asks_trimmed(dec: DecodeState) -> bool:
    """Whether an ask may stay at the trimmed draft head's K columns: every row greedy without logits processors or
    a request for the logits, so that nothing needs the full-width row (the one fused ask: adapter, norm, trimmed
    head, gate features and top-1 on K columns; building the -inf row and reading it back cost about as much as the
    head itself)."""
    return dec.exit_drafter.can_trim and not any(
        row.selector.params.do_sample or row.selector.processors or row.request.output_logits for row in dec.rows
    )


def ask_in_chain(dec: DecodeState, plan: Plan, hidden: torch.Tensor, q: int) -> bool:
    """One ask of an exit plan's chain at slot `q` (exit states `hidden`): whether its token drafted. The token drafts
    where its confidence reaches the exit rule's bar or its own break-even (`draft_threshold`); a refusal ends the
    chain and is booked as the gate's "no", not as a rejected draft. The ask is timed for the policy, which prices
    asks as the decoder runs them."""
    threshold, t0 = draft_threshold(dec, plan.tier), time.perf_counter()
    fired = try_exit(dec, plan.tier, hidden, q, None, plan.key, plan.branches, threshold)
    if dec.policy is not None:
        dec.policy.observe_ask(plan.tier, (time.perf_counter() - t0) * 1000)
    dec.tracker.observe(("fire", plan.tier), fired)
    return fired


def worth_asking(dec: DecodeState, i: int, target: int | None) -> bool:
    """Whether to ask exit `i` about this token. Under the cost policy only while asking pays
    (`DraftPolicy.worth_consulting`, at the exit's estimated exit rate); a skipped exit is asked anyway every
    `probe_interval` tokens, so that its estimate follows the text. A block's target is always asked, and with
    blocks of several tokens every exit is: one decision there moves a whole block, which the per-token saving
    does not price."""
    if dec.policy is None or target is not None or dec.config.block_size > 1:
        return True
    if dec.policy.worth_consulting(i, dec.tracker.estimate(("ask", i))):
        return True
    unpaid = dec.passes.unpaid_asks
    unpaid[i] = unpaid.get(i, 0) + 1
    interval = dec.config.probe_interval
    return interval > 0 and unpaid[i] % interval == 0


def exit_flags(
    dec: DecodeState,
    i: int,
    last: torch.Tensor,
    logits: torch.Tensor,
    with_gate: bool,
    threshold: float | None = None,
    trimmed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exit `i`'s cascade on its head's `logits` (b, vocab): (b,) flags, whether every unfinished row may leave, and
    the lowest confidence among them. A head gate's probability is the confidence; `with_gate` also folds in a gate
    that runs before the head (the decoder asks that one first, probes do not). `threshold`: a confidence that also
    lets a row draft, below the exit rule's thresholds (verify mode's per-token break-even). `trimmed`: `logits` are
    the trimmed head's K columns (`asks_trimmed`)."""
    gate = dec.exit_drafter.gate(i)
    learned = gate_probability_at(dec, i, gate, last, logits, trimmed) if uses_head(gate) else None
    columns = None if trimmed else dec.exit_drafter.draft_ids
    flags, confidence = dec.rule.head_signal(logits, dec.routing.threshold_shift, learned, columns)
    if threshold is not None:  # the exit rule's bar still suffices: a user's thresholds keep their meaning
        flags = flags | (confidence >= threshold)
    if with_gate and gate is not None and learned is None:
        flags = flags & dec.rule.gate_allows(gate_probability_at(dec, i, gate, last))
    return flags, *every_row(flags, confidence, deciding_rows(dec, flags.device))


def gate_probability_at(
    dec: DecodeState,
    i: int,
    gate: torch.nn.Module,
    last: torch.Tensor,
    logits: torch.Tensor | None = None,
    trimmed: bool = False,
) -> torch.Tensor:
    """Exit `i`'s gate probability (b,) for the current slot, with the context features where it reads them."""
    return dec.exit_drafter.gate_probability(gate, last, *_gate_context(dec, i, gate), logits, trimmed)


def gate_inputs_at(
    dec: DecodeState, i: int, gate: torch.nn.Module | None, last: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Exit `i`'s `gate`'s context features and n-gram tokens for the current slot (None where it reads none)."""
    return dec.exit_drafter.gate_inputs(gate, last, *_gate_context(dec, i, gate))


def _gate_context(dec: DecodeState, i: int, gate: torch.nn.Module | None) -> tuple[list[int] | None, float]:
    """What exit `i`'s `gate` reads of the context: each row's n-gram token (None: it reads none), and the exit's
    agreement estimate (the `recent_acceptance` it was trained on)."""
    tokens = [ngram_token(dec, row) for row in dec.rows] if dec.exit_drafter.needs_context(gate) else None
    return tokens, dec.tracker.estimate(("agree", i))


def _deciding(dec: DecodeState) -> list[tuple[list[int], int]]:
    """Each row's (tokens, prompt length), a finished row's as empty (the repeat guard reads what rows decide)."""
    return [(row.tokens, row.prompt_len) if not row.done else ([], 0) for row in dec.rows]


def _every_active(dec: DecodeState, flags: torch.Tensor) -> bool:
    active = deciding_rows(dec, flags.device)
    return bool(flags.all() if active is None else (flags | ~active).all())


def probe_exits(dec: DecodeState, shadows: list[tuple[int, torch.Tensor]]) -> None:
    """Shadow tokens: would each exit have drafted the token the deep pass just chose, from the states (b, hidden)
    the step computed at it anyway?"""
    t0 = time.perf_counter()
    dec.passes.probes += 1
    chosen = torch.tensor([row.tokens[-1] for row in dec.rows], device=shadows[0][1].device)
    probed, signals = [], []
    for i, last in shadows:
        if i in dec.fill.blocks and dec.fill.blocks[i].end != dec.slots.length - 1:
            continue  # the probed position was rolled back: nothing to ask the block about
        trimmed = asks_trimmed(dec)
        logits = dec.exit_drafter.logits(i, last, dec.fill.blocks, trimmed)  # (b, vocab), trimmed (b, K)
        flags = exit_flags(dec, i, last, logits, True, draft_threshold(dec, i), trimmed)[0]
        top1 = trimmed_top1(logits, dec.exit_drafter.draft_ids) if trimmed else logits.argmax(dim=-1)
        probed.append(i)
        signals.append(torch.stack([flags, top1 == chosen]))  # (2, b)
    if signals:
        for i, (fired, agreed) in zip(probed, torch.stack(signals).tolist()):  # one host sync for every exit
            for fire, ok in zip(fired, agreed):
                dec.tracker.observe(("fire", i), bool(fire))
                dec.tracker.observe(("agree", i), bool(ok))
                if fire:
                    dec.tracker.observe(("exit", i), bool(ok))
    dec.passes.routing_s += time.perf_counter() - t0


def draft_threshold(dec: DecodeState, i: int) -> float | None:
    """Verify mode under the cost policy: the P(agree) exit `i` needs to draft the current slot's next token, at what
    waits for the deep pass and the cycle's survival so far (`DraftPolicy.draft_threshold`); else None (the exit
    rule's thresholds decide)."""
    if dec.mode != "verify" or dec.policy is None:
        return None
    return dec.policy.draft_threshold(i, dec.pending, dec.survival)


def judge_refusals(dec: DecodeState) -> None:
    """The step's refused asks (an exit whose gate kept the token from leaving), judged where the full model chose
    the next token right after: whether the exit's top-1 was that token. With the drafts' verdicts this is the exit's
    agreement over every position it was asked about, the `recent_acceptance` its gate was trained on (drafts alone
    would show only the positions where the gate fired)."""
    for row, length, token, i in dec.refusals:
        if len(row.tokens) > length and row.depth[length - row.prompt_len] == dec.full_layer:
            dec.tracker.observe(("agree", i), row.tokens[length] == token)
    dec.refusals.clear()


def append_ngram(
    dec: DecodeState, proposals: list[Proposal | None], tier: int | None = None, key: TierKey | None = None,
    layer: int = NGRAM_LAYER,
) -> int:  # fmt: skip
    """Append each row's n-gram proposal as drafts, column by column (a row with a shorter one gets holes after it);
    their embeddings wait in front of segment 0. A row stops drafting at a token that ends its generation. Returns
    how many slots were appended. Another tier whose drafts the model verifies from its embeddings (the adapted
    draft path's) passes its `tier`, acceptance `key` and histogram `layer`."""
    q = dec.slots.length - 1
    # Unverified copies would pass the rows' logits processors by (min_new_tokens, suppressed or banned tokens):
    # with any of those they are verified, so that the processors judge them.
    unverified = dec.config.ngram_unverified and not any(row.selector.processors for row in dec.rows)
    verified = dec.mode == "verify" or not unverified
    if verified and dec.cycle is None:  # exit mode: the tokens waiting now stay final; verify what follows
        dec.cycle = VerifyCycle(q)
    tier = len(dec.exits) if tier is None else tier
    vocab, device = dec.stack.vocab_size, dec.slots.seq.device
    drafting = [p is not None and bool(p.tokens) for p in proposals]
    width = 0
    while True:
        column = [p.tokens[width] if on and width < len(p.tokens) else None for p, on in zip(proposals, drafting)]
        if all(t is None for t in column):
            break
        for row, token, proposal in zip(dec.rows, column, proposals):
            if token is not None:
                row.drafts[q + width] = Draft(tier, key or ("ngram", proposal.match_class))
                row.drafted += 1
        ids = [dec.pad_token_id if t is None else t for t in column]
        logits = None
        if any(row.request.output_logits for row in dec.rows):  # the tier's "logits": all mass on the copy
            logits = torch.full((len(ids), vocab), float("-inf"), device=device)
            logits[torch.arange(len(ids)), torch.tensor(ids)] = 0.0
        append(dec, torch.tensor(ids, device=device), column, layer, logits)
        width += 1
        # Every stop rule sees every token, as in plain decoding: a draft ends at the first token that stops.
        drafting = [on and t is not None and row.stop_at is None for on, t, row in zip(drafting, column, dec.rows)]
    dec.fill.queue(embed(dec, q, width))  # (b, width, hidden): slots q..q+width-1
    return width


def draft_budget(dec: DecodeState, row: Row) -> int:
    """How many more tokens `row` may draft: the window rule's room and the tokens it has still to make."""
    return min(dec.config.max_pending - dec.pending, row.request.max_new_tokens - len(row.new_tokens))


def draft_ngram(dec: DecodeState) -> bool:
    """The n-gram tier in a cascade step (one sequence): what followed the last tokens before, as drafts. Exit mode
    verifies them too (`append_ngram`), also past waiting exited tokens (final, only checked)."""
    row = dec.rows[0]
    proposal, _ = propose_ngram(dec, row, min(dec.config.ngram_draft, draft_budget(dec, row)))
    if not proposal.tokens:
        return False
    append_ngram(dec, [proposal])
    return True


def draft_chain(dec: DecodeState) -> bool:
    """The adapted draft path's chain in a cascade step (one sequence), drafted like the n-gram tier's copies: the
    model verifies it from its embeddings in the next step's pass (`chained`)."""
    row = dec.rows[0]
    budget, threshold = draft_budget(dec, row), dec.config.draft_path_threshold
    chain = dec.adapted.propose(row.tokens, budget, threshold, row.request.eos_token_ids)
    if not chain:
        return False
    at = dec.draft_path.exit_layer
    append_ngram(dec, [Proposal(chain, 0)], tier=len(dec.exits) + 1, key=("adapted", at), layer=at)
    dec.chained = True
    return True

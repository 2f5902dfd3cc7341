"""The decode loop: early exit with layer-wise KV filling, in `exit` (lossy) or `verify` (lossless) mode.

Layers are split into segments at the exit points: with exits `e_0 < e_1 < ...`, segment 0 is layers `0..e_0`,
segment `i + 1` is layers `e_i + 1 .. e_{i+1}`, and the last segment ends at the last layer. Every layer of a
segment always holds the same positions in the cache.

A token that exits at exit `i` leaves its hidden state (the output of segment `i`) in `buffers[i + 1]`, in front
of segment `i + 1`. The positions in `buffers[s]` are exactly those segment `s - 1` has seen and segment `s` has
not, so they are consecutive; `buffers[0]` holds embeddings of positions the zero-layer n-gram tier skipped. When
a later token reaches segment `s`, the waiting positions join it and the whole chunk runs segment `s` in one
batched pass: that is the layer-wise KV fill. After the last segment, the chunk's final-layer logits are the full
model's predictions for every waiting position: `exit` mode compares them with the emitted tokens (agreement),
`verify` mode accepts the longest matching prefix and crops every layer's cache after it.

All per-sequence state lives in `SequenceState`, so batching can add one per sequence.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.utils import logging

from early_exit_router.config import RouterConfig
from early_exit_router.decode.sampling import TokenSelector
from early_exit_router.decode.stats import GenerationStats
from early_exit_router.heads.adapters import needs_context
from early_exit_router.heads.block import BlockContext
from early_exit_router.heads.draft import draft_logits
from early_exit_router.heads.exit_heads import ExitHeads
from early_exit_router.heads.gates import gate_probability, uses_head
from early_exit_router.models import _compat
from early_exit_router.models.architecture import LayerStack
from early_exit_router.routing.costs import CostModel
from early_exit_router.routing.exit_rule import FULL_DEPTH, Router, RoutingState
from early_exit_router.routing.ngram import SuffixStore, ngram_match, prefer_stored
from early_exit_router.routing.policy import AcceptanceTracker, DraftPolicy, Plan, TierKey

logger = logging.get_logger(__name__)
NGRAM_LAYER = -1  # exit-histogram key of the zero-layer n-gram tier


@dataclass
class DecodeRequest:
    """What one `generate` call asks for, already validated."""

    mode: str
    max_new_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    stopping_criteria: Any = None  # transformers StoppingCriteriaList, or None
    streamer: Any = None  # transformers BaseStreamer, or None
    tokenizer: Any = None  # needed for stop_strings
    output_logits: bool = False


@dataclass
class SequenceState:
    """Everything one sequence carries between decode steps."""

    tokens: list[int]  # prompt + generated, on the host
    prompt_len: int
    seq: torch.Tensor  # (1, capacity) the same tokens on the model's device
    cache: Any
    buffers: list[torch.Tensor | None]  # per segment: (1, m, hidden) waiting in front of it (0: embeddings)
    routing: RoutingState
    depth: list[int] = field(default_factory=list)  # per new token: layer it left at
    draft_exit: dict[int, int] = field(default_factory=dict)  # position -> exit index of the token it predicted
    draft_probs: dict[int, torch.Tensor] = field(default_factory=dict)  # verify + sampling: q(x) per position
    logits: list[torch.Tensor] = field(default_factory=list)  # per new token, when requested
    deep_len: int = 0  # positions the last layer has seen
    streamed: int = 0  # tokens handed to the streamer
    checked_by_exit: list[int] = field(default_factory=list)
    agreed_by_exit: list[int] = field(default_factory=list)
    deep_passes: int = 0
    fill_positions: int = 0
    forced: int = 0
    rejected: int = 0
    routing_s: float = 0.0
    recent_matches: deque = field(default_factory=deque)  # rolling verdicts on exited tokens (monitoring)
    min_rolling_agreement: float = 1.0
    monitor_warned: bool = False
    verify_passes: int = 0  # verify mode: deep passes that checked at least one draft
    accepted: int = 0  # verify mode: drafts accepted
    verifying: bool = False  # drafts now waiting are verified (always in verify mode; n-gram cycles in exit mode)
    verify_from: int = 0  # exit mode: the first position whose draft is verified (those before it exited: final)
    tracker: AcceptanceTracker = field(default_factory=AcceptanceTracker)
    draft_key: dict[int, TierKey] = field(default_factory=dict)  # position -> acceptance key of its draft
    plan: Plan | None = None  # cost policy: the current draft cycle
    cycle_drafts: int = 0
    shadow_ngram: tuple[TierKey, int] | None = None  # an unused n-gram proposal's key and first token
    plain_steps: int = 0
    probes: int = 0
    unpaid_asks: dict[int, int] = field(default_factory=dict)  # exit mode, cost policy: exit index -> tokens where
    # asking it did not pay (every `probe_interval`-th of them it was asked anyway)
    exited_seen: int = 0  # exit mode: exited tokens the deep layers have seen (checked or not)
    plan_counts: dict[str, int] = field(default_factory=dict)
    blocks: dict[int, BlockContext] = field(default_factory=dict)  # exit index -> its block adapter's context
    # Gates' memo of the n-gram tier's view of this context: (context length, the token it would copy next or -1).
    context_ngram: tuple[int, int] = (-1, -1)

    @property
    def new_tokens(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def pending(self) -> int:
        """Fed positions the deep layers have not seen yet."""
        return len(self.tokens) - 1 - self.deep_len


@dataclass
class Decoding:
    """One decode in flight: `Engine.start` makes it, `Engine.advance` steps it, `Engine.finish` closes it."""

    state: SequenceState
    request: DecodeRequest
    selector: TokenSelector
    started: float  # perf_counter at the start of the prefill
    prefill_s: float
    done: bool = False


class Engine:
    """Runs generation for one wrapped model with its exit heads and router."""

    def __init__(
        self,
        stack: LayerStack,
        heads: ExitHeads,
        router: Router,
        config: RouterConfig,
        costs: CostModel | None = None,
        store: SuffixStore | None = None,
    ) -> None:
        self.stack = stack
        self.heads = heads
        self.router = router
        self.config = config
        self.exits = config.consulted_exit_layers()
        # segment s runs layers [starts[s], starts[s + 1])
        self.starts = [0] + [e + 1 for e in self.exits] + [stack.num_layers]
        self.full_layer = stack.num_layers - 1
        # exits whose adapter is a block with its own KV cache: every position's state there is kept for it
        self.block_exits = {i for i, e in enumerate(self.exits) if needs_context(heads.adapter(e))}
        self.draft = heads.draft_head(stack, config.draft_vocab_size)
        self.draft_ids = None if self.draft is None else self.draft.token_ids  # the draft logits' finite columns
        self.store = store if config.ngram_tier else None
        self.costs = costs  # when set, chunks and head rows are padded to the cheapest measured length
        self.policy: DraftPolicy | None = None
        if config.policy == "cost" and costs is not None:
            self.policy = DraftPolicy.for_config(costs, config, heads)

    def _kind_priors(self) -> dict[str, float]:
        prior = self.config.exit_acceptance_prior
        return {} if prior is None else {"exit": prior}

    def _probed(self, unpaid: int) -> int:
        """Of `unpaid` tokens where asking an exit did not pay, those on which it was asked anyway."""
        interval = self.config.probe_interval
        return unpaid // interval if interval > 0 else 0

    def _estimate_name(self, key: TierKey) -> str:
        """A tracker key as the statistics name it: 'exit L4', 'ngram match 3', 'exit rate L16' (exit mode)."""
        kind, index = key
        if kind == "ngram":
            return f"ngram match {index}"
        return f"exit L{self.exits[index]}" if kind == "exit" else f"exit rate L{self.exits[index]}"

    def tier_layer(self, tier: int) -> int:
        """The histogram key of a draft tier: its exit layer, or NGRAM_LAYER for the n-gram tier."""
        return self.exits[tier] if tier < len(self.exits) else NGRAM_LAYER

    # ----------------------------------------------------------------------------------------------- entry point
    @torch.no_grad()  # not inference_mode: returned tensors must stay usable with autograd
    def generate(
        self, input_ids: torch.Tensor, request: DecodeRequest, selector: TokenSelector
    ) -> tuple[torch.Tensor, GenerationStats, list[torch.Tensor], Any, list[int]]:
        """Returns sequences, stats, per-token logits (when requested), the cache and each new token's depth."""
        decoding = self.start(input_ids, request, selector)
        while not self.advance(decoding):
            pass
        return self.finish(decoding)

    @torch.no_grad()
    def start(self, input_ids: torch.Tensor, request: DecodeRequest, selector: TokenSelector) -> Decoding:
        """Prefill one sequence: the first step of a decode that `advance` continues and `finish` closes.

        Split in three so that a scheduler can interleave several decodes between steps (the server does)."""
        started = time.perf_counter()
        state = self._prefill(input_ids, request, selector)
        return Decoding(state, request, selector, started, time.perf_counter() - started)

    @torch.no_grad()
    def advance(self, decoding: Decoding) -> bool:
        """One decode step (or the final flush of waiting drafts); True once the sequence is complete."""
        state, request, selector = decoding.state, decoding.request, decoding.selector
        if decoding.done:
            return True
        if self._should_stop(state, request):
            if state.pending == 0 or not self._flush(state, request, selector):
                decoding.done = True
        else:
            self._step(state, request, selector)
        return decoding.done

    @torch.no_grad()
    def finish(self, decoding: Decoding) -> tuple[torch.Tensor, GenerationStats, list[torch.Tensor], Any, list[int]]:
        """Close a complete decode: stream the rest, trim the cache, feed the n-gram store, and return
        `generate`'s tuple."""
        state, request = decoding.state, decoding.request
        if not decoding.done:
            raise RuntimeError("finish() called before advance() reported the decode complete.")
        self._stream(state, request, len(state.tokens))
        if request.streamer is not None:
            request.streamer.end()
        _compat.trim_sliding(state.cache)  # no rollback can follow: sliding layers keep only their window
        if self.store is not None:
            self.store.add(state.tokens)
        wall = time.perf_counter() - decoding.started
        sequences = state.seq[:, : len(state.tokens)].clone()
        stats = self._stats(state, request, wall, decoding.prefill_s)
        return sequences, stats, state.logits, state.cache, state.depth

    # --------------------------------------------------------------------------------------------------- prefill
    def _prefill(self, input_ids: torch.Tensor, request: DecodeRequest, selector: TokenSelector) -> SequenceState:
        stack = self.stack
        n = input_ids.shape[1]
        seq = torch.empty((1, n + request.max_new_tokens + 1), dtype=torch.long, device=stack.device)
        seq[:, :n] = input_ids
        state = SequenceState(
            tokens=input_ids[0].tolist(),
            prompt_len=n,
            seq=seq,
            cache=stack.new_cache(),
            buffers=[None] * (len(self.exits) + 1),
            routing=self.router.new_state(),
            recent_matches=deque(maxlen=self.config.monitor_window),
            checked_by_exit=[0] * (len(self.exits) + 1),  # one slot per exit, then the n-gram tier
            agreed_by_exit=[0] * (len(self.exits) + 1),
            verifying=request.mode == "verify",
            tracker=AcceptanceTracker(prior=self.config.acceptance_prior, kind_priors=self._kind_priors()),
            blocks={i: BlockContext() for i in self.block_exits},
        )
        may_crop = self.config.ngram_tier and not self.config.ngram_unverified
        if request.mode == "verify" or may_crop or self.costs is not None:
            _compat.prepare_for_rollback(state.cache)
        positions = torch.arange(n, device=stack.device).unsqueeze(0)
        hidden = stack.embed(input_ids)
        i = 0
        while i <= len(self.exits):  # every layer, stopping only where a block adapter needs the states
            last = self._range_end(state, i, set())
            hidden = stack.run(hidden, self.starts[i], self.starts[last + 1], state.cache, positions)
            if last in state.blocks:
                state.blocks[last].push(hidden, 0, stack, self.heads.adapter(self.exits[last]))
            i = last + 1
        logits = self._head(hidden[:, -1:])[:, -1]  # (1, vocab): only the last position's prediction is needed
        state.deep_len = n
        if request.streamer is not None:
            request.streamer.put(input_ids[0].cpu())
        token = selector.choose(seq[:, :n], logits)
        self._append(state, token, int(token.item()), self.full_layer, logits, request)
        self._stream(state, request, len(state.tokens))  # the prefill's token is final in both modes
        return state

    # ------------------------------------------------------------------------------------------------ one step
    def _step(self, state: SequenceState, request: DecodeRequest, selector: TokenSelector) -> None:
        """Feed the last token; it leaves at an exit or runs the full depth (filling the waiting KV on the way)."""
        if self.policy is not None and request.mode == "verify":
            self._planned_step(state, request, selector)
            return
        stack, router = self.stack, self.router
        q = len(state.tokens) - 1
        forced = router.forced_deep(state.routing, state.pending)
        if not forced and self.config.ngram_tier and self._propose_ngram(state, request):
            return
        if forced:
            state.forced += 1
            router.end_block(state.routing)
        target = None if forced else router.block_target(state.routing)

        hidden: torch.Tensor | None = stack.embed(state.seq[:, q : q + 1], q)  # (1, 1, hidden)
        chunk_start = q
        for i in range(len(self.exits) + 1):
            hidden, chunk_start = self._fill_segment(state, i, hidden, chunk_start, q + 1)
            if i < len(self.exits) and not forced and target in (None, i) and self._asks(state, i, target):
                exited = self._try_exit(state, i, self.exits[i], hidden, q, target, request, selector)
                if target is None:  # a block's later tokens follow its first one: nothing was decided here
                    state.tracker.observe(("ask", i), exited)
                if exited:
                    return

        if target is None and not forced:
            router.start_block(state.routing, FULL_DEPTH)
        self._finish_deep(state, hidden, chunk_start, True, request, selector)

    def _asks(self, state: SequenceState, i: int, target: int | None) -> bool:
        """Exit mode: whether to ask exit `i` about this token. Under the cost policy only while asking pays
        (`DraftPolicy.worth_consulting`, at the exit's estimated exit rate); a skipped exit is asked anyway every
        `probe_interval` tokens, so that its estimate follows the text. A block's target is always asked, and
        with blocks of several tokens (`block_size` > 1) every exit is: one decision there moves a whole block,
        which the per-token saving does not price."""
        if self.policy is None or target is not None or self.config.block_size > 1:
            return True
        if self.policy.worth_consulting(i, state.tracker.estimate(("ask", i))):
            return True
        state.unpaid_asks[i] = state.unpaid_asks.get(i, 0) + 1
        interval = self.config.probe_interval
        return interval > 0 and state.unpaid_asks[i] % interval == 0

    def _fill_segment(
        self,
        state: SequenceState,
        i: int,
        hidden: torch.Tensor | None,
        chunk_start: int,
        end: int,
        last: int | None = None,
    ) -> tuple[torch.Tensor | None, int]:
        """Run segment `i` (through segment `last`, when given) over the chunk, after the positions waiting in front
        of it: the layer-wise KV fill.

        `hidden` covers positions chunk_start..end-1 (or is None when nothing arrives from below); the waiting
        positions come just before them. Segments after `i` must have nothing waiting. Returns the output of the
        last segment run and the chunk's new first position.
        """
        last = i if last is None else last
        waiting = state.buffers[i]
        if waiting is not None:
            chunk_start -= waiting.shape[1]
            hidden = waiting if hidden is None else torch.cat([waiting, hidden], dim=1)  # (1, m, hidden)
            state.buffers[i] = None
        if hidden is None:
            return None, chunk_start
        positions = torch.arange(chunk_start, end, device=self.stack.device).unsqueeze(0)
        pad_to = self.costs.layer_pad(hidden.shape[1]) if self.costs is not None else 0
        out = self.stack.run(hidden, self.starts[i], self.starts[last + 1], state.cache, positions, pad_to)
        if last in state.blocks:  # the block adapter at this exit sees every position once, in order
            state.blocks[last].push(out, chunk_start, self.stack, self.heads.adapter(self.exits[last]))
        return out, chunk_start

    def _range_end(self, state: SequenceState, i: int, stops: set[int]) -> int:
        """The last segment one layer range starting at segment `i` may cover: it ends at an exit in `stops`, at
        a block adapter's exit (the block needs every position's state there) and before waiting positions."""
        last = i
        while last < len(self.exits) and last not in stops and last not in state.blocks:
            if state.buffers[last + 1] is not None:
                break
            last += 1
        return last

    def _planned_step(self, state: SequenceState, request: DecodeRequest, selector: TokenSelector) -> None:
        """Verify mode under the cost policy: one step of the current draft cycle (see `policy.py`).

        A cycle starts with a plan: draft from the n-gram tier, draft from one exit (only that exit's draft head
        runs, until the plan's length or the first unconfident token), or decode plainly (every layer, no head, no
        gate). Then the token that goes deep verifies the cycle's drafts in one pass.
        """
        q = len(state.tokens) - 1
        if state.plan is None:
            state.plan = self._choose_plan(state, request)
            name = state.plan.kind if state.plan.kind != "exit" else f"exit L{self.exits[state.plan.tier]}"
            state.plan_counts[name] = state.plan_counts.get(name, 0) + 1
        plan = state.plan
        if plan.kind == "ngram" and state.cycle_drafts == 0:
            state.cycle_drafts = self._append_ngram(state, request, list(plan.proposal), plan.key)
            return
        probe_every = self.config.probe_interval
        probe = plan.kind == "plain" and probe_every > 0 and state.plain_steps % probe_every == 0
        drafting = plan.kind == "exit" and state.cycle_drafts < plan.max_draft
        # The exits this step must stop at; between them, segments with nothing waiting run as one layer range
        # (one mask and rotary table instead of one per segment).
        stops = set(range(len(self.exits))) if probe else ({plan.tier} if drafting else set())
        shadows: list[tuple[int, torch.Tensor]] = []
        hidden: torch.Tensor | None = self.stack.embed(state.seq[:, q : q + 1], q)  # (1, 1, hidden)
        chunk_start = q
        i = 0
        while i <= len(self.exits):
            last = self._range_end(state, i, stops)
            hidden, chunk_start = self._fill_segment(state, i, hidden, chunk_start, q + 1, last)
            i = last + 1
            if last == len(self.exits):
                break
            if drafting and last == plan.tier:
                if self._try_exit(state, last, self.exits[last], hidden, q, None, request, selector):
                    state.cycle_drafts += 1
                    return
                state.tracker.observe(plan.key, False)  # the chain stopped: this position yielded no draft
            elif probe:
                shadows.append((last, hidden[:, -1]))
        if plan.kind == "plain":
            state.plain_steps += 1
        state.plan, state.cycle_drafts = None, 0
        self._finish_deep(state, hidden, chunk_start, True, request, selector)
        deep_token = state.tokens[-1]
        if state.shadow_ngram is not None:
            key, predicted = state.shadow_ngram
            state.tracker.observe(key, predicted == deep_token)
            state.shadow_ngram = None
        if shadows:
            self._probe_exits(state, shadows, deep_token)

    def _choose_plan(self, state: SequenceState, request: DecodeRequest) -> Plan:
        cfg = self.config
        budget = self._draft_budget(state, request)
        proposal, match_len = self._ngram_proposal(state, min(cfg.ngram_draft, budget)) if budget > 0 else ([], 0)
        assert self.policy is not None
        plan = self.policy.plan(state.tracker, budget, proposal, match_len)
        if proposal and plan.kind == "plain":  # score the unused proposal against the token the step will choose
            state.shadow_ngram = (("ngram", match_len), proposal[0])
        return plan

    def _draft_budget(self, state: SequenceState, request: DecodeRequest) -> int:
        """How many more tokens may be drafted now: the window rule's room and the tokens still to generate."""
        return min(self.config.max_pending - state.pending, request.max_new_tokens - state.new_tokens)

    def _probe_exits(self, state: SequenceState, shadows: list[tuple[int, torch.Tensor]], deep_token: int) -> None:
        """Shadow tokens: would each exit have drafted `deep_token` from the hidden state this step computed?"""
        t0 = time.perf_counter()
        state.probes += 1
        probed, signals = [], []
        for i, last in shadows:
            if i in state.blocks and state.blocks[i].end != len(state.tokens) - 1:
                continue  # the probed position was rolled back: nothing to ask the block about
            layer = self.exits[i]
            logits = self._draft_logits(state, i, last)  # (1, vocab)
            gate = self.heads.gate(layer) if self.config.use_gate else None
            learned = self._gate(state, i, gate, last, logits) if uses_head(gate) else None
            flag, _ = self.router.head_signal(logits[0], state.routing.threshold_shift, learned, self.draft_ids)
            if gate is not None and learned is None:
                flag = flag & self.router.gate_allows(self._gate(state, i, gate, last))[0]
            probed.append(i)
            signals.append(flag & (logits[0].argmax() == deep_token))
        if signals:
            for i, ok in zip(probed, torch.stack(signals).tolist()):  # one host sync for every exit
                state.tracker.observe(("exit", i), bool(ok))
        state.routing_s += time.perf_counter() - t0

    def _ngram_proposal(self, state: SequenceState, budget: int) -> tuple[list[int], int]:
        """What the n-gram tier proposes: the longer match of this context and the router's earlier sequences (on
        a tie, the longer proposal; then the context)."""
        if budget <= 0:
            return [], 0
        found = ngram_match(state.tokens, self.config.ngram_size, budget, self.config.ngram_min_size)
        state.context_ngram = (len(state.tokens), found[0][0] if found[0] else -1)  # gates read this scan's answer
        return prefer_stored(found, self.store, state.tokens, budget)

    def _propose_ngram(self, state: SequenceState, request: DecodeRequest) -> bool:
        """Zero-layer tier: if the last tokens occurred before, emit what followed them there as drafts.

        In exit mode the drafts are verified like verify mode's (unless `ngram_unverified`), also while exited
        tokens wait: the next deep pass fills those (final, only checked) and verifies the drafts after them in
        one pass, so exits do not crowd out the tier.
        """
        cfg = self.config
        budget = min(cfg.ngram_draft, self._draft_budget(state, request))
        proposal, match_len = self._ngram_proposal(state, budget)
        if not proposal:
            return False
        verified = request.mode == "verify" or not cfg.ngram_unverified
        if verified and not state.verifying:  # exit mode: the tokens waiting now stay final; verify what follows
            state.verify_from = len(state.tokens) - 1
        state.verifying = verified
        self._append_ngram(state, request, proposal, ("ngram", match_len))
        return True

    def _append_ngram(self, state: SequenceState, request: DecodeRequest, proposal: list[int], key: TierKey) -> int:
        """Emit `proposal` as n-gram drafts; their positions wait in front of segment 0 (`buffers[0]`, as
        embeddings) and are filled with the next token, like any exited token. Returns how many were emitted."""
        q = len(state.tokens) - 1
        tier = len(self.exits)  # the n-gram tier's index after the exits
        vocab = self.stack.vocab_size
        appended = 0
        for k, token_id in enumerate(proposal):
            state.draft_exit[q + k] = tier
            state.draft_key[q + k] = key
            point_mass = torch.full((1, vocab), float("-inf"), device=self.stack.device)
            point_mass[0, token_id] = 0.0  # the tier's "logits": all mass on the copied token
            if state.verifying:
                state.draft_probs[q + k] = point_mass[0].exp()
            token = torch.tensor([token_id], device=self.stack.device)
            self._append(state, token, token_id, NGRAM_LAYER, point_mass, request)
            appended += 1
            # Every stop rule sees every token, as in plain decoding: a draft ends at the first token that stops
            # generation (verify mode then verifies it before stopping; a rejection resumes decoding).
            if self._should_stop(state, request):
                break
        embedded = self.stack.embed(state.seq[:, q : q + appended], q)  # (1, m, hidden): positions q..q+m-1
        waiting = state.buffers[0]
        state.buffers[0] = embedded if waiting is None else torch.cat([waiting, embedded], dim=1)
        return appended

    def _try_exit(
        self,
        state: SequenceState,
        i: int,
        layer: int,
        hidden: torch.Tensor,
        q: int,
        target: int | None,
        request: DecodeRequest,
        selector: TokenSelector,
    ) -> bool:
        """Ask exit `i` about position `q`; on exit, emit its token and park the chunk in `buffers[i + 1]`."""
        router = self.router
        last = hidden[:, -1]  # (1, hidden): the current token at this exit
        gate = self.heads.gate(layer) if self.config.use_gate else None
        if target is None and gate is not None and not uses_head(gate):
            t0 = time.perf_counter()
            allowed = bool(router.gate_allows(self._gate(state, i, gate, last)).item())
            state.routing_s += time.perf_counter() - t0
            if not allowed:
                return False
        logits = self._draft_logits(state, i, last)  # (1, vocab)
        # Greedy: choose before deciding, so that one host sync fetches the flag, confidence and token together.
        # Sampling: draw only once the token exits, so the generator serves emitted tokens alone (never-exit
        # sampling then draws exactly what HF sampling draws from the same seed).
        token = None if selector.params.do_sample else selector.choose(state.seq[:, : q + 1], logits)
        chosen: list[float] = []  # the token id, when the decision's sync fetched it
        if target is None:
            t0 = time.perf_counter()
            learned = self._gate(state, i, gate, last, logits) if uses_head(gate) else None
            shift = state.routing.threshold_shift
            exit_flag, confidence = router.head_signal(logits[0], shift, learned, self.draft_ids)
            signals = [exit_flag.double(), confidence.double()]
            flag, conf, *chosen = torch.stack(
                signals + ([] if token is None else [token.reshape(()).double()])
            ).tolist()
            state.routing_s += time.perf_counter() - t0
            if not flag:
                return False
            router.start_block(state.routing, i)
            router.record_exit(state.routing, conf)
        if token is None:
            token = selector.choose(state.seq[:, : q + 1], logits)
        token_id = int(chosen[0]) if chosen else int(token.item())
        waiting = state.buffers[i + 1]
        state.buffers[i + 1] = hidden if waiting is None else torch.cat([waiting, hidden], dim=1)
        state.draft_exit[q] = i
        if state.verifying and selector.params.do_sample:
            state.draft_probs[q] = torch.softmax(selector.scores(state.seq[:, : q + 1], logits), dim=-1)[0]
        self._append(state, token, int(token_id), layer, logits, request)
        return True

    def _gate(
        self,
        state: SequenceState,
        i: int,
        gate: torch.nn.Module,
        last: torch.Tensor,
        logits: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Exit `i`'s gate probability (1,) for the current position: its hidden state `last` and, for a gate that
        weighs them, the context features (`heads.GATE_CONTEXT`) as training replayed them and (a head gate) the
        head's `logits`."""
        context, proposed = None, None
        if getattr(gate, "uses_context", False) or uses_head(gate):
            cfg = self.config
            length, token = state.context_ngram
            if length != len(state.tokens):  # one O(context) scan per position, whichever exits ask
                found = ngram_match(state.tokens, cfg.ngram_size, 1, cfg.ngram_min_size)[0]
                token = found[0] if found else -1
                state.context_ngram = (len(state.tokens), token)
            acceptance = state.tracker.estimate(("exit", i))
            context = torch.tensor([[float(token >= 0), acceptance]], device=last.device)
            proposed = torch.tensor([token], device=last.device)
        return gate_probability(gate, last, context, logits, proposed, self.draft)

    def _draft_logits(self, state: SequenceState, i: int, last: torch.Tensor) -> torch.Tensor:
        """Exit `i`'s draft logits (1, vocab) for the current position, whose exit state is `last` (1, hidden).

        A block adapter first runs over its queued positions (the current one is the last of them)."""
        adapter = self.heads.adapter(self.exits[i])
        if i in state.blocks:
            out = state.blocks[i].run(self.stack, adapter)  # the current position is always the last queued
            assert out is not None
            last, adapter = out[:, -1], getattr(adapter, "post", None)  # the block ran: only its post-norm map is left
        return draft_logits(self.stack, adapter, self.draft, last)

    # --------------------------------------------------------------------------------------------- deep passes
    def _flush(self, state: SequenceState, request: DecodeRequest, selector: TokenSelector) -> bool:
        """Run every waiting position through the rest of the model, with no new token. Returns `rejected`."""
        end = len(state.tokens) - 1  # fed positions are 0..end-1; the waiting ones end the range
        chunk_start = end
        hidden: torch.Tensor | None = None
        for i in range(len(self.exits) + 1):
            hidden, chunk_start = self._fill_segment(state, i, hidden, chunk_start, end)
        assert hidden is not None and chunk_start == state.deep_len
        state.plan, state.cycle_drafts = None, 0
        return self._finish_deep(state, hidden, chunk_start, False, request, selector)

    def _finish_deep(
        self,
        state: SequenceState,
        hidden: torch.Tensor,
        chunk_start: int,
        has_current: bool,
        request: DecodeRequest,
        selector: TokenSelector,
    ) -> bool:
        """Final-layer logits of a deep chunk: check (exit) or verify (verify) the drafts, pick the next token.

        `hidden` is (1, m, hidden) for positions chunk_start..chunk_start+m-1. Every position but the current one
        (when `has_current`) predicted an exited token. Returns True when verify mode rejected a draft.
        """
        m = hidden.shape[1]
        n_drafts = m - 1 if has_current else m
        state.deep_passes += 1
        state.fill_positions += m
        state.deep_len = chunk_start + m
        drafts = state.seq[0, chunk_start + 1 : chunk_start + 1 + n_drafts]  # (n_drafts,) exited tokens
        # Exit mode: the drafts before `verify_from` exited and are final (a sample of them is checked); an n-gram
        # cycle's drafts after them are verified. Verify mode verifies every draft.
        final = min(n_drafts, max(0, state.verify_from - chunk_start)) if state.verifying else n_drafts
        checked = self._sample_checks(state, final)  # offsets into the chunk's drafts
        # One head call over the checked rows, then the verified rows or the current token's row.
        tail = list(range(final, m)) if state.verifying else ([m - 1] if has_current else [])
        if state.verifying and not checked:
            selected = hidden[:, final:]  # contiguous: no copy
        else:
            index = torch.tensor(checked + tail, dtype=torch.long, device=hidden.device)
            selected = hidden.index_select(1, index)  # (1, checked + tail rows, hidden)
        logits = self._head(selected)[0] if selected.shape[1] else None  # (rows, vocab); None: nothing to check
        matches = (logits[: len(checked)].argmax(dim=-1) == drafts[checked]).long() if checked else None
        if state.verifying:
            if matches is not None:
                self._count_agreement(state, chunk_start, matches.tolist(), checked)
            return self._verify(
                state, logits[len(checked) :], chunk_start + final, drafts[final:], has_current, request, selector
            )
        _compat.trim_sliding(state.cache)
        if has_current:
            row = logits[-1:]
            token = selector.choose(state.seq[:, : chunk_start + m], row)
            # one host sync for the verdicts and the token
            *matched, token_id = (
                token.reshape(1) if matches is None else torch.cat([matches, token.reshape(1)])
            ).tolist()
            self._count_agreement(state, chunk_start, matched, checked)
            self._append(state, token, token_id, self.full_layer, row, request)
        elif matches is not None:
            self._count_agreement(state, chunk_start, matches.tolist(), checked)
        state.draft_exit.clear()
        state.draft_key.clear()
        return False

    def _sample_checks(self, state: SequenceState, n_drafts: int) -> list[int]:
        """Which of a chunk's exited tokens exit mode checks: every one at `check_fraction` 1, none at 0, else an
        evenly spread share (deterministic, so runs repeat)."""
        fraction = self.config.check_fraction if self.config.check_agreement else 0.0
        picked = []
        for offset in range(n_drafts):
            before = int(state.exited_seen * fraction)
            state.exited_seen += 1
            if int(state.exited_seen * fraction) > before:
                picked.append(offset)
        return picked

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final-layer logits of a deep chunk, its rows padded to the cheapest measured count.

        Non-finite logits (an fp16 overflow, typically) would otherwise be argmaxed into garbage silently."""
        pad_to = self.costs.head_pad(hidden.shape[1]) if self.costs is not None else 0
        logits = self.stack.logits(hidden, pad_to)
        if not bool(torch.isfinite(logits).all()):
            raise FloatingPointError(
                f"The model produced NaN or infinite logits ({self.stack.dtype}); in float16 this is usually an "
                "overflow in the hidden states: load the model in bfloat16 or float32."
            )
        return logits

    def _verify(
        self,
        state: SequenceState,
        logits: torch.Tensor,
        chunk_start: int,
        drafts: torch.Tensor,
        has_current: bool,
        request: DecodeRequest,
        selector: TokenSelector,
    ) -> bool:
        """Accept the longest prefix of drafts the full model agrees with; at the first mismatch, emit its token.

        Greedy: a draft is accepted when it equals the deep argmax (after logits processors). Sampling: the
        speculative-sampling rule (accept x with prob min(1, p(x)/q(x)), else resample from max(0, p - q)), so the
        output distribution is the full model's.
        """
        m = logits.shape[0]
        # (m, vocab): the scores each position's next token is chosen from (processors see the right prefix)
        scores = torch.cat([selector.scores(state.seq[:, : chunk_start + j + 1], logits[j : j + 1]) for j in range(m)])
        n_drafts = drafts.shape[0]
        if not selector.params.do_sample:
            deep_tokens = scores.argmax(dim=-1)  # (m,)
            ok = (deep_tokens[:n_drafts] == drafts).tolist()  # one host sync for the whole chunk
        else:
            p = torch.softmax(scores, dim=-1)  # (m, vocab) full-model distributions
            if n_drafts:
                q = torch.stack([state.draft_probs[chunk_start + j] for j in range(n_drafts)])  # (n_drafts, vocab)
                u = torch.rand(n_drafts, device=p.device, generator=selector.generator)
                p_x = p[:n_drafts].gather(1, drafts[:, None])[:, 0]
                q_x = q.gather(1, drafts[:, None])[:, 0]
                ok = (u * q_x <= p_x).tolist()  # accept x with probability min(1, p(x) / q(x))
            else:
                ok = []
        accepted = next((j for j, good in enumerate(ok) if not good), n_drafts)
        self._count_agreement(state, chunk_start, ok[: accepted + 1])
        if n_drafts:
            state.verify_passes += 1
            state.accepted += accepted
        if request.output_logits:
            for j in range(accepted):
                state.logits[chunk_start + j + 1 - state.prompt_len] = logits[j : j + 1].float().clone()

        rejected = accepted < n_drafts
        if rejected:
            keep = chunk_start + accepted + 1  # positions 0..keep-1 stay; the replacement is token `keep`
            if not selector.params.do_sample:
                token = deep_tokens[accepted]
            else:
                residual = (p[accepted] - q[accepted]).clamp_min(0)  # resample from max(0, p - q), normalised
                residual = torch.where(residual.sum() > 0, residual, p[accepted])  # p == q up to rounding
                token = torch.multinomial(residual, 1, generator=selector.generator)
            self._rollback(state, keep)
            state.rejected += 1
            self.router.end_block(state.routing)
            row = logits[accepted : accepted + 1]
            self._append(state, token, int(token.item()), self.full_layer, row, request)
        elif has_current:
            row = logits[-1:]
            if not selector.params.do_sample:
                token = deep_tokens[-1]
            else:
                token = torch.multinomial(p[-1], 1, generator=selector.generator)
            self._append(state, token, int(token.item()), self.full_layer, row, request)
        state.draft_exit.clear()
        state.draft_probs.clear()
        state.draft_key.clear()
        _compat.trim_sliding(state.cache)
        state.verifying, state.verify_from = request.mode == "verify", 0  # exit mode: the n-gram cycle is over
        self._stream(state, request, self._verified_frontier(state, request))
        return rejected

    def _rollback(self, state: SequenceState, keep: int) -> None:
        """Drop every position from `keep` on: tokens, per-token records and every layer's cache."""
        for layer_idx in range(self.stack.num_layers):
            _compat.crop_cache_layer(state.cache, layer_idx, keep)
        for block in state.blocks.values():
            block.rollback(keep)
        del state.tokens[keep:]
        state.context_ngram = (-1, -1)  # the context may regrow to the same length with other tokens
        new_keep = keep - state.prompt_len
        del state.depth[new_keep:]
        del state.logits[new_keep:]
        state.deep_len = keep
        state.buffers = [None] * (len(self.exits) + 1)

    def _count_agreement(
        self, state: SequenceState, first_pos: int, matches: list[bool], offsets: list[int] | None = None
    ) -> None:
        """Book the deep pass's verdict on exited tokens (at `offsets` from `first_pos`, default 0, 1, ...):
        per-exit counts, acceptance estimates and the rolling monitor."""
        for offset, ok in zip(offsets if offsets is not None else range(len(matches)), matches):
            i = state.draft_exit[first_pos + offset]
            state.tracker.observe(state.draft_key.get(first_pos + offset, ("exit", i)), bool(ok))
            state.checked_by_exit[i] += 1
            state.agreed_by_exit[i] += int(ok)
            state.recent_matches.append(bool(ok))
        window = self.config.monitor_window
        if matches and state.recent_matches:
            # the controller acts on whatever history there is; the monitor waits for a full window
            self.router.adjust(state.routing, sum(state.recent_matches) / len(state.recent_matches))
        if len(state.recent_matches) < window:
            return
        rolling = sum(state.recent_matches) / window
        state.min_rolling_agreement = min(state.min_rolling_agreement, rolling)
        bound = self.config.monitor_min_agreement
        if rolling < bound and not state.monitor_warned:
            state.monitor_warned = True
            logger.warning(
                "early-exit monitor: agreement of the last %d exited tokens with the full model is %.2f, below %.2f. "
                "The router is too aggressive for this text: raise the thresholds or use mode='verify'.",
                window,
                rolling,
                bound,
            )

    # ---------------------------------------------------------------------------------------- emission, stop
    def _append(
        self,
        state: SequenceState,
        token: torch.Tensor,
        token_id: int,
        layer: int,
        logits: torch.Tensor,
        request: DecodeRequest,
    ) -> None:
        idx = len(state.tokens)
        state.seq[:, idx] = token.reshape(-1)[0]
        state.tokens.append(token_id)
        state.depth.append(layer)
        if request.output_logits:
            state.logits.append(logits.detach().float().reshape(1, -1).clone())
        if not state.verifying:
            self._stream(state, request, len(state.tokens))

    def _verified_frontier(self, state: SequenceState, request: DecodeRequest) -> int:
        """How many tokens are final: all of them, unless drafts await verification (then up to the last deep
        prediction)."""
        return state.deep_len + 1 if state.verifying else len(state.tokens)

    def _stream(self, state: SequenceState, request: DecodeRequest, upto: int) -> None:
        if request.streamer is None:
            return
        start = max(state.prompt_len, state.streamed)
        upto = min(upto, len(state.tokens))
        if upto > start:
            request.streamer.put(torch.tensor(state.tokens[start:upto]))
        state.streamed = max(state.streamed, upto)

    def _should_stop(self, state: SequenceState, request: DecodeRequest) -> bool:
        if state.new_tokens >= request.max_new_tokens:
            return True
        if state.tokens[-1] in request.eos_token_ids:
            return True
        if request.stop_strings:
            tail = request.tokenizer.decode(state.tokens[max(state.prompt_len, len(state.tokens) - 32) :])
            if any(s in tail for s in request.stop_strings):
                return True
        if request.stopping_criteria is not None:
            scores = state.logits[-1] if state.logits else None
            done = request.stopping_criteria(state.seq[:, : len(state.tokens)], scores)
            if bool(torch.as_tensor(done).any()):
                return True
        return False

    # ------------------------------------------------------------------------------------------------- stats
    def _stats(self, state: SequenceState, request: DecodeRequest, wall: float, prefill_s: float) -> GenerationStats:
        histogram: dict[int, int] = {}
        for layer in state.depth:
            histogram[layer] = histogram.get(layer, 0) + 1
        new = state.new_tokens
        exited = sum(c for layer, c in histogram.items() if layer != self.full_layer)
        checked = sum(state.checked_by_exit)
        decode_s = wall - prefill_s
        return GenerationStats(
            new_tokens=new,
            exit_histogram=dict(sorted(histogram.items())),
            hit_rate=exited / new if new else 0.0,
            agreement=sum(state.agreed_by_exit) / checked if checked else None,
            agreement_by_layer={
                self.tier_layer(i): state.agreed_by_exit[i] / c for i, c in enumerate(state.checked_by_exit) if c
            },
            exited_checked=checked,
            deep_passes=state.deep_passes,
            mean_fill_chunk=state.fill_positions / state.deep_passes if state.deep_passes else 0.0,
            forced_deep=state.forced,
            rejected_drafts=state.rejected,
            mean_accepted_length=state.accepted / state.verify_passes if state.verify_passes else 0.0,
            min_rolling_agreement=state.min_rolling_agreement if checked >= self.config.monitor_window else None,
            monitor_warned=state.monitor_warned,
            threshold_shift=state.routing.threshold_shift,
            wall_time_s=wall,
            prefill_s=prefill_s,
            tokens_per_s=new / wall if wall > 0 else 0.0,
            decode_tokens_per_s=(new - 1) / decode_s if decode_s > 0 and new > 1 else 0.0,
            routing_overhead=state.routing_s / wall if wall > 0 else 0.0,
            routing_s=state.routing_s,
            plain_share=state.plain_steps / new if new else 0.0,
            policy_cycles=dict(sorted(state.plan_counts.items())),
            probes=state.probes,
            acceptance={self._estimate_name(k): round(a, 4) for k, a in sorted(state.tracker.estimates.items())},
            asks_skipped={self.exits[i]: n - self._probed(n) for i, n in sorted(state.unpaid_asks.items())},
            mode=request.mode,
            num_layers=self.stack.num_layers,
        )

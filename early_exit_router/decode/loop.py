"""The decode loop: early exit with layer-wise KV filling, for one sequence or a batch, in `exit` (lossy) or
`verify` (lossless) mode.

One step feeds each row's newest token: plan, draft, deep pass, verify or check, append.

- **plan**: the window rule may force the deep layers (`ExitRule.forced_deep`). Verify mode under the cost policy
  plans whole cycles (`DraftPolicy.plan`: draft from the n-gram tier, from one exit, or decode plainly); every other
  decode asks the exits in turn each step (the threshold cascade; exit mode asks an exit only while that pays), after
  the n-gram tier, whose proposal it takes whenever there is one.
- **draft**: an n-gram proposal is appended at once (its embeddings wait in front of segment 0); an exit that fires
  emits its head's token and parks the chunk's states in front of the next segment (`segments.py`).
- **deep pass**: a token that goes deep carries every waiting slot with it through the rest of the model: the
  layer-wise KV fill. Its final-layer logits are the full model's prediction at every waiting slot.
- **verify or check**: drafts in a verify cycle are accepted up to the first the full model rejects (`verify.py`),
  and every layer's cache is cut back after the last kept slot; exited tokens outside a cycle are final (exit mode),
  and a `check_fraction` share of them is compared with the full model (agreement, the monitor, the controller).
- **append**: the full model's next token follows, and every appended token is checked against the stop rules.

A batch is several rows in the same slots (`batch.py`). Exits are batch-synchronous: a step leaves at an exit only
when every unfinished row may. Synchronous batches keep one accepted length for every row; the per-row design
(verify mode) drafts each row's own n-gram proposal and keeps each row's own accepted prefix, with holes.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from early_exit_router.config import MODES, RouterConfig
from early_exit_router.decode import batch as batching
from early_exit_router.decode.adapted_draft import AdaptedDrafter
from early_exit_router.decode.batch import Slots
from early_exit_router.decode.deep import deep_pass, flush, head
from early_exit_router.decode.drafters import ExitDrafter, SuffixDrafter
from early_exit_router.decode.drafting import (
    append_ngram,
    ask_in_chain,
    draft_budget,
    draft_chain,
    draft_ngram,
    judge_refusals,
    probe_exits,
    propose_rows,
    try_exit,
    worth_asking,
)
from early_exit_router.decode.emit import append, choose, embed, settle
from early_exit_router.decode.inputs import check_one_sequence, check_prefill
from early_exit_router.decode.noise import noise_sources, settle_generators
from early_exit_router.decode.sampling import TokenSelector
from early_exit_router.decode.segments import LayerwiseFill
from early_exit_router.decode.state import DecodeState, Row, VerifyCycle
from early_exit_router.decode.stats import (
    AgreementMonitor,
    GenerationStats,
    PassCounters,
    RowCounters,
    compiled_seconds,
    decode_stats,
)
from early_exit_router.decode.stopping import DecodeRequest, StreamFrontier
from early_exit_router.decode.tree import exit_tree_supported, tree_supported, verify_exit_tree, verify_tree
from early_exit_router.heads.adapters import needs_context
from early_exit_router.heads.block import BlockContext
from early_exit_router.heads.draft_path import DraftPath
from early_exit_router.heads.exit_heads import ExitHeads
from early_exit_router.models import _compat
from early_exit_router.models.architecture import LayerStack
from early_exit_router.models.compiled import compile_unsupported, say_eager
from early_exit_router.routing.costs import CostModel
from early_exit_router.routing.exit_rule import FULL_DEPTH, ExitRule
from early_exit_router.routing.ngram import SuffixStore
from early_exit_router.routing.policy import AcceptanceTracker, DraftPolicy, Plan, ProbeSchedule, without_idle_blocks

BATCH_DESIGNS = ("synchronous", "per_row")

SLOTS_AHEAD = 1024  # new-token slots made at prefill ("until EOS" callers pass huge max_new_tokens); more grow


class Decoder(DecodeState):
    """One decode in flight: `prefill` (or `join`) rows, `step` until `finished`, then `finish`; each row's `output()`
    and `stats(row)` are there all along.

    A single sequence is a batch of one. Built by `EarlyExitRouter.decoder()`; `batch_design` only matters once
    several rows share it."""

    def __init__(
        self,
        stack: LayerStack,
        heads: ExitHeads,
        rule: ExitRule,
        config: RouterConfig,
        mode: str,
        *,
        costs: CostModel | None = None,
        store: SuffixStore | None = None,
        batch_design: str = "synchronous",
        pad_token_id: int = 0,
        draft_path: DraftPath | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"Unknown mode {mode!r}: use one of {', '.join(MODES)}.")
        if batch_design not in BATCH_DESIGNS:
            raise ValueError(f"Unknown batch_design {batch_design!r}: use one of {', '.join(BATCH_DESIGNS)}.")
        if batch_design == "per_row" and mode != "verify":
            raise ValueError("The per-row batch design is verify mode's: exit-mode batches run batch-synchronously.")
        # A table that looks wrong (measured while other work held the CPU, say) is not drafted from: plain decoding.
        found = costs.problems() if config.policy == "cost" and costs is not None else []
        self.fallback = f"the cost model looks wrong ({'; '.join(found)})" if found else None
        policy = config.policy == "cost" and costs is not None and not found
        left_out = without_idle_blocks(config, heads, costs) if policy and mode == "verify" else (config, [])
        config, self.exits_left_out = left_out  # verify mode: block exits whose drafts cannot pay from the start
        self.stack, self.heads, self.rule, self.config, self.mode = stack, heads, rule, config, mode
        self.costs, self.per_row, self.pad_token_id = costs, batch_design == "per_row", pad_token_id
        self.exits = config.consulted_exit_layers()
        self.full_layer = stack.num_layers - 1
        self.block_exits = [i for i, e in enumerate(self.exits) if needs_context(heads.adapter(e))]
        self.policy = DraftPolicy.for_config(costs, config, heads) if policy else None
        self.suffix = SuffixDrafter(config, store if config.ngram_tier else None)
        self.exit_drafter = ExitDrafter(stack, heads, config, self.exits)
        self.draft_path = draft_path  # verify mode drafts from it alone (one sequence): `drafting.draft_chain`
        self.adapted = AdaptedDrafter.for_decoder(self, draft_path)
        exit_prior = config.exit_acceptance_prior  # an exit's drafts, their alternatives, its gate, its top-1
        kinds = ("exit", "exit branch", "fire", "agree")
        prior = {} if exit_prior is None else dict.fromkeys(kinds, exit_prior)
        self.tracker = AcceptanceTracker(prior=config.acceptance_prior, kind_priors=prior)
        self.probe_schedule = ProbeSchedule(config.probe_interval)
        self.monitor = AgreementMonitor(config.monitor_window, config.monitor_min_agreement)
        self.reset()

    def reset(self) -> None:
        """Forget every row (the last one left): the next `join` prefills a new batch; acceptance estimates are kept,
        the exit rule's memory (the controller's shift, a suspension of exits) and the batch's tallies start afresh."""
        self.routing, self.passes = self.rule.new_state(), PassCounters()
        self.rows: list[Row] = []
        self.slots: Slots | None = None
        self.fill: LayerwiseFill | None = None
        self.cycle: VerifyCycle | None = None
        self.plan: Plan | None = None
        self.cycle_drafts, self.survival = 0, 1.0
        self.refusals = []
        self.chained = False  # an adapted chain waits for its verifying pass
        if self.adapted is not None:
            self.adapted.reset()

    # ------------------------------------------------------------------------------------------ rows in and out
    @property
    def pending(self) -> int:
        """Fed slots the deep layers have not seen (the same for every row)."""
        return self.slots.length - 1 - self.fill.deep_len if self.rows else 0

    @property
    def finished(self) -> bool:
        return all(row.done for row in self.rows) and self.pending == 0

    def can_join(self) -> bool:
        """Rows join only where nothing waits (then every layer holds the same slots), and never beside a block
        adapter's per-sequence context."""
        return self.pending == 0 and not self.block_exits

    # Decoding runs in inference mode: without autograd's version counters and view tracking every operator costs
    # less (a plain step 5-10% less here, bf16 or float32). What leaves the decoder is ordinary tensors (`finish`).
    @torch.inference_mode()
    def prefill(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        requests: list[DecodeRequest],
        selectors: list[TokenSelector],
        rows_may_join: bool = False,
    ) -> None:
        """Start from (b, n) left-padded prompts and their (b, n) attention mask, one request and selector per row
        (`rows_may_join`: later, `decode_cache`)."""
        started = time.perf_counter()
        ids, mask = check_prefill(ids, mask, len(requests), len(selectors), len(self.rows), self.stack)
        b, n = ids.shape
        if b > 1 and self.block_exits:
            raise ValueError("Block adapters keep a context per sequence: consult other exits in batches.")
        cfg = self.config
        cache = decode_cache(self, n, requests, rows_may_join)
        # sliding layers keep what a rollback may need (drafts, repairs, unverified copies too: see append_ngram)
        if self.mode == "verify" or cfg.holdback != 0 or cfg.ngram_tier or self.costs is not None:
            _compat.prepare_for_rollback(cache)
        blocks = {i: BlockContext() for i in self.block_exits}
        self.fill = LayerwiseFill(self.stack, self.heads, self.exits, cache, blocks, self.costs)
        capacity = n + min(max(r.max_new_tokens for r in requests), SLOTS_AHEAD) + cfg.max_pending + cfg.ngram_draft + 2
        self.slots = Slots.for_prompts(ids, mask, self.pad_token_id, capacity)
        tiers = len(self.exits) + 1 + (self.adapted is not None)  # exits, the n-gram tier, the draft path
        noises = noise_sources(selectors, ids.device)
        for k, (request, selector) in enumerate(zip(requests, selectors)):
            prompt = ids[k][mask[k].bool()].tolist()
            frontier = StreamFrontier(request, prompt)
            row = Row(request, selector, prompt, len(prompt), n, ids[k : k + 1], RowCounters.for_tiers(tiers),
                      frontier, started=started, noise=noises[k][0], noise_row=noises[k][1],
                      compiling_from=compiled_seconds(self.stack))  # fmt: skip
            self.rows.append(row)
        positions = self.slots.positions(0, n)
        hidden = self.fill.prefill(self.stack.embed(ids, positions=positions), positions, self.slots.attention_mask(n))
        logits = head(self, hidden[:, -1:])[:, -1]  # (b, vocab): only the last position's prediction is needed
        tokens = choose(self, n, logits)
        append(self, tokens, tokens.tolist(), self.full_layer, logits)  # the prefill's token is final
        for row in self.rows:
            row.prefill_s = time.perf_counter() - started
        settle(self)

    @torch.inference_mode()
    def join(self, ids: torch.Tensor, request: DecodeRequest, selector: TokenSelector) -> Row:
        """Add one sequence (1, n) between steps: prefilled alone, then left-padded into the batch."""
        check_one_sequence(ids)
        if self.rows and not self.can_join():
            raise RuntimeError("Rows join only when no drafts are waiting (see can_join).")
        single = self._new_like() if self.rows else self  # a first row starts the batch
        single.prefill(ids, torch.ones_like(ids), [request], [selector], rows_may_join=True)
        if single is not self:
            batching.join(self, single)
        return self.rows[-1]

    def _new_like(self) -> Decoder:
        design = "per_row" if self.per_row else "synchronous"
        return Decoder(self.stack, self.heads, self.rule, self.config, self.mode, costs=self.costs,
                       store=self.suffix.store, batch_design=design, pad_token_id=self.pad_token_id,
                       draft_path=self.draft_path)  # fmt: skip

    @torch.inference_mode()
    def remove(self, rows: list[Row]) -> None:
        """Drop rows (finished or cancelled) between steps."""
        batching.remove(self, rows)

    # ---------------------------------------------------------------------------------------------------- steps
    @torch.inference_mode()
    def step(self) -> None:
        """One step for every row (a token each, or a draft), or, once no row drafts on, the flush of what waits."""
        if not self.rows:
            return
        started, passes, positions = time.perf_counter(), self.passes.deep_passes, self.passes.fill_positions
        if all(row.done or row.stop_at is not None for row in self.rows):
            if self.pending:
                flush(self)
                self.chained = False
        elif self.fallback is not None:
            self._plain_step()
        elif self._plans_cycles():
            self._cycle_step()
        else:
            self._cascade_step()
        judge_refusals(self)
        settle(self)
        one = self.passes.deep_passes == passes + 1 and self.passes.fill_positions == positions + 1
        if one and len(self.rows) == 1 and self.costs is not None:  # a plain step: the table's check (`stale`)
            self.costs.observe_step((time.perf_counter() - started) * 1000)

    def _plain_step(self) -> None:
        """Every layer for the current token, no head or gate at any exit, no draft."""
        q, self.passes.plain_steps = self.slots.length - 1, self.passes.plain_steps + 1
        *_, at = self.fill.walk(embed(self, q), q, q + 1, self.slots, set())
        deep_pass(self, at.hidden, at.chunk_start, has_current=True)

    def _plans_cycles(self) -> bool:
        """Verify mode plans whole draft cycles under the cost policy, and always in per-row batches; one sequence
        with an adapted draft path drafts in the cascade (its chains are not in the policy's plans yet)."""
        many = len(self.rows) > 1
        alone = self.policy is not None and self.adapted is None
        return self.mode == "verify" and ((self.per_row and many) or (alone and not many))

    def _exits_draft(self) -> bool:
        """Exits are batch-synchronous: per-row batches draft from the n-gram tier alone."""
        return len(self.rows) == 1 or not self.per_row

    def _cascade_step(self) -> None:
        """Ask the n-gram tier, then each exit in turn; the token leaves at the first that fires, else goes deep."""
        q = self.slots.length - 1
        forced = self.rule.forced_deep(self.routing, self.pending)
        chained, self.chained = self.chained, False  # an adapted chain waits: this step's token verifies it
        drafts = not forced and not chained and len(self.rows) == 1
        if drafts and ((self.config.ngram_tier and draft_ngram(self)) or (self.adapted and draft_chain(self))):
            return
        if forced:
            self.passes.forced += 1
            self.rule.end_block(self.routing)
        target = None if forced else self.rule.block_target(self.routing)
        asked = set(range(len(self.exits))) if target is None else {target}
        alone = self.adapted is not None and len(self.rows) == 1  # one sequence drafts from its draft path instead
        if forced or chained or alone or target == FULL_DEPTH or self.routing.exits_suspended:
            asked = set()
        for at in self.fill.walk(embed(self, q), q, q + 1, self.slots, asked):
            if at.exit < len(self.exits) and worth_asking(self, at.exit, target):
                exited = try_exit(self, at.exit, at.hidden, q, target)
                if target is None:  # a block's later tokens follow its first one: nothing was decided here
                    self.tracker.observe(("ask", at.exit), exited)
                if exited:
                    return
        if target is None and not forced:
            self.rule.start_block(self.routing, FULL_DEPTH)
        deep_pass(self, at.hidden, at.chunk_start, has_current=True)

    def _cycle_step(self) -> None:
        """One step of the current draft cycle (`DraftPolicy.plan`): the n-gram tier's drafts, one exit's draft (only
        that exit's head runs, until the plan's length or the first unconfident token), or a plain step (no head, no
        gate; every `probe_interval` plain steps the exits' draft heads are scored on the states it computed). The
        token that goes deep verifies the cycle's drafts in one pass."""
        q = self.slots.length - 1
        if self.plan is None:
            self.plan, self.survival = self._choose_plan(), 1.0
            name = self.plan.label(self.exits)
            self.passes.plan_counts[name] = self.passes.plan_counts.get(name, 0) + 1
        plan = self.plan
        if plan.kind == "tree":  # drafted and verified in this one step
            self.plan = None
            return verify_tree(self, plan.tree)
        if plan.kind == "ngram" and self.cycle_drafts == 0:
            self.cycle_drafts = append_ngram(self, list(plan.proposals))
            return
        step = self.passes.plain_steps
        due = self.probe_schedule.due(step, len(self.exits)) if plan.kind == "plain" and self._exits_draft() else set()
        drafting = plan.kind == "exit" and self.cycle_drafts < plan.max_draft
        stops = due or ({plan.tier} if drafting or plan.exit_tree else set())
        shadows: list[tuple[int, torch.Tensor]] = []
        for at in self.fill.walk(embed(self, q), q, q + 1, self.slots, stops):
            if at.exit == len(self.exits):
                break
            if plan.kind != "exit":
                shadows.append((at.exit, at.hidden[:, -1]))
                continue
            if drafting and ask_in_chain(self, plan, at.hidden, q):
                self.cycle_drafts += 1
                return
            if plan.exit_tree and self.cycle_drafts:  # the token that goes deep takes the alternatives with it
                self.plan, self.cycle_drafts = None, 0
                return verify_exit_tree(self, plan.tier, at.hidden)
        if plan.kind == "plain":
            self.passes.plain_steps += 1
        self.plan, self.cycle_drafts = None, 0
        deep_pass(self, at.hidden, at.chunk_start, has_current=True)
        if shadows:
            probe_exits(self, shadows)
            for i in due:  # without the cost policy nothing backs off
                self.probe_schedule.probed(i, step, self.policy is None or self.policy.draft_pays(i, self.tracker))

    def _choose_plan(self) -> Plan:
        """This cycle's plan, from each row's n-gram proposal and the policy (without one: every proposal in full)."""
        budgets = [draft_budget(self, row) for row in self.rows]
        trees = self.policy is not None and tree_supported(self)
        proposals, tree = propose_rows(self, budgets, trees)
        if self.policy is not None:
            branching = [i for i in range(len(self.exits)) if trees and exit_tree_supported(self, i)]
            plan = self.policy.plan(self.tracker, max(budgets), proposals, exits=self._exits_draft(), tree=tree,
                                    branching=branching)  # fmt: skip
        else:
            longest = max((len(p.tokens) for p in proposals if p is not None), default=0)
            plan = Plan("ngram", longest, proposals=tuple(proposals)) if longest else Plan("plain")
        for row, proposal in zip(self.rows, proposals):  # judged after the deep pass, drafted or not
            keep = plan.kind in ("plain", "ngram") and proposal is not None and bool(proposal.tokens)
            row.proposal, row.drafted = proposal if keep else None, 0
        return plan

    # ------------------------------------------------------------------------------------------------ results
    def stats(self, row: Row) -> GenerationStats:
        """The row's statistics (wall time up to now, or to its end: `finish`, or its last token with others to go)."""
        return decode_stats(self, row)

    def finish(self) -> Any:
        """Close a finished decode: the cache trimmed to what the outputs hold, every row's wall time stopped.
        Returns the cache (None where per-row holes keep it from lining up with the padded outputs)."""
        if not self.finished:
            raise RuntimeError("finish() called before the decode finished: step() until decoder.finished.")
        now = time.perf_counter()
        for row in self.rows:
            row.ended = row.ended if row.ended is not None else now
        settle_generators(self.rows)
        cache = self.fill.cache
        with torch.inference_mode():  # the layers hold inference tensors until released below
            _compat.trim_sliding(cache)  # no rollback can follow: sliding layers keep only their window
            if len(self.rows) > 1 and self.per_row:
                return None
            width = max(len(row.output()) for row in self.rows)
            n = self.rows[0].start
            for layer_idx in range(self.stack.num_layers):  # drafts accepted past the last stop: not in the output
                _compat.crop_cache_layer(cache, layer_idx, n + width - 1)
        return _compat.handed_back(cache, self.stack.config)


def decode_cache(decoder: Decoder, n: int, requests: list[DecodeRequest], rows_may_join: bool) -> Any:
    """A decode's cache: dynamic, or the compiled passes' static one for a single sequence that no row will join
    (rows joining, leaving and left-padded need dynamic layers), where the model can use one. Its static length
    holds the prompt, the new tokens (up to SLOTS_AHEAD; more grow it) and the drafts and trees past them, or the
    longest this stack's decodes needed so far (one length: the graphs compiled for it serve every call)."""
    cfg, stack = decoder.config, decoder.stack
    if not cfg.compile:
        return stack.new_cache()
    compiled = stack.compiled_layers()
    reason = compile_unsupported(stack) if compiled is None else compiled.failed
    reason = reason or ("a batch" if len(requests) > 1 else "rows may join" if rows_may_join else None)
    ahead = cfg.max_pending + cfg.ngram_tree_nodes + 16  # past the last token: tree nodes, a pass's padded rows
    if reason is None:
        compiled.static_slots = max(compiled.static_slots, n + min(requests[0].max_new_tokens, SLOTS_AHEAD) + ahead)
        cache = stack.new_cache(compiled.static_slots)
        reason = None if cache is not None else "its layers cannot use a static cache"
    if reason is not None:
        say_eager(reason)
        return stack.new_cache()
    return cache

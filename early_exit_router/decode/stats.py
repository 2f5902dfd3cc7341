"""What a decode measures: the counters it keeps while it runs, and `GenerationStats`, built from them in one place.

A decoder keeps `PassCounters` for the whole batch (its deep passes, plans and probes) and `RowCounters` per sequence
(the deep pass's verdicts on that row's drafts); `AgreementMonitor` watches the rolling agreement of exited tokens
with the full model. `row_stats` turns them into one row's `GenerationStats`, `combined_stats` sums a batch's rows.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

logger = logging.getLogger("early_exit_router")


@dataclass
class GenerationStats:
    """Measured routing statistics of one generation.

    Exit layers are 0-based layer indices; the full depth appears as the last layer's index.
    """

    new_tokens: int = 0
    exit_histogram: dict[int, int] = field(default_factory=dict)  # layer -> tokens emitted there (-1: n-gram tier)
    hit_rate: float = 0.0  # share of new tokens emitted from a shallow exit
    # Quality (exit mode): of the early tokens that stayed final, the share the full model agrees with, over the
    # checked sample; per tier too. None where no final early token was checked (verify mode: none is final).
    exit_agreement: float | None = None
    exit_agreement_by_layer: dict[int, float] = field(default_factory=dict)
    exit_checked: int = 0
    exit_checked_by_layer: dict[int, int] = field(default_factory=dict)
    # Speed (both modes): of the drafted tokens a verify cycle judged, the share the deep pass accepted; per tier too.
    draft_acceptance: float | None = None
    draft_acceptance_by_layer: dict[int, float] = field(default_factory=dict)
    drafts_judged: int = 0
    drafts_judged_by_layer: dict[int, int] = field(default_factory=dict)
    # Exit mode: the teacher-forced agreement of the whole output, estimated from the checks (exact at check_fraction
    # 1: only final early tokens can disagree), and why exits stopped when no threshold held target_agreement.
    output_agreement: float | None = None
    exits_suspended: str | None = None
    # Exit mode: exited tokens the deep pass found wrong before they reached the caller, replaced by the full model's
    # token (the output rolled back there), and exited tokens the holdback released unchecked (0 with holdback None:
    # every exited token was checked first, and greedy output is the full model's).
    repaired_tokens: int = 0
    released_unchecked: int = 0
    # Exit mode, free-running: the new token where the output first left the full model's (the first final token, a
    # released exited token or an unverified n-gram copy, its check found wrong: before it the prefix was the full
    # model's own, so this is where a cascade starts; None: none found; a batch: its earliest row's), and the tokens
    # the repeat guard sent deeper (`repeat_guard`).
    first_divergence: int | None = None
    repeat_refusals: int = 0
    deep_passes: int = 0  # decode-time passes through the last layer (the prompt's prefill excluded)
    mean_fill_chunk: float = 0.0  # mean positions per deep pass (1 = no exited token waited)
    forced_deep: int = 0  # deep passes forced by the window rules
    rejected_drafts: int = 0  # verify mode: exited tokens the deep pass replaced
    mean_accepted_length: float = 0.0  # verify mode: accepted drafts per verifying deep pass ...
    verify_passes: int = 0  # ... the deep passes that judged a draft of this sequence
    min_rolling_agreement: float | None = None  # lowest agreement over `monitor_window` consecutive checks
    monitor_warned: bool = False  # the monitor's agreement bound was crossed
    threshold_shift: float = 0.0  # where the threshold controller left both confidence thresholds (0: off)
    wall_time_s: float = 0.0
    prefill_s: float = 0.0
    compile_s: float = 0.0  # of wall_time_s, compiling graphs (a pass shape's first use in this process: compile)
    tokens_per_s: float = 0.0  # new_tokens / wall_time_s
    decode_tokens_per_s: float = 0.0  # new tokens after the first / (wall_time_s - prefill_s)
    routing_overhead: float = 0.0  # share of wall time spent in routing decisions (gates, signals, their sync)
    routing_s: float = 0.0
    # share of new tokens decoded plainly (no draft, no head, no gate) in verify mode's plans and fallback decoding
    # (exit mode's cascade, which asks exits token by token, counts none)
    plain_share: float = 0.0
    policy_cycles: dict[str, int] = field(default_factory=dict)  # cost policy: draft cycles per plan kind
    probes: int = 0  # cost policy: plain steps that scored the exits' draft heads (shadow tokens)
    # cost policy: final per-position acceptance estimates (exit mode: "exit rate Lx", the share of tokens asked there
    # that left)
    policy_estimates: dict[str, float] = field(default_factory=dict)
    asks_skipped: dict[int, int] = field(default_factory=dict)  # exit mode, cost policy: exit layer -> tokens not asked
    fallback: str | None = None  # why the decode ran plainly (no draft, no exit) where it did, else None
    # verify mode, cost policy: block exits left out, their drafts not paying at their starting estimate (a block's
    # layer runs on every step, drafting or not: `policy.without_idle_blocks`)
    exits_left_out: list[int] = field(default_factory=list)
    mode: str = "exit"
    num_layers: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def summary(self) -> str:
        """A few human-readable lines."""
        names = {self.num_layers - 1: "full", -1: "ngram"}
        hist = ", ".join(
            f"{names.get(layer, f'L{layer}')}: {count}" for layer, count in sorted(self.exit_histogram.items())
        )
        quality = (
            f"exit agreement {self.exit_agreement:.3f} over {self.exit_checked} checked final early tokens"
            if self.exit_agreement is not None
            else "exit agreement n/a (no final early token checked)"
            if self.mode != "exit" or self.released_unchecked
            else "every exited token checked before release"
        ) + ("" if self.output_agreement is None else f" (output agreement {self.output_agreement:.3f})")
        speed = (
            f"draft acceptance {self.draft_acceptance:.3f} over {self.drafts_judged} drafts"
            if self.draft_acceptance is not None
            else "no draft judged"
        )
        left_out = ", ".join(f"L{e}" for e in self.exits_left_out)
        return "\n".join(
            ([f"decoded plainly: {self.fallback}"] if self.fallback else [])
            + ([f"block exits left out ({left_out}): drafts from them do not pay at their prior"] if left_out else [])
            + ([f"exits stopped: {self.exits_suspended}"] if self.exits_suspended else [])
            + [
                f"mode {self.mode}: {self.new_tokens} new tokens in {self.wall_time_s:.2f} s "
                f"({self.tokens_per_s:.1f} tok/s; decode {self.decode_tokens_per_s:.1f} tok/s; "
                f"prefill {self.prefill_s * 1000:.0f} ms"
                + (f"; compiling graphs {self.compile_s:.1f} s, once" if self.compile_s else "")
                + ")",
                f"exit histogram: {hist}",
                f"hit rate {self.hit_rate:.3f}; "
                + (f"{quality}; {self._repairs()}; " if self.mode == "exit" else "")
                + speed
                + (
                    f"; rejected drafts {self.rejected_drafts}, mean accepted length {self.mean_accepted_length:.2f}"
                    if self.drafts_judged
                    else ""
                ),
                f"deep passes {self.deep_passes} (mean fill chunk {self.mean_fill_chunk:.2f}, "
                f"forced {self.forced_deep}); routing overhead {self.routing_overhead:.1%}"
                + (f"; controller moved the thresholds by {self.threshold_shift:+.2f}" if self.threshold_shift else ""),
            ]
            + (
                [
                    f"cost policy: cycles {', '.join(f'{k} {v}' for k, v in self.policy_cycles.items())}; "
                    f"plain share {self.plain_share:.2f}; {self.probes} probes",
                    "acceptance estimates: " + ", ".join(f"{k} {v:.2f}" for k, v in self.policy_estimates.items()),
                ]
                if self.policy_cycles
                else []
            )
            + (
                [
                    "cost policy: tokens not asked at "
                    + ", ".join(f"L{layer} {n}" for layer, n in self.asks_skipped.items())
                    + " (asking did not pay); exit-rate estimates: "
                    + ", ".join(f"{k} {v:.2f}" for k, v in self.policy_estimates.items() if k.startswith("exit rate"))
                ]
                if self.asks_skipped
                else []
            )
        )

    def _repairs(self) -> str:
        """Exit mode: what the deep pass repaired before the caller saw it, and what reached the caller unchecked."""
        unchecked = f"{self.released_unchecked} released unchecked" if self.released_unchecked else "none unchecked"
        at = self.first_divergence
        diverged = "" if at is None else f" (the output left the full model's at new token {at})"
        guard = f"; repeat guard sent {self.repeat_refusals} deeper" if self.repeat_refusals else ""
        return f"repaired {self.repaired_tokens} exited tokens, {unchecked}{diverged}{guard}"


@dataclass
class RowCounters:
    """One sequence's tallies of the deep pass's verdicts, per tier (exits, then the n-gram tier): on early tokens
    that stay final (exit mode's checks: quality) and on drafts a verify cycle judged (speed)."""

    checked: list[int]  # per tier: final early tokens the deep pass checked
    agreed: list[int]  # ... and of them, those the full model agrees with
    judged: list[int]  # per tier: drafts a verify cycle judged
    accepted: list[int]  # ... and of them, those the deep pass accepted
    rejected: int = 0  # drafts the deep pass replaced (one per rejection)
    verify_passes: int = 0  # deep passes that judged at least one of this row's drafts
    repaired: int = 0  # exit mode: exited tokens the deep pass replaced before they reached the caller
    released: int = 0  # exit mode: exited tokens that reached the caller unchecked (the holdback's)
    diverged: int | None = None  # exit mode: the first final token found wrong (its new-token index)

    @classmethod
    def for_tiers(cls, tiers: int) -> RowCounters:
        return cls([0] * tiers, [0] * tiers, [0] * tiers, [0] * tiers)


@dataclass
class PassCounters:
    """The whole batch's tallies (one sequence: its own)."""

    deep_passes: int = 0  # decode-time passes through the last layer
    fill_positions: int = 0  # positions those passes ran
    forced: int = 0  # deep passes forced by the window rules
    routing_s: float = 0.0  # time spent in routing decisions (gates, signals, their host syncs; a fused ask's head)
    plain_steps: int = 0  # cost policy: steps decoded plainly
    probes: int = 0  # cost policy: plain steps that scored the exits' draft heads
    plan_counts: dict[str, int] = field(default_factory=dict)  # cost policy: draft cycles per plan
    unpaid_asks: dict[int, int] = field(default_factory=dict)  # ask rule: exit index -> tokens where asking did not pay
    exited_seen: int = 0  # exit mode: exited tokens the deep layers have seen (the check sample's counter)
    repeat_refusals: int = 0  # exit mode: tokens the repeat guard sent deeper

    def copy(self) -> PassCounters:
        return replace(self, plan_counts=dict(self.plan_counts), unpaid_asks=dict(self.unpaid_asks))

    def since(self, earlier: PassCounters) -> PassCounters:
        """What was counted after `earlier` (a `copy()` taken then): a row's share of a batch that outlives it (a
        server's batch serves request after request)."""
        later = {f.name: getattr(self, f.name) for f in fields(self)}
        return PassCounters(**{k: _minus(v, getattr(earlier, k)) for k, v in later.items()})


def _minus(later: Any, earlier: Any) -> Any:
    """later - earlier: numbers, or counts by key (keys whose count did not change dropped)."""
    if isinstance(later, dict):
        return {k: v - earlier.get(k, 0) for k, v in later.items() if v != earlier.get(k, 0)}
    return later - earlier


class AgreementMonitor:
    """The rolling agreement of the last `window` judged drafts with the full model; warns once below `bound`."""

    def __init__(self, window: int, bound: float) -> None:
        self.window, self.bound = window, bound
        self.recent: deque[bool] = deque(maxlen=window)
        self.minimum = 1.0
        self.warned = False

    def observe(self, verdicts: list[bool]) -> float | None:
        """Record verdicts; returns the rolling agreement over whatever history there is (None: none yet)."""
        self.recent.extend(verdicts)
        if len(self.recent) >= self.window:
            rolling = sum(self.recent) / self.window
            self.minimum = min(self.minimum, rolling)
            if rolling < self.bound and not self.warned:
                self.warned = True
                logger.warning(
                    "early-exit monitor: agreement of the last %d exited tokens with the full model is %.2f, below "
                    "%.2f. The router is too aggressive for this text: raise the thresholds or use mode='verify' (exit "
                    "mode's repairs keep the output, but each one costs time).",
                    self.window,
                    rolling,
                    self.bound,
                )
        return sum(self.recent) / len(self.recent) if self.recent else None


@dataclass
class RowRecord:
    """What `row_stats` reads off one finished (or running) sequence."""

    depths: list[int]  # per new token: the layer it left at
    counters: RowCounters
    wall_s: float
    prefill_s: float


def row_stats(
    row: RowRecord,
    passes: PassCounters,
    monitor: AgreementMonitor,
    *,
    mode: str,
    num_layers: int,
    tier_layers: list[int],
    threshold_shift: float,
    policy_estimates: dict[str, float],
    asks_skipped: dict[int, int],
    fallback: str | None = None,
) -> GenerationStats:
    """One sequence's `GenerationStats`. `tier_layers[i]`: the histogram key of tier i (an exit layer, or -1)."""
    full = num_layers - 1
    histogram: dict[int, int] = {}
    for layer in row.depths:
        histogram[layer] = histogram.get(layer, 0) + 1
    new = len(row.depths)
    exited = sum(c for layer, c in histogram.items() if layer != full)
    c = row.counters
    checked, judged = sum(c.checked), sum(c.judged)
    exit_agreement = sum(c.agreed) / checked if checked else None
    exit_by_layer = {tier_layers[i]: c.agreed[i] / n for i, n in enumerate(c.checked) if n}
    draft_acceptance = sum(c.accepted) / judged if judged else None
    acceptance_by_layer = {tier_layers[i]: c.accepted[i] / n for i, n in enumerate(c.judged) if n}
    wall, decode_s = row.wall_s, row.wall_s - row.prefill_s
    return GenerationStats(
        new_tokens=new,
        exit_histogram=dict(sorted(histogram.items())),
        hit_rate=exited / new if new else 0.0,
        exit_agreement=exit_agreement,
        exit_agreement_by_layer=exit_by_layer,
        exit_checked=checked,
        exit_checked_by_layer={tier_layers[i]: n for i, n in enumerate(c.checked) if n},
        draft_acceptance=draft_acceptance,
        draft_acceptance_by_layer=acceptance_by_layer,
        drafts_judged=judged,
        drafts_judged_by_layer={tier_layers[i]: n for i, n in enumerate(c.judged) if n},
        deep_passes=passes.deep_passes,
        mean_fill_chunk=passes.fill_positions / passes.deep_passes if passes.deep_passes else 0.0,
        forced_deep=passes.forced,
        rejected_drafts=c.rejected,
        repaired_tokens=c.repaired,
        released_unchecked=c.released,
        first_divergence=c.diverged,
        repeat_refusals=passes.repeat_refusals,
        mean_accepted_length=sum(c.accepted) / c.verify_passes if c.verify_passes else 0.0,
        verify_passes=c.verify_passes,
        min_rolling_agreement=monitor.minimum if checked >= monitor.window else None,
        monitor_warned=monitor.warned,
        threshold_shift=threshold_shift,
        wall_time_s=wall,
        prefill_s=row.prefill_s,
        tokens_per_s=new / wall if wall > 0 else 0.0,
        decode_tokens_per_s=(new - 1) / decode_s if decode_s > 0 and new > 1 else 0.0,
        routing_overhead=passes.routing_s / wall if wall > 0 else 0.0,
        routing_s=passes.routing_s,
        plain_share=passes.plain_steps / new if new else 0.0,
        policy_cycles=dict(sorted(passes.plan_counts.items())),
        probes=passes.probes,
        policy_estimates=policy_estimates,
        asks_skipped=asks_skipped,
        fallback=fallback,
        mode=mode,
        num_layers=num_layers,
    )


def combined_stats(rows: list[GenerationStats], one_after_another: bool = False) -> GenerationStats:
    """One batch's statistics from its rows': token counts and histograms summed, rates over all tokens; what the
    batch shares (its passes, plans and estimates) from the row that saw most of them. Wall time: the longest row's,
    or with `one_after_another` (rows decoded alone in turn) their sum."""
    histogram: dict[int, int] = {}
    for row in rows:
        for layer, count in row.exit_histogram.items():
            histogram[layer] = histogram.get(layer, 0) + count
    new = sum(r.new_tokens for r in rows)

    def pooled(rate: str, count: str) -> tuple[float | None, int]:
        total = sum(getattr(r, count) for r in rows)
        hits = sum((getattr(r, rate) or 0.0) * getattr(r, count) for r in rows)
        return (hits / total if total else None), total

    def pooled_by_layer(rates: str, counts: str) -> tuple[dict[int, float], dict[int, int]]:
        totals: dict[int, int] = {}
        hits: dict[int, float] = {}
        for r in rows:
            for layer, n in getattr(r, counts).items():
                totals[layer] = totals.get(layer, 0) + n
                hits[layer] = hits.get(layer, 0.0) + getattr(r, rates)[layer] * n
        return {k: hits[k] / n for k, n in sorted(totals.items())}, dict(sorted(totals.items()))

    exit_agreement, exit_checked = pooled("exit_agreement", "exit_checked")
    acceptance, judged = pooled("draft_acceptance", "drafts_judged")
    exit_by_layer, checked_by_layer = pooled_by_layer("exit_agreement_by_layer", "exit_checked_by_layer")
    acceptance_by_layer, judged_by_layer = pooled_by_layer("draft_acceptance_by_layer", "drafts_judged_by_layer")
    verify_passes = sum(r.verify_passes for r in rows)
    accepted = sum(r.mean_accepted_length * r.verify_passes for r in rows)
    gather = sum if one_after_another else max  # rows decoded alone in turn, or side by side
    decode_s = gather(r.wall_time_s - r.prefill_s for r in rows)
    output_agreement, _ = pooled("output_agreement", "new_tokens")
    output_agreement = output_agreement if any(r.output_agreement is not None for r in rows) else None
    longest = max(rows, key=lambda r: r.deep_passes)  # side by side, the row that was there longest saw them all

    def shared(name: str) -> Any:
        """A tally of the batch's passes: side by side, the longest row saw it all; in turn, each row made its own."""
        if not one_after_another:
            return getattr(longest, name)
        values = [getattr(r, name) for r in rows]
        if isinstance(values[0], dict):
            return {k: sum(v.get(k, 0) for v in values) for k in sorted(set().union(*values))}
        return sum(values)

    deep_passes, wall = shared("deep_passes"), gather(r.wall_time_s for r in rows)
    positions = sum(r.mean_fill_chunk * r.deep_passes for r in rows) if one_after_another else None
    return GenerationStats(
        new_tokens=new,
        exit_histogram=dict(sorted(histogram.items())),
        hit_rate=sum(r.hit_rate * r.new_tokens for r in rows) / new if new else 0.0,
        exit_agreement=exit_agreement,
        exit_agreement_by_layer=exit_by_layer,
        exit_checked=exit_checked,
        exit_checked_by_layer=checked_by_layer,
        draft_acceptance=acceptance,
        draft_acceptance_by_layer=acceptance_by_layer,
        drafts_judged=judged,
        drafts_judged_by_layer=judged_by_layer,
        deep_passes=deep_passes,
        mean_fill_chunk=longest.mean_fill_chunk if positions is None else positions / max(deep_passes, 1),
        forced_deep=shared("forced_deep"),
        rejected_drafts=sum(r.rejected_drafts for r in rows),
        repaired_tokens=sum(r.repaired_tokens for r in rows),
        released_unchecked=sum(r.released_unchecked for r in rows),
        first_divergence=min((r.first_divergence for r in rows if r.first_divergence is not None), default=None),
        repeat_refusals=shared("repeat_refusals"),
        mean_accepted_length=accepted / verify_passes if verify_passes else 0.0,
        verify_passes=verify_passes,
        min_rolling_agreement=longest.min_rolling_agreement,  # one monitor watches the batch
        wall_time_s=wall,
        prefill_s=longest.prefill_s,
        compile_s=max(r.compile_s for r in rows),
        tokens_per_s=new / wall if wall > 0 else 0.0,
        decode_tokens_per_s=(new - len(rows)) / decode_s if decode_s > 0 and new > len(rows) else 0.0,
        routing_overhead=shared("routing_s") / wall if wall > 0 else 0.0,
        routing_s=shared("routing_s"),
        plain_share=sum(r.plain_share * r.new_tokens for r in rows) / new if new else 0.0,
        policy_cycles=shared("policy_cycles"),
        probes=shared("probes"),
        policy_estimates=longest.policy_estimates,
        asks_skipped=longest.asks_skipped,
        threshold_shift=longest.threshold_shift,
        monitor_warned=any(r.monitor_warned for r in rows),
        fallback=longest.fallback,
        exits_left_out=longest.exits_left_out,
        output_agreement=output_agreement,
        exits_suspended=next((r.exits_suspended for r in rows if r.exits_suspended), None),
        mode=longest.mode,
        num_layers=longest.num_layers,
    )


def exit_head_tokens(histogram: dict[Any, int], num_layers: int) -> int:
    """Tokens of an exit histogram that left at an exit head: neither at full depth nor from the n-gram tier (key
    -1). Keys may be strings (a summary read back from JSON)."""
    return sum(count for layer, count in histogram.items() if 0 <= int(layer) < num_layers - 1)


def exit_draft_cycles(policy_cycles: dict[str, int] | None) -> int:
    """The cost policy's cycles that an exit head drafted (its chains and trees)."""
    return sum(count for plan, count in (policy_cycles or {}).items() if plan.startswith("exit"))


def plain_stats(new_tokens: int, wall_s: float, num_layers: int) -> GenerationStats:
    """Plain HF decoding's statistics: every token at full depth, one deep pass per token after the prefill's."""
    passes = max(0, new_tokens - 1)
    row = RowRecord([num_layers - 1] * new_tokens, RowCounters.for_tiers(1), wall_s, 0.0)
    stats = row_stats(row, PassCounters(deep_passes=passes, fill_positions=passes), AgreementMonitor(1, 0.0),
                      mode="plain", num_layers=num_layers, tier_layers=[-1], threshold_shift=0.0, policy_estimates={},
                      asks_skipped={})  # fmt: skip
    stats.decode_tokens_per_s = 0.0  # the prefill is not timed apart
    return stats


def compiled_seconds(stack: Any) -> float:
    """Seconds `stack`'s compiled passes have spent compiling in this process (0: none compiled)."""
    return stack._compiled.compile_s if stack._compiled is not None else 0.0


def decode_stats(dec: Any, row: Any) -> GenerationStats:
    """One row's `GenerationStats` from a decode's state (`state.DecodeState`) and the row's record."""
    new = len(row.output())
    end = row.ended if row.ended is not None else time.perf_counter()
    record = RowRecord(row.depth[:new], row.counters, end - row.started, row.prefill_s)
    names = {"ngram": "ngram match {}", "branch": "tree branch match {}", "exit": "exit L{}", "ask": "exit rate L{}",
             "exit branch": "exit branch L{}", "fire": "exit fires L{}", "agree": "exit agreement L{}",
             "adapted": "draft path L{}"}  # fmt: skip
    estimates = {
        names[kind].format(index if kind in ("ngram", "branch", "adapted") else dec.exits[index]): round(a, 4)
        for (kind, index), a in sorted(dec.tracker.estimates.items())
    }
    passes = (row.passes_to or dec.passes).since(row.passes_from)  # the batch's passes while the row was in it
    interval = dec.config.probe_interval
    skipped = {dec.exits[i]: n - (n // interval if interval > 0 else 0) for i, n in sorted(passes.unpaid_asks.items())}
    stats = row_stats(record, passes, dec.monitor, mode=dec.mode, num_layers=dec.stack.num_layers,
                      tier_layers=dec.exits + [-1] + ([dec.draft_path.exit_layer] if dec.adapted else []),  # -1: n-gram
                      threshold_shift=dec.routing.threshold_shift,
                      policy_estimates=estimates, asks_skipped=skipped, fallback=dec.fallback)  # fmt: skip
    stats.exits_suspended = dec.routing.exits_suspended
    stats.exits_left_out = list(dec.exits_left_out)
    stats.compile_s = compiled_seconds(dec.stack) - row.compiling_from
    fraction = dec.config.check_fraction if dec.config.check_agreement else 0.0
    if dec.mode == "exit" and new and fraction > 0:
        misses = sum(row.counters.checked) - sum(row.counters.agreed)
        stats.output_agreement = max(0.0, 1.0 - misses / fraction / new)
    return stats

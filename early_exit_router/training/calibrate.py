"""`calibrate`: choose the exit threshold that is fastest while meeting a quality target, and check it held out.

Method (documented in docs/training.md, "Calibration"):

1. Split the prompts into a calibration half and a held-out half (alternating within each category).
2. On the calibration half, run the control (plain HF greedy) and the router at every candidate threshold t
   (the confidence rule alone: `high_conf_threshold = low_conf_threshold = t`), side by side
   (`bench.run_bench`), and score every output with the full model. Exit mode runs without repairs here, so that
   the score is the exit rule's own disagreement (see `calibrate`).
3. Keep the candidates that meet the target on the calibration half, and pick the fastest of them (measured
   speedup, or compute per token with `objective="compute"`). A candidate whose speed the run cannot tell from
   the fastest's (per prompt, the log of its tokens/s over the fastest's averages within `speed_tie_z` standard
   errors of zero) ties with it, and the tie goes to the candidate that exits most tokens: the target already
   says how much quality is enough, and the hit rate, unlike a dozen prompts' speed, repeats from run to run.
   - Agreement target (teacher-forced agreement >= 1 - epsilon), `method="ltt"`: a Learn-then-Test risk bound as
     in CALM. Each candidate's null hypothesis "its disagreement rate exceeds epsilon" gets the exact binomial
     p-value P(Binomial(n, epsilon) <= k) of its k disagreements in n tokens. Candidates are tested in a fixed
     sequence from the most conservative threshold down, stopping at the first p-value above `delta`; every
     candidate before that point meets the target with probability >= 1 - delta (family-wise). Tokens are treated
     as independent draws, which is an approximation: tokens of one answer are correlated.
   - Consistency target (outputs identical to the full model's >= 1 - epsilon, sequence-level as CALM's textual
     consistency): the same test over outputs, k differing outputs in n (prompts times repeats); exit mode then runs
     under the router's own `holdback`, since the target is about what the caller gets.
   - `method="empirical"` (and every NLL target, whose loss is unbounded): the calibration estimate must meet
     the target; no risk bound.
4. Run the chosen threshold on the held-out half, again against the control, and report whether the target holds
   there. The chosen thresholds replace the router's config, with an agreement target as exit mode's
   `target_agreement` (the threshold controller then holds it on new text), ready for `save_pretrained`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from early_exit_router.bench.bench import CONTROL, BenchConfig, run_bench, threshold_overrides
from early_exit_router.bench.report import format_value

DEFAULT_CANDIDATES = (0.99, 0.97, 0.95, 0.9, 0.85, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3)


@dataclass
class QualityTarget:
    """Exactly one of: a minimum teacher-forced agreement (per token), a maximum relative NLL increase (0.02 = 2%),
    or a minimum consistency: the share of outputs identical to the full model's greedy output (per sequence, CALM's
    textual consistency: what a user comparing answers sees)."""

    min_agreement: float | None = None
    max_nll_increase: float | None = None
    min_consistency: float | None = None

    def __post_init__(self) -> None:
        given = [v for v in (self.min_agreement, self.max_nll_increase, self.min_consistency) if v is not None]
        if len(given) != 1:
            raise ValueError(
                "Give exactly one quality target: min_agreement (e.g. 0.95), max_nll_increase (0.02) or "
                "min_consistency (0.9)."
            )
        for name in ("min_agreement", "min_consistency"):
            value = getattr(self, name)
            if value is not None and not 0 < value <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {value}.")
        if self.max_nll_increase is not None and self.max_nll_increase < 0:
            raise ValueError(f"max_nll_increase must be >= 0, got {self.max_nll_increase}.")

    def met(self, agreement: float, nll_ratio: float | None, consistency: float | None = None) -> bool:
        if self.min_agreement is not None:
            return agreement >= self.min_agreement
        if self.min_consistency is not None:
            return consistency is not None and consistency >= self.min_consistency
        return nll_ratio is not None and nll_ratio - 1 <= self.max_nll_increase

    def risk_bound(self) -> float | None:
        """The largest failure rate the target allows, where a Learn-then-Test bound applies (None: an NLL target,
        whose loss is unbounded): disagreeing tokens, or outputs that differ from the full model's."""
        target = self.min_agreement if self.min_agreement is not None else self.min_consistency
        return None if target is None else 1 - target

    def describe(self) -> str:
        if self.min_agreement is not None:
            return f"teacher-forced agreement >= {self.min_agreement:g}"
        if self.min_consistency is not None:
            return f"outputs identical to the full model's >= {self.min_consistency:g}"
        return f"NLL increase <= {self.max_nll_increase:.1%}"


@dataclass
class CalibrationConfig:
    target: QualityTarget
    candidates: tuple[float, ...] = DEFAULT_CANDIDATES  # high_conf_threshold values
    mode: str = "exit"
    method: str = "ltt"  # or "empirical"
    delta: float = 0.1  # LTT: allowed probability that a chosen threshold misses the target
    objective: str = "speed"  # or "compute"
    speed_tie_z: float = 2.0  # speed objective: within this many standard errors of the fastest is a tie
    max_new_tokens: int = 64
    repeats: int = 1

    def __post_init__(self) -> None:
        if self.method not in ("ltt", "empirical"):
            raise ValueError(f"method must be 'ltt' or 'empirical', got {self.method!r}.")
        if self.objective not in ("speed", "compute"):
            raise ValueError(f"objective must be 'speed' or 'compute', got {self.objective!r}.")
        if not 0 < self.delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {self.delta}.")
        if self.speed_tie_z < 0:
            raise ValueError(f"speed_tie_z must be >= 0 (0: only the fastest), got {self.speed_tie_z}.")
        if not self.candidates or any(not 0 <= t <= 1 for t in self.candidates):
            raise ValueError(f"candidates must be thresholds in [0, 1], got {self.candidates}.")


@dataclass
class Candidate:
    threshold: float
    tokens: int
    disagreements: int
    agreement: float
    nll_ratio: float | None
    speedup: float | None
    compute_ratio: float | None
    hit_rate: float
    outputs: int = 0  # generations it made on the calibration half ...
    consistent: int = 0  # ... and of them, those identical to the full model's (the control's)
    p_value: float | None = None  # LTT only
    meets_target: bool = False  # valid under the method (bound or estimate)
    prompt_speedups: dict[str, float] = field(default_factory=dict)  # per calibration prompt: tokens/s over control


@dataclass
class CalibrationResult:
    target: str
    method: str
    chosen_threshold: float | None
    candidates: list[Candidate]
    calibration_prompts: list[str]
    heldout_prompts: list[str]
    heldout: dict[str, Any] = field(default_factory=dict)  # agreement, nll_ratio, speedup, ... of the chosen one
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def table(self) -> str:
        lines = [
            f"target: {self.target}; method: {self.method}",
            "| threshold | tokens | agreement | identical | NLL ratio | speedup | compute | hit rate | p-value "
            "| valid |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for c in self.candidates:
            p = "–" if c.p_value is None else f"{c.p_value:.3g}"
            lines.append(
                f"| {c.threshold:g}{' (chosen)' if c.threshold == self.chosen_threshold else ''} | {c.tokens} | "
                f"{c.agreement:.3f} | {c.consistent}/{c.outputs} | {format_value(c.nll_ratio)} | "
                f"{format_value(c.speedup)} | "
                f"{format_value(c.compute_ratio)} | {c.hit_rate:.2f} | {p} | {'yes' if c.meets_target else 'no'} |"
            )
        if self.heldout:
            h = self.heldout
            lines.append(
                f"held out ({len(self.heldout_prompts)} prompts) at {self.chosen_threshold:g}: agreement "
                f"{h['agreement']:.3f}, identical {h.get('consistency', 0):.2f}, NLL ratio "
                f"{format_value(h['nll_ratio'])}, speedup "
                f"{format_value(h['speedup'])}x, compute {format_value(h['compute_ratio'])}, hit rate "
                f"{h['hit_rate']:.2f}; target met: {h['meets_target']}"
            )
        lines += self.notes
        return "\n".join(lines)


def binomial_cdf(k: int, n: int, p: float) -> float:
    """P(Binomial(n, p) <= k), summed in log space (stable for n in the thousands)."""
    if k >= n:
        return 1.0
    if p <= 0:
        return 1.0
    if p >= 1:
        return 0.0
    log_p, log_q = math.log(p), math.log1p(-p)
    terms = [
        math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * log_p + (n - i) * log_q
        for i in range(k + 1)
    ]
    top = max(terms)
    return min(1.0, math.exp(top) * sum(math.exp(t - top) for t in terms))


def split_prompts(prompts: Sequence[dict[str, Any]]) -> tuple[list[dict], list[dict]]:
    """Calibration and held-out halves: alternate within each category, so both cover every category."""
    seen: dict[str, int] = {}
    calibration, heldout = [], []
    for item in prompts:
        index = seen.get(item["category"], 0)
        seen[item["category"]] = index + 1
        (calibration if index % 2 == 0 else heldout).append(item)
    if not calibration or not heldout:
        raise ValueError("Calibration needs at least two prompts (one to calibrate on, one to check held out).")
    return calibration, heldout


def choose(valid: Sequence[Candidate], cfg: CalibrationConfig) -> Candidate:
    """The candidate `calibrate` picks among those that meet the target: the least compute per token, or the
    fastest, where every candidate the run cannot tell from the fastest (`speed_ties`) ties with it and the tie goes
    to the highest hit rate (then the higher speedup)."""
    if cfg.objective == "compute":
        return min(valid, key=lambda c: c.compute_ratio if c.compute_ratio is not None else math.inf)
    fastest = max(valid, key=lambda c: c.speedup or 0.0)
    if cfg.speed_tie_z == 0:  # no tolerance: the measured fastest, even where a paired mean favours another
        return fastest
    tied = [c for c in valid if c is fastest or speed_ties(c, fastest, cfg.speed_tie_z)]
    return max(tied, key=lambda c: (c.hit_rate, c.speedup or 0.0))


def speed_ties(candidate: Candidate, fastest: Candidate, z: float) -> bool:
    """Whether `candidate` is as fast as `fastest` within the run's noise: over the prompts both ran, the mean of
    log(its tokens/s over the fastest's) is within `z` standard errors of zero (a paired comparison, so the
    prompts' own spread in speed cancels)."""
    prompts = sorted(set(candidate.prompt_speedups) & set(fastest.prompt_speedups))
    if len(prompts) < 2:
        return False
    diffs = [math.log(candidate.prompt_speedups[p] / fastest.prompt_speedups[p]) for p in prompts]
    mean = sum(diffs) / len(diffs)
    variance = sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1)
    return mean >= -z * math.sqrt(variance / len(diffs))


def calibrate(
    router: Any,
    calibration_prompts: Sequence[dict[str, Any]],
    heldout_prompts: Sequence[dict[str, Any]],
    cfg: CalibrationConfig,
    progress: bool = True,
) -> CalibrationResult:
    """Pick `high_conf_threshold` for `cfg.target` (see the module docstring); on success set it in `router.config`.

    Returns the result whatever happens; `chosen_threshold` is None (and the router unchanged) when no candidate
    meets the target.

    For per-token targets exit mode is measured without repairs (`holdback` 0 for the sweep and the held-out check,
    the router's own restored after): the output's teacher-forced disagreement then measures the exit rule itself,
    the rate the threshold controller holds (the rate of repairs under the default holdback, of wrong tokens released
    otherwise). A consistency target is about the outputs the caller gets, so it runs under the router's holdback.
    """
    held = router.config.holdback
    if cfg.mode == "exit" and cfg.target.min_consistency is None:
        router.config = router.config.replace(holdback=0)
    try:
        return _calibrate(router, calibration_prompts, heldout_prompts, cfg, progress)
    finally:
        router.config = router.config.replace(holdback=held)


def _calibrate(
    router: Any,
    calibration_prompts: Sequence[dict[str, Any]],
    heldout_prompts: Sequence[dict[str, Any]],
    cfg: CalibrationConfig,
    progress: bool,
) -> CalibrationResult:
    notes = []
    method = cfg.method
    if method == "ltt" and cfg.target.risk_bound() is None:
        method = "empirical"
        notes.append("An NLL target has an unbounded loss, so no Learn-then-Test bound: the empirical rule was used.")
    bench_cfg = BenchConfig(
        max_new_tokens=cfg.max_new_tokens,
        repeats=cfg.repeats,
        modes=(cfg.mode,),
        thresholds=tuple(cfg.candidates),
        ngram=False,
        fixed_cascade=False,
        loaded_config=False,
        engine_control=False,
        assistant_early_exit=(),
        prompt_lookup_num_tokens=0,
        no_repair_arm=False,
        hf_compiled=False,
        compiled=False,
    )
    sweep = run_bench(router, calibration_prompts, bench_cfg, progress=progress)
    rows = {row["threshold"]: row for row in sweep.summary if row["category"] == "all" and row["threshold"] is not None}
    candidates = [_candidate(t, rows[t], sweep.records) for t in sorted(rows, reverse=True)]
    epsilon, per_output = cfg.target.risk_bound(), cfg.target.min_consistency is not None
    still_testing = True
    for c in candidates:  # most conservative first: the order of the fixed-sequence test
        if method == "ltt":  # failures in trials: disagreeing tokens, or (per output) outputs that differ
            failures, trials = (c.outputs - c.consistent, c.outputs) if per_output else (c.disagreements, c.tokens)
            c.p_value = binomial_cdf(failures, trials, epsilon) if trials else 1.0
            still_testing = still_testing and c.p_value <= cfg.delta
            c.meets_target = still_testing
        else:
            c.meets_target = cfg.target.met(c.agreement, c.nll_ratio, c.consistent / max(1, c.outputs))
    valid = [c for c in candidates if c.meets_target]
    result = CalibrationResult(
        target=cfg.target.describe() + (f" (with probability >= {1 - cfg.delta:g})" if method == "ltt" else ""),
        method=method,
        chosen_threshold=None,
        candidates=candidates,
        calibration_prompts=[p["id"] for p in calibration_prompts],
        heldout_prompts=[p["id"] for p in heldout_prompts],
        notes=notes,
    )
    if not valid:
        result.notes.append(
            "No candidate threshold meets the target on the calibration prompts: relax the target, use more "
            "calibration prompts (a tighter bound), or, for output identical to the full model, keep exit mode's "
            "repairs (holdback None) or use mode='verify'."
        )
        return result
    best = choose(valid, cfg)
    result.chosen_threshold = best.threshold
    # An agreement target is what exit mode then holds on new text (the threshold controller starts from `best`).
    checked = router.config.check_agreement and router.config.check_fraction > 0  # the controller's evidence
    target = cfg.target.min_agreement if cfg.mode == "exit" and checked else None
    router.config = router.config.replace(**{**threshold_overrides(best.threshold), "target_agreement": target})
    if best.speedup is not None and best.speedup < 1:
        result.notes.append(
            f"The chosen threshold is slower than plain HF generation on this machine ({best.speedup:.2f}x): "
            "the exit heads cost more than the layers they skip here (see `compute` and docs/benchmarks.md)."
        )
    check = run_bench(router, heldout_prompts, _heldout_config(bench_cfg), progress=progress)
    row = next(r for r in check.summary if r["category"] == "all" and r["arm"] == f"router {cfg.mode} (loaded config)")
    consistency = row["identical"] / max(1, row["runs"])
    result.heldout = {
        "agreement": row["teacher_forced_agreement"],
        "nll_ratio": row["nll_ratio"],
        "speedup": row["speedup"],
        "compute_ratio": row["compute_ratio"],
        "hit_rate": row["hit_rate"],
        "tokens": row["tokens"],
        "consistency": consistency,  # outputs identical to the full model's
        "meets_target": cfg.target.met(row["teacher_forced_agreement"], row["nll_ratio"], consistency),
    }
    return result


def _heldout_config(cfg: BenchConfig) -> BenchConfig:
    """The sweep's settings with no sweep: only the router's loaded (now calibrated) config runs."""
    return BenchConfig(**{**asdict(cfg), "thresholds": (), "loaded_config": True})


def _candidate(threshold: float, row: dict[str, Any], records: list) -> Candidate:
    disagreements = sum(r.quality["disagreements"] for r in records if r.arm == row["arm"])
    return Candidate(
        threshold=threshold,
        tokens=row["tokens"],
        disagreements=disagreements,
        agreement=row["teacher_forced_agreement"],
        nll_ratio=row["nll_ratio"],
        speedup=row["speedup"],
        compute_ratio=row["compute_ratio"],
        hit_rate=row["hit_rate"],
        outputs=row["runs"],
        consistent=row["identical"],
        prompt_speedups=_prompt_speedups(records, row["arm"]),
    )


def _prompt_speedups(records: list, arm: str) -> dict[str, float]:
    """Per prompt, the arm's tokens/s over the control's (repeats pooled)."""
    totals: dict[tuple[str, str], list[float]] = {}
    for r in records:
        if r.arm in (arm, CONTROL):
            tokens_time = totals.setdefault((r.arm, r.prompt_id), [0.0, 0.0])
            tokens_time[0] += len(r.new_ids)
            tokens_time[1] += r.wall_s
    speeds = {key: n / t for key, (n, t) in totals.items() if n and t > 0}
    return {
        p: round(speed / speeds[(CONTROL, p)], 4)
        for (a, p), speed in speeds.items()
        if a == arm and (CONTROL, p) in speeds
    }

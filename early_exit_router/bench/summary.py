"""A bench run's records (`RunRecord`) summarized: one row per (category, arm), speedups over the control and over
HF's compiled fast path measured in the same run."""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from early_exit_router.bench.arms import CONTROL, HF_COMPILED, Arm
from early_exit_router.bench.quality import correct_fields


@dataclass
class RunRecord:
    """One generation of one arm on one prompt."""

    prompt_id: str
    category: str
    arm: str
    repeat: int
    new_ids: list[int]
    wall_s: float
    ttft_s: float | None
    inter_token_s: list[float]
    peak_memory_mb: float | None
    compute_ratio: float | None  # decode multiply-adds per new token / the full model's per decode step
    stats: dict[str, Any] | None  # GenerationStats of router arms
    quality: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return len(self.new_ids)


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def summarize(records: list[RunRecord], arms: list[Arm]) -> list[dict[str, Any]]:
    """One row per (category, arm), categories in order of appearance, then 'all'; `speedup` is over the control,
    `speedup_compiled` over HF's static cache + torch.compile (None where that arm did not run)."""
    groups: dict[tuple[str, str], list[RunRecord]] = defaultdict(list)
    categories: list[str] = []
    for r in records:
        if r.category not in categories:
            categories.append(r.category)
        groups[(r.category, r.arm)].append(r)
        groups[("all", r.arm)].append(r)
    rows = []
    for category in [*categories, "all"]:
        control = groups[(category, CONTROL)]
        control_tps = _tokens_per_s(control)
        compiled_tps = _tokens_per_s(groups[(category, HF_COMPILED)])  # 0 where the run had no such arm
        for arm in arms:
            runs = groups[(category, arm.name)]
            if not runs:
                continue
            tokens = sum(r.tokens for r in runs)
            tps = _tokens_per_s(runs)
            stats = [r.stats for r in runs if r.stats is not None]
            histogram: dict[int, int] = defaultdict(int)
            for s in stats:
                for layer, count in s["exit_histogram"].items():
                    histogram[int(layer)] += count
            divergences = [r.quality["first_divergence"] for r in runs if r.quality["first_divergence"] is not None]
            gaps = [g for r in runs for g in r.inter_token_s]
            rows.append(
                {
                    "category": category,
                    "arm": arm.name,
                    "family": arm.family,
                    "threshold": arm.threshold,
                    "runs": len(runs),
                    "tokens": tokens,
                    "tokens_per_s": tps,
                    "speedup": tps / control_tps if control_tps else None,
                    "speedup_compiled": tps / compiled_tps if compiled_tps else None,  # over HF's fast path
                    "ttft_ms": _ms(_mean([r.ttft_s for r in runs])),
                    "itl_p50_ms": _ms(_percentile(gaps, 0.5)),
                    "itl_p99_ms": _ms(_percentile(gaps, 0.99)),
                    "peak_memory_mb": max((r.peak_memory_mb or 0.0) for r in runs) or None,
                    "hit_rate": sum(s["hit_rate"] * s["new_tokens"] for s in stats) / tokens if stats else 0.0,
                    "exit_histogram": dict(sorted(histogram.items())),
                    "routing_overhead": _mean([s["routing_overhead"] for s in stats]),
                    "plain_share": sum(s["plain_share"] * s["new_tokens"] for s in stats) / tokens if stats else None,
                    "policy_cycles": _sum_counts([s["policy_cycles"] for s in stats]),
                    "compute_ratio": _weighted([(r.compute_ratio, r.tokens - 1) for r in runs]),
                    "identical": sum(r.quality["identical"] for r in runs),
                    "token_match": _mean([r.quality["token_match"] for r in runs]),
                    "first_divergence_median": statistics.median(divergences) if divergences else None,
                    "first_divergence_mean": _mean(divergences),  # over the runs that differ from the control
                    "teacher_forced_agreement": 1 - sum(r.quality["disagreements"] for r in runs) / max(1, tokens),
                    "reference_agreement": _reference_agreement(runs, tokens),
                    "nll_ratio": _mean([r.quality["nll_ratio"] for r in runs]),
                    "rouge_l": _mean([r.quality["rouge_l"] for r in runs]),
                    # exit mode: wrong exited tokens replaced before release, and exited tokens released unchecked
                    "repaired_tokens": sum(s.get("repaired_tokens", 0) for s in stats),
                    "released_unchecked": sum(s.get("released_unchecked", 0) for s in stats),
                    # free-running, as the router saw it: the outputs it found leaving the full model's, and the
                    # runs where its figure is bench's own first divergence (both none included); the repeat guard
                    "divergences_found": sum(s.get("first_divergence") is not None for s in stats),
                    "divergence_as_measured": sum(
                        r.stats.get("first_divergence") == r.quality["first_divergence"] for r in runs if r.stats
                    ),
                    "repeat_refusals": sum(s.get("repeat_refusals", 0) for s in stats),
                    **correct_fields(runs, control),
                }
            )
    return rows


def _reference_agreement(runs: list[RunRecord], tokens: int) -> float | None:
    """Teacher-forced agreement of the runs' tokens with the reference model (None without one)."""
    counts = [r.quality.get("reference_disagreements") for r in runs]
    if not counts or None in counts:
        return None
    return 1 - sum(counts) / max(1, tokens)


def _sum_counts(counts: list[dict[str, int]]) -> dict[str, int]:
    total: dict[str, int] = defaultdict(int)
    for c in counts:
        for key, value in c.items():
            total[key] += value
    return dict(sorted(total.items()))


def _tokens_per_s(runs: list[RunRecord]) -> float:
    wall = sum(r.wall_s for r in runs)
    return sum(r.tokens for r in runs) / wall if wall > 0 else 0.0


def _weighted(pairs: list[tuple[float | None, int]]) -> float | None:
    pairs = [(v, w) for v, w in pairs if v is not None and w > 0]
    total = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / total if total else None


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000

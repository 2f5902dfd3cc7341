"""`GenerationStats`: what one `generate` call measured."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass
class GenerationStats:
    """Measured routing statistics of one generation.

    Exit layers are 0-based layer indices; the full depth appears as the last layer's index.
    """

    new_tokens: int = 0
    exit_histogram: dict[int, int] = field(default_factory=dict)  # layer -> tokens emitted there (-1: n-gram tier)
    hit_rate: float = 0.0  # share of new tokens emitted from a shallow exit
    agreement: float | None = None  # share of exited tokens whose deep prediction is the same token (None: none)
    agreement_by_layer: dict[int, float] = field(default_factory=dict)
    exited_checked: int = 0  # exited tokens the deep layers have seen (the denominator of `agreement`)
    deep_passes: int = 0  # decode-time passes through the last layer (the prompt's prefill excluded)
    mean_fill_chunk: float = 0.0  # mean positions per deep pass (1 = no exited token waited)
    forced_deep: int = 0  # deep passes forced by the window rules
    rejected_drafts: int = 0  # verify mode: exited tokens the deep pass replaced
    mean_accepted_length: float = 0.0  # verify mode: accepted drafts per verifying deep pass
    min_rolling_agreement: float | None = None  # lowest agreement over `monitor_window` consecutive checks
    monitor_warned: bool = False  # the monitor's agreement bound was crossed
    threshold_shift: float = 0.0  # where the threshold controller left both confidence thresholds (0: off)
    wall_time_s: float = 0.0
    prefill_s: float = 0.0
    tokens_per_s: float = 0.0  # new_tokens / wall_time_s
    decode_tokens_per_s: float = 0.0  # new tokens after the first / (wall_time_s - prefill_s)
    routing_overhead: float = 0.0  # share of wall time spent in routing decisions (gates, signals, their sync)
    routing_s: float = 0.0
    plain_share: float = 0.0  # cost policy: share of new tokens decoded plainly (no draft, no head, no gate)
    policy_cycles: dict[str, int] = field(default_factory=dict)  # cost policy: draft cycles per plan kind
    probes: int = 0  # cost policy: plain steps that scored the exits' draft heads (shadow tokens)
    # cost policy: final per-position acceptance estimates (exit mode: "exit rate Lx", the share of tokens asked there
    # that left)
    acceptance: dict[str, float] = field(default_factory=dict)
    asks_skipped: dict[int, int] = field(default_factory=dict)  # exit mode, cost policy: exit layer -> tokens not asked
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
        agreement = "n/a (nothing exited)" if self.agreement is None else f"{self.agreement:.3f}"
        return "\n".join(
            [
                f"mode {self.mode}: {self.new_tokens} new tokens in {self.wall_time_s:.2f} s "
                f"({self.tokens_per_s:.1f} tok/s; decode {self.decode_tokens_per_s:.1f} tok/s; "
                f"prefill {self.prefill_s * 1000:.0f} ms)",
                f"exit histogram: {hist}",
                f"hit rate {self.hit_rate:.3f}; agreement {agreement} over {self.exited_checked} exited tokens"
                + (
                    f"; rejected drafts {self.rejected_drafts}, mean accepted length {self.mean_accepted_length:.2f}"
                    if self.mode == "verify"
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
                    "acceptance estimates: " + ", ".join(f"{k} {v:.2f}" for k, v in self.acceptance.items()),
                ]
                if self.policy_cycles
                else []
            )
            + (
                [
                    "cost policy: tokens not asked at "
                    + ", ".join(f"L{layer} {n}" for layer, n in self.asks_skipped.items())
                    + " (asking did not pay); exit-rate estimates: "
                    + ", ".join(f"{k} {v:.2f}" for k, v in self.acceptance.items() if k.startswith("exit rate"))
                ]
                if self.asks_skipped
                else []
            )
        )

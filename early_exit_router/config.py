"""`RouterConfig`: every knob of the exit heads and their routing, in four groups, saved as JSON beside the heads.

- `HeadLayout`: what is saved with the heads and must match them (exit layers, adapters, the draft vocabulary).
- `CascadeOptions`: the exit rule (thresholds, gates, blocks, the window rules).
- `DraftingOptions`: the mode, the decision policy, the n-gram tier, the batch design.
- `MonitoringOptions`: checks of exited tokens, the agreement monitor, the quality target and its controller.

`RouterConfig` is all four in one flat dataclass (`config.high_conf_threshold`, `config.replace(mode="exit")`, one
JSON object); `RouterConfig.groups()` names which group each field belongs to. Every field carries a `help` string in
its metadata: `describe()` prints them, the CLI builds its options and `docs/configuration.md` from them
(`reference()`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from early_exit_router.config_checks import (
    as_exit_adapters,
    as_layers,
    check_active_subset,
    check_booleans,
    check_cascade,
    check_drafting,
    check_exit_depth,
    check_exit_layers,
    check_integers,
    check_monitoring,
    check_saved_fields,
    check_unit_interval,
)

MODES = ("exit", "verify")
POLICIES = ("cost", "fixed")
BATCH_DESIGNS = ("per_row", "synchronous")
ADAPTER_KINDS = ("identity", "linear", "lowrank", "postnorm", "block", "residual_block")


@dataclass
class HeadLayout:
    """What is saved with the heads and must match them: the exit layers, their adapters, the trimmed draft head's
    vocabulary, and whether they were trained. Loading saved heads under another layout is refused."""

    exit_layers: list[int] | None = field(
        default=None,
        metadata={
            "help": "0-based layer indices with an exit head; exit `e` reads the output of layer `e` "
            "(HF `hidden_states[e + 1]`). Strictly increasing, each below the last layer. "
            "None picks layers at 1/3 and 2/3 of the depth."
        },
    )
    adapter: str = field(
        default="postnorm",
        metadata={
            "help": "Exit adapter kind: 'identity' (logit lens, no parameters), 'linear' (residual full-rank "
            "affine before the final norm, tuned-lens style), 'lowrank' (residual low-rank) or 'postnorm' "
            "(residual full-rank map after the final norm; export-draft folds it exactly into the LM head) or "
            "'block' (one decoder block at the exit, a trained copy of the next layer with a KV cache of its own, "
            "as in Kangaroo; export-draft keeps it as the draft model's last layer) or 'residual_block' (such a "
            "block whose attention and MLP outputs enter scaled per channel from zero, then a post-norm map: it "
            "starts as exactly a 'postnorm' head, can be warm-started from one, and export-draft folds both "
            "scales into the layer's own weights)."
        },
    )
    exit_adapters: dict[int, str] | None = field(
        default=None,
        metadata={
            "help": "Per-exit adapter kinds that replace `adapter` at those exits, e.g. {16: 'residual_block'} "
            "(on the command line 16:residual_block,24:postnorm): a block where one layer of cost buys much more "
            "agreement, the cheap map elsewhere. None gives every exit `adapter`."
        },
    )
    adapter_rank: int = field(
        default=64,
        metadata={"help": "Rank of the 'lowrank' adapter."},
    )
    draft_vocab_size: int = field(
        default=4096,
        metadata={
            "help": "Exit heads draft over the this-many highest-ranked token ids only (a trimmed head: a small "
            "fraction of the full head's cost); the deep pass still uses the full head. 0 uses the full vocabulary."
        },
    )
    heads_trained: bool = field(
        default=False,
        metadata={
            "help": "Set by training. False means the heads are the untrained logit lens, which is confidently "
            "wrong on most models: lossy exits then warn."
        },
    )

    def __post_init__(self) -> None:
        self._check_layout()

    def _check_layout(self) -> None:
        if self.exit_layers is not None:
            self.exit_layers = as_layers("exit_layers", self.exit_layers)
            check_exit_layers(self.exit_layers)
        if self.adapter not in ADAPTER_KINDS:
            raise ValueError(f"Unknown adapter {self.adapter!r}: use one of {', '.join(ADAPTER_KINDS)}.")
        if self.exit_adapters is not None:
            self.exit_adapters = as_exit_adapters(self.exit_adapters, self.exit_layers, ADAPTER_KINDS)
        check_integers(self, {"adapter_rank": 1, "draft_vocab_size": 0})


@dataclass
class CascadeOptions:
    """The exit rule (`early_exit_router/routing/exit_rule.py`): which exits are asked, the confidence -> entropy
    cascade and the gates in front of it, block decisions, and the window rules that force the deep layers back in."""

    active_exit_layers: list[int] | None = field(
        default=None,
        metadata={
            "help": "The exit layers the router consults, a subset of exit_layers; None consults all. An empty list "
            "keeps the heads loaded but runs every token at full depth (the engine's own cost, for comparisons)."
        },
    )
    high_conf_threshold: float = field(
        default=0.9,
        metadata={"help": "Exit when the head's max softmax probability is at or above this (in [0, 1])."},
    )
    low_conf_threshold: float = field(
        default=0.4,
        metadata={
            "help": "Go deeper when the max probability is below this (in [0, 1], at most high_conf_threshold). "
            "Between the two, the entropy rule decides."
        },
    )
    entropy_threshold: float = field(
        default=0.15,
        metadata={
            "help": "Exit when the head's entropy is at or below this. In nats, or as a share of log(vocab) "
            "when entropy_normalized is true (then in [0, 1])."
        },
    )
    entropy_normalized: bool = field(
        default=True,
        metadata={"help": "Divide entropy by log(vocab) so that one threshold transfers across vocabularies."},
    )
    gate_threshold: float = field(
        default=0.5,
        metadata={
            "help": "When an exit has a learned gate, its predicted probability that the exit agrees with the "
            "full model must reach this, or the head is skipped and the token goes deeper (in [0, 1])."
        },
    )
    use_gate: bool = field(
        default=True,
        metadata={"help": "Use learned gates where the checkpoint has them. False ignores them."},
    )
    block_size: int = field(
        default=1,
        metadata={
            "help": "Decide once per block of this many tokens: the block's first token runs the cascade, the "
            "rest leave at the same depth without consulting the router. 1 decides per token."
        },
    )
    max_pending: int = field(
        default=8,
        metadata={
            "help": "Window rule: at most this many exited tokens may wait for the deep layers; at the limit the "
            "next token is forced through the full depth, filling their KV in the same pass."
        },
    )
    confidence_window: int = field(
        default=0,
        metadata={
            "help": "Optional low-confidence window: if the mean confidence of the last this-many exits is below "
            "window_min_confidence, force a deep pass. 0 turns the rule off."
        },
    )
    window_min_confidence: float = field(
        default=0.0,
        metadata={"help": "Mean-confidence bound for confidence_window (in [0, 1])."},
    )
    repeat_guard: int = field(
        default=64,
        metadata={
            "help": "Exit mode under a holdback (where exited tokens may reach the caller unchecked), greedy: an exit "
            "whose token is a word (3+ letters, as the tokenizer decodes it; none without a tokenizer) among the "
            "last this-many generated tokens goes deeper. Shallow heads copy the previous list item ('1. Monday 2. "
            "Monday'), which then cascades; with holdback None repairs catch it. Tokens inside a block (block_size) "
            "follow its first. 0 turns it off."
        },
    )

    def __post_init__(self) -> None:
        self._check_cascade()

    def _check_cascade(self) -> None:
        check_cascade(self)


@dataclass
class DraftingOptions:
    """How drafts are made and judged: the mode, the decision policy (the measured cost model or the fixed cascade),
    the acceptance priors, the zero-layer n-gram tier and its store, and the batch design."""

    mode: str = field(
        default="exit",
        metadata={
            "help": "'exit': a token leaves where the exit rule lets it; one the deep pass finds wrong before it "
            "reached the caller is repaired (holdback). 'verify': exited tokens are drafts that the next deep pass "
            "verifies, so greedy output equals the full model's (lossless)."
        },
    )
    policy: str = field(
        default="cost",
        metadata={
            "help": "'cost': in verify mode, each draft cycle drafts from the tier (an exit or the n-gram tier) with "
            "the most expected tokens per millisecond under the measured cost model and online acceptance "
            "estimates, and decodes plainly (no head, no gate) when no tier beats plain decoding; in exit mode, an "
            "exit is asked only while its estimated exit rate times what an exit saves covers what asking costs "
            "(so exit mode's text can differ between machines that measure different costs). 'fixed': every "
            "token runs the threshold cascade at every exit."
        },
    )
    batch_design: str = field(
        default="synchronous",
        metadata={
            "help": "Verify-mode batches (batch > 1). 'per_row': each row drafts from the n-gram tier and keeps its "
            "own accepted prefix (rejected drafts become masked holes in a rectangular cache); 'synchronous': the "
            "batch drafts from the exits only when every row may and keeps the shortest accepted prefix. Exit-mode "
            "batches are always synchronous, and verify-mode sampling always runs per row. The default is the "
            "faster in `bench-batch` on this project's CPU (docs/batching.md)."
        },
    )
    probe_interval: int = field(
        default=8,
        metadata={
            "help": "Cost policy: every this-many plain steps, score each exit's draft head on the hidden states "
            "the step computed anyway, so acceptance estimates stay current for tiers not in use; an exit whose "
            "estimate stays below where drafting from it pays is scored at doubling gaps, up to 8 times this "
            "(exit mode: ask an exit that does not pay every this-many tokens). 0 never probes."
        },
    )
    acceptance_prior: float = field(
        default=0.5,
        metadata={"help": "Cost policy: the acceptance estimate of a tier before any verdict (in [0, 1])."},
    )
    exit_acceptance_prior: float | None = field(
        default=None,
        metadata={
            "help": "Cost policy: an exit's estimates before any verdict (in [0, 1]; None: acceptance_prior): "
            "drafts' acceptance, gate firing share, top-1 agreement. Where they price its chains below plain "
            "decoding, probes must see it pay first; verify mode leaves a block exit out (it runs every step)."
        },
    )
    ngram_tier: bool = field(
        default=True,
        metadata={
            "help": "Zero-layer tier (prompt lookup): when the last tokens occurred earlier in the context, propose "
            "the tokens that followed there, running no layer for them. The deep pass verifies them in both modes "
            "(exit mode too, unless ngram_unverified). Histogram key -1."
        },
    )
    ngram_size: int = field(
        default=4, metadata={"help": "Longest suffix the n-gram tier matches (it tries down to 2 tokens)."}
    )
    ngram_min_size: int = field(
        default=2,
        metadata={
            "help": "Shortest suffix the n-gram tier matches. 1 also copies after a single repeated token: far more "
            "proposals, far less reliable ones; the cost policy tracks acceptance per match class and drafts from "
            "a class only where it pays."
        },
    )
    ngram_draft: int = field(
        default=32,
        metadata={"help": "Most tokens the n-gram tier proposes at once (the cost policy drafts as many as pay)."},
    )
    ngram_tree_nodes: int = field(
        default=16,
        metadata={
            "help": "Verify mode, one sequence: draft up to this many tokens as a tree of every continuation "
            "the n-gram matches found, verified in one pass (the cost policy picks how many pay). Below 2: chains."
        },
    )
    exit_branches: int = field(
        default=1,
        metadata={
            "help": "Verify mode, one sequence, greedy: each token an exit drafts brings its head's next this-many "
            "choices as alternatives, verified in the same pass as leaves of a token tree (up to ngram_tree_nodes "
            "nodes), where the cost policy finds that they pay. 0: exits draft chains."
        },
    )
    draft_path_threshold: float = field(
        default=0.3,
        metadata={
            "help": "Verify mode, one sequence, a router with a base-exact draft path (adapt-base --scope draft), "
            "consulted while its exit is: a chain ends before the first token drafted below this probability."
        },
    )
    ngram_unverified: bool = field(
        default=False,
        metadata={
            "help": "Exit mode: keep n-gram tokens without verifying them (faster, lossy, prone to repetition); "
            "calls with logits processors (min_new_tokens, suppressed or banned tokens) still verify them, so that the "
            "processors judge every token. Verify mode always verifies."
        },
    )
    ngram_store_tokens: int = field(
        default=65536,
        metadata={
            "help": "The n-gram tier also matches against this router's earlier sequences (prompts and outputs) "
            "across calls, kept up to this many tokens (oldest dropped first; never shared between routers). "
            "0 turns the store off."
        },
    )
    precise_logits: bool = field(
        default=True,
        metadata={
            "help": "With a bf16/fp16 LM head: recompute the full model's 8 leading logits per position in float32 "
            "(same normed state and weights), so greedy choices and verification rank near-ties as the exact product "
            "does, not as bf16 rounding leaves them; logits come back as float32. No effect in float32."
        },
    )
    half_draft_head: bool = field(
        default=True,
        metadata={
            "help": "On an x86 CPU a float32 model's trimmed draft head keeps its rows in float16: half the bytes an "
            "exit's ask reads (most of its cost) and of its copy, for logits within a few hundredths of float32's. "
            "Verify mode's output is unchanged; exit mode can exit differently at near-ties. False (and GPUs, until "
            "measured there): float32 rows."
        },
    )
    compile: bool = field(
        default=False,
        metadata={
            "help": "One sequence's passes of up to 8 positions (plain steps, fills, verify and tree passes) run as "
            "torch.compile graphs over a static KV cache (one for a single position, one for 2 to 8), each graph "
            "shared by every group of layers of its size and computing from the prepacked weights where the stack "
            "has them; the cost policy prices these graphs. Compiled once per process (warm_up does it at load: about "
            "a minute the first time, seconds from inductor's disk cache; stats.compile_s says what a call spent). "
            "Where a family, device or dtype cannot use them (or compiling fails), eager passes run, logged."
        },
    )

    def __post_init__(self) -> None:
        self._check_drafting()

    def _check_drafting(self) -> None:
        check_drafting(self, {"mode": MODES, "policy": POLICIES, "batch_design": BATCH_DESIGNS})
        check_unit_interval("draft_path_threshold", self.draft_path_threshold)


@dataclass
class MonitoringOptions:
    """Online quality: which final early tokens the deep pass checks, the rolling exit-agreement monitor, and the
    threshold controller that holds exit mode's target agreement (rejected drafts, corrected, reach neither)."""

    check_agreement: bool = field(
        default=True,
        metadata={
            "help": "In exit mode, compute the full model's logits for every exited token during the KV fill and "
            "report the exit agreement. Costs one LM-head row per exited token; False computes only the last row."
        },
    )
    check_fraction: float = field(
        default=1.0,
        metadata={
            "help": "In exit mode, the share of exited tokens the deep pass checks against the full model (one "
            "LM-head row each, spread evenly); the exit agreement and the monitor count those. 1: all (in [0, 1])."
        },
    )
    monitor_window: int = field(
        default=32,
        metadata={"help": "Online monitoring: how many recently checked exited tokens the rolling agreement spans."},
    )
    monitor_min_agreement: float = field(
        default=0.0,
        metadata={
            "help": "Warn (once per generate call) when the rolling exit agreement (exited tokens with the full model) "
            "falls below this (in [0, 1]); 0 turns the warning off. The statistics always carry the minimum seen."
        },
    )
    target_agreement: float | None = field(
        default=None,
        metadata={
            "help": "Exit mode's quality target: the teacher-forced agreement of the output with the full model (the "
            "share of tokens that are its choice given the same prefix: greedy after the logits processors, or its "
            "draw with the same noise when sampling) that the threshold controller holds. "
            "From the exit checks since the thresholds last moved (at most controller_window) it raises both "
            "confidence thresholds as soon as the estimate misses the target, lowers them slowly once a 90% upper "
            "bound on the disagreement is within it, and stops exiting (drafts stay verified) when no threshold "
            "holds it. "
            "Calibration sets it (the shipped SmolLM2 heads: 0.95). None keeps the thresholds fixed. In [0, 1]."
        },
    )
    holdback: int | None = field(
        default=None,
        metadata={
            "help": "Exit mode: how many exited tokens may wait for their check before the oldest reaches the "
            "caller (streamer, stopping criteria, output) unchecked. One the deep pass finds wrong before then is "
            "repaired: the output rolls back to it and takes the full model's token, so one wrong list item cannot "
            "cascade. None: none reaches the caller unchecked (greedy output is the full model's; a streamer gets "
            "each after its check, as many as max_pending wait); k > 0: lossy past k; 0: final at once (0.1's)."
        },
    )
    controller_step: float = field(
        default=0.01,
        metadata={"help": "Threshold controller: how far one deep pass lowers the thresholds (raising is 4x faster)."},
    )
    controller_window: int = field(
        default=256,
        metadata={"help": "Threshold controller: the recent tokens (and exit checks) its estimate spans."},
    )

    def __post_init__(self) -> None:
        self._check_monitoring()

    def _check_monitoring(self) -> None:
        check_monitoring(self)


@dataclass
class RouterConfig(MonitoringOptions, DraftingOptions, CascadeOptions, HeadLayout):
    """Configuration of the exit heads and their routing: the four groups' fields in one flat dataclass. Validation
    happens in `__post_init__` (ranges that need no model) and `check_model_depth` (exit layers against the depth)."""

    def __post_init__(self) -> None:
        check_booleans(self)
        self._check_layout()
        self._check_cascade()
        self._check_drafting()
        self._check_monitoring()
        check_active_subset(self.active_exit_layers, self.exit_layers)

    def check_model_depth(self, num_layers: int) -> None:
        """Raise a clear error when an exit layer does not fit a model with `num_layers` layers."""
        check_exit_depth(self.exit_layers or [], num_layers)

    def adapter_for(self, layer: int) -> str:
        """The adapter kind of exit `layer`: its `exit_adapters` entry, else `adapter`."""
        return (self.exit_adapters or {}).get(layer, self.adapter)

    def consulted_exit_layers(self) -> list[int]:
        """The exit layers the router asks, in depth order."""
        layers = self.exit_layers or []
        return [e for e in layers if self.active_exit_layers is None or e in self.active_exit_layers]

    def resolved_exit_layers(self, num_layers: int) -> list[int]:
        """The configured exit layers, or the default ones (1/3 and 2/3 of the depth)."""
        if self.exit_layers is not None:
            self.check_model_depth(num_layers)
            return list(self.exit_layers)
        return sorted({max(0, min(num_layers - 2, round(num_layers * f))) for f in (1 / 3, 2 / 3)})

    def replace(self, **changes: Any) -> RouterConfig:
        """A validated copy with `changes` applied; unknown names raise a TypeError listing the valid ones.

        A new `high_conf_threshold` given without `low_conf_threshold` takes the low threshold down with it where
        the old one would lie above it (a calibrated config uses the confidence rule alone, low = high)."""
        self.check_names(changes)
        high = changes.get("high_conf_threshold")
        if "low_conf_threshold" not in changes and isinstance(high, (int, float)) and self.low_conf_threshold > high:
            changes["low_conf_threshold"] = high
        return dataclasses.replace(self, **changes)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def check_names(cls, changes: Any) -> None:
        """Unknown field names in `changes` raise a TypeError listing the valid ones."""
        if unknown := sorted(set(changes) - set(cls.field_names())):
            raise TypeError(f"Unknown RouterConfig fields {unknown}; valid fields: {', '.join(cls.field_names())}.")

    @staticmethod
    def groups() -> dict[str, list[str]]:
        """Each group's name and its fields, in order."""
        return {g.__name__: [f.name for f in dataclasses.fields(g)] for g in GROUPS}

    @classmethod
    def describe(cls) -> str:
        """One line per field, group by group: name, default, help."""
        return "\n".join(f"{f.name} (default {f.default!r}): {f.metadata['help']}" for f in dataclasses.fields(cls))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RouterConfig:
        data = dict(data)
        if "controller_target" in data:  # 0.1.0 steered the exit agreement; the target is now the output's
            data.setdefault("target_agreement", data.pop("controller_target"))
        check_saved_fields(data, cls.field_names())
        return cls(**data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")


GROUPS = (HeadLayout, CascadeOptions, DraftingOptions, MonitoringOptions)

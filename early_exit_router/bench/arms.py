"""The arms a bench run compares (`build_arms`) and what selects them (`BenchConfig`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from early_exit_router.bench.llama_cpp_arm import LLAMA_CPP, llama_cpp_source
from early_exit_router.models.compiled import compile_unsupported

CONTROL = "plain HF generate"
ENGINE_CONTROL = "router, exits off"
NO_REPAIR = "router exit, no repair (holdback 0)"
NO_GUARD = "router exit, no repair, no repeat guard"  # what `repeat_guard` buys where nothing repairs
# HF's own fast path, the speed a user who knows transformers gets without this package: a static cache and the
# decode step compiled by torch.compile (`_compat.compiled_generate_kwargs`)
HF_COMPILED = "HF static cache + torch.compile"


@dataclass
class Arm:
    """One way of generating. `kind`: 'plain' (HF generate with `hf_kwargs`), 'router' or 'llama.cpp'
    (`llama_cpp_arm.py`)."""

    name: str
    kind: str
    mode: str | None = None
    overrides: dict[str, Any] = field(default_factory=dict)  # RouterConfig changes for router arms
    hf_kwargs: dict[str, Any] = field(default_factory=dict)  # extra HF generate arguments for plain arms
    family: str = ""  # plot series: arms of one family differ only in `threshold`
    threshold: float | None = None
    heads: str = ""  # router arms: which heads run it, by label ("": the bench's router; else one of `others`)
    compiled: bool = False  # compiled passes: HF's static cache + torch.compile, or the router's `compile`


@dataclass
class BenchConfig:
    """What `run_bench` measures. Sweeps set a confidence-only threshold (`threshold_overrides`)."""

    max_new_tokens: int = 64
    repeats: int = 2  # one repeat's per-prompt ratios move by 8-10% on a 2-core CPU
    modes: tuple[str, ...] = ("exit", "verify")
    thresholds: tuple[float, ...] = (0.3, 0.5, 0.7, 0.9)  # swept next to the loaded config
    ngram: bool = True  # add each mode with the zero-layer n-gram tier alone (exits off)
    fixed_cascade: bool = True  # add each mode with the fixed threshold cascade and no n-gram tier
    loaded_config: bool = True  # add each mode at the router's loaded config
    engine_control: bool = True
    assistant_early_exit: tuple[int, ...] | None = None  # None: the deepest exit layer + 1; () skips the arm
    prompt_lookup_num_tokens: int = 10  # 0 skips the arm
    no_repair_arm: bool = True  # exit mode: the loaded config also without repairs (holdback 0), with and without
    # the repeat guard
    hf_compiled: bool = True  # the anchor arm: HF generate with a static cache and torch.compile (`HF_COMPILED`)
    compiled: bool = True  # where the router's passes compile: exits off and each mode's loaded config, compiled
    llama_cpp: bool = True  # greedy runs, where llama-cpp-python is installed and the base came from a GGUF file
    warmup: bool = True
    # > 0: every arm samples at this temperature (no top-k or top-p), each prompt and repeat from one seed; the
    # outputs then differ between arms by chance, and speed is what compares
    temperature: float = 0.0


def threshold_overrides(threshold: float) -> dict[str, float | None]:
    """RouterConfig changes for a swept threshold: the confidence rule alone (low = high, no entropy band), held
    fixed (no quality target moves it).

    One number then orders the candidates from conservative to aggressive, which calibration's fixed-sequence
    test needs; with a band, the entropy rule decides most exits and a sweep of `high_conf_threshold` alone
    barely changes anything (measured: 0.7 to 0.99 gave the same outputs).
    """
    return {"high_conf_threshold": threshold, "low_conf_threshold": threshold, "target_agreement": None}


def build_arms(router: Any, cfg: BenchConfig, others: Sequence[str] = ()) -> list[Arm]:
    """The arms for `router` under `cfg`, the control first; `others`: labels of other heads, each run at its
    loaded config in every mode."""
    arms = [Arm(CONTROL, "plain", family="control")]
    if cfg.hf_compiled:
        arms.append(Arm(HF_COMPILED, "plain", family="HF compiled", compiled=True))
    if cfg.llama_cpp and cfg.temperature == 0 and llama_cpp_source(router) is not None:
        arms.append(Arm(LLAMA_CPP, "llama.cpp", family="llama.cpp"))  # what a CPU user would run instead
    compiled = cfg.compiled and compile_unsupported(router.stack) is None
    no_drafts = {"active_exit_layers": [], "ngram_tier": False}  # the decode loop alone: every token plain
    if cfg.engine_control:
        arms.append(Arm(ENGINE_CONTROL, "router", "exit", no_drafts, family="engine control"))
    if cfg.engine_control and compiled:
        arms.append(Arm(f"{ENGINE_CONTROL}, compiled", "router", "exit", {**no_drafts, "compile": True},
                        family="engine control, compiled", compiled=True))  # fmt: skip
    for mode in cfg.modes:
        if cfg.loaded_config:
            arms.append(Arm(f"router {mode} (loaded config)", "router", mode, family=f"router {mode}, loaded config"))
        if cfg.loaded_config and compiled:
            name, family = f"router {mode} (loaded config), compiled", f"router {mode}, loaded config, compiled"
            arms.append(Arm(name, "router", mode, {"compile": True}, family=family, compiled=True))
        if cfg.loaded_config and cfg.no_repair_arm and mode == "exit":  # what repairs cost and buy
            arms.append(Arm(NO_REPAIR, "router", mode, {"holdback": 0}, family="router exit, no repair"))
            unguarded = {"holdback": 0, "repeat_guard": 0}
            arms.append(Arm(NO_GUARD, "router", mode, unguarded, family="router exit, no repair, no repeat guard"))
        for t in sorted(cfg.thresholds, reverse=True):
            overrides = threshold_overrides(t)
            arms.append(Arm(f"router {mode} @{t:g}", "router", mode, overrides, family=f"router {mode}", threshold=t))
        if cfg.ngram:
            name = f"router {mode}, n-gram tier only"
            overrides = {"ngram_tier": True, "active_exit_layers": []}
            arms.append(Arm(name, "router", mode, overrides, family=f"router {mode}, n-gram only"))
        if cfg.ngram and compiled:  # what the compiled default's exits add over its own n-gram tier
            name, family = f"router {mode}, n-gram tier only, compiled", f"router {mode}, n-gram only, compiled"
            overrides = {"ngram_tier": True, "active_exit_layers": [], "compile": True}
            arms.append(Arm(name, "router", mode, overrides, family=family, compiled=True))
        if cfg.fixed_cascade:
            name = f"router {mode}, fixed cascade, no n-gram"
            overrides = {"policy": "fixed", "ngram_tier": False}
            arms.append(Arm(name, "router", mode, overrides, family=f"router {mode}, fixed cascade"))
        for label in others:
            family = f"router {mode}, loaded config, heads {label}"
            arms.append(Arm(f"router {mode} (heads {label})", "router", mode, family=family, heads=label))
    early_exits = cfg.assistant_early_exit
    if early_exits is None:
        early_exits = (router.exit_layers[-1] + 1,) if router.exit_layers else ()
    for e in early_exits:
        arms.append(Arm(f"HF assisted, early exit {e}", "plain", hf_kwargs={"assistant_early_exit": e}, family="HF"))
    if cfg.prompt_lookup_num_tokens:
        n = cfg.prompt_lookup_num_tokens
        arms.append(Arm(f"HF prompt lookup {n}", "plain", hf_kwargs={"prompt_lookup_num_tokens": n}, family="HF"))
    return arms

"""`bench`: the router against plain HF generation and HF's own speed-ups, side by side in one process.

An A/B design: the control is plain HF `model.generate` (greedy) on the unpatched model; every other arm runs on
the same prompts, the same hardware and the same decoding parameters, interleaved prompt by prompt (the arm order
rotates between prompts and repeats, so no arm always runs first). Arms:

- the control, and the router with its exits switched off (the cost or gain of our own decode loop);
- the anchor: HF `generate` with its static cache and the decode step compiled by torch.compile, HF's own fast path
  (every row also reports its speedup over it);
- the router at its loaded config (the default that `generate` uses; exit mode also without repairs, holdback 0),
  and in each mode over a sweep of confidence-only thresholds (`@t`: exit when the head's max probability >= t);
- the n-gram tier alone (exits off), so the exits must earn their place against it in the same run, and the fixed
  threshold cascade without the n-gram tier (how the router decoded before the cost policy);
- HF assisted generation with `assistant_early_exit=E` (the model's own first E layers and its LM head draft);
- HF prompt-lookup decoding (`prompt_lookup_num_tokens`);
- other heads for the same base (`others`: heads in training against the shipped ones), each at its loaded config,
  on its own copy of the model: heads compare by speed only in one process (one kernel choice, one cost table).

Prompts that name a `sequence` are similar requests sent one after another through one router: each arm runs the
sequence's calls in order, its n-gram store kept between them (every other run starts with an empty store), and the
first call is reported apart (category "..., first call") from the calls after it, which is where the store pays.

Per run: tokens/s, time to first token, inter-token latency (the gap between tokens' arrival at a streamer, so
tokens that arrive together count 0 after the first), peak memory, routing statistics, compute per token relative
to the full model (`compute.ComputeMeter`), and quality against the control (`metrics`). Speedups are ratios to the
control measured in the same run; absolute numbers depend on the machine.
"""

from __future__ import annotations

import json
import os
import platform
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from transformers.utils import logging as hf_logging

from early_exit_router.bench.arms import (  # noqa: F401 (the names the bench is used by)
    CONTROL,
    ENGINE_CONTROL,
    HF_COMPILED,
    NO_GUARD,
    NO_REPAIR,
    Arm,
    BenchConfig,
    build_arms,
    threshold_overrides,
)
from early_exit_router.bench.compute import ComputeMeter
from early_exit_router.bench.copy_ceiling import copy_ceilings
from early_exit_router.bench.llama_cpp_arm import LlamaCppRunner, llama_cpp_source
from early_exit_router.bench.prompts import encode_record, request_units
from early_exit_router.bench.quality import score_quality
from early_exit_router.bench.report import format_markdown, plot_tradeoff
from early_exit_router.bench.summary import RunRecord, summarize
from early_exit_router.bench.timing import ArrivalStreamer, latencies, peak_memory_mb, reset_peak_memory
from early_exit_router.decode.ask import warm_graphs
from early_exit_router.heads.checkpoint import base_identity
from early_exit_router.models import _compat
from early_exit_router.models.compiled import MAX_WIDTH
from early_exit_router.routing.costs import cpu_model


class _Runner:
    """Runs one arm on one prompt, leaving the router's config as it found it."""

    def __init__(self, router: Any, max_new_tokens: int, temperature: float = 0.0, costs_from: Any = None) -> None:
        self.router = router
        self.costs_from = costs_from  # compared heads decide from the bench router's cost table: one table per run
        self.max_new_tokens = max_new_tokens
        self.device = router.stack.device
        self.temperature = temperature
        # HF's static cache, sized once for the run's longest call: one compiled decode step serves every call
        self.static_cache_len = max_new_tokens
        self.llama_cpp: LlamaCppRunner | None = None  # loaded by the first llama.cpp arm's `prepare`

    def prepare(self, arm: Arm) -> None:
        """Before a run, outside its time and compute: under the cost policy the cost table is measured (or loaded)
        here, not inside a router run (before the first, and again when the timed steps no longer fit it: the
        machine's load changed); heads compared with the bench router's take its table (their own `cost_model`,
        which the bench restores). A compiled arm's table is the compiled passes' own. llama.cpp loads its model."""
        if arm.kind == "llama.cpp" and self.llama_cpp is None:
            gpu = self.device.type == "cuda"
            self.llama_cpp = LlamaCppRunner(
                llama_cpp_source(self.router), self.static_cache_len, torch.get_num_threads(), gpu
            )
        if arm.kind != "router" or self.router.config.policy != "cost":
            return
        if self.costs_from is None:
            self.router.costs(config=self.config(arm))
        else:
            self.router.cost_model = self.costs_from.costs(config=self.costs_from.config.replace(**arm.overrides))

    def config(self, arm: Arm) -> Any:
        """The router config `arm` runs: the runner's router's, with the arm's overrides (router.config is never
        swapped)."""
        return self.router.config.replace(**arm.overrides)

    def warm_graphs(self, arm: Arm) -> None:
        """A compiled router arm: compile now the graphs its decodes would compile at first use (the widths the
        warm-up's decode did not run, the asks of the arm's own exits)."""
        if arm.compiled and arm.kind == "router":
            warm_graphs(self.router.stack, self.router.heads, self.config(arm), range(1, MAX_WIDTH + 1))

    def run(
        self, arm: Arm, ids: torch.Tensor, keep_store: bool = False, seed: int = 0
    ) -> tuple[list[int], dict | None, float, list]:
        """Generate with `arm` (sampling from `seed` at the runner's temperature, if any); returns new token ids,
        router stats, wall seconds, streamer arrivals."""
        router, n = self.router, ids.shape[1]
        sampling = {"do_sample": False}  # greedy whatever the model's generation config says
        if self.temperature > 0:
            sampling = {"do_sample": True, "temperature": self.temperature, "top_k": 0, "top_p": 1.0}
        streamer = ArrivalStreamer()
        start = time.perf_counter()
        if arm.kind == "router":
            # A run starts with an empty n-gram store (the same prompt from another arm would otherwise be copied
            # whole), except the later calls of a sequence of requests, which keep what this arm's earlier calls
            # stored: that is what the store is for.
            if not keep_store:
                router.clear_ngram_store()
            out = router.generate(ids, self.max_new_tokens, mode=arm.mode, config=self.config(arm), streamer=streamer,
                                  **sampling, **({"seed": seed} if sampling["do_sample"] else {}))  # fmt: skip
            new_ids, stats = out.sequences[0, n:].tolist(), out.stats.to_dict()
        elif arm.kind == "llama.cpp":
            new_ids, times = self.llama_cpp.generate(ids, self.max_new_tokens, router.eos_token_ids())
            stats, streamer.arrivals = None, [(t, 1) for t in times]
        else:
            if sampling:
                torch.manual_seed(seed)  # HF samples from the global generator
            with router.disabled() as model, torch.no_grad():
                out = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=self.max_new_tokens,
                    streamer=streamer,
                    **{"do_sample": False, **sampling, **arm.hf_kwargs},
                    **(_compat.compiled_generate_kwargs(self.static_cache_len, self.device) if arm.compiled else {}),
                )
            new_ids, stats = out[0, n:].tolist(), None
        wall = time.perf_counter() - start
        return new_ids, stats, wall, [(t - start, k) for t, k in streamer.arrivals]


@dataclass
class BenchResult:
    """Everything one bench run measured; `summary` holds one row per (category, arm), categories plus 'all'."""

    meta: dict[str, Any]
    arms: list[Arm]
    records: list[RunRecord]
    summary: list[dict[str, Any]]

    def to_dict(self) -> dict[str, Any]:
        return {
            "meta": self.meta,
            "arms": [asdict(a) for a in self.arms],
            "summary": self.summary,
            "records": [asdict(r) for r in self.records],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BenchResult:
        """Rebuild a result from `to_dict()` (e.g. bench.json), to render its table or plot again."""
        arms = [Arm(**a) for a in data["arms"]]
        records = [RunRecord(**r) for r in data["records"]]
        return cls(data["meta"], arms, records, data["summary"])

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    def markdown(self) -> str:
        return format_markdown(self.meta, self.summary)

    def plot(self, path: str | Path) -> None:
        plot_tradeoff(self.meta, self.summary, path)


def run_bench(
    router: Any,
    prompts: Sequence[dict[str, Any]],
    cfg: BenchConfig | None = None,
    progress: bool = True,
    reference: torch.nn.Module | Callable[[], torch.nn.Module] | None = None,
    others: Mapping[str, Any] | None = None,
) -> BenchResult:
    """Run every arm of `build_arms(router, cfg)` on every prompt (records: id, category, kind, prompt).

    `reference`: the same base model at a higher precision (fp32 beside a bf16 bench), or a function that loads it
    (called after the timed runs, so its memory stays out of theirs): every output is also scored by its
    teacher-forced agreement with that model, the quality a lower-precision arm is held to.
    `others`: label -> a router with other heads for the same base model (its own copy), each run at its loaded config
    in every mode beside `router`'s arms."""
    from tqdm.auto import tqdm

    cfg = cfg or BenchConfig()
    if not prompts:
        raise ValueError("No prompts to benchmark: give a JSONL file with id, category, kind and prompt fields.")
    if cfg.repeats < 1 or cfg.max_new_tokens < 1:
        raise ValueError(f"repeats and max_new_tokens must be >= 1, got {cfg.repeats} and {cfg.max_new_tokens}.")
    others = dict(others or {})
    base = (base_identity(router.stack, ""), router.stack.dtype, _adapted(router)) if others else None
    for label, other in others.items():  # one base (its LM head and final norm, checked numerically) in one dtype
        if (base_identity(other.stack, ""), other.stack.dtype, _adapted(other)) != base:
            raise ValueError(f"Heads {label!r} run on {other.name_or_path} in {other.stack.dtype}, not on the base and "
                             "dtype of --model (or an adapt-base folder's other weights): compare heads trained for "
                             "one base model, in one dtype.")  # fmt: skip
    arms = build_arms(router, cfg, list(others))
    if cfg.temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0: greedy), got {cfg.temperature}.")
    runners = {"": _Runner(router, cfg.max_new_tokens, cfg.temperature)}
    runners |= {label: _Runner(o, cfg.max_new_tokens, cfg.temperature, router) for label, o in others.items()}
    assigned = {label: other.cost_model for label, other in others.items()}
    encoded = [encode_record(router, p) for p in prompts]
    for runner in runners.values():
        runner.static_cache_len = max(ids.shape[1] for ids in encoded) + cfg.max_new_tokens
    units = request_units(prompts)
    records: list[RunRecord] = []
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # HF's assisted-generation notices and our monitor's warnings: noise here
    try:
        with ExitStack() as stack:
            meters = {k: stack.enter_context(ComputeMeter(r.router.stack, r.router.heads)) for k, r in runners.items()}
            if cfg.warmup:  # first-call allocations (and compilation) stay out of the numbers
                longest = max(encoded, key=lambda ids: ids.shape[1])  # compiled passes: the static length of the run
                for arm in arms:
                    with meters[arm.heads].paused() if arm.compiled else nullcontext():
                        runners[arm.heads].prepare(arm)  # a compiled arm's cost table is measured on its graphs
                        runners[arm.heads].run(arm, longest if arm.compiled else encoded[0][:, :8])
                        runners[arm.heads].warm_graphs(arm)
            bar = tqdm(total=cfg.repeats * len(prompts) * len(arms), disable=not progress, desc="bench", unit="run")
            for repeat in range(cfg.repeats):
                for u_idx, unit in enumerate(units):
                    shift = (u_idx + repeat) % len(arms)
                    for arm in arms[shift:] + arms[:shift]:
                        for call, p_idx in enumerate(unit):  # a sequence's calls in order, one arm at a time
                            runner, meter = runners[arm.heads], meters[arm.heads]
                            records.append(_measure(runner, arm, prompts[p_idx], encoded[p_idx], repeat, meter, call))
                            bar.update(1)
            bar.close()
    finally:
        hf_logging.set_verbosity(verbosity)
        for runner in runners.values():
            if runner.llama_cpp is not None:
                runner.llama_cpp.close()
        for label, other in others.items():
            other.cost_model = assigned[label]
    if reference is not None and not isinstance(reference, torch.nn.Module):
        reference = reference()
    score_quality(router, prompts, encoded, records, reference, control_arm=CONTROL)
    meta = _meta(router, cfg, prompts)
    meta["compared_heads"] = {label: other.describe() for label, other in others.items()}
    if runners[""].llama_cpp is not None:
        meta["llama_cpp"] = runners[""].llama_cpp.describe()
    if router.config.policy == "cost" and router.config.ngram_tier:
        control = {r.prompt_id: (r.category, r.new_ids) for r in records if r.arm == CONTROL and r.repeat == 0}
        meta["copy_ceiling"] = copy_ceilings(prompts, encoded, control, units, router.costs(), router.config)
    if reference is not None:
        meta["reference_dtype"] = str(next(reference.parameters()).dtype).replace("torch.", "")
    return BenchResult(meta, arms, records, summarize(records, arms))


def _measure(
    runner: _Runner, arm: Arm, item: dict, ids: torch.Tensor, repeat: int, meter: ComputeMeter, call: int = 0
) -> RunRecord:
    """One run; `call` > 0: a later call of a sequence (the router keeps its n-gram store from the earlier ones)."""
    with meter.paused() if arm.compiled else nullcontext():
        runner.prepare(arm)
    reset_peak_memory(runner.device)
    meter.reset()
    seed = zlib.crc32(f"{item['id']}:{repeat}".encode())  # the same for every arm
    # Compiled arms run without the meter's hooks (a graph would trace them): their compute is not counted (HF's
    # is the control's; the router's, its eager arm's: the same decisions)
    with meter.paused() if arm.compiled else nullcontext():
        new_ids, stats, wall, arrivals = runner.run(arm, ids, keep_store=call > 0, seed=seed)
    count = meter.reset()
    decode_steps = len(new_ids) - 1
    compute = None
    if decode_steps > 0 and not arm.compiled and arm.kind != "llama.cpp":  # llama.cpp's compute is not torch's
        decode_macs = count.total - meter.prefill_macs(ids.shape[1])
        compute = decode_macs / (decode_steps * meter.full_token_macs)
    ttft, gaps = latencies(arrivals)
    # A sequence's first call has nothing stored to copy from: it is reported apart from the calls after it.
    first_call = "sequence" in item and call == 0
    return RunRecord(
        prompt_id=item["id"],
        category=f"{item['category']}, first call" if first_call else item["category"],
        arm=arm.name,
        repeat=repeat,
        new_ids=new_ids,
        wall_s=wall,
        ttft_s=ttft,
        inter_token_s=gaps,
        peak_memory_mb=peak_memory_mb(runner.device),
        compute_ratio=compute,
        stats=stats,
    )


def _meta(router: Any, cfg: BenchConfig, prompts: Sequence[dict]) -> dict[str, Any]:
    import transformers

    stack = router.stack
    device = stack.device
    if device.type == "cuda":
        machine = torch.cuda.get_device_name(device)
    else:
        machine = (
            f"{platform.machine()} CPU ({cpu_model()}), {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"
        )
    return {
        "model": router.describe(),
        "machine": machine,
        "device": str(device),
        "dtype": str(stack.dtype).replace("torch.", ""),
        "weights": sorted(stack.weight_formats()),  # quantized bases: every arm runs the same quantized model
        "packed_weights": len(stack.packed_weights or ()),  # router arms' products from prepacked weights
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "num_layers": stack.num_layers,
        "router_config": router.config.to_dict(),
        "cost_model": router.costs().to_dict() if router.config.policy == "cost" else None,
        "bench_config": asdict(cfg),
        "prompts": len(prompts),
        "decoding": f"sampled at temperature {cfg.temperature}" if cfg.temperature > 0 else "greedy",
        "peak_memory": "peak allocated CUDA memory" if device.type == "cuda" else "process resident high-water mark",
    }


def _adapted(router: Any) -> str | None:
    """The adapt-base folder whose weights `router`'s model holds (None: the base as it was)."""
    return str(router.adapted_from[0].resolve()) if getattr(router, "adapted_from", None) else None

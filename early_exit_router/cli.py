"""Command line: `early-exit-router generate ...`. Router options are generated from `RouterConfig`'s fields."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from early_exit_router.config import ADAPTER_KINDS, BATCH_DESIGNS, MODES, POLICIES, RouterConfig
from early_exit_router.models.loading import DEFAULT_MODEL

CHOICES = {"mode": MODES, "adapter": ADAPTER_KINDS, "policy": POLICIES, "batch_design": BATCH_DESIGNS}
DEFAULT_PROMPT = "List the seven days of the week as a numbered list, one per line, nothing else."


def _add_router_options(parser: argparse.ArgumentParser) -> None:
    """One --option per RouterConfig field, with the field's own help text. Unset options keep saved values."""
    group = parser.add_argument_group("router options (default: the saved or built-in RouterConfig)")
    for f in dataclasses.fields(RouterConfig):
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{f.metadata['help']} (built-in default: {f.default!r})"
        if f.name in ("exit_layers", "active_exit_layers"):
            group.add_argument(flag, type=_int_list, default=None, metavar="E1,E2", help=help_text)
        elif f.name == "exit_adapters":
            group.add_argument(flag, type=_kind_map, default=None, metavar="E1:KIND,E2:KIND", help=help_text)
        elif f.type in ("bool", bool):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif f.name in CHOICES:
            group.add_argument(flag, choices=CHOICES[f.name], default=None, help=help_text)
        else:
            kind = int if isinstance(f.default, int) and not isinstance(f.default, bool) else float
            kind = str if isinstance(f.default, str) else kind
            group.add_argument(flag, type=kind, default=None, help=help_text)


def _add_load_options(parser: argparse.ArgumentParser) -> None:
    """--dtype and --device, for commands whose speed or numbers depend on where the model runs."""
    parser.add_argument(
        "--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="Model dtype (default: float32)."
    )
    parser.add_argument("--device", default=None, help="Device, e.g. cpu or cuda (default: cpu).")
    parser.add_argument(
        "--quantize",
        default=None,
        choices=["int8", "int4", "bnb-8bit", "bnb-4bit"],
        help="Load the base quantized: torchao weight-only int8/int4 (any device) or bitsandbytes (CUDA). In bench "
        "every arm, the plain HF control included, runs the same quantized model.",
    )


def _router_overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(RouterConfig)
        if getattr(args, f.name, None) is not None
    }


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer indices like 10,20, got {text!r}") from None


def _kind_map(text: str) -> dict[int, str]:
    """'16:residual_block,24:postnorm' -> {16: 'residual_block', 24: 'postnorm'}."""
    try:
        pairs = [item.split(":") for item in text.split(",") if item.strip()]
        return {int(layer): kind.strip() for layer, kind in pairs}
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated layer:kind pairs like 16:residual_block, got {text!r}"
        ) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="early-exit-router",
        description="One-model early-exit generation for Hugging Face causal LMs, with layer-wise KV filling.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser(
        "generate",
        help="Generate text with early exit and print routing statistics.",
        description="Generate from a prompt with early exit; print the text and the routing statistics.",
    )
    gen.add_argument(
        "prompt", nargs="?", default=DEFAULT_PROMPT, help="The prompt text (default: a short list-making request)."
    )
    gen.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="Alias, local HF model folder, .gguf file, or saved router folder (default: %(default)s).",
    )
    gen.add_argument("--max-new-tokens", type=int, default=96, help="Most tokens to generate (default: %(default)s).")
    gen.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Wrap the prompt in the tokenizer's chat template when it has one (default: on).",
    )
    gen.add_argument("--do-sample", action="store_true", help="Sample instead of greedy decoding.")
    gen.add_argument("--temperature", type=float, default=1.0, help="Sampling temperature (default: %(default)s).")
    gen.add_argument("--top-k", type=int, default=None, help="Sample from the k most likely tokens.")
    gen.add_argument("--top-p", type=float, default=None, help="Nucleus sampling mass.")
    gen.add_argument("--seed", type=int, default=None, help="Seed for reproducible sampling.")
    gen.add_argument("--stop", action="append", default=None, help="Stop string (repeatable).")
    _add_load_options(gen)
    gen.add_argument("--stream", action="store_true", help="Print tokens as they become final.")
    gen.add_argument(
        "--compare",
        action="store_true",
        help="Also run plain HF generate on the same prompt and report the speed ratio and token match.",
    )
    gen.add_argument("--json", action="store_true", help="Print the statistics as JSON instead of a summary.")
    gen.add_argument(
        "--trace",
        action="store_true",
        help="Show each token with the depth it left at: colours in a terminal, [L12]-style markers otherwise.",
    )
    _add_router_options(gen)

    train = sub.add_parser(
        "train-heads",
        help="Train the exit heads (and gates) by self-distillation and save the router.",
        description="Train exit adapters by KL self-distillation to the frozen full model, on the model's own "
        "answers to a prompt set plus READMEs of installed packages; fit a learned gate per exit; pick "
        "high_conf_threshold for a target agreement on held-out positions; save the router folder.",
    )
    train.add_argument("--model", default=DEFAULT_MODEL, help="Base model: alias, HF folder or .gguf file.")
    train.add_argument("--out", required=True, help="Folder to save the trained router into.")
    train.add_argument("--max-tokens", type=int, default=120_000, help="Corpus size in tokens (default: %(default)s).")
    train.add_argument("--max-steps", type=int, default=600, help="Optimiser steps (default: %(default)s).")
    train.add_argument(
        "--max-seconds", type=float, default=None, help="A wall-clock training budget instead of --max-steps."
    )
    train.add_argument("--batch-tokens", type=int, default=512, help="Positions per step (default: %(default)s).")
    train.add_argument("--lr", type=float, default=2e-3, help="Learning rate (default: %(default)s).")
    train.add_argument("--ce-weight", type=float, default=0.0, help="Weight of next-token cross-entropy.")
    train.add_argument("--seed", type=int, default=0, help="Seed (default: %(default)s).")
    train.add_argument(
        "--self-gen-tokens", type=int, default=96, help="Answer length per training prompt; 0 skips self-generation."
    )
    train.add_argument("--prompts", default=None, help="JSONL of training prompts (default: the shipped set).")
    train.add_argument(
        "--generated-prompts",
        type=int,
        default=0,
        help="Also answer this many prompts built offline (templates, package summaries, text to continue).",
    )
    train.add_argument("--sampled", action="store_true", help="Also add one sampled answer to every prompt.")
    train.add_argument("--no-docs", action="store_true", help="Do not train on installed packages' READMEs.")
    train.add_argument("--no-gates", action="store_true", help="Do not fit learned gates.")
    train.add_argument(
        "--pre-head-gates",
        action="store_true",
        help="Fit gates that run before the head (they can skip it) instead of head gates (a learned confidence "
        "from the head's output, the state and the n-gram tier: more exits at the same agreement).",
    )
    train.add_argument(
        "--target-agreement",
        type=float,
        default=0.9,
        help="Pick high_conf_threshold so held-out exits agree this often (default: %(default)s; 0 keeps it).",
    )
    train.add_argument(
        "--init-from",
        default=None,
        help="Warm start: a saved router folder or alias whose trained adapters load into the new heads (same kind "
        "whole; a postnorm head into a residual_block's post-norm map) and learn at --warm-lr-scale of the rate.",
    )
    train.add_argument(
        "--train-exits",
        type=_int_list,
        default=None,
        metavar="E1,E2",
        help="Train only these exits' adapters; the others keep what --init-from loaded (default: all).",
    )
    train.add_argument(
        "--warm-lr-scale", type=float, default=0.1, help="Rate factor of warm-started parameters (default: 0.1)."
    )
    train.add_argument(
        "--hidden-states",
        default=None,
        help="A file for the corpus' hidden states: reused when it exists (the corpus is then not built again), "
        "written after the corpus pass when it does not.",
    )
    train.add_argument(
        "--gate-prompts",
        type=int,
        default=0,
        help="Fit the gates also on the model's greedy and sampled answers to this many fresh prompts (built "
        "offline, none of them a training prompt), text no adapter trains on (default: %(default)s).",
    )
    train.add_argument(
        "--gate-hidden-states",
        default=None,
        help="A file for the gate text's hidden states: reused when it exists, written when it does not.",
    )
    train.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice).")
    train.add_argument("--quiet", action="store_true", help="No progress bars.")
    _add_router_options(train)

    report = sub.add_parser(
        "eval-heads",
        help="Report exit-head agreement with the full model, logit lens vs trained, on held-out text.",
        description="For each exit layer: top-1 agreement with the final layer for the logit lens and the loaded "
        "heads over all tokens, the share of tokens the router's cascade lets exit there at the loaded thresholds, "
        "and the agreement among those. Sources: the model's answers to the development prompts, Debian's "
        "common licenses and CPython standard-library source (none of them used in training).",
    )
    report.add_argument("--model", default=DEFAULT_MODEL, help="Alias, saved router folder, HF folder or .gguf.")
    report.add_argument("--prompts", default=None, help="Development prompts JSONL (default: the shipped set).")
    report.add_argument("--answer-tokens", type=int, default=96, help="Answer length per development prompt.")
    report.add_argument("--max-tokens", type=int, default=6000, help="Tokens per held-out text source.")
    report.add_argument("--json", default=None, help="Also write the tables to this JSON file.")
    _add_router_options(report)

    bench = sub.add_parser(
        "bench",
        help="Side by side: plain HF generate, the router (threshold sweep), HF assisted early exit and prompt lookup.",
        description="A/B benchmark in one process on the same prompts: the control (plain HF greedy), the router "
        "with exits off, the router in each mode over a threshold sweep (and with the n-gram tier), HF assisted "
        "generation with assistant_early_exit, and HF prompt lookup. Prints a markdown table per category (speed, "
        "routing, compute, quality against the control) and writes JSON and a PNG plot.",
    )
    bench.add_argument("--model", default=DEFAULT_MODEL, help="Alias, saved router folder, HF folder or .gguf.")
    bench.add_argument("--prompts", default=None, help="JSONL: id, category, kind (text|chat), prompt (default: dev).")
    bench.add_argument("--max-new-tokens", type=int, default=64, help="New tokens per prompt (default: %(default)s).")
    bench.add_argument("--repeats", type=int, default=1, help="Interleaved repeats (default: %(default)s).")
    bench.add_argument(
        "--modes", type=_str_list, default=["exit", "verify"], metavar="M1,M2", help="Router modes (default: both)."
    )
    bench.add_argument(
        "--thresholds",
        type=_float_list,
        default=[0.3, 0.5, 0.7, 0.9],
        metavar="T1,T2",
        help="high_conf_threshold sweep; the loaded threshold is always added (default: 0.3,0.5,0.7,0.9).",
    )
    bench.add_argument("--no-ngram", action="store_true", help="Skip the 'n-gram tier only' rows.")
    bench.add_argument(
        "--no-fixed-cascade", action="store_true", help="Skip the 'fixed cascade, no n-gram' rows (the old default)."
    )
    bench.add_argument(
        "--assistant-early-exit",
        type=_int_list,
        default=None,
        metavar="E1,E2",
        help="HF assisted generation with the first E layers as draft (default: deepest exit + 1; '' skips).",
    )
    bench.add_argument(
        "--prompt-lookup", type=int, default=10, help="HF prompt_lookup_num_tokens; 0 skips (default: %(default)s)."
    )
    bench.add_argument("--out", default="bench-results", help="Folder for bench.json and bench.png.")
    _add_load_options(bench)
    bench.add_argument("--quiet", action="store_true", help="No progress bar.")
    _add_router_options(bench)

    load = sub.add_parser(
        "loadtest",
        help="Concurrent streaming clients against the server (routing on and off); checks every response.",
        description="Starts the server in-process on loopback, sends chat requests from N concurrent streaming clients "
        "with the official openai client, once with the router's config and once with routing off, checks that "
        "every (greedy) response equals the same request run alone, and reports throughput and p50/p99 latency.",
    )
    load.add_argument("--model", default=DEFAULT_MODEL, help="Alias, saved router folder, HF folder or .gguf.")
    load.add_argument("--prompts", default=None, help="JSONL: id, category, kind, prompt (default: dev).")
    load.add_argument("--clients", type=int, default=8, help="Concurrent streaming clients (default: 8).")
    load.add_argument("--requests-per-client", type=int, default=2, help="Requests each client sends (default: 2).")
    load.add_argument("--max-tokens", type=int, default=32, help="max_tokens per request (default: 32).")
    load.add_argument("--out", default=None, help="Write loadtest.json into this folder.")
    _add_load_options(load)
    _add_router_options(load)

    batch = sub.add_parser(
        "bench-batch",
        help="Batched generation against HF batched generate, at several batch sizes, side by side.",
        description="Left-pads the first B prompts into one batch for each batch size and runs plain HF batched "
        "generate, the router in verify mode and in exit mode (batch-synchronous), greedy; reports throughput, "
        "per-request latency and whether each row equals the control's.",
    )
    batch.add_argument("--model", default=DEFAULT_MODEL, help="Alias, saved router folder, HF folder or .gguf.")
    batch.add_argument("--prompts", default=None, help="JSONL: id, category, kind (text|chat), prompt (default: dev).")
    batch.add_argument(
        "--batch-sizes", type=_int_list, default=[1, 4, 8, 16], metavar="B1,B2", help="Default: 1,4,8,16."
    )
    batch.add_argument("--max-new-tokens", type=int, default=32, help="New tokens per row (default: 32).")
    batch.add_argument("--repeats", type=int, default=2, help="Repeats per batch size; medians reported (default: 2).")
    batch.add_argument("--out", default=None, help="Write bench-batch.json into this folder.")
    _add_load_options(batch)
    _add_router_options(batch)

    profile = sub.add_parser(
        "profile",
        help="Measure (or show the cached) cost model the router decides from on this device.",
        description="Times one decoder layer at chunk lengths 1..N, the full LM head at 1..N rows, an exit's trimmed "
        "draft head and its gate, on the device and dtype in use; caches the table on disk and prints it with what "
        "the cost policy would do at a few acceptance rates.",
    )
    profile.add_argument("--model", default=DEFAULT_MODEL, help="Alias, saved router folder, HF folder or .gguf.")
    profile.add_argument("--refresh", action="store_true", help="Measure again even when a cached table exists.")
    profile.add_argument("--json", action="store_true", help="Print the cost model as JSON.")
    _add_load_options(profile)
    _add_router_options(profile)

    survey = sub.add_parser(
        "survey",
        help="Fit a cheap exit head at every layer and report agreement, coverage and what drafting there would pay.",
        description="Cache hidden states of the training corpus after every surveyed layer, fit a fresh adapter "
        "per layer by self-distillation on the trimmed draft vocabulary, and report per layer: held-out top-1 "
        "agreement (logit lens and trained), the share of positions that exit at a target precision, the draft "
        "cost from the measured cost model, the break-even acceptance and the speed-up at the measured agreement.",
    )
    survey.add_argument("--model", default=DEFAULT_MODEL, help="Alias, saved router folder, HF folder or .gguf.")
    survey.add_argument(
        "--layers", type=_int_list, default=None, metavar="L1,L2", help="Layers to survey (default: every layer)."
    )
    survey.add_argument(
        "--adapter",
        default="postnorm",
        choices=list(ADAPTER_KINDS),
        help="Adapter kind to fit (default: %(default)s).",
    )
    survey.add_argument("--steps", type=int, default=300, help="Optimiser steps per layer (default: %(default)s).")
    survey.add_argument("--max-tokens", type=int, default=40_000, help="Corpus tokens (default: %(default)s).")
    survey.add_argument("--precision", type=float, default=0.95, help="Exit precision target (default: %(default)s).")
    survey.add_argument("--json", default=None, help="Also write the rows to this JSON file.")
    survey.add_argument("--quiet", action="store_true", help="No progress bars.")
    _add_load_options(survey)

    memory = sub.add_parser(
        "memory",
        help="Print the memory budget at a context length: weights, heads, trimmed head, KV cache, workspace.",
        description="Weights and heads are counted from their tensors; the KV cache per position is measured on a "
        "short probe through every layer (sliding-window layers capped at their window). --measure also runs one "
        "routed generation at that context and compares.",
    )
    memory.add_argument("--model", default=DEFAULT_MODEL, help="Alias, saved router folder, HF folder or .gguf.")
    memory.add_argument("--context", type=int, default=2048, help="Positions in the sequence (default: %(default)s).")
    memory.add_argument("--measure", action="store_true", help="Also measure one generation at that context.")
    memory.add_argument("--json", action="store_true", help="Print the budget as JSON.")
    _add_load_options(memory)
    _add_router_options(memory)

    calib = sub.add_parser(
        "calibrate",
        help="Choose the exit threshold that is fastest while meeting a quality target; save it with the heads.",
        description="Sweep a confidence threshold (high = low, no entropy band) on a calibration half of the "
        "prompts against plain HF greedy, keep the thresholds that meet the target (Learn-then-Test binomial bound "
        "for agreement targets, empirical for NLL), pick the fastest, check it on the held-out half, and save the "
        "router with it.",
    )
    calib.add_argument("--model", default=DEFAULT_MODEL, help="Alias, saved router folder, HF folder or .gguf.")
    calib.add_argument("--out", required=True, help="Folder to save the calibrated router into.")
    calib.add_argument("--prompts", default=None, help="JSONL prompts, split in halves (default: the shipped set).")
    target = calib.add_mutually_exclusive_group(required=True)
    target.add_argument("--target-agreement", type=float, help="Teacher-forced agreement to reach, e.g. 0.95.")
    target.add_argument("--max-nll-increase", type=float, help="Largest relative NLL increase, e.g. 0.02 for 2%%.")
    calib.add_argument("--method", choices=["ltt", "empirical"], default="ltt", help="Default: %(default)s.")
    calib.add_argument("--delta", type=float, default=0.1, help="LTT risk level (default: %(default)s).")
    calib.add_argument("--objective", choices=["speed", "compute"], default="speed", help="Default: %(default)s.")
    calib.add_argument(
        "--speed-tie-z",
        type=float,
        default=2.0,
        help="Speed objective: a candidate within this many standard errors of the fastest (paired over the "
        "prompts) ties with it, and the tie goes to the candidate that exits most tokens; 0 takes the fastest "
        "(default: %(default)s).",
    )
    calib.add_argument(
        "--candidates", type=_float_list, default=None, metavar="T1,T2", help="Thresholds to try (default: 0.3-0.99)."
    )
    calib.add_argument("--max-new-tokens", type=int, default=64, help="New tokens per prompt (default: %(default)s).")
    calib.add_argument("--quiet", action="store_true", help="No progress bar.")
    _add_load_options(calib)
    _add_router_options(calib)

    server = sub.add_parser(
        "serve",
        help="An OpenAI-compatible HTTP server over the router (needs the 'serve' extra).",
        description="Serves /v1/completions and /v1/chat/completions (with SSE streaming), /v1/models, /health and "
        "/metrics (Prometheus). Listens on localhost unless --host says otherwise. Requests wait in a bounded queue "
        "(a full one answers 503 with Retry-After) and are decoded by one worker, interleaved step by step. Each "
        "request may set its routing in the 'early_exit' field (openai client: extra_body={'early_exit': {...}}).",
    )
    server.add_argument("--model", default=DEFAULT_MODEL, help="Alias, saved router folder, HF folder or .gguf.")
    server.add_argument("--served-model-name", default=None, help="The model id clients send (default: --model).")
    server.add_argument("--host", default="127.0.0.1", help="Interface to listen on (default: 127.0.0.1).")
    server.add_argument("--port", type=int, default=8000, help="Port (default: 8000).")
    server.add_argument(
        "--api-key",
        default=os.environ.get("EER_API_KEY"),
        help="Require 'Authorization: Bearer KEY' (default: $EER_API_KEY).",
    )
    server.add_argument("--max-queue", type=int, default=64, help="Requests that may wait (default: 64).")
    server.add_argument(
        "--max-running", type=int, default=8, help="Requests decoded at once, interleaved (default: 8)."
    )
    server.add_argument("--default-max-tokens", type=int, default=256, help="Chat requests without max_tokens.")
    server.add_argument(
        "--no-batching",
        action="store_true",
        help="Decode every request on its own (interleaved step by step) instead of sharing a batch per mode.",
    )
    _add_load_options(server)
    _add_router_options(server)

    export = sub.add_parser(
        "export-draft",
        help="Write one exit (its first layers, norm and LM head with the adapter folded in) as an HF checkpoint.",
        description="Export exit layer E as a standalone HF model of E + 1 layers in the base architecture, for "
        "serving engines that take a separate draft model (vLLM draft_model, SGLang STANDALONE; a 'block' head adds "
        "its block as layer E + 1). The adapter must fold exactly: 'postnorm', 'block' or 'identity' heads.",
    )
    export.add_argument("--model", default=DEFAULT_MODEL, help="Alias or saved router folder with the heads.")
    export.add_argument("--exit-layer", type=int, required=True, help="The exit to export (0-based layer index).")
    export.add_argument("--out", required=True, help="Folder for the draft model.")
    return parser


def _str_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _float_list(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers like 0.5,0.9, got {text!r}") from None


def cmd_generate(args: argparse.Namespace) -> int:
    import torch
    from transformers import TextStreamer

    from early_exit_router.api import EarlyExitRouter
    from early_exit_router.bench.metrics import first_divergence

    router = EarlyExitRouter.from_pretrained(
        args.model, dtype=args.dtype, device=args.device, quantize=args.quantize, **_router_overrides(args)
    )
    print(router.describe(), file=sys.stderr)
    chat = args.chat and router.tokenizer is not None and bool(getattr(router.tokenizer, "chat_template", None))
    input_ids = router.encode(args.prompt, chat=chat)
    streamer = TextStreamer(router.tokenizer, skip_prompt=True) if args.stream and router.tokenizer else None
    kwargs = dict(
        max_new_tokens=args.max_new_tokens,
        do_sample=args.do_sample,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop_strings=args.stop,
    )
    out = router.generate(input_ids, streamer=streamer, **kwargs)
    new_ids = out.sequences[0, input_ids.shape[1] :]
    text = router.tokenizer.decode(new_ids, skip_special_tokens=True) if router.tokenizer else str(new_ids.tolist())
    report: dict[str, Any] = {"stats": out.stats.to_dict()}
    if not args.stream:
        print(text)
    if args.compare:
        with router.disabled():
            start = time.perf_counter()
            plain = router.generate(input_ids, **kwargs)
            plain_s = time.perf_counter() - start
        plain_new = plain.sequences[0, input_ids.shape[1] :]
        report["compare"] = {
            "plain_tokens_per_s": plain.stats.tokens_per_s,
            "speedup": out.stats.tokens_per_s / plain.stats.tokens_per_s if plain.stats.tokens_per_s else None,
            "identical": torch.equal(plain.sequences, out.sequences),
            "first_divergence": first_divergence(plain_new.tolist(), new_ids.tolist()),
            "plain_wall_s": plain_s,
        }
    if args.trace:
        from early_exit_router.bench.trace import render_trace, trace_legend, use_colour

        colour = use_colour(sys.stdout)
        if router.tokenizer is None:
            raise ValueError("--trace needs the model's tokenizer.")
        coloured, plain = render_trace(
            router.tokenizer, new_ids.tolist(), out.depths, router.model.config.num_hidden_layers, router.exit_layers
        )
        print("\n--- trace ---")
        print(trace_legend(router.model.config.num_hidden_layers, router.exit_layers, out.depths, colour))
        print(coloured if colour else plain)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print("\n--- routing statistics ---")
        print(out.stats.summary())
        if args.compare:
            c = report["compare"]
            print(
                f"plain HF generate: {c['plain_tokens_per_s']:.1f} tok/s; speed ratio {c['speedup']:.2f}x; "
                f"identical tokens: {c['identical']}"
                + ("" if c["identical"] else f" (first divergence at new token {c['first_divergence']})")
            )
    return 0


def cmd_train_heads(args: argparse.Namespace) -> int:
    import torch

    from early_exit_router.api import EarlyExitRouter
    from early_exit_router.training.config import TrainingConfig
    from early_exit_router.training.distill import distill_router, warm_start
    from early_exit_router.training.hidden_states import HiddenStateCache, build_cache
    from early_exit_router.training.sequences import corpus_sequences

    if args.threads:
        torch.set_num_threads(args.threads)
    overrides = _router_overrides(args)
    router = EarlyExitRouter.from_pretrained(args.model, fresh_heads=True, **overrides)
    print(router.describe(), file=sys.stderr)
    cfg = TrainingConfig(
        max_steps=args.max_steps,
        max_seconds=args.max_seconds,
        batch_tokens=args.batch_tokens,
        lr=args.lr,
        ce_weight=args.ce_weight,
        seed=args.seed,
        head_gates=not args.pre_head_gates,
        train_exits=args.train_exits,
        warm_lr_scale=args.warm_lr_scale,
    )
    warm = []
    if args.init_from:
        warm = warm_start(router, router.load_saved_heads(args.init_from), router.exit_layers)
    elif args.train_exits is not None:
        raise ValueError("--train-exits leaves the other exits untrained unless --init-from loads them: add it.")
    start = time.perf_counter()
    states = Path(args.hidden_states) if args.hidden_states else None
    if states is not None and states.exists():
        sequences, cache = None, HiddenStateCache.load(states, router.exit_layers)
        manifest = {"hidden_states": str(states), "note": "reused: the corpus was not built again"}
    else:
        sequences, manifest = corpus_sequences(
            router,
            args.max_tokens,
            args.self_gen_tokens,
            args.prompts,
            use_docs=not args.no_docs,
            progress=not args.quiet,
            extra_prompts=args.generated_prompts,
            sampled=args.sampled,
            seed=args.seed,
        )
        cache = None
        if states is not None:
            cache = build_cache(router.stack, router.exit_layers, sequences, cfg.chunk_len, progress=not args.quiet)
            cache.save(states)
    gate_cache, gate_manifest = _gate_cache(router, args, cfg.chunk_len if cache is None else cache.chunk_len)
    result = distill_router(
        router,
        sequences,
        cfg,
        gates=not args.no_gates,
        target_agreement=args.target_agreement or None,
        progress=not args.quiet,
        cache=cache,
        warm=warm,
        gate_cache=gate_cache,
    )
    result["corpus"] = manifest
    if gate_manifest:
        result["gate_corpus"] = gate_manifest
    result["wall_seconds"] = round(time.perf_counter() - start, 1)
    router.save_pretrained(args.out)
    (Path(args.out) / "training_report.json").write_text(json.dumps(result, indent=2) + "\n")
    from early_exit_router.training.head_report import ExitQuality, format_table

    print(
        format_table("held-out positions of the training corpus", [ExitQuality(**r) for r in result["holdout_quality"]])
    )
    print(f"saved to {args.out}; thresholds {result.get('thresholds')}; {result['wall_seconds']} s in all")
    return 0


def _gate_cache(router: Any, args: argparse.Namespace, chunk_len: int) -> tuple[Any, dict[str, Any]]:
    """train-heads' gate-only text (`--gate-prompts`) as hidden states, read from `--gate-hidden-states` when that
    file exists; (None, {}) without it."""
    from early_exit_router.training.corpus import (
        CALIBRATION_PROMPTS,
        DEV_PROMPTS,
        HELDOUT_PROMPTS,
        generated_prompts,
        load_prompts,
    )
    from early_exit_router.training.hidden_states import HiddenStateCache, build_cache
    from early_exit_router.training.sequences import gate_sequences

    states = Path(args.gate_hidden_states) if args.gate_hidden_states else None
    if states is not None and states.exists():
        cache = HiddenStateCache.load(states, router.exit_layers)
        if cache.chunk_len != chunk_len:  # checked now, before the adapters train, not when the gates fit
            raise ValueError(
                f"The gate text's hidden states in {states} come in chunks of {cache.chunk_len} positions, the "
                f"corpus's in chunks of {chunk_len}: remove the file, so that they are computed again."
            )
        return cache, {"hidden_states": str(states), "note": "reused"}
    if args.gate_prompts <= 0:
        return None, {}
    # Never the training prompts, nor those measured or tuned on.
    exclude = load_prompts(args.prompts) + generated_prompts(args.generated_prompts, args.seed)
    exclude += [p for name in (DEV_PROMPTS, CALIBRATION_PROMPTS, HELDOUT_PROMPTS) for p in load_prompts(shipped=name)]
    sequences, manifest = gate_sequences(
        router, args.gate_prompts, args.self_gen_tokens or 96, args.seed, exclude, progress=not args.quiet
    )
    cache = build_cache(router.stack, router.exit_layers, sequences, chunk_len, progress=not args.quiet)
    if states is not None:
        cache.save(states)
    return cache, manifest


def cmd_eval_heads(args: argparse.Namespace) -> int:
    from early_exit_router.api import EarlyExitRouter
    from early_exit_router.training.corpus import DEV_PROMPTS, held_out_texts, load_prompts, self_generated
    from early_exit_router.training.head_report import as_dicts, exit_signals, format_table, quality_table
    from early_exit_router.training.hidden_states import build_cache

    router = EarlyExitRouter.from_pretrained(args.model, **_router_overrides(args))
    print(router.describe(), file=sys.stderr)
    tok = router.tokenizer
    if tok is None:
        raise ValueError("eval-heads needs the model's tokenizer.")
    prompts = load_prompts(args.prompts, shipped=DEV_PROMPTS)
    with router.disabled() as model:
        sources = {"development prompts (model answers)": self_generated(model, tok, prompts, args.answer_tokens)}
    for name, text in held_out_texts().items():
        sources[name] = [tok(text, add_special_tokens=False).input_ids[: args.max_tokens]]
    tables = {}
    for name, sequences in sources.items():
        cache = build_cache(router.stack, router.exit_layers, sequences, chunk_len=256, progress=False)
        rows = quality_table(exit_signals(router, cache))
        tables[name] = {"positions": len(cache), "rows": as_dicts(rows)}
        print(format_table(f"{name}: {len(cache)} positions", rows) + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": router.describe(), "config": router.config.to_dict(), "tables": tables}, f, indent=2)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from early_exit_router.api import EarlyExitRouter
    from early_exit_router.bench.bench import BenchConfig, run_bench
    from early_exit_router.training.corpus import DEV_PROMPTS, load_prompts

    router = EarlyExitRouter.from_pretrained(
        args.model, dtype=args.dtype, device=args.device, quantize=args.quantize, **_router_overrides(args)
    )
    print(router.describe(), file=sys.stderr)
    cfg = BenchConfig(
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        modes=tuple(args.modes),
        thresholds=tuple(args.thresholds),
        ngram=not args.no_ngram,
        fixed_cascade=not args.no_fixed_cascade,
        assistant_early_exit=None if args.assistant_early_exit is None else tuple(args.assistant_early_exit),
        prompt_lookup_num_tokens=args.prompt_lookup,
    )
    for mode in cfg.modes:
        if mode not in MODES:
            raise ValueError(f"Unknown mode {mode!r} in --modes: use {', '.join(MODES)}.")
    prompts = load_prompts(args.prompts, shipped=DEV_PROMPTS)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = run_bench(router, prompts, cfg, progress=not args.quiet)
    print(result.markdown())
    result.write_json(out / "bench.json")
    result.plot(out / "bench.png")
    print(f"\nwrote {out / 'bench.json'} and {out / 'bench.png'}")
    return 0


def cmd_loadtest(args: argparse.Namespace) -> int:
    try:
        from early_exit_router.integrations.server.loadtest import LoadtestConfig, run_loadtest
    except ImportError as exc:
        raise ImportError(f"loadtest needs the 'serve' extra and openai ({exc.name} is missing).") from None
    from early_exit_router.api import EarlyExitRouter
    from early_exit_router.training.corpus import DEV_PROMPTS, load_prompts

    router = EarlyExitRouter.from_pretrained(
        args.model, dtype=args.dtype, device=args.device, quantize=args.quantize, **_router_overrides(args)
    )
    if router.config.policy == "cost":
        router.costs()  # measured (or loaded) before the load, not inside a request
    prompts = [p["prompt"] for p in load_prompts(args.prompts, shipped=DEV_PROMPTS)]
    result = run_loadtest(router, prompts, LoadtestConfig(args.clients, args.requests_per_client, args.max_tokens))
    print(result.markdown())
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "loadtest.json").write_text(json.dumps(result.to_dict(), indent=2))
    return 0 if result.passed else 1


def cmd_bench_batch(args: argparse.Namespace) -> int:
    from early_exit_router.api import EarlyExitRouter
    from early_exit_router.bench.batch_bench import BatchBenchConfig, run_batch_bench
    from early_exit_router.training.corpus import DEV_PROMPTS, load_prompts

    router = EarlyExitRouter.from_pretrained(
        args.model, dtype=args.dtype, device=args.device, quantize=args.quantize, **_router_overrides(args)
    )
    cfg = BatchBenchConfig(tuple(args.batch_sizes), args.max_new_tokens, args.repeats)
    result = run_batch_bench(router, load_prompts(args.prompts, shipped=DEV_PROMPTS), cfg)
    print(result.markdown())
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench-batch.json").write_text(json.dumps(result.to_dict(), indent=2))
        print(f"\nwrote {out / 'bench-batch.json'}")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from early_exit_router.api import EarlyExitRouter
    from early_exit_router.routing.ngram import Proposal
    from early_exit_router.routing.policy import AcceptanceTracker, DraftPolicy

    router = EarlyExitRouter.from_pretrained(
        args.model, dtype=args.dtype, device=args.device, quantize=args.quantize, **_router_overrides(args)
    )
    costs = router.costs(refresh=args.refresh)
    if args.json:
        print(json.dumps(costs.to_dict(), indent=2))
        return 0
    print(router.describe())
    print(costs.markdown())
    exits = router.config.consulted_exit_layers()
    policy = DraftPolicy.for_config(costs, router.config, router.heads)
    budget = router.config.max_pending
    print(f"\nWhat the cost policy chooses for a cycle of up to {budget} drafts (expected tokens per plain step):\n")
    print("| acceptance | n-gram tier (proposal of 8) | " + " | ".join(f"exit L{e}" for e in exits) + " |")
    print("|---|---|" + "---|" * len(exits))
    for a in (0.3, 0.5, 0.7, 0.8, 0.9, 0.95):
        cells = []
        ngram_d, ngram_rate = policy.best_draft(a, policy.ngram_cycle_ms, min(8, budget))
        cells.append(f"d={ngram_d}: {ngram_rate / policy.plain_rate:.2f}x")
        for i in range(len(exits)):
            d, rate = policy.best_draft(a, lambda d, i=i: policy.exit_cycle_ms(i, d), budget)
            cells.append(f"d={d}: {rate / policy.plain_rate:.2f}x")
        print(f"| {a:.2f} | " + " | ".join(cells) + " |")
    chosen = policy.plan(AcceptanceTracker(prior=router.config.acceptance_prior), budget, [Proposal([0] * 8, 2)])
    print(
        f"\nAt the prior acceptance {router.config.acceptance_prior:.2f}, a cycle with an n-gram proposal runs: "
        f"{chosen.kind}" + (f", {chosen.max_draft} drafts" if chosen.max_draft else "")
    )
    rates = ", ".join(f"L{e} {policy.break_even_exit_rate(i):.2f}" for i, e in enumerate(exits))
    print(f"Exit mode asks an exit while the share of tokens asked that leave there is at least: {rates}")
    return 0


def cmd_survey(args: argparse.Namespace) -> int:
    from early_exit_router.api import EarlyExitRouter
    from early_exit_router.training.head_report import as_dicts
    from early_exit_router.training.hidden_states import build_cache
    from early_exit_router.training.sequences import corpus_sequences
    from early_exit_router.training.survey import format_survey, survey_exits

    router = EarlyExitRouter.from_pretrained(args.model, dtype=args.dtype, device=args.device, quantize=args.quantize)
    stack = router.stack
    layers = args.layers or list(range(stack.num_layers - 1))
    bad = [e for e in layers if not 0 <= e < stack.num_layers - 1]
    if bad:
        raise ValueError(f"--layers {bad} out of range: exits are layers 0..{stack.num_layers - 2} of this model.")
    costs = router.costs()
    sequences, manifest = corpus_sequences(router, args.max_tokens, progress=not args.quiet)
    cache = build_cache(stack, sorted(set(layers)), sequences, progress=not args.quiet)
    rows = survey_exits(router, cache, costs, adapter=args.adapter, steps=args.steps, precision=args.precision)
    title = (
        f"{router.name_or_path}: '{args.adapter}' adapters, {args.steps} steps, {len(cache)} positions "
        f"(20% of the chunks held out), draft vocabulary {router.config.draft_vocab_size}; plain step "
        f"{costs.plain_step():.1f} ms"
    )
    print(format_survey(rows, args.precision, title))
    if args.json:
        report = {"title": title, "corpus": manifest, "costs": costs.to_dict(), "rows": as_dicts(rows)}
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def cmd_memory(args: argparse.Namespace) -> int:
    from early_exit_router.api import EarlyExitRouter
    from early_exit_router.bench.memory import measured_bytes, memory_budget

    if args.context < 2:
        raise ValueError(f"--context must be at least 2 positions, got {args.context}.")
    router = EarlyExitRouter.from_pretrained(
        args.model, dtype=args.dtype, device=args.device, quantize=args.quantize, **_router_overrides(args)
    )
    budget = memory_budget(router, args.context)
    report: dict[str, Any] = budget.to_dict()
    if args.measure:
        report["measured"] = measured_bytes(router, args.context)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(router.describe())
    print(budget.markdown())
    if args.measure:
        print(f"\nmeasured: {report['measured'] / 2**20:.2f} MiB ({report['measured'] / budget.total - 1:+.1%})")
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from early_exit_router.api import EarlyExitRouter
    from early_exit_router.training.calibrate import (
        DEFAULT_CANDIDATES,
        CalibrationConfig,
        QualityTarget,
        calibrate,
        split_prompts,
    )
    from early_exit_router.training.corpus import CALIBRATION_PROMPTS, load_prompts

    target = QualityTarget(min_agreement=args.target_agreement, max_nll_increase=args.max_nll_increase)
    cfg = CalibrationConfig(
        target=target,
        candidates=tuple(args.candidates or DEFAULT_CANDIDATES),
        method=args.method,
        delta=args.delta,
        objective=args.objective,
        speed_tie_z=args.speed_tie_z,
        max_new_tokens=args.max_new_tokens,
    )
    router = EarlyExitRouter.from_pretrained(
        args.model, dtype=args.dtype, device=args.device, quantize=args.quantize, **_router_overrides(args)
    )
    print(router.describe(), file=sys.stderr)
    calibration, heldout = split_prompts(load_prompts(args.prompts, shipped=CALIBRATION_PROMPTS))
    result = calibrate(router, calibration, heldout, cfg, progress=not args.quiet)
    print(result.table())
    if result.chosen_threshold is None:
        print("nothing saved: no threshold met the target", file=sys.stderr)
        return 1
    router.save_pretrained(args.out)
    (Path(args.out) / "calibration_report.json").write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    print(f"saved to {args.out} with high_conf_threshold={router.config.high_conf_threshold:g}")
    return 0


def cmd_export_draft(args: argparse.Namespace) -> int:
    from early_exit_router.api import EarlyExitRouter
    from early_exit_router.integrations.export import export_draft

    router = EarlyExitRouter.from_pretrained(args.model)
    print(router.describe(), file=sys.stderr)
    result = export_draft(router, args.exit_layer, args.out)
    print(
        f"wrote {result.path}: {result.num_layers} of {result.base_layers} layers, {result.parameters:,} parameters "
        f"({result.bytes / 2**20:.0f} MiB in {result.dtype}), {result.adapter} adapter folded in"
    )
    snippets = result.serving_snippets()
    print(f"vLLM:   {snippets['vllm']}  # speculative_config, beside the base model\nSGLang: {snippets['sglang']}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        from early_exit_router.integrations.server import serve
        from early_exit_router.integrations.server.app import ServerSettings
    except ImportError as exc:
        raise ImportError(
            f"serve needs the 'serve' extra ({exc.name} is missing): pip install 'early-exit-router[serve]'."
        ) from None
    from early_exit_router.api import EarlyExitRouter

    router = EarlyExitRouter.from_pretrained(
        args.model, dtype=args.dtype, device=args.device, quantize=args.quantize, **_router_overrides(args)
    )
    if router.config.policy == "cost":
        router.costs()  # measured (or loaded) before the first request, not inside it
    settings = ServerSettings(
        model_name=args.served_model_name or args.model,
        api_key=args.api_key or None,
        max_queue=args.max_queue,
        max_running=args.max_running,
        default_max_tokens=args.default_max_tokens,
        batching=not args.no_batching,
    )
    print(router.describe())
    serve(router, settings, host=args.host, port=args.port)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    warnings.simplefilter("default", UserWarning)
    # transformers imports torchao whenever it is installed (the `quant` extra); on a CPU build its CUDA kernels
    # fail to load, and torch's pytree warns about its enums. Neither matters to a command line run.
    for noisy in ("torchao", "torch.utils._pytree"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    try:
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "train-heads":
            return cmd_train_heads(args)
        if args.command == "eval-heads":
            return cmd_eval_heads(args)
        if args.command == "bench":
            return cmd_bench(args)
        if args.command == "calibrate":
            return cmd_calibrate(args)
        if args.command == "profile":
            return cmd_profile(args)
        if args.command == "survey":
            return cmd_survey(args)
        if args.command == "memory":
            return cmd_memory(args)
        if args.command == "export-draft":
            return cmd_export_draft(args)
        if args.command == "serve":
            return cmd_serve(args)
        if args.command == "bench-batch":
            return cmd_bench_batch(args)
        if args.command == "loadtest":
            return cmd_loadtest(args)
    except (ValueError, FileNotFoundError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())

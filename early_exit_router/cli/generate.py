"""`early-exit-router generate`: its subparser and its run function."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from early_exit_router.cli.options import (
    DEFAULT_PROMPT,
    add_load_options,
    add_router_options,
    load_options,
    router_overrides,
)
from early_exit_router.models.loading import DEFAULT_MODEL


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
    gen.add_argument(
        "--temperature", type=float, default=None, help="Sampling temperature (default: the model's generation config)."
    )
    gen.add_argument(
        "--top-k", type=int, default=None, help="Sample from the k most likely tokens (default: as HF, 50; 0: off)."
    )
    gen.add_argument("--top-p", type=float, default=None, help="Nucleus sampling mass (default: the model's config).")
    gen.add_argument("--seed", type=int, default=None, help="Seed for reproducible sampling.")
    gen.add_argument("--stop", action="append", default=None, help="Stop string (repeatable).")
    add_load_options(gen)
    gen.add_argument("--stream", action="store_true", help="Print tokens as they become final.")
    gen.add_argument(
        "--compare",
        action="store_true",
        help="Also run plain HF generate on the same prompt and report the speed ratio and token match.",
    )
    gen.add_argument(
        "--json", action="store_true", help="Print one JSON document (text, statistics, comparison, trace) alone."
    )
    gen.add_argument(
        "--trace",
        action="store_true",
        help="Show each token with the depth it left at: colours in a terminal, [L12]-style markers otherwise.",
    )
    add_router_options(gen)


def run(args: argparse.Namespace) -> int:
    import torch
    from transformers import TextStreamer

    from early_exit_router.api import EarlyExitRouter
    from early_exit_router.bench.metrics import first_divergence

    if not args.do_sample:
        # Greedy decoding ignores these (the command passes do_sample=False): refuse them rather than drop them.
        given = {"--temperature": args.temperature, "--top-k": args.top_k, "--top-p": args.top_p}
        ignored = [flag for flag, value in given.items() if value is not None]
        if ignored:
            raise ValueError(
                f"{', '.join(ignored)} only shape sampling, and generate decodes greedily without --do-sample: "
                "add --do-sample, or leave them out."
            )
    router = EarlyExitRouter.from_pretrained(args.model, **load_options(args), **router_overrides(args))
    print(router.describe(), file=sys.stderr)
    chat = args.chat and router.tokenizer is not None and bool(getattr(router.tokenizer, "chat_template", None))
    input_ids = router.encode(args.prompt, chat=chat)
    streamer = None
    if args.stream and not args.json and router.tokenizer:  # --json: stdout holds the JSON document alone
        streamer = TextStreamer(router.tokenizer, skip_prompt=True, skip_special_tokens=True)
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
    report: dict[str, Any] = {"text": text, "stats": out.stats.to_dict()}
    if not args.stream and not args.json:
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
        if args.json:
            report["trace"] = plain
        else:
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

"""Compare exit-adapter variants at equal training budget: quality against size.

    python examples/compare_adapters.py [--max-tokens 60000] [--max-steps 200] [--exit-layers 12,18,24]

One corpus and one hidden-state cache serve every variant (identity = logit lens, low-rank at a few ranks,
full-rank linear). Each trained variant gets the same steps, batch and seed. Quality is measured on text no variant
trained on: the model's answers to the development prompts, Debian's common licenses and CPython source. Prints
a markdown table: added parameters, top-1 agreement with the full model per exit and source.
"""

from __future__ import annotations

import argparse
import json
import warnings

from early_exit_router import EarlyExitRouter
from early_exit_router.training.config import TrainingConfig
from early_exit_router.training.corpus import DEV_PROMPTS, held_out_texts, load_prompts, self_generated
from early_exit_router.training.distill import train_heads
from early_exit_router.training.head_report import exit_signals, quality_table
from early_exit_router.training.hidden_states import build_cache
from early_exit_router.training.sequences import corpus_sequences


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--max-tokens", type=int, default=60_000)
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--exit-layers", default="12,18,24")
    parser.add_argument("--variants", default="identity,lowrank:16,lowrank:64,linear")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    warnings.simplefilter("ignore", UserWarning)
    layers = [int(x) for x in args.exit_layers.split(",")]

    router = EarlyExitRouter.from_pretrained(args.model, fresh_heads=True, exit_layers=layers)
    tok = router.tokenizer
    sequences, _ = corpus_sequences(router, args.max_tokens)
    train_cache = build_cache(router.stack, layers, sequences)
    dev_prompts = load_prompts(shipped=DEV_PROMPTS)
    with router.disabled() as model:
        dev = {"dev answers": self_generated(model, tok, dev_prompts, 96)}
    for name, text in held_out_texts().items():
        dev[name] = [tok(text, add_special_tokens=False).input_ids]
    dev_caches = {name: build_cache(router.stack, layers, seqs, progress=False) for name, seqs in dev.items()}
    base_model = router.unpatch()

    results = []
    for variant in args.variants.split(","):
        kind, _, rank = variant.partition(":")
        candidate = EarlyExitRouter.from_model(
            base_model, tok, exit_layers=layers, adapter=kind, adapter_rank=int(rank or 64)
        )
        report = train_heads(candidate, train_cache, TrainingConfig(max_steps=args.max_steps))
        row = {"variant": variant, "params": candidate.num_added_parameters(), "seconds": round(report.seconds)}
        for name, cache in dev_caches.items():
            for quality in quality_table(exit_signals(candidate, cache)):
                row[f"{name} L{quality.layer}"] = round(quality.trained_agreement, 3)
        results.append(row)
        print(row)
        candidate.unpatch()

    columns = [c for c in results[0] if c not in ("variant", "params", "seconds")]
    print(f"\nTop-1 agreement with the full model; {args.max_steps} steps x 512 positions, same cache and seed.\n")
    print("| variant | added params | train s | " + " | ".join(columns) + " |")
    print("|---" * (3 + len(columns)) + "|")
    for row in results:
        cells = " | ".join(f"{row[c]:.3f}" for c in columns)
        print(f"| {row['variant']} | {row['params']:,} | {row['seconds']} | {cells} |")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()

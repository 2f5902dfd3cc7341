"""Token sequences to train on: the corpus' text and the model's own answers (`corpus_sequences`), and the model's
answers to fresh prompts for the gates alone (`gate_sequences`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from early_exit_router.training.corpus import (
    fresh_prompts,
    generated_prompts,
    load_prompts,
    package_descriptions,
    self_generated,
)


def corpus_sequences(
    router: Any,
    max_tokens: int,
    self_gen_tokens: int = 96,
    prompts_path: str | None = None,
    use_docs: bool = True,
    self_gen_repeats: int = 2,
    progress: bool = True,
    extra_prompts: int = 0,
    sampled: bool = False,
    seed: int = 0,
) -> tuple[list[list[int]], dict[str, Any]]:
    """Token sequences to train on and their manifest: the model's own greedy answers to the prompt set (repeated
    `self_gen_repeats` times), to `extra_prompts` generated prompts, and with `sampled` a sampled answer to every
    prompt; then package READMEs up to `max_tokens`."""

    tokenizer = router.tokenizer
    if tokenizer is None:
        raise ValueError("Training needs the model's tokenizer: build the router with one.")
    sequences: list[list[int]] = []
    manifest: dict[str, Any] = {}
    if self_gen_tokens > 0:
        prompts = load_prompts(prompts_path)
        extra = generated_prompts(extra_prompts, seed) if extra_prompts > 0 else []
        start = time.perf_counter()
        with router.disabled() as model:
            answers = self_generated(model, tokenizer, prompts, self_gen_tokens)
            sequences += answers * self_gen_repeats
            if extra:
                sequences += self_generated(model, tokenizer, extra, self_gen_tokens)
            if sampled:
                sequences += self_generated(model, tokenizer, prompts + extra, self_gen_tokens, sample=True, seed=seed)
        manifest["self_generated"] = {
            "prompts": len(prompts),
            "generated_prompts": len(extra),
            "sampled": sampled,
            "tokens": sum(map(len, sequences)),
            "repeats": self_gen_repeats,
            "seconds": round(time.perf_counter() - start, 1),
        }
    used = sum(map(len, sequences))
    if use_docs and used < max_tokens:
        texts, sources = package_descriptions(max_chars=4 * (max_tokens - used))  # ~4 characters per token
        docs = [tokenizer(t, add_special_tokens=False).input_ids + [tokenizer.eos_token_id] for t in texts]
        sequences += docs
        manifest["package_descriptions"] = {"packages": sources, "tokens": sum(map(len, docs))}
    stream_len = sum(map(len, sequences))
    if progress:
        print(f"training corpus: {min(stream_len, max_tokens)} tokens ({manifest})")
    # Cut to the budget without reordering: answers first, then documents.
    out, total = [], 0
    for seq in sequences:
        if total >= max_tokens:
            break
        out.append(seq[: max_tokens - total])
        total += len(out[-1])
    return out, manifest


def gate_sequences(
    router: Any,
    count: int,
    answer_tokens: int,
    seed: int,
    exclude: Iterable[dict[str, Any]],
    progress: bool = True,
) -> tuple[list[list[int]], dict[str, Any]]:
    """Text for fitting the gates alone, and its manifest: the model's own greedy and sampled answers to `count`
    fresh prompts (`corpus.fresh_prompts`: seeded, none of them in `exclude`, the training prompts). No adapter
    trains on it, so a gate fit there learns how often a head is right on text it never saw."""

    prompts = fresh_prompts(count, seed, exclude)
    start = time.perf_counter()
    with router.disabled() as model:
        sequences = self_generated(model, router.tokenizer, prompts, answer_tokens)
        sequences += self_generated(model, router.tokenizer, prompts, answer_tokens, sample=True, seed=seed)
    manifest = {
        "prompts": len(prompts),
        "answers": "greedy and sampled",
        "tokens": sum(map(len, sequences)),
        "seconds": round(time.perf_counter() - start, 1),
    }
    if progress:
        print(f"gate corpus: {manifest}")
    return sequences, manifest

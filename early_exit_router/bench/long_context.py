"""What a plain decoding step costs at a long context (`early-exit-router profile --long-context N`).

The router's cache appends a step's keys and values into buffers with room to grow (`_compat.GrowingLayer`), where
the `DynamicCache` plain HF `generate` keeps concatenates every layer's states into new tensors at every step, a copy
that grows with the context. This times the stack's own plain step at `context` cached positions with each cache,
alternating step by step so that both see the same machine, and checks that they give the same logits.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import DynamicCache

from early_exit_router.models import _compat

PREFILL_CHUNK = 512  # positions per prefill pass: bounds the prefill's attention memory at long contexts


@dataclass
class LongContextStep:
    context: int
    growing_ms: float  # median plain step, the router's cache
    concatenating_ms: float  # median plain step, a DynamicCache as plain HF `generate` keeps it
    same_logits: bool


@torch.inference_mode()
def measure_long_context_step(stack: Any, context: int, steps: int = 24, seed: int = 0) -> LongContextStep:
    """Median plain step of `stack` at `context` cached positions of random tokens, with each cache."""
    limit = getattr(stack.config, "max_position_embeddings", None)
    if context < 1:
        raise ValueError(f"A long-context step needs 1 or more cached positions; got {context}.")
    if limit and context + steps > limit:
        raise ValueError(
            f"A long-context step needs 1 to {limit - steps} cached positions on this model (it holds {limit} "
            f"positions, and {steps} steps follow the context); got {context}."
        )
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, stack.vocab_size, (1, context + steps), generator=generator).to(stack.device)
    positions = torch.arange(context + steps, device=stack.device).unsqueeze(0)
    caches = {"growing": _compat.new_cache(stack.config), "concatenating": DynamicCache(config=stack.config)}
    times: dict[str, list[float]] = {name: [] for name in caches}
    logits: dict[str, list[torch.Tensor]] = {name: [] for name in caches}
    for cache in caches.values():
        for start in range(0, context, PREFILL_CHUNK):
            chunk = slice(start, min(context, start + PREFILL_CHUNK))
            stack.run(stack.embed(ids[:, chunk], start), 0, stack.num_layers, cache, positions[:, chunk])
    for step in range(context, context + steps):
        for name, cache in caches.items():
            began = time.perf_counter()
            hidden = stack.embed(ids[:, step : step + 1], step)
            hidden = stack.run(hidden, 0, stack.num_layers, cache, positions[:, step : step + 1])
            logits[name].append(stack.logits(hidden))
            if stack.device.type == "cuda":
                torch.cuda.synchronize(stack.device)
            times[name].append(time.perf_counter() - began)
    skip = min(2, steps - 1)  # the first steps pay for first calls
    return LongContextStep(
        context=context,
        growing_ms=statistics.median(times["growing"][skip:]) * 1e3,
        concatenating_ms=statistics.median(times["concatenating"][skip:]) * 1e3,
        same_logits=torch.equal(torch.cat(logits["growing"], 1), torch.cat(logits["concatenating"], 1)),
    )

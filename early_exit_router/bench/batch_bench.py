"""`early-exit-router bench-batch`: batched generation against HF batched `generate`, side by side in one run.

For each batch size, the first B prompts (repeated when there are fewer) are left-padded into one batch and
generated greedily by each arm in turn: plain HF batched `generate` (the control), the router in verify mode in both
batch designs (per row: n-gram drafts, each row keeping its own accepted prefix; batch-synchronous: exits every row
may take), both lossless and checked row by row against the control, the router in exit mode, and the batched decode
loop alone (no exit, no n-gram tier: every token plain), whose distance from 1.00x is the run's noise band. Every
row of a batch finishes when the batch call returns, so per-request latency is the call's wall time.
Throughput is new tokens (up to each row's stop) per second of wall time. The arms rotate their order per repeat.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

ENGINE_CONTROL = "router, exits off (the decode loop alone)"
# The control, then the router's arms: (mode, config changes) each.
ROUTER_ARMS = {
    ENGINE_CONTROL: ("exit", {"batch_design": "synchronous", "active_exit_layers": [], "ngram_tier": False}),
    "router verify (per-row)": ("verify", {"batch_design": "per_row"}),
    "router verify (batch-synchronous)": ("verify", {"batch_design": "synchronous"}),
    "router exit (batch-synchronous)": ("exit", {"batch_design": "synchronous"}),
}
ARMS = ("plain HF generate (batched)", *ROUTER_ARMS)


@dataclass
class BatchBenchConfig:
    batch_sizes: tuple[int, ...] = (1, 4, 8, 16)
    max_new_tokens: int = 32
    repeats: int = 2


@dataclass
class BatchRow:
    """One arm at one batch size: medians over the repeats."""

    arm: str
    batch_size: int
    wall_s: float
    new_tokens: int
    tokens_per_s: float
    speedup: float  # throughput over the control's at the same batch size
    identical_rows: int  # rows equal to the control's
    hit_rate: float | None = None


@dataclass
class BatchBenchResult:
    meta: dict[str, Any]
    rows: list[BatchRow] = field(default_factory=list)

    def markdown(self) -> str:
        lines = [
            f"model: {self.meta['model']}",
            f"{self.meta['machine']}; {self.meta['dtype']}; {self.meta['max_new_tokens']} new tokens per row, greedy, "
            f"median of {self.meta['repeats']} repeats; latency = the batch call's wall time (every row returns "
            f"with it); '{ENGINE_CONTROL}' runs every token plainly through the router: its distance from 1.00x is "
            "this run's noise band",
            "",
            "| batch | arm | tokens/s | speedup | latency s | hit rate | identical rows |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in self.rows:
            hit = "–" if r.hit_rate is None else f"{r.hit_rate:.2f}"
            lines.append(
                f"| {r.batch_size} | {r.arm} | {r.tokens_per_s:.1f} | {r.speedup:.2f}x | {r.wall_s:.2f} | {hit} | "
                f"{r.identical_rows}/{r.batch_size} |"
            )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"meta": self.meta, "rows": [asdict(r) for r in self.rows]}


def run_batch_bench(router: Any, prompts: Sequence[dict], cfg: BatchBenchConfig | None = None) -> BatchBenchResult:
    """Run every arm at every batch size (see the module docstring)."""
    cfg = cfg or BatchBenchConfig()
    if not prompts:
        raise ValueError("No prompts: give a JSONL file with id, category, kind and prompt fields.")
    if any(b < 1 for b in cfg.batch_sizes) or cfg.max_new_tokens < 1 or cfg.repeats < 1:
        raise ValueError("batch sizes, max_new_tokens and repeats must be >= 1.")
    tokenizer = router.tokenizer
    if tokenizer is None:
        raise ValueError("bench-batch needs a tokenizer to pad the prompts.")
    texts = [_text(router, p) for p in prompts]
    meta = {
        "model": router.describe(),
        "machine": f"{router.stack.device}, {torch.get_num_threads()} torch threads",
        "dtype": str(router.stack.dtype).replace("torch.", ""),
        "max_new_tokens": cfg.max_new_tokens,
        "repeats": cfg.repeats,
        "config": asdict(cfg),
        "router_config": router.config.to_dict(),
    }
    result = BatchBenchResult(meta)
    pad_id = router.pad_token_id(router.eos_token_ids(None))
    _run(router, *_batch(tokenizer, texts[:1], router), min(4, cfg.max_new_tokens), pad_id, ARMS)  # warm up
    for b in cfg.batch_sizes:
        ids, mask = _batch(tokenizer, [texts[k % len(texts)] for k in range(b)], router)
        samples: dict[str, list[tuple[float, torch.Tensor, Any]]] = {arm: [] for arm in ARMS}
        for repeat in range(cfg.repeats):
            order = ARMS[repeat % len(ARMS) :] + ARMS[: repeat % len(ARMS)]
            for arm, outcome in _run(router, ids, mask, cfg.max_new_tokens, pad_id, order).items():
                samples[arm].append(outcome)
        control = samples[ARMS[0]][0][1]
        control_tps = _throughput(samples[ARMS[0]], ids.shape[1], router)
        for arm in ARMS:
            wall = statistics.median(s[0] for s in samples[arm])
            sequences = samples[arm][0][1]
            tokens = _new_tokens(sequences, ids.shape[1], router)
            tps = _throughput(samples[arm], ids.shape[1], router)
            identical = sum(bool(torch.equal(sequences[r], control[r])) for r in range(b))
            stats = samples[arm][0][2]
            result.rows.append(
                BatchRow(arm, b, wall, tokens, tps, tps / control_tps, identical, stats.hit_rate if stats else None)
            )
    return result


def _text(router: Any, item: dict) -> str:
    if item.get("kind") == "chat" and getattr(router.tokenizer, "chat_template", None):
        return router.tokenizer.apply_chat_template(
            [{"role": "user", "content": item["prompt"]}], add_generation_prompt=True, tokenize=False
        )
    return item["prompt"]


def _batch(tokenizer: Any, texts: list[str], router: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded (b, n) ids and mask; the tokenizer's padding side is restored afterwards."""
    side, pad = tokenizer.padding_side, tokenizer.pad_token
    try:
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    finally:
        tokenizer.padding_side, tokenizer.pad_token = side, pad
    device = router.stack.device
    return enc.input_ids.to(device), enc.attention_mask.to(device)


def _run(router: Any, ids, mask, n: int, pad_id: int, order: Sequence[str]) -> dict[str, tuple[float, Any, Any]]:
    """Each arm once, in `order`: (wall seconds, sequences, stats or None)."""
    outcomes = {}
    for arm in order:
        start = time.perf_counter()
        if arm == ARMS[0]:
            with router.disabled() as model, torch.no_grad():
                sequences = model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                                           pad_token_id=pad_id)  # fmt: skip
            stats = None
        else:
            mode, changes = ROUTER_ARMS[arm]
            router.clear_ngram_store()  # no arm copies from an earlier arm's (or repeat's) outputs
            start = time.perf_counter()
            out = router.generate(ids, n, mode=mode, attention_mask=mask, config=changes, do_sample=False)
            sequences, stats = out.sequences, out.stats
        outcomes[arm] = (time.perf_counter() - start, sequences, stats)
    return outcomes


def _new_tokens(sequences: torch.Tensor, prompt_len: int, router: Any) -> int:
    """New tokens up to and including each row's EOS (the padding after it is not generated text)."""
    eos = set(router.eos_token_ids(None))
    total = 0
    for row in sequences[:, prompt_len:].tolist():
        stop = next((k for k, t in enumerate(row) if t in eos), None)
        total += len(row) if stop is None else stop + 1
    return total


def _throughput(samples: list[tuple[float, Any, Any]], prompt_len: int, router: Any) -> float:
    return statistics.median(_new_tokens(s[1], prompt_len, router) / s[0] for s in samples)

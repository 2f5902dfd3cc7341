"""Soak: 10,000 generated tokens over many calls on one router. Memory stays flat, statistics stay consistent,
and nothing the router keeps between calls (the n-gram store, draft heads, the cost model) grows past its bound."""

from __future__ import annotations

import gc
import random

import torch

from early_exit_router import EarlyExitRouter

from .conftest import VOCAB, tiny_costs, tiny_llama

RSS_BOUND_MB = 64  # growth allowed between the warm-up and the end (allocator noise; a leak of one cache per call
# at these sizes would be about 2 MB per 100 calls, so a steady leak shows well within the run)


def resident_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def test_ten_thousand_tokens_keep_memory_flat_and_statistics_consistent():
    model = tiny_llama(0)
    router = EarlyExitRouter.from_model(
        model,
        exit_layers=[1, 3],
        ngram_store_tokens=3000,
        draft_vocab_size=48,
        high_conf_threshold=0.06,
        low_conf_threshold=0.0,
    )
    router.cost_model = tiny_costs()["flat"]
    rng = random.Random(0)
    generated, calls, baseline = 0, 0, None
    while generated < 10_000:
        unit = [rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 6))]
        ids = torch.tensor([(unit * rng.randint(1, 4))[:16]])
        n = rng.randint(20, 80)
        mode = rng.choice(["exit", "verify"])
        out = router.generate(ids, max_new_tokens=n, mode=mode)
        new = out.sequences.shape[1] - ids.shape[1]
        s = out.stats
        assert new == n == s.new_tokens == sum(s.exit_histogram.values()) == len(out.depths)
        assert 0 <= s.hit_rate <= 1 and (s.exit_agreement is None or 0 <= s.exit_agreement <= 1)
        generated += new
        calls += 1
        if calls == 20:
            gc.collect()
            baseline = resident_mb()
        store = router.ngram_store()
        assert store.num_tokens <= 3000 and store.index_size <= 3 * 3000
    gc.collect()
    assert baseline is not None and calls > 150
    assert resident_mb() - baseline < RSS_BOUND_MB, (baseline, resident_mb())
    assert len(router.heads.__dict__["_draft_heads"]) == 1  # one trimmed head, reused by every call

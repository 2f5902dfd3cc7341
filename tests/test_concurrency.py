"""Per-request configuration and concurrent use of one router: never mixed."""

from __future__ import annotations

import threading

import pytest
import torch

from early_exit_router import EarlyExitRouter
from early_exit_router.decode.sampling import SamplingParams, TokenSelector
from early_exit_router.decode.stopping import DecodeRequest

from .conftest import (
    ALWAYS_EXIT,
    MIXED,
    NEVER_EXIT,
    assert_cache_matches_full_forward,
    prompt,
    tiny_llama,
)


def test_a_per_call_config_applies_to_that_call_only():
    model = tiny_llama(0)
    ids = prompt(1)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **NEVER_EXIT)
    before = router.config
    exited = router.generate(ids, 16, mode="exit", config={"high_conf_threshold": 0.0, "low_conf_threshold": 0.0})
    assert router.config is before  # nothing swapped in and out
    assert exited.stats.hit_rate > 0  # the call's thresholds applied
    reference = EarlyExitRouter.from_model(tiny_llama(0), exit_layers=[1, 3], **ALWAYS_EXIT)
    assert torch.equal(exited.sequences, reference.generate(ids, 16, mode="exit").sequences)
    plain = router.generate(ids, 16, mode="exit")
    assert plain.stats.hit_rate == 0.0  # the router's own config again
    with pytest.raises(TypeError, match="Unknown RouterConfig fields"):
        router.generate(ids, 4, config={"no_such_field": 1})
    with pytest.raises(ValueError, match="exit_layers"):
        router.generate(ids, 4, config=router.config.replace(exit_layers=[2]))
    with pytest.raises(TypeError, match="RouterConfig or a mapping"):
        router.generate(ids, 4, config=0.5)


def test_two_threads_on_one_router_are_served_like_sequential_calls():
    router = EarlyExitRouter.from_model(tiny_llama(0), exit_layers=[1, 3], **MIXED)
    jobs = [
        (prompt(s), {"high_conf_threshold": t, "low_conf_threshold": 0.0}) for s, t in [(1, 0.0), (2, 0.06), (3, 1.0)]
    ]
    expected = [router.generate(ids, 20, mode="exit", config=cfg) for ids, cfg in jobs]
    results: dict[tuple[int, int], torch.Tensor] = {}

    def worker(k: int) -> None:
        for j, (ids, cfg) in enumerate(jobs):
            results[(k, j)] = router.generate(ids, 20, mode="exit", config=cfg).sequences

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (_, j), sequences in results.items():
        assert torch.equal(sequences, expected[j].sequences)
    assert len(results) == 9


@pytest.mark.parametrize("mode", ["exit", "verify"])
def test_interleaved_decodes_equal_each_run_alone(mode):
    """What the server's scheduler does: several decodes in flight, advanced one step at a time in turn."""
    model = tiny_llama(0)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **MIXED)
    prompts = [prompt(s, length=4 + s) for s in range(3)]
    alone = [router.generate(ids, 12 + 4 * k, mode=mode) for k, ids in enumerate(prompts)]
    decoders = []
    for k, ids in enumerate(prompts):
        decoder = router.decoder(mode=mode)
        request = DecodeRequest(max_new_tokens=12 + 4 * k)
        decoder.prefill(ids, torch.ones_like(ids), [request], [TokenSelector(SamplingParams(), ids.device)])
        decoders.append(decoder)
    running = list(decoders)
    while running:
        for decoder in running:
            decoder.step()
        running = [d for d in running if not d.finished]
    for k, decoder in enumerate(decoders):
        cache = decoder.finish()
        row = decoder.rows[0]
        sequences = torch.cat([prompts[k], torch.tensor([row.output()])], dim=1)
        assert torch.equal(sequences, alone[k].sequences)
        assert row.depth == alone[k].depths
        assert_cache_matches_full_forward(model, sequences, cache)
    unfinished = router.decoder(mode=mode)
    unfinished.prefill(prompts[0], torch.ones_like(prompts[0]), [DecodeRequest(max_new_tokens=3)],
                       [TokenSelector(SamplingParams(), prompts[0].device)])  # fmt: skip
    with pytest.raises(RuntimeError, match="before the decode finished"):
        unfinished.finish()

"""Compiled passes (`RouterConfig(compile=True)`): torch.compile graphs over a static KV cache keep the contract:
greedy verify output identical to plain greedy, the returned cache a full forward pass's, fallbacks that say why."""

from __future__ import annotations

import logging

import pytest
import torch

from early_exit_router import EarlyExitRouter, RouterConfig
from early_exit_router.decode import loop
from early_exit_router.models import _compat
from early_exit_router.models._compat import static_cache
from early_exit_router.models.compiled import GROUP, compile_unsupported

from .conftest import MIXED, assert_cache_matches_full_forward, assert_same_model, model_fingerprint, tiny_llama
from .test_architectures import DISCOVERED, FAMILIES, build
from .test_token_trees import FLAT, repetitive_prompt


def compiled_router(model, **overrides) -> EarlyExitRouter:
    options = dict(exit_layers=[1, 3], acceptance_prior=0.5, ngram_min_size=1, compile=True)
    router = EarlyExitRouter.from_model(model, **{**options, **overrides})
    router.cost_model = FLAT  # positions cost nothing: n-gram chains, trees and exit drafts are all drafted
    return router


def graphs_used(router: EarlyExitRouter) -> set:
    compiled = router.stack.compiled_layers()
    assert compiled is not None and compiled.failed is None, compiled and compiled.failed
    return {key[0] for key in compiled._seen}


@pytest.mark.parametrize("seed", range(3))
def test_compiled_verify_is_plain_greedy_through_trees_and_rollbacks_with_a_full_forwards_cache(seed):
    model = tiny_llama(seed)
    before = model_fingerprint(model)
    ids = repetitive_prompt(seed)
    ref = model.generate(ids, max_new_tokens=40, do_sample=False)
    router = compiled_router(model, ngram_draft=6, ngram_tree_nodes=6)  # trees as graphs: passes up to 8 positions
    out = router.generate(ids, max_new_tokens=40, mode="verify")
    assert torch.equal(out.sequences, ref)
    assert out.stats.policy_cycles.get("tree", 0) >= 1  # tree passes ran on the static cache, under their own mask
    assert out.stats.draft_acceptance < 1  # rejected drafts: rollbacks (length updates)
    assert graphs_used(router) == {"range", "layers", "head"}  # plain steps ran as graphs
    seen = router.stack.compiled_layers()._seen
    assert any(key[0] == "range" and key[-1] for key in seen)  # and tree passes, under their own mask, padded
    assert type(out.cache) is _compat.DynamicCache  # what the caller gets back is a cache like any other
    assert_cache_matches_full_forward(model, out.sequences, out.cache)
    # the same again with exits on (segments that lag behind one another, filled layer-wise) and in exit mode
    out = router.generate(ids, max_new_tokens=40, mode="verify", config={"ngram_tier": False, **MIXED})
    assert torch.equal(out.sequences, ref) and out.stats.drafts_judged > 0
    repaired = router.generate(ids, max_new_tokens=40, mode="exit", config={**MIXED, "holdback": None})
    assert torch.equal(repaired.sequences, ref)  # exit mode repairs every wrong exited token
    lossy = router.generate(ids, max_new_tokens=40, mode="exit", config=MIXED)
    eager = router.generate(ids, max_new_tokens=40, mode="exit", config={**MIXED, "compile": False})
    assert torch.equal(lossy.sequences, eager.sequences)  # the same decisions, compiled or not
    assert_cache_matches_full_forward(model, lossy.sequences, lossy.cache)
    assert router.unpatch() is model
    assert_same_model(before, model_fingerprint(model))


def test_one_compiled_graph_serves_every_decoder_layer():
    from torch._dynamo.utils import counters

    model = tiny_llama(3, layers=12)
    ids = repetitive_prompt(3)
    ref = model.generate(ids, max_new_tokens=24, do_sample=False)
    router = compiled_router(model, **MIXED)
    before = counters["stats"]["unique_graphs"]
    out = router.generate(ids, max_new_tokens=24, mode="verify")
    assert torch.equal(out.sequences, ref)
    # at each width passes ran at: a mask graph per range start (0, 1, 3), a graph for a group of layers and one for
    # a single layer, the head
    seen = router.stack.compiled_layers()._seen
    widths = {key[-1] for key in seen if key[0] == "layers"}
    assert 1 in widths and len(widths) > 1  # plain steps and wider passes (exit drafts' fills, verify passes)
    assert counters["stats"]["unique_graphs"] - before <= 6 * len(widths)  # not a graph per layer (12)
    assert {key[:3] for key in seen if key[0] == "layers"} == {("layers", 1, 256), ("layers", GROUP, 256)}


def test_a_decode_longer_than_its_static_cache_grows_it(monkeypatch):
    monkeypatch.setattr(static_cache, "STATIC_ROOM", 8)  # lengths of 8, 16, 32...: growths in one decode
    # sized for the prompt and 2 slots (as an "until EOS" caller's cache is, past SLOTS_AHEAD), then grown
    monkeypatch.setattr(loop, "decode_cache", lambda decoder, n, requests, join: decoder.stack.new_cache(n + 2))
    model = tiny_llama(1)
    ids = repetitive_prompt(1, length=20)
    ref = model.generate(ids, max_new_tokens=48, do_sample=False)
    router = compiled_router(model)
    grown = []
    make_room = static_cache.make_room

    def watched(cache, layer_idx, needed):
        length = cache.layers[layer_idx].max_cache_len
        make_room(cache, layer_idx, needed)
        if cache.layers[layer_idx].max_cache_len != length:
            grown.append(cache.layers[layer_idx].max_cache_len)

    monkeypatch.setattr(_compat, "make_room", watched)
    out = router.generate(ids, max_new_tokens=48, mode="verify")
    assert torch.equal(out.sequences, ref) and grown  # grown mid-decode, every state carried over
    assert router.stack.compiled_layers().static_slots == grown[-1]  # later decodes start at the grown length
    assert_cache_matches_full_forward(model, out.sequences, out.cache)


def test_where_passes_cannot_compile_they_run_eagerly_and_say_why(caplog):
    sliding = EarlyExitRouter.from_model(build("mistral-sliding"), exit_layers=[1, 3], compile=True)
    assert "sliding-window layers" in compile_unsupported(sliding.stack)
    ids = repetitive_prompt(0)
    with sliding.disabled():
        ref = sliding.model.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(sliding.generate(ids, max_new_tokens=12, mode="verify").sequences, ref)
    bf16 = EarlyExitRouter.from_model(tiny_llama(0, dtype=torch.bfloat16), exit_layers=[1, 3], compile=True)
    assert "on a CPU, where the prepacked products are faster" in compile_unsupported(bf16.stack)
    assert bf16.stack.compiled_layers() is None
    out = bf16.generate(repetitive_prompt(0), max_new_tokens=8, mode="verify")
    assert type(out.cache) is _compat.DynamicCache
    # a batch (rows may leave and be padded) and a server's batch decoder (rows join later) keep dynamic caches
    router = compiled_router(tiny_llama(0))
    ids = torch.cat([repetitive_prompt(0), repetitive_prompt(1)])
    ref = router.generate(ids, max_new_tokens=12, mode="verify", config={"compile": False}).sequences
    assert torch.equal(router.generate(ids, max_new_tokens=12, mode="verify").sequences, ref)
    # a graph that fails (here after writing its layers' slots, mid-range): logged once, and the decode goes on
    # eagerly, the range run again from its first layer, every layer's length put back first
    model = tiny_llama(2)
    ids = repetitive_prompt(2)
    ref = model.generate(ids, max_new_tokens=24, do_sample=False)
    router = compiled_router(model)
    compiled = router.stack.compiled_layers()
    layer_graph, calls = compiled._layers, []

    def broken(*args):
        calls.append(layer_graph(*args))
        if len(calls) == 3:  # the third graph call of the first compiled step (a group of layers, or one)
            raise RuntimeError("inductor could not compile this")
        return calls[-1]

    compiled._layers = broken
    with caplog.at_level(logging.WARNING, logger="early_exit_router.models.compiled"):
        out = router.generate(ids, max_new_tokens=24, mode="verify")
    assert torch.equal(out.sequences, ref) and len(calls) == 3
    assert_cache_matches_full_forward(model, out.sequences, out.cache)
    assert compiled.failed == "RuntimeError: inductor could not compile this"
    assert "compiled passes failed (RuntimeError: inductor could not compile this); eager passes" in caplog.text


def test_compile_is_a_config_switch_checked_like_any_other():
    assert RouterConfig().compile is False and RouterConfig(compile=True).compile is True
    with pytest.raises(ValueError, match="compile must be true or false"):
        RouterConfig(compile="yes")
    router = compiled_router(tiny_llama(0))
    ids = repetitive_prompt(0)
    out = router.model.generate(ids, max_new_tokens=16, do_sample=False)  # generate() on the patched model
    assert graphs_used(router) and torch.equal(out, router.generate(ids, 16, config={"compile": False}).sequences)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES) + sorted(DISCOVERED))
def test_family_contract_with_compiled_passes(family):
    """Every family of the support matrix keeps the contract with `compile=True`: compiled where its layers can use
    a static cache, eager (and said so) where not."""
    model = build(family)
    before = model_fingerprint(model)
    ids = repetitive_prompt(0, length=24)
    ref = model.generate(ids, max_new_tokens=24, do_sample=False)
    router = compiled_router(model)
    out = router.generate(ids, max_new_tokens=24, mode="verify")
    assert torch.equal(out.sequences, ref)
    assert_cache_matches_full_forward(model, out.sequences, out.cache)
    out = router.generate(ids, max_new_tokens=24, mode="verify", config={"ngram_tier": False, **MIXED})
    assert torch.equal(out.sequences, ref) and out.stats.drafts_judged > 0
    assert_cache_matches_full_forward(model, out.sequences, out.cache)
    compiled = router.stack.compiled_layers()
    if compile_unsupported(router.stack) is None:
        assert compiled is not None and compiled.failed is None and compiled._seen, compiled and compiled.failed
    assert router.unpatch() is model
    assert_same_model(before, model_fingerprint(model))

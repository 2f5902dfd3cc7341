"""The router's cache layers: views of buffers with room to grow, holding exactly what HF's DynamicLayer holds."""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicLayer

from early_exit_router import EarlyExitRouter
from early_exit_router.bench.long_context import measure_long_context_step
from early_exit_router.models import _compat

from .conftest import NEVER_EXIT, assert_cache_matches_full_forward, prompt, tiny_llama


def _states(length: int, seed: int, rows: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 2, length, 4, generator=generator), torch.randn(rows, 2, length, 4, generator=generator)


def _same(ours: _compat.GrowingLayer, theirs: DynamicLayer) -> None:
    assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)


def test_appends_crops_and_growth_hold_what_a_dynamic_layer_holds():
    ours, theirs = _compat.GrowingLayer(), DynamicLayer()
    with torch.inference_mode():
        first = ours.update(*_states(5, 0))
        assert all(torch.equal(a, b) for a, b in zip(first, theirs.update(*_states(5, 0))))
        buffer = ours.keys.data_ptr()
        for seed in range(1, 4):  # single positions and a chunk, within the room: written in place
            for layer in (ours, theirs):
                layer.update(*_states(1 + 2 * (seed == 2), seed))
            _same(ours, theirs)
            assert ours.keys.data_ptr() == buffer
        for layer in (ours, theirs):  # a rejected draft: the next append overwrites the cropped positions
            layer.crop(-3)
            layer.update(*_states(2, 9))
        _same(ours, theirs)
        for seed in range(10, 14):  # past the room: copied into a larger buffer
            for layer in (ours, theirs):
                layer.update(*_states(40, seed))
            _same(ours, theirs)
        assert ours.keys.data_ptr() != buffer and ours.keys.shape[2] == 169


def test_states_replaced_from_outside_are_adopted():
    ours, theirs = _compat.GrowingLayer(), DynamicLayer()
    with torch.inference_mode():
        for layer in (ours, theirs):
            layer.update(*_states(6, 0, rows=3))
            layer.batch_select_indices(torch.tensor([2, 0]))  # rows leave a batch: new tensors, not the buffer
            layer.update(*_states(1, 1, rows=2))
        _same(ours, theirs)
        for layer in (ours, theirs):
            layer.keys, layer.values = layer.keys[:, :, 2:], layer.values[:, :, 2:]  # front slots dropped: a view
            layer.update(*_states(1, 2, rows=2))
        _same(ours, theirs)


def test_autograd_records_through_appends():
    layer = _compat.GrowingLayer()
    weight = torch.ones((), requires_grad=True)
    loss = torch.zeros(())
    for seed in range(3):
        keys, values = _states(2, seed)
        out_keys, out_values = layer.update(keys * weight, values * weight)
        loss = loss + out_keys.sum() + out_values.sum()
    loss.backward()  # appending in place would have changed what the first steps saved for this
    want = sum(float((k.sum() + v.sum()) * (3 - seed)) for seed, (k, v) in enumerate(_states(2, s) for s in range(3)))
    assert torch.allclose(weight.grad, torch.tensor(want), rtol=1e-5)


def test_a_cache_decoded_in_inference_mode_takes_ordinary_appends_after_release():
    layer = _compat.GrowingLayer()
    with torch.inference_mode():
        layer.update(*_states(4, 0))
    cache = type("Cache", (), {"layers": [layer]})()
    _compat.release_inference_tensors(cache)
    assert not layer.keys.is_inference() and layer.keys.is_contiguous()  # compact: the room is dropped
    reference = DynamicLayer()
    reference.update(*_states(4, 0))
    for layer_ in (layer, reference):
        layer_.update(*_states(1, 1))
    _same(layer, reference)


def test_new_caches_use_growing_layers_for_full_attention_only():
    model = tiny_llama(0)
    model.config.layer_types = ["full_attention", "sliding_attention"] * 3
    model.config.sliding_window = 4
    cache = _compat.new_cache(model.config)
    kinds = [type(layer).__name__ for layer in cache.layers]
    assert kinds == ["GrowingLayer", "DynamicSlidingWindowLayer"] * 3
    assert _compat.cache_rows_can_change(_compat.new_cache(tiny_llama(0).config))


def test_generation_leaves_the_full_forward_cache_through_crops_and_growth():
    model = tiny_llama(0)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **dict(NEVER_EXIT, ngram_tier=True))
    ids = prompt(1, length=40)
    with torch.inference_mode():
        out = router.generate(ids, max_new_tokens=80, mode="verify")
    with router.disabled() as plain:
        want = plain.generate(ids, max_new_tokens=80, do_sample=False)
    assert torch.equal(out.sequences, want)
    assert_cache_matches_full_forward(model, out.sequences, out.cache)


def test_long_context_step_gives_the_same_logits_with_either_cache():
    router = EarlyExitRouter.from_model(tiny_llama(0), exit_layers=[1, 3])
    step = measure_long_context_step(router.stack, context=400, steps=4)
    assert step.same_logits and step.growing_ms > 0 and step.concatenating_ms > 0


@pytest.mark.parametrize(("context", "message"), [(0, "1 or more cached positions"), (509, "1 to 508 cached")])
def test_long_context_outside_the_model_is_refused_clearly(context, message):
    router = EarlyExitRouter.from_model(tiny_llama(0), exit_layers=[1, 3])  # 512 positions
    with pytest.raises(ValueError, match=message):
        measure_long_context_step(router.stack, context=context, steps=4)

"""Grouped-query attention without copying the cache (`models/attention.py`): the stack's masked passes give bitwise
the numbers of HF's own `sdpa` attention, every config is left as it was, and other calls go to HF's `sdpa`."""

from __future__ import annotations

import pytest
import torch

from early_exit_router import EarlyExitRouter
from early_exit_router.models import architecture, attention
from early_exit_router.models.attention import NATIVE_GQA_SDPA, native_gqa, native_gqa_supported

from .conftest import tiny_llama, tiny_tokenizer

needs_native = pytest.mark.skipif(
    not native_gqa_supported(torch.device("cpu")), reason="torch before 2.5 has no enable_gqa"
)


def chunk_logits(router: EarlyExitRouter, ids: torch.Tensor, split: int) -> torch.Tensor:
    """Logits of `ids[:, split:]` run as one masked chunk over a cache holding `ids[:, :split]`."""
    stack = router.stack
    cache = stack.new_cache()
    with torch.no_grad():
        stack.run(stack.embed(ids[:, :split]), 0, stack.num_layers, cache, torch.arange(split).unsqueeze(0))
        rest = torch.arange(split, ids.shape[1]).unsqueeze(0)
        return stack.logits(stack.run(stack.embed(ids[:, split:], split), 0, stack.num_layers, cache, rest))


@needs_native
def test_masked_passes_over_grouped_heads_give_hf_sdpas_numbers_bitwise(monkeypatch):
    model = tiny_llama(0)
    assert model.config.num_attention_heads > model.config.num_key_value_heads  # grouped heads
    router = EarlyExitRouter.from_model(model, tiny_tokenizer(), exit_layers=[1, 3])
    ids = torch.tensor([[3, 17, 5, 9, 40, 41, 42, 3, 17, 5, 9, 40, 7, 8]])
    calls = []
    original = attention.sdpa_native_gqa

    def counted(*args, **kwargs):
        calls.append(args[4] is not None)  # whether a mask was given
        return original(*args, **kwargs)

    monkeypatch.setattr(attention, "sdpa_native_gqa", counted)
    attention._register.cache_clear()
    try:
        got = chunk_logits(router, ids, 6)
    finally:
        attention._register.cache_clear()
    assert sum(calls) == router.stack.num_layers  # the second chunk's masked attention, in every layer
    monkeypatch.setattr(architecture.LayerStack, "_attention", lambda self, positions: torch.no_grad())
    want = chunk_logits(router, ids, 6)  # HF's sdpa: repeat_kv, then the kernel
    assert torch.equal(got, want)
    assert model.config._attn_implementation == "sdpa"


def test_every_config_is_put_back_after_an_error_and_other_implementations_are_left_alone():
    model = tiny_llama(0)
    config = model.config
    with pytest.raises(RuntimeError, match="inside"), native_gqa(config):
        assert config._attn_implementation == NATIVE_GQA_SDPA
        raise RuntimeError("inside")
    assert config._attn_implementation == "sdpa"
    config._attn_implementation = "eager"
    with native_gqa(config):
        assert config._attn_implementation == "eager"
    assert config._attn_implementation == "eager"


@needs_native
def test_eager_attention_and_unmasked_steps_keep_their_own_path():
    model = tiny_llama(0)
    model.config._attn_implementation = "eager"
    router = EarlyExitRouter.from_model(model, tiny_tokenizer(), exit_layers=[1, 3])
    ids = torch.tensor([[3, 17, 5, 9, 40, 41, 42, 3]])
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(router.generate(ids, 12, mode="verify").sequences, want)
    assert model.config._attn_implementation == "eager"

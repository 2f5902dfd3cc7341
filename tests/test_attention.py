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


served = [0]  # the masked calls `sdpa_native_gqa` served in the last chunk `chunk_logits` ran


def chunk_logits(router: EarlyExitRouter, ids: torch.Tensor, split: int, padding: int = 0) -> torch.Tensor:
    """Logits of `ids[:, split:]` run as one masked chunk over a cache holding `ids[:, :split]`; with `padding`, the
    first row's first `padding` slots are left padding."""
    stack = router.stack
    real = torch.ones(ids.shape, dtype=torch.long)
    real[0, :padding] = 0
    positions = (real.cumsum(1) - 1).clamp(min=0)  # (b, length): each row counts its real slots
    mask = real if padding else None
    cache = stack.new_cache()
    with torch.no_grad():
        head = stack.embed(ids[:, :split], positions=positions[:, :split])
        stack.run(
            head,
            0,
            stack.num_layers,
            cache,
            positions[:, :split],
            attention_mask=None if mask is None else mask[:, :split],
        )
        rest = stack.embed(ids[:, split:], positions=positions[:, split:])
        before = attention._native_calls[0]
        out = stack.run(rest, 0, stack.num_layers, cache, positions[:, split:], attention_mask=mask)
        served[0] = attention._native_calls[0] - before
        return stack.logits(out)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_passes_over_grouped_heads_give_hf_sdpas_numbers_bitwise(monkeypatch, dtype):
    model = tiny_llama(0, dtype=dtype)
    assert model.config.num_attention_heads > model.config.num_key_value_heads  # grouped heads
    router = EarlyExitRouter.from_model(model, tiny_tokenizer(), exit_layers=[1, 3])
    stack = router.stack
    one = [3, 17, 5, 9, 40, 41, 42, 3, 17, 5, 9, 40, 7, 8, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59]
    ids = torch.tensor([one, one[::-1]])
    # chunks of 2, 3, 8 and 20 positions, and a batch of two rows, one of them left-padded
    cases = [(1, 22, 0), (1, 21, 0), (1, 16, 0), (1, 4, 0), (2, 16, 0), (2, 16, 3)]
    got = []
    for rows, split, padding in cases:
        got.append(chunk_logits(router, ids[:rows], split, padding))
        assert served[0] == stack.num_layers  # the masked chunk, in every layer
        assert not attention._pass_masks.masks  # the pass's converted masks are dropped with it
    monkeypatch.setattr(architecture.LayerStack, "_attention", lambda self, positions: torch.no_grad())
    for (rows, split, padding), logits in zip(cases, got):
        assert torch.equal(logits, chunk_logits(router, ids[:rows], split, padding))  # HF's sdpa: repeat_kv, kernel
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

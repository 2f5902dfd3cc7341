"""The contract on every supported family, each on a tiny random config built locally."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

from early_exit_router import EarlyExitRouter

from .conftest import (
    MIXED,
    NEVER_EXIT,
    VOCAB,
    assert_cache_matches_full_forward,
    assert_same_model,
    model_fingerprint,
    prompt,
)

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
FAMILIES = {
    "llama": lambda: LlamaConfig(**COMMON),
    "mistral": lambda: MistralConfig(**COMMON, sliding_window=None),
    "mistral-sliding": lambda: MistralConfig(**COMMON, sliding_window=5),
    "qwen2": lambda: Qwen2Config(**COMMON),
    "qwen2-sliding": lambda: Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=5, max_window_layers=3),
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=8),
    "phi3": lambda: Phi3Config(**COMMON, pad_token_id=0, sliding_window=None),
    # Sliding and global layers (every 3rd global), two rotary tables, soft-capped logits.
    "gemma3_text": lambda: Gemma3TextConfig(
        **COMMON, head_dim=8, sliding_window=5, sliding_window_pattern=3, final_logit_softcapping=30.0
    ),
    # Learned absolute positions, LayerNorm, Conv1D projections, transformer.h layout.
    "gpt2": lambda: GPT2Config(vocab_size=VOCAB, n_embd=32, n_inner=64, n_layer=6, n_head=4, n_positions=512),
}


def build(family: str, seed: int = 0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(FAMILIES[family]()).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # spread confidences, as in conftest.tiny_llama
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_contract(family):
    model = build(family)
    assert model.config.model_type == family.split("-")[0]
    before = model_fingerprint(model)
    ids = prompt(0)
    ref = model.generate(ids, max_new_tokens=24, do_sample=False)

    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **NEVER_EXIT)
    assert torch.equal(router.generate(ids, max_new_tokens=24).sequences, ref), "never-exit differs from generate"

    router.config = router.config.replace(**MIXED)
    out = router.generate(ids, max_new_tokens=24, mode="exit")
    assert 0 < out.stats.hit_rate < 1, out.stats.exit_histogram
    assert_cache_matches_full_forward(model, out.sequences, out.cache)

    out = router.generate(ids, max_new_tokens=24, mode="verify")
    assert torch.equal(out.sequences, ref), "verify differs from greedy"
    assert out.stats.exited_checked > 0
    assert_cache_matches_full_forward(model, out.sequences, out.cache)

    router.config = router.config.replace(mode="verify")  # model.generate() itself routes, losslessly
    assert torch.equal(model.generate(ids, max_new_tokens=24, do_sample=False), ref), "generate() differs"
    assert router.last_stats is not None and router.last_stats.exited_checked > 0

    assert router.unpatch() is model
    assert_same_model(before, model_fingerprint(model))

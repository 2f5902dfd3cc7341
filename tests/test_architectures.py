"""The contract on every supported family, each on a tiny random config built locally."""

from __future__ import annotations

import pytest
import torch
import transformers
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
from early_exit_router.models.architecture import architecture_table
from early_exit_router.models.discovery import ArchitectureMismatchError, discover_spec, self_test

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
NO_SPECIAL = dict(pad_token_id=None, bos_token_id=None, eos_token_id=None)  # the tiny vocabulary has none of theirs
# Families without a spec file: discovery and the self-test alone.
DISCOVERED = {
    "gemma": lambda: transformers.GemmaConfig(**COMMON, head_dim=8),
    # Post-norms, soft-capped attention and logits, sliding and global layers.
    "gemma2": lambda: transformers.Gemma2Config(**COMMON, head_dim=8, sliding_window=5, final_logit_softcapping=30.0),
    "olmo": lambda: transformers.OlmoConfig(**COMMON, **NO_SPECIAL),
    "olmo2": lambda: transformers.Olmo2Config(**COMMON, **NO_SPECIAL),  # post-norms, q/k norms
    "olmo3": lambda: transformers.Olmo3Config(**COMMON, sliding_window=5, **NO_SPECIAL),
    # Partial rotary and biased LayerNorm.
    "stablelm": lambda: transformers.StableLmConfig(**COMMON, partial_rotary_factor=0.25, **NO_SPECIAL),
    "gpt_neox": lambda: transformers.GPTNeoXConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        max_position_embeddings=512,
        rotary_pct=0.25,
        tie_word_embeddings=False,
        **NO_SPECIAL,
    ),
    "phi": lambda: transformers.PhiConfig(**COMMON, partial_rotary_factor=0.5, **NO_SPECIAL),
    "cohere": lambda: transformers.CohereConfig(**COMMON, logit_scale=2.0, **NO_SPECIAL),  # a logit multiplier
    # Embedding, residual, attention and logit multipliers.
    "granite": lambda: transformers.GraniteConfig(
        **COMMON, embedding_multiplier=3.0, residual_multiplier=0.5, logits_scaling=0.5, attention_multiplier=0.3
    ),
    "starcoder2": lambda: transformers.Starcoder2Config(**COMMON, sliding_window=5, **NO_SPECIAL),
    "mixtral": lambda: transformers.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **COMMON, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32
    ),
    "smollm3": lambda: transformers.SmolLM3Config(**COMMON, **NO_SPECIAL),  # layers without rotary (NoPE)
    "glm4": lambda: transformers.Glm4Config(**COMMON, head_dim=8, **NO_SPECIAL),
    "helium": lambda: transformers.HeliumConfig(**COMMON, head_dim=8, **NO_SPECIAL),
    "gptj": lambda: transformers.GPTJConfig(
        vocab_size=VOCAB, n_embd=32, n_layer=6, n_head=4, rotary_dim=4, n_positions=512, **NO_SPECIAL
    ),
    # Rotary, parallel attention and MLP; its layers require an `alibi` argument, passed as None.
    "falcon": lambda: transformers.FalconConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=6,
        num_attention_heads=4,
        alibi=False,
        max_position_embeddings=512,
        **NO_SPECIAL,
    ),  # fmt: skip
}
# Families the stack cannot run segment by segment: refused, with the reason.
REFUSED = {
    "opt": (
        lambda: transformers.OPTConfig(
            vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=6, num_attention_heads=4, **NO_SPECIAL
        ),
        # OPT's position embedding takes the attention mask, not positions: the self-test sees the wrong positions
        "embeddings or positions are not reproduced",
    ),
    "bloom": (
        lambda: transformers.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=6, n_head=4, **NO_SPECIAL),
        "expected one final norm",
    ),
    "falcon-alibi": (
        lambda: transformers.FalconConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=6, num_attention_heads=4, alibi=True, **NO_SPECIAL
        ),
        r"need `alibi` \(config.alibi is set\), which early-exit-router does not compute",
    ),
}


def build(family: str, seed: int = 0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config({**FAMILIES, **DISCOVERED}[family]()).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # spread confidences, as in conftest.tiny_llama
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model


@pytest.mark.parametrize("family", sorted(FAMILIES) + sorted(DISCOVERED))
def test_family_contract(family):
    model = build(family)
    assert model.config.model_type == family.split("-")[0]
    assert model.config.model_type not in architecture_table()  # discovery alone
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
    assert out.stats.drafts_judged > 0
    assert_cache_matches_full_forward(model, out.sequences, out.cache)

    router.config = router.config.replace(mode="verify")  # model.generate() itself routes, losslessly
    assert torch.equal(model.generate(ids, max_new_tokens=24, do_sample=False), ref), "generate() differs"
    assert router.last_stats is not None and router.last_stats.drafts_judged > 0

    assert router.unpatch() is model
    assert_same_model(before, model_fingerprint(model))


@pytest.mark.parametrize("family", sorted(FAMILIES) + sorted(DISCOVERED))
def test_bfloat16_passes_from_packed_weights_give_the_tokens_of_the_modules_own_products(family):
    """bf16 products from packed weights equal `F.linear`'s bitwise, and a group's members (query, key and value;
    gate and up) read their columns of one product as views: every family's attention and MLP code takes them, and
    verify passes give the same tokens with packing on and off."""
    router = EarlyExitRouter.from_model(build(family).to(torch.bfloat16), exit_layers=[1, 3], **MIXED)
    if router.stack.packed_weights is None:
        pytest.skip("this CPU does not compute bf16 natively: nothing is packed")
    ids = prompt(0)
    packed = router.generate(ids, max_new_tokens=24, mode="verify")
    router.stack.use_packed_weights(False)
    assert torch.equal(packed.sequences, router.generate(ids, max_new_tokens=24, mode="verify").sequences)
    assert packed.stats.drafts_judged > 0


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_a_family_the_stack_cannot_run_is_refused_with_the_reason(family):
    config, reason = REFUSED[family]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config()).eval()
    before = model_fingerprint(model)
    with pytest.raises(ValueError, match=reason):
        EarlyExitRouter.from_model(model, exit_layers=[1, 3])
    assert_same_model(before, model_fingerprint(model))


def test_a_residual_block_finds_its_writers_by_running_the_layer():
    """Phi3 registers its attention's output projection before its fused qkv projection: the writers are the
    projections each part of the layer calls last, so a residual block builds there and verify stays greedy."""
    model = build("phi3")
    ids = prompt(0)
    ref = model.generate(ids, max_new_tokens=24, do_sample=False)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], adapter="residual_block", **MIXED)
    adapter = router.heads.adapter(1)
    assert adapter.writers == ["self_attn.o_proj", "mlp.down_proj"]
    with torch.no_grad():
        adapter.mix.fill_(0.5)  # the block's update enters, as after training
    out = router.generate(ids, max_new_tokens=24, mode="verify")
    assert torch.equal(out.sequences, ref) and out.stats.drafts_judged > 0


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_a_residual_block_on_a_mixture_of_experts_layer_is_refused_with_the_fix(family):
    """Their MLP writes through fused experts, not one projection (its last call is the router's scores)."""
    model = build(family)
    before = model_fingerprint(model)
    with pytest.raises(ValueError, match=r"found \['self_attn.o_proj'\]\). Use the 'block' or 'postnorm' adapter"):
        EarlyExitRouter.from_model(model, exit_layers=[1, 3], adapter="residual_block")
    assert_same_model(before, model_fingerprint(model))
    assert EarlyExitRouter.from_model(model, exit_layers=[1, 3], adapter="block").heads.kinds[1] == "block"


def test_discovery_measures_the_multipliers_and_the_self_test_refuses_wrong_ones():
    model = build("granite")
    spec = discover_spec(model)
    assert spec.embed_multiplier == pytest.approx(3.0) and spec.logit_multiplier == pytest.approx(2.0)
    from dataclasses import replace

    from early_exit_router.models.architecture import LayerStack

    self_test(LayerStack(model, spec))
    with pytest.raises(ArchitectureMismatchError, match="logits differ"):
        self_test(LayerStack(model, replace(spec, logit_multiplier=1.5)))
    with pytest.raises(ArchitectureMismatchError, match="layer 0's keys/values differ"):
        self_test(LayerStack(model, replace(spec, embed_multiplier=None)))


# What discovery must find for the families that once had spec files (kept here as the expected values).
EXPECTED_SPECS = {
    "llama": dict(layers="model.layers", final_norm="model.norm", rotary_emb="model.rotary_emb", mask_rule="full"),
    "mistral-sliding": dict(mask_rule="sliding_window_config"),
    "qwen2-sliding": dict(mask_rule="layer_types"),
    "phi3": dict(final_norm="model.norm", mask_rule="full"),
    "gemma3_text": dict(
        position_style="rotary_per_layer_type",
        mask_rule="layer_types",
        final_logit_softcapping_attr="final_logit_softcapping",
    ),
    "gpt2": dict(
        layers="transformer.h",
        embed_tokens="transformer.wte",
        final_norm="transformer.ln_f",
        rotary_emb=None,
        position_embed="transformer.wpe",
        position_style="learned",
    ),
}


@pytest.mark.parametrize("family", sorted(EXPECTED_SPECS))
def test_discovery_finds_the_known_layouts(family):
    spec = discover_spec(build(family))
    for name, value in EXPECTED_SPECS[family].items():
        assert getattr(spec, name) == value, name
    assert spec.embed_multiplier is None and spec.logit_multiplier is None


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_left_padded_batches_equal_hf_batched_greedy_with_learned_positions(family):
    """HF numbers a left-padded row's padding slots 1 (`cumsum - 1`, then filled); a learned position table cannot
    look up the negative positions the rows' own numbering gives padding, which failed with an IndexError."""
    model = build(family)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(2, VOCAB, (3, 7), generator=generator)
    mask = torch.ones_like(ids)
    for row, pad in enumerate([0, 3, 5]):
        ids[row, :pad], mask[row, :pad] = 0, 0
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **MIXED)
    out = router.generate(ids, 12, mode="verify", attention_mask=mask)
    assert torch.equal(out.sequences, ref)

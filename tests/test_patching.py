"""In-place patching: exact undo, the plain model inside disabled(), and no half-applied patch on errors."""

from __future__ import annotations

import pytest
import torch
from transformers import OPTConfig, OPTForCausalLM

from early_exit_router import EarlyExitRouter, RouterConfig
from early_exit_router.integrations.hf_generate import RoutedGenerate

from .conftest import MIXED, NEVER_EXIT, assert_same_model, model_fingerprint, prompt, tiny_llama


def test_from_model_copies_no_weights_and_adds_nothing_to_the_model(model):
    before = model_fingerprint(model)
    base_params = sum(p.numel() for p in model.parameters())
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3])
    assert router.model is model
    assert router.stack.lm_head.weight.data_ptr() == model.lm_head.weight.data_ptr()
    assert router.num_added_parameters() == 2 * 32 * 32  # one postnorm map (no bias) per exit, in the router
    assert router.added_parameter_share() == pytest.approx(2 * 32 * 32 / base_params)
    # The heads are the router's: the model's parameters, state_dict and module tree stay the base's.
    after = model_fingerprint(model)
    assert set(after["attrs"]) - set(before["attrs"]) == {"_early_exit_router", "generate"}
    before["attrs"] = after["attrs"] = {}
    assert_same_model(before, after)
    assert "exits at [1, 3]" in router.describe() and "UNTRAINED" in router.describe()


def test_unpatch_returns_the_original_object_with_identical_logits_params_and_keys(model):
    before = model_fingerprint(model)
    ids = prompt(0)
    with torch.no_grad():
        ref_logits = model(ids).logits
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **MIXED)
    router.generate(ids, max_new_tokens=10)
    base = router.unpatch()
    assert base is model
    assert_same_model(before, model_fingerprint(base))
    with torch.no_grad():
        assert torch.equal(base(ids).logits, ref_logits)
    with pytest.raises(RuntimeError, match="unpatched"):
        router.generate(ids, max_new_tokens=2)
    # The unpatched model can be patched again.
    EarlyExitRouter.from_model(base, exit_layers=[2]).unpatch()


def test_disabled_gives_the_plain_model_and_plain_generate(model):
    before = model_fingerprint(model)
    ids = prompt(0)
    ref = model.generate(ids, max_new_tokens=12, do_sample=False)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **MIXED)
    with router.disabled() as plain:
        assert plain is model
        assert_same_model(before, model_fingerprint(model))
        out = router.generate(ids, max_new_tokens=12)
        assert torch.equal(out.sequences, ref)
        assert out.stats.mode == "plain" and out.stats.exit_histogram == {5: 12}
    assert router.is_enabled and isinstance(model.__dict__.get("generate"), RoutedGenerate)


def test_disabled_restores_the_patch_even_after_an_exception(model):
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3])
    with pytest.raises(KeyError), router.disabled():
        raise KeyError("boom")
    assert router.is_enabled and isinstance(model.__dict__.get("generate"), RoutedGenerate)


def test_a_model_cannot_be_patched_twice(model):
    first = EarlyExitRouter.from_model(model, exit_layers=[1])
    with pytest.raises(ValueError, match="already patched"):
        EarlyExitRouter.from_model(model, exit_layers=[2])
    with first.disabled():  # the model holds no back-reference in there, and a second patch would be overwritten
        with pytest.raises(ValueError, match="already patched .*disabled"):
            EarlyExitRouter.from_model(model, exit_layers=[2])
    assert model._early_exit_router is first
    first.unpatch()
    EarlyExitRouter.from_model(model, exit_layers=[2]).unpatch()  # once unpatched, the model is free


def test_a_config_mapping_and_default_layers_are_read_as_the_routers_own(model):
    router = EarlyExitRouter.from_model(model, None, {"exit_layers": [1, 3], "mode": "verify"})
    assert router.exit_layers == [1, 3] and router.config.mode == "verify"
    router.unpatch()
    router = EarlyExitRouter.from_model(model)  # the default layers
    out = router.generate(prompt(0), max_new_tokens=4, config=RouterConfig(mode="verify", **NEVER_EXIT))
    assert out.stats.new_tokens == 4  # a config that leaves exit_layers unset means the loaded heads' layers


@pytest.mark.parametrize("adapter", ["postnorm", "linear", "residual_block"])
def test_patching_leaves_the_global_random_stream_as_it_was(model, adapter):
    """Fresh adapters are zeroed after nn.Linear draws its initial weights: that draw must not come out of the
    caller's `torch.manual_seed` stream, or a seeded sampled `generate` after patching would change."""
    torch.manual_seed(0)
    want = torch.rand(4)
    torch.manual_seed(0)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], adapter=adapter)
    assert torch.equal(torch.rand(4), want)
    torch.manual_seed(0)
    router.heads.add_gates(32)  # as loading saved gates does
    assert torch.equal(torch.rand(4), want)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(exit_layers=[1, 7]), ValueError, "out of range"),
        (dict(exit_layers=[5]), ValueError, "layer 5 is the full depth"),
        (dict(exit_layers=[3, 1]), ValueError, "sorted"),
        (dict(exit_layers=[2, 2]), ValueError, "duplicates"),
        (dict(high_conf_threshold=1.2), ValueError, "\\[0, 1\\]"),
        (dict(high_conf_threshold=0.2, low_conf_threshold=0.5), ValueError, "above"),
        (dict(mode="turbo"), ValueError, "Unknown mode"),
        (dict(no_such_knob=1), TypeError, "Unknown RouterConfig fields"),
        # Layer lists are never read as something else: "13" is not [1, 3], nor 1.9 layer 1.
        (dict(exit_layers="13"), ValueError, "list of layer indices"),
        (dict(exit_layers=3), ValueError, "list of layer indices"),
        (dict(exit_layers=[1.9, 3.2]), ValueError, "list of layer indices"),
        (dict(exit_layers=[True, 3]), ValueError, "list of layer indices"),
        (dict(exit_layers=[1, 3], active_exit_layers="1"), ValueError, "active_exit_layers must be a list"),
        (dict(exit_layers=[1, 3], exit_adapters=["block"]), ValueError, "exit_adapters maps exit layers"),
        (dict(config=7), TypeError, "config must be a RouterConfig or a mapping"),
        (dict(tokenizer=RouterConfig(exit_layers=[1, 3])), TypeError, "the second argument is the tokenizer"),
    ],
)
def test_bad_config_leaves_the_model_untouched(model, kwargs, error, message):
    before = model_fingerprint(model)
    with pytest.raises(error, match=message):
        EarlyExitRouter.from_model(model, **kwargs)
    assert_same_model(before, model_fingerprint(model))


def test_an_architecture_the_stack_cannot_run_is_refused_untouched():
    config = OPTConfig(
        num_hidden_layers=2, hidden_size=16, num_attention_heads=2, ffn_dim=32, vocab_size=50, word_embed_proj_dim=16
    )
    opt = OPTForCausalLM(config)
    before = model_fingerprint(opt)
    with pytest.raises(ValueError, match="OPTForCausalLM .*not supported"):
        EarlyExitRouter.from_model(opt, config=RouterConfig(exit_layers=[0]))
    assert_same_model(before, model_fingerprint(opt))


def test_a_base_model_without_lm_head_is_refused():
    bare = tiny_llama().model
    bare.config.model_type = "llama"
    with pytest.raises(ValueError, match="no LM head .*load it with AutoModelForCausalLM"):
        EarlyExitRouter.from_model(bare)


@pytest.mark.parametrize(
    "ids, kwargs, error, message",
    [
        (torch.zeros((1, 0), dtype=torch.long), {}, ValueError, "empty"),
        (torch.tensor([1, 2, 3]), {}, ValueError, "must be 2-D .*unsqueeze\\(0\\)"),
        (
            torch.ones((2, 3), dtype=torch.long),
            dict(attention_mask=torch.ones((2, 2), dtype=torch.long)),
            ValueError,
            "attention_mask has shape",
        ),
        (torch.ones((1, 3), dtype=torch.float), {}, TypeError, "integer token ids"),
        (torch.tensor([[1, 200]]), {}, ValueError, "outside the vocabulary"),
        (torch.ones((1, 3), dtype=torch.long), dict(max_new_tokens=0), ValueError, "positive integer"),
        (torch.ones((1, 3), dtype=torch.long), dict(max_new_tokens=-4), ValueError, "positive integer"),
        (torch.ones((1, 3), dtype=torch.long), dict(mode="fast"), ValueError, "Unknown mode 'fast'"),
        (torch.ones((1, 3), dtype=torch.long), dict(temperature=0.0, do_sample=True), ValueError, "temperature"),
        (torch.ones((1, 3), dtype=torch.long), dict(top_p=1.5), ValueError, "top_p"),
        (torch.ones((1, 3), dtype=torch.long), dict(stop_strings=["x"]), ValueError, "need a tokenizer"),
        (torch.ones((1, 3), dtype=torch.long), dict(stop_strings=["x", ""]), ValueError, "non-empty strings"),
        ("a text prompt", {}, ValueError, "No tokenizer is attached"),
        (
            torch.ones((1, 3), dtype=torch.long),
            dict(attention_mask=torch.tensor([[1, 1, 0]])),
            ValueError,
            "Only left padding is supported",
        ),
    ],
)
def test_bad_generate_input_is_refused_and_changes_nothing(model, ids, kwargs, error, message):
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3])
    before = model_fingerprint(model)
    with pytest.raises(error, match=message):
        router.generate(ids, **{"max_new_tokens": 4, **kwargs})
    assert_same_model(before, model_fingerprint(model))
    assert router.generate(prompt(0), max_new_tokens=3).stats.new_tokens == 3


def test_heads_follow_the_model_to_another_dtype(model):
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3])
    model.to(torch.float64)
    assert next(router.heads.parameters()).dtype == torch.float64
    with router.disabled() as plain:
        ref = plain.generate(prompt(0), max_new_tokens=8, do_sample=False)
    router.config = router.config.replace(high_conf_threshold=1.0, low_conf_threshold=1.0, entropy_threshold=0.0)
    assert torch.equal(router.generate(prompt(0), max_new_tokens=8).sequences, ref)


def test_a_custom_gate_runs_before_the_head_and_can_veto_every_exit(model):
    from torch import nn

    class Never(nn.Module):
        def forward(self, hidden):
            return torch.zeros(hidden.shape[:-1])

    # no n-gram tier: its copies of the earlier calls' output (its store) would count as hits too
    always = dict(high_conf_threshold=0.0, low_conf_threshold=0.0, ngram_tier=False)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **always)
    assert router.generate(prompt(0), max_new_tokens=10).stats.hit_rate > 0
    router.set_gate(1, Never())
    router.set_gate(3, Never())
    assert router.generate(prompt(0), max_new_tokens=10).stats.hit_rate == 0
    router.config = router.config.replace(use_gate=False)
    assert router.generate(prompt(0), max_new_tokens=10).stats.hit_rate > 0
    with pytest.raises(ValueError, match="has no exit head"):
        router.set_gate(2, Never())


def test_fresh_heads_are_never_marked_trained(model):
    router = EarlyExitRouter.from_model(model, config=RouterConfig(exit_layers=[1], heads_trained=True))
    assert router.config.heads_trained is False


def test_a_deep_copy_of_a_patched_model_is_patched_by_a_router_of_its_own():
    """TRL's reference models (and anyone's `copy.deepcopy(model)`) copy the model's `__dict__`, the router in it."""
    import copy

    model = tiny_llama(0)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], mode="verify", **MIXED)
    ids = prompt(1)
    before = model_fingerprint(model)
    want = model.generate(ids, max_new_tokens=10, do_sample=False)
    twin = copy.deepcopy(model)
    other = twin._early_exit_router
    assert other is not router and other.model is twin and other.lock is not router.lock
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(model.parameters(), twin.parameters()))
    assert torch.equal(twin.generate(ids, max_new_tokens=10, do_sample=False), want) and other.last_stats is not None
    other.unpatch()  # the copy's router undoes the copy's patch only
    assert isinstance(model.generate, RoutedGenerate) and not isinstance(twin.generate, RoutedGenerate)
    assert_same_model(before, model_fingerprint(model))

"""Tiny random models built locally (as transformers' own tests do), and shared checks."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from early_exit_router.models import _compat

VOCAB = 96


def tiny_llama(seed: int = 0, layers: int = 6, dtype: torch.dtype = torch.float32, peaky: float = 8.0):
    """A 6-layer Llama with a 96-token vocabulary. `peaky` scales the LM head so that softmax confidences spread
    over [0, 1] (a random head gives near-uniform distributions, which never exit)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(peaky)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model.to(dtype)


@pytest.fixture
def model():
    return tiny_llama()


@pytest.fixture(autouse=True)
def _quiet_untrained_warning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Exit mode with UNTRAINED")
        yield


@pytest.fixture(autouse=True)
def _deterministic_costs(request, monkeypatch):
    """Routers decide from a fixed synthetic cost table in tests, not one measured while other work shares the CPU:
    a measured table (cached per model shape, device and library versions) made the exit-mode ask rule and the
    policy's plans depend on timing. The table is flat (a bandwidth-bound device: asking an exit and drafting both
    pay). Tests of the measurement call `costs.cost_model_for` or `costs.measure` themselves (the router calls them
    through `config_costs`), and tests that assign `router.cost_model` use their own; `@pytest.mark.measured_costs`
    opts a test out."""
    if request.node.get_closest_marker("measured_costs"):
        yield
        return
    from early_exit_router import api as router_module
    from early_exit_router.routing.costs import CostModel

    def flat(stack, heads, config, refresh=False):
        return CostModel.synthetic(stack.num_layers, [1.0] * 16, [6.0] * 16, draft_head_ms=0.1)

    monkeypatch.setattr(router_module, "config_costs", flat)
    yield


def prompt(seed: int = 1, length: int = 6) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (1, length), generator=g)


# The threshold cascade at every exit, the full exit head and no n-gram tier: tests of the cascade itself pin these,
# so that the cost policy (which decides from measured times) and the n-gram tier cannot change what they check
# (batches: the synchronous design, the one whose verify passes draft from exits). In exit mode an exited token is
# final at once (holdback 0), so that these tests see the cascade's own tokens; tests/test_exit_repair.py checks the
# repairs that the default holdback makes.
CASCADE = dict(policy="fixed", ngram_tier=False, draft_vocab_size=0, batch_design="synchronous", holdback=0)
NEVER_EXIT = dict(high_conf_threshold=1.0, low_conf_threshold=1.0, entropy_threshold=0.0, **CASCADE)
ALWAYS_EXIT = dict(high_conf_threshold=0.0, low_conf_threshold=0.0, **CASCADE)
# Shallow confidences of the tiny models sit around 0.04-0.13 (96-token vocabulary): this threshold mixes depths.
MIXED = dict(high_conf_threshold=0.06, low_conf_threshold=0.0, entropy_threshold=0.0, **CASCADE)
# The n-gram tier as it was: in exit mode its drafts stay unverified (lossy).
UNVERIFIED_NGRAM = dict(ngram_tier=True, ngram_unverified=True)


def assert_cache_matches_full_forward(model, sequences: torch.Tensor, cache, atol: float = 1e-5) -> None:
    """Every layer of `cache` holds what one full forward pass over sequences[:, :-1] produces."""
    with torch.no_grad():
        full = _compat.forward_cache(model(sequences[:, :-1], use_cache=True))
    expected_len = sequences.shape[1] - 1
    assert len(cache.layers) == len(full.layers)
    for layer_idx, (mine, ref) in enumerate(zip(cache.layers, full.layers)):
        assert mine.get_seq_length() == expected_len, f"layer {layer_idx} holds {mine.get_seq_length()} positions"
        assert mine.keys.shape == ref.keys.shape, f"layer {layer_idx} keeps {mine.keys.shape} vs {ref.keys.shape}"
        torch.testing.assert_close(mine.keys, ref.keys, atol=atol, rtol=0, msg=f"keys of layer {layer_idx}")
        torch.testing.assert_close(mine.values, ref.values, atol=atol, rtol=0, msg=f"values of layer {layer_idx}")


def assert_exit_statistics_match_teacher_forcing(model, prompt_len: int, out) -> None:
    """Exit mode's two statistics against one full forward pass over the (single-row, greedy) output: every early
    token that was never verified is checked (check_fraction 1), and its disagreements with the full model's greedy
    choice given the same prefix are exactly the exit agreement's; the verified early tokens are the accepted drafts
    (those agree by construction), so the checked ones and the accepted drafts are all the early tokens."""
    s, full_layer = out.stats, model.config.num_hidden_layers - 1
    with torch.no_grad():
        logits = model(out.sequences).logits[0]  # (prompt + new, vocab)
    new = out.sequences[0, prompt_len:]
    chosen = logits[prompt_len - 1 : -1].argmax(dim=-1)  # the full model's greedy choice at each new token
    early = [i for i, d in enumerate(out.depths) if d != full_layer]
    disagreements = sum(int(chosen[i] != new[i]) for i in early)
    agreed = round((s.exit_agreement or 0.0) * s.exit_checked)
    accepted = round((s.draft_acceptance or 0.0) * s.drafts_judged)
    assert s.exit_checked - agreed == disagreements, (s.exit_agreement, s.exit_checked, disagreements)
    assert s.exit_checked + accepted == len(early), (s.exit_checked, accepted, len(early))
    assert s.output_agreement == pytest.approx(1 - disagreements / len(new))  # the whole output's, teacher-forced


def model_fingerprint(model) -> dict:
    """Everything `unpatch()` must restore, by value: parameters, state_dict, submodules, attributes, flags, hooks,
    `requires_grad`, `training` and the configs."""
    hook_dicts = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
        "training": {n: m.training for n, m in model.named_modules()},
        "hooks": {n: [len(getattr(m, d)) for d in hook_dicts] for n, m in model.named_modules()},
        "config": model.config.to_dict(),
        "generation_config": model.generation_config.to_dict() if hasattr(model, "generation_config") else None,
        "keys": list(model.state_dict().keys()),
        "values": {k: v.clone() for k, v in model.state_dict().items()},
        "modules": [n for n, _ in model.named_modules()],
        "attrs": {k: v for k, v in model.__dict__.items() if k != "_modules"},  # values by identity
    }


def assert_same_model(before: dict, after: dict) -> None:
    assert before["params"] == after["params"]
    assert before["keys"] == after["keys"]
    assert before["modules"] == after["modules"]
    for key in ("requires_grad", "training", "hooks", "config", "generation_config"):
        assert before[key] == after[key], f"{key} changed"
    assert sorted(before["attrs"]) == sorted(after["attrs"])
    for k, v in before["attrs"].items():
        assert after["attrs"][k] is v or after["attrs"][k] == v, f"model.{k} changed"
    for k, v in before["values"].items():
        assert torch.equal(v, after["values"][k]), k


def tiny_tokenizer():
    """A word-level tokenizer for the tiny models: '<bos>', '<unk>', then 'w2' .. 'w95'; a chat template."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {"<bos>": 0, "<unk>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<bos>")
    tokenizer.chat_template = "{% for m in messages %}w2 {{ m['content'] }} w3 {% endfor %}w4"
    return tokenizer


def tiny_costs() -> dict:
    """Synthetic cost tables for the 6-layer tiny models, so that tests of the cost policy do not depend on timing:
    'flat' (a bandwidth-bound GPU: drafting pays), 'steep' (every extra position costs nearly as much as the first:
    drafting rarely pays) and 'quirky' (slow at 2-4 positions and 2-7 head rows, as this project's CPU measured)."""
    from early_exit_router.routing.costs import CostModel

    return {
        "flat": CostModel.synthetic(6, [1.0] * 16, [6.0] * 16, draft_head_ms=0.1),
        "steep": CostModel.synthetic(6, [0.9 * m + 0.1 for m in range(1, 17)], [5.0 * m for m in range(1, 17)]),
        "quirky": CostModel.synthetic(
            6, [1.0, 3.0, 3.0, 3.0, 1.2, 1.4, 1.6, 1.5], [1.0, 3.0, 3.0, 3.0, 2.5, 2.6, 2.7, 1.5]
        ),
    }

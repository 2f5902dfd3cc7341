"""A base-exact adapted draft path: a LoRA on copies of layers 0..E that only drafts run, with their own KV cache.
The user's model stays bit-identical, verify mode's output is the base model's greedy, and each draft is the adapted
path's own prediction, whatever the draft cache had to roll back."""

from __future__ import annotations

import copy

import pytest
import torch

from early_exit_router.api import EarlyExitRouter
from early_exit_router.config import RouterConfig
from early_exit_router.decode.adapted_draft import AdaptedDrafter
from early_exit_router.heads.checkpoint import save_router
from early_exit_router.heads.exit_heads import build_heads
from early_exit_router.models._compat import quiet_peft
from early_exit_router.models.discovery import stack_for

from .conftest import assert_cache_matches_full_forward, tiny_llama

pytest.importorskip("peft")

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def adapted_copy(model, exit_layer: int, strength: float = 0.05, seed: int = 0):
    """`model` with a random LoRA on layers 0..exit_layer (PEFT's own model, what adapt-base --scope draft trains)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=PROJECTIONS, layers_to_transform=list(range(exit_layer + 1)))
    with quiet_peft():
        peft_model = get_peft_model(copy.deepcopy(model), config)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=strength)
    return peft_model


def draft_path_folder(tmp_path, exit_layer: int = 1, strength: float = 0.05, seed: int = 0, base=None):
    """(router folder, the PEFT model): a router folder with a draft-scope LoRA at `exit_layer` on `base` (a tiny
    Llama by default), saved as `tmp_path / "base"`."""
    base = tiny_llama(0) if base is None else base
    base.save_pretrained(tmp_path / "base")
    peft_model = adapted_copy(base, exit_layer, strength, seed)
    folder = tmp_path / "router"
    with quiet_peft():
        peft_model.save_pretrained(str(folder))
    stack = stack_for(base)
    config = RouterConfig(exit_layers=[exit_layer], adapter="identity", heads_trained=True)
    heads = build_heads(stack, config, config.exit_layers)
    entry = {"format": "lora", "scope": "draft", "exit_layer": exit_layer, "method": "lora", "base": "tiny"}
    save_router(folder, config, heads, stack, str(tmp_path / "base"), adapted=entry)
    return folder, peft_model


@torch.no_grad()
def adapted_top1(peft_model, ids: list[int], exit_layer: int) -> int:
    """The adapted path's greedy prediction after `ids`, computed from scratch: the PEFT model's hidden state after
    layer `exit_layer` through the model's own final norm and LM head."""
    hidden = peft_model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[exit_layer + 1]
    base = peft_model.get_base_model()
    return int(base.lm_head(base.model.norm(hidden[:, -1])).argmax())


@pytest.mark.parametrize("strength", [0.02, 0.3])
def test_verify_mode_with_a_draft_path_is_the_base_greedy_and_leaves_the_model_bit_identical(tmp_path, strength):
    folder, _ = draft_path_folder(tmp_path, strength=strength)
    router = EarlyExitRouter.from_pretrained(folder, warm_up=False)
    assert router.draft_path is not None and router.draft_path.exit_layer == 1
    assert "draft path: adapted copies of layers 0..1" in router.describe()
    reference = tiny_llama(0)
    assert [n for n, _ in router.model.named_modules()] == [n for n, _ in reference.named_modules()]  # no LoRA
    for name, p in reference.named_parameters():  # the LoRA is in the copies, not in the model's weights
        assert torch.equal(p, dict(router.model.named_parameters())[name]), name
    for prompt in ([0, 5, 9, 14, 3, 7], [0, 11, 11, 4, 60, 2, 9]):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            expected = reference.generate(ids, max_new_tokens=40, do_sample=False)
        out = router.generate(ids, max_new_tokens=40, mode="verify", config={"draft_path_threshold": 0.0})
        assert torch.equal(out.sequences, expected)
        assert_cache_matches_full_forward(reference, out.sequences, out.cache)
        assert out.stats.drafts_judged_by_layer.get(1, 0) > 0  # the draft path drafted, booked at its layer
        assert "draft path L1" in out.stats.policy_estimates


def test_each_draft_is_the_adapted_paths_own_prediction_after_any_rollback(tmp_path):
    """The draft cache follows the row's tokens by content: after a rejected tail, a shorter context or another
    sequence, each chain equals what the adapted model predicts from scratch."""
    folder, peft_model = draft_path_folder(tmp_path, strength=0.3)
    router = EarlyExitRouter.from_pretrained(folder, warm_up=False)
    drafter = AdaptedDrafter(router.stack, router.draft_path, None, None)
    contexts = [[0, 5, 9, 14], [0, 5, 9, 14, 3, 7, 7], [0, 5, 9, 2], [0, 5], [0, 40, 41, 42, 43], [0, 40, 41, 42, 43]]
    for tokens in contexts:
        chain = drafter.propose(list(tokens), budget=3, threshold=0.0)
        assert len(chain) == 3
        context = list(tokens)
        for token in chain:
            assert token == adapted_top1(peft_model, context, 1)
            context.append(token)
        assert drafter.fed == context[:-1]  # the last draft is fed with the next chain
    assert drafter.propose([0, 5], budget=0, threshold=0.0) == []
    high = drafter.propose([0, 5, 9], budget=5, threshold=1.0)  # nothing is that sure: no chain
    assert high == []
    chain = drafter.propose([0, 7, 3], budget=3, threshold=0.0)
    assert drafter.propose([0, 7, 3], budget=3, threshold=0.0, end_ids={chain[0]}) == chain[:1]  # ends at an end id


def test_a_draft_paths_chain_ends_at_the_requests_end_token(tmp_path, monkeypatch):
    folder, _ = draft_path_folder(tmp_path, strength=0.3)
    router = EarlyExitRouter.from_pretrained(folder, warm_up=False)
    ends, propose = [], AdaptedDrafter.propose

    def recorded(self, tokens, budget, threshold, end_ids=frozenset()):
        ends.append(set(end_ids))
        return propose(self, tokens, budget, threshold, end_ids)

    monkeypatch.setattr(AdaptedDrafter, "propose", recorded)
    ids = torch.tensor([[0, 5, 9, 14, 3, 7]])
    out = router.generate(
        ids, max_new_tokens=20, mode="verify", eos_token_id=[61, 62], config={"draft_path_threshold": 0.0}
    )
    assert ends and all(end == {61, 62} for end in ends)
    expected = tiny_llama(0).generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=[61, 62])
    assert torch.equal(out.sequences, expected)


def test_sampling_with_a_draft_path_is_plain_sampling(tmp_path):
    folder, _ = draft_path_folder(tmp_path, strength=0.3)
    router = EarlyExitRouter.from_pretrained(folder, warm_up=False)
    ids = torch.tensor([[0, 5, 9, 14, 3, 7]])
    plain = EarlyExitRouter.from_model(tiny_llama(0), exit_layers=[1])
    kwargs = dict(max_new_tokens=30, do_sample=True, temperature=0.8, seed=3)
    expected = plain.generate(ids, mode="verify", config={"ngram_tier": False}, **kwargs).sequences
    out = router.generate(ids, mode="verify", config={"ngram_tier": False, "draft_path_threshold": 0.0}, **kwargs)
    assert torch.equal(out.sequences, expected)
    assert out.stats.drafts_judged_by_layer.get(1, 0) > 0


def test_exit_mode_and_batches_decode_without_the_draft_path_and_stay_exact_where_promised(tmp_path):
    folder, _ = draft_path_folder(tmp_path, strength=0.3)
    router = EarlyExitRouter.from_pretrained(folder, warm_up=False)
    reference = tiny_llama(0)
    ids = torch.tensor([[0, 5, 9, 14, 3, 7], [0, 11, 11, 4, 60, 2]])
    with torch.no_grad():
        expected = reference.generate(ids, max_new_tokens=20, do_sample=False)
    assert torch.equal(router.generate(ids, max_new_tokens=20, mode="verify").sequences, expected)
    router.generate(ids[:1], max_new_tokens=10, mode="exit")  # exit mode runs the shared exits as before
    eager = {"high_conf_threshold": 0.0, "low_conf_threshold": 0.0, "policy": "fixed"}
    batch = router.generate(ids, max_new_tokens=20, mode="verify", config=eager)
    assert torch.equal(batch.sequences, expected) and batch.stats.drafts_judged_by_layer.get(1, 0) > 0  # shared exit
    off = router.generate(ids[:1], max_new_tokens=20, mode="verify", config={"active_exit_layers": []})
    assert torch.equal(off.sequences, expected[:1]) and 1 not in off.stats.drafts_judged_by_layer  # its exit is off


def test_a_draft_path_folder_saves_and_loads_again_and_a_bad_entry_says_what_to_do(tmp_path):
    import json

    folder, _ = draft_path_folder(tmp_path)
    router = EarlyExitRouter.from_pretrained(folder, warm_up=False)
    router.save_pretrained(tmp_path / "copy")
    again = EarlyExitRouter.from_pretrained(tmp_path / "copy", warm_up=False)
    assert again.draft_path is not None
    for a, b in zip(router.draft_path.layers, again.draft_path.layers):
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            assert torch.equal(p, q), name
    meta_path = folder / "early_exit_config.json"
    meta = json.loads(meta_path.read_text())
    meta["adapted_base"] = {"format": "lora", "scope": "draft"}
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="exit_layer"):
        EarlyExitRouter.from_pretrained(folder, warm_up=False)


@pytest.mark.parametrize("strength", [0.0, 0.3])
def test_eval_heads_figures_compare_the_draft_path_with_the_models_own_layers(tmp_path, strength):
    from early_exit_router.training.adapt_quality import draft_path_agreement

    folder, _ = draft_path_folder(tmp_path, strength=strength)
    router = EarlyExitRouter.from_pretrained(folder, warm_up=False)
    sequences = [torch.randint(1, 96, (70,), generator=torch.Generator().manual_seed(k)).tolist() for k in range(4)]
    text, figures = draft_path_agreement(router, {"random": sequences}, chunk_len=32)
    held = figures["random"]
    assert held["positions"] == 8 * 32 and "exit L1's drafts" in text
    if strength == 0.0:  # a LoRA that changes nothing: the copies are the model's own layers
        assert held["draft path"] == held["own layers"]
    else:
        assert held["draft path"] != held["own layers"]


def test_a_sliding_window_model_drafts_past_its_window_and_rolls_the_draft_cache_back(tmp_path):
    """Mistral with a 5-position window: the draft cache's sliding layers keep what a rejected tail needs."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    sizes = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
    config = MistralConfig(**sizes, num_hidden_layers=6, sliding_window=5, tie_word_embeddings=False)
    model = MistralForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    folder, peft_model = draft_path_folder(tmp_path, strength=0.3, base=model)
    router = EarlyExitRouter.from_pretrained(folder, warm_up=False)
    ids = torch.tensor([[0, 5, 9, 14, 3, 7, 11, 2]])
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=30, do_sample=False)
    out = router.generate(ids, max_new_tokens=30, mode="verify", config={"draft_path_threshold": 0.0})
    assert torch.equal(out.sequences, expected) and out.stats.drafts_judged_by_layer.get(1, 0) > 0
    drafter = AdaptedDrafter(router.stack, router.draft_path, None, None)
    for tokens in ([0, 5, 9, 14, 3, 7, 11, 2, 4, 4], [0, 5, 9, 14, 3, 7, 11, 8]):  # the second cuts back 2 slots
        context = list(tokens)
        for token in drafter.propose(list(tokens), budget=2, threshold=0.0):
            assert token == adapted_top1(peft_model, context, 1)
            context.append(token)


def test_fresh_heads_skip_the_checkpoint_table_and_a_draft_config_refuses_what_it_ignores(tmp_path):
    from early_exit_router.training.config import AdaptConfig

    folder = tmp_path / "layerskip-llama3.2-1B"
    tiny_llama(3, layers=16).save_pretrained(folder)
    fresh = EarlyExitRouter.from_pretrained(folder, warm_up=False, fresh_heads=True)
    assert fresh.config.adapter != "identity" and not fresh.config.heads_trained
    with pytest.raises(ValueError, match="layer dropout and curricula"):
        AdaptConfig(exit_layers=[4], scope="draft", layer_dropout=0.1)

"""Saved routers: round trip, base-model matching, and clear errors for missing or foreign files."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from early_exit_router import EarlyExitRouter, RouterConfig
from early_exit_router.heads.checkpoint import CONFIG_NAME, WEIGHTS_NAME, BaseModelMismatchError, load_router

from .conftest import MIXED, prompt, tiny_llama


def trained_looking_router(model, **kwargs):
    """A router whose adapters are not zero, as trained ones would be."""
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **MIXED, **kwargs)
    torch.manual_seed(5)
    with torch.no_grad():
        for p in router.heads.parameters():
            p.normal_(std=0.05)
    return router


@pytest.mark.parametrize("adapter", ["linear", "lowrank", "identity", "postnorm", "block", "residual_block"])
def test_save_and_load_round_trip_gives_identical_outputs(tmp_path, adapter):
    model = tiny_llama(0)
    model.save_pretrained(tmp_path / "base")
    router = trained_looking_router(model, adapter=adapter, adapter_rank=4)
    router.heads.add_gates(32)
    expected = router.generate(prompt(0), max_new_tokens=20, output_logits=True)
    router.save_pretrained(tmp_path / "router")
    meta = json.loads((tmp_path / "router" / CONFIG_NAME).read_text())
    assert meta["format_version"] == 1 and meta["heads"]["exit_layers"] == [1, 3]
    assert meta["base_model"]["num_hidden_layers"] == 6 and len(meta["base_model"]["head_hash"]) == 64

    # Base weights are never saved: only adapters and gates.
    from safetensors.torch import load_file

    keys = set(load_file(str(tmp_path / "router" / WEIGHTS_NAME)))
    assert keys and all(k.startswith(("adapters.", "gates.")) for k in keys)

    # Reload onto a fresh copy of the same base model, from its folder.
    saved = load_router(tmp_path / "router")
    fresh = EarlyExitRouter._from_saved(tiny_llama(0), None, saved, None, str(tmp_path / "base"))
    out = fresh.generate(prompt(0), max_new_tokens=20, output_logits=True)
    assert torch.equal(out.sequences, expected.sequences)
    for a, b in zip(out.logits, expected.logits):
        assert torch.equal(a, b)


def test_saved_heads_stay_trained_under_a_config_of_the_callers_and_another_layout_says_what_to_do(tmp_path):
    """Whether heads are trained is the heads' own: a config passed to route them keeps it (else describe() would
    call them untrained, exit mode would warn, and saving would write them as untrained)."""
    router = trained_looking_router(tiny_llama(0))
    router.save_pretrained(tmp_path / "router")
    saved = load_router(tmp_path / "router")
    saved = dataclasses.replace(saved, config=saved.config.replace(heads_trained=True))
    routing = saved.config.replace(heads_trained=False, mode="exit")
    loaded = EarlyExitRouter._from_saved(tiny_llama(0), None, saved, routing, "x")
    assert loaded.config.heads_trained and loaded.config.mode == "exit" and "UNTRAINED" not in loaded.describe()
    with pytest.raises(ValueError, match="pass them as keywords"):
        EarlyExitRouter._from_saved(tiny_llama(0), None, saved, RouterConfig(mode="exit"), "x")


def test_saved_heads_go_on_a_model_the_caller_loaded_from_anywhere(tmp_path, monkeypatch):
    """`from_model(model, heads=DIR)` puts saved heads on a model the caller loaded; a base loaded from a relative
    path is recorded absolute, so the saved router loads from any working directory; a base recorded as a name that
    is no path here is refused with that way out."""
    from transformers import AutoModelForCausalLM

    tiny_llama(0).save_pretrained(tmp_path / "base")
    monkeypatch.chdir(tmp_path)
    model = AutoModelForCausalLM.from_pretrained("base")  # its _name_or_path: "base", relative
    router = trained_looking_router(model)
    expected = router.generate(prompt(0), 12, do_sample=False).sequences
    router.save_pretrained(tmp_path / "router")
    monkeypatch.chdir(tmp_path / "router")
    loaded = EarlyExitRouter.from_pretrained(tmp_path / "router", warm_up=False)
    assert torch.equal(loaded.generate(prompt(0), 12, do_sample=False).sequences, expected)
    mine = EarlyExitRouter.from_model(tiny_llama(0), heads=tmp_path / "router")
    assert torch.equal(mine.generate(prompt(0), 12, do_sample=False).sequences, expected)
    assert mine.heads.kinds == loaded.heads.kinds
    with pytest.raises(FileNotFoundError, match="early_exit_config.json is missing"):
        EarlyExitRouter.from_model(tiny_llama(0), heads=tmp_path / "base")
    trained_looking_router(tiny_llama(0)).save_pretrained(tmp_path / "nameless")  # recorded as "LlamaForCausalLM"
    with pytest.raises(FileNotFoundError, match=r"from_model\(model, tokenizer, heads="):
        EarlyExitRouter.from_pretrained(tmp_path / "nameless")


def test_mixed_adapter_kinds_save_load_and_refuse_another_layout(tmp_path):
    model = tiny_llama(0)
    model.save_pretrained(tmp_path / "base")
    router = trained_looking_router(model, adapter="postnorm", exit_adapters={3: "residual_block"})
    expected = router.generate(prompt(1), max_new_tokens=16, output_logits=True)
    router.save_pretrained(tmp_path / "router")
    saved = load_router(tmp_path / "router")
    fresh = EarlyExitRouter._from_saved(tiny_llama(0), None, saved, None, str(tmp_path / "base"))
    assert fresh.heads.kinds == {1: "postnorm", 3: "residual_block"}
    assert "L3 residual_block" in fresh.describe()
    same = EarlyExitRouter.from_model(tiny_llama(0), exit_layers=[1, 3], exit_adapters={1: "block", 3: "block"})
    assert "(block adapters" in same.describe()
    out = fresh.generate(prompt(1), max_new_tokens=16, output_logits=True)
    assert torch.equal(out.sequences, expected.sequences)
    with pytest.raises(ValueError, match="exit_adapters"):
        EarlyExitRouter._from_saved(tiny_llama(0), None, saved, None, "x", exit_adapters={3: "block"})
    # A warm start reads saved heads onto a router's own base model, kinds included, without attaching them.
    other = EarlyExitRouter.from_model(tiny_llama(0), exit_layers=[1, 3])
    loaded = other.load_saved_heads(tmp_path / "router")
    assert loaded.kinds == {1: "postnorm", 3: "residual_block"} and other.heads is not loaded
    for key, value in router.heads.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    with pytest.raises(ValueError, match="holds no saved exit heads"):
        other.load_saved_heads(tmp_path / "base")


def test_from_pretrained_loads_a_router_folder_with_its_base_model(tmp_path):
    model = tiny_llama(0)
    model.save_pretrained(tmp_path / "base")
    base = EarlyExitRouter.from_pretrained(tmp_path / "base", exit_layers=[1, 3], **MIXED)
    with torch.no_grad():
        for p in base.heads.parameters():
            p.add_(0.01)
    expected = base.generate(prompt(0), max_new_tokens=16).sequences
    base.save_pretrained(tmp_path / "router")
    loaded = EarlyExitRouter.from_pretrained(tmp_path / "router")
    assert loaded.config == base.config
    assert torch.equal(loaded.generate(prompt(0), max_new_tokens=16).sequences, expected)
    # Thresholds may be overridden at load time; the head layout may not.
    reloaded = EarlyExitRouter.from_pretrained(tmp_path / "router", high_conf_threshold=0.9)
    assert reloaded.config.high_conf_threshold == 0.9
    with pytest.raises(ValueError, match="cannot be loaded with another exit_layers"):
        EarlyExitRouter.from_pretrained(tmp_path / "router", exit_layers=[2])


def test_a_mismatched_base_model_is_refused(tmp_path):
    router = trained_looking_router(tiny_llama(0))
    router.save_pretrained(tmp_path / "router")
    saved = load_router(tmp_path / "router")
    other = tiny_llama(seed=1)  # same shapes, other weights
    with pytest.raises(BaseModelMismatchError, match="LM head and final norm differ"):
        EarlyExitRouter._from_saved(other, None, saved, None, "other")
    assert "_early_exit_router" not in other.__dict__ and "generate" not in other.__dict__
    deeper = tiny_llama(seed=0, layers=8)
    with pytest.raises(BaseModelMismatchError, match="num_hidden_layers 6"):
        EarlyExitRouter._from_saved(deeper, None, saved, None, "deeper")


def test_a_base_whose_head_has_other_weights_of_the_same_size_is_refused(tmp_path):
    """Chunk means of the LM head (the check before value samples were recorded) let such bases through."""
    router = trained_looking_router(tiny_llama(0))
    router.save_pretrained(tmp_path / "router")
    saved = load_router(tmp_path / "router")
    assert len(saved.identity.head_sample["lm_head.weight"]) == 512
    shuffled = tiny_llama(0)
    with torch.no_grad():  # the same values, rows permuted within blocks: the model predicts other tokens
        w = shuffled.lm_head.weight
        w.copy_(w.view(8, 12, -1)[:, torch.randperm(12, generator=torch.Generator().manual_seed(0))].reshape_as(w))
    for other in (tiny_llama(seed=2), shuffled):
        with pytest.raises(BaseModelMismatchError, match="LM head and final norm differ"):
            EarlyExitRouter._from_saved(other, None, saved, None, "other")
    fp16 = tiny_llama(0, dtype=torch.float16)  # hashed apart from float32 (rounded twice), sampled alike
    assert EarlyExitRouter._from_saved(fp16, None, saved, None, "fp16").exit_layers == [1, 3]


def test_a_router_saved_before_value_samples_is_checked_by_its_chunk_means(tmp_path):
    router = trained_looking_router(tiny_llama(0))
    router.save_pretrained(tmp_path / "router")
    meta = json.loads((tmp_path / "router" / CONFIG_NAME).read_text())
    del meta["base_model"]["head_sample"]
    (tmp_path / "router" / CONFIG_NAME).write_text(json.dumps(meta))
    saved = load_router(tmp_path / "router")
    assert EarlyExitRouter._from_saved(tiny_llama(0, dtype=torch.float16), None, saved, None, "fp16").exit_layers
    with pytest.raises(BaseModelMismatchError, match="LM head and final norm differ"):
        EarlyExitRouter._from_saved(tiny_llama(seed=1), None, saved, None, "other")


def test_saving_into_a_folder_of_other_files_is_refused_and_hidden_files_are_let_be(tmp_path):
    model = tiny_llama(0)
    model.save_pretrained(tmp_path / "base")
    router = EarlyExitRouter.from_pretrained(tmp_path / "base", exit_layers=[1, 3], warm_up=False)
    before = sorted(p.name for p in (tmp_path / "base").iterdir())
    with pytest.raises(ValueError, match="holds other files .*config.json.*save to an empty or new folder"):
        router.save_pretrained(tmp_path / "base")  # loading would refuse it, and the base folder too
    assert sorted(p.name for p in (tmp_path / "base").iterdir()) == before
    router.save_pretrained(tmp_path / "router")
    router.save_pretrained(tmp_path / "router")  # a router folder is overwritten
    (tmp_path / "router" / ".gitattributes").write_text("*.safetensors filter=lfs\n")  # as a hub upload adds
    assert EarlyExitRouter.from_pretrained(tmp_path / "router", warm_up=False).exit_layers == [1, 3]


def test_the_same_base_in_bf16_is_accepted(tmp_path):
    router = trained_looking_router(tiny_llama(0))
    router.save_pretrained(tmp_path / "router")
    saved = load_router(tmp_path / "router")
    loaded = EarlyExitRouter._from_saved(tiny_llama(0, dtype=torch.bfloat16), None, saved, None, "bf16")
    assert next(loaded.heads.parameters()).dtype == torch.bfloat16


def test_missing_files_give_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a known alias.*Models are never downloaded"):
        EarlyExitRouter.from_pretrained(tmp_path / "nothing-here")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="neither a .gguf file"):
        EarlyExitRouter.from_pretrained(tmp_path / "empty")
    router_dir = tmp_path / "broken"
    router_dir.mkdir()
    (router_dir / CONFIG_NAME).write_text("{}")
    with pytest.raises(FileNotFoundError, match=f"{WEIGHTS_NAME} is missing"):
        EarlyExitRouter.from_pretrained(router_dir)


def test_a_newer_format_version_is_refused(tmp_path):
    router = trained_looking_router(tiny_llama(0))
    router.save_pretrained(tmp_path / "router")
    meta = json.loads((tmp_path / "router" / CONFIG_NAME).read_text())
    meta["format_version"] = 99
    (tmp_path / "router" / CONFIG_NAME).write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="format_version 99.*Upgrade"):
        EarlyExitRouter.from_pretrained(tmp_path / "router")

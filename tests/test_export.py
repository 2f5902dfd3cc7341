"""`export-draft`: the exported checkpoint loads with plain transformers and reproduces the exit head's logits."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from early_exit_router import EarlyExitRouter
from early_exit_router.cli import main
from early_exit_router.heads.draft import exit_logits
from early_exit_router.integrations.export import export_draft

from .conftest import prompt, tiny_llama, tiny_tokenizer
from .test_architectures import build


def router_exit_logits(router: EarlyExitRouter, layer: int, ids: torch.Tensor) -> torch.Tensor:
    """The router's exit-`layer` head over every position of `ids`, computed through its own layer stack."""
    stack = router.stack
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    with torch.no_grad():
        hidden = stack.run(stack.embed(ids), 0, layer + 1, None, positions)
        return exit_logits(stack, router.heads.adapter(layer), hidden)


def randomize_adapters(router: EarlyExitRouter, seed: int = 0) -> None:
    """Trained-looking (non-zero) adapters, so that folding is really exercised."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in router.heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)


@pytest.mark.parametrize("family", ["llama", "qwen2-sliding", "gemma3_text", "gpt2"])
@pytest.mark.parametrize("adapter", ["postnorm", "identity", "block", "residual_block"])
def test_exported_draft_reproduces_the_exit_head(tmp_path, family, adapter):
    model = build(family, seed=1)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], adapter=adapter)
    blocky = adapter in ("block", "residual_block")
    if blocky:  # a trained-looking block: the copied layer, moved (and its residual writes let through)
        torch.manual_seed(0)
        with torch.no_grad():
            for p in router.heads.parameters():
                p.add_(torch.randn_like(p) * 0.02)
            for e in (1, 3):
                if router.heads.adapter(e).mix is not None:
                    router.heads.adapter(e).mix.add_(torch.rand_like(router.heads.adapter(e).mix) + 0.3)
    else:
        randomize_adapters(router)
    info = export_draft(router, 3, tmp_path / "draft")
    layers = 5 if blocky else 4  # a block exit keeps its block as the draft's last layer
    assert info.num_layers == layers and info.base_layers == 6 and info.adapter == adapter

    draft = AutoModelForCausalLM.from_pretrained(tmp_path / "draft").eval()  # plain transformers, no plugin
    assert draft.config.num_hidden_layers == layers
    assert not any(n.startswith("early_exit_heads") for n, _ in draft.named_parameters())
    ids = prompt(2, length=12)
    with torch.no_grad():
        theirs = draft(ids).logits
    torch.testing.assert_close(theirs, router_exit_logits(router, 3, ids), atol=1e-4, rtol=1e-4)
    notes = json.loads((tmp_path / "draft" / "draft_info.json").read_text())
    assert "draft_model" in notes["serving"]["vllm"] and notes["parameters"] == info.parameters
    assert router.model is model and router.is_enabled  # the source router is untouched


def test_each_exit_exports_with_its_own_adapter_kind(tmp_path):
    """Mixed kinds (a residual block at one exit, postnorm maps elsewhere, as shipped): every exit exports."""
    router = EarlyExitRouter.from_model(
        tiny_llama(0), exit_layers=[1, 3], adapter="postnorm", exit_adapters={1: "residual_block"}
    )
    assert router.heads.kinds == {1: "residual_block", 3: "postnorm"}
    randomize_adapters(router)
    ids = prompt(4, length=9)
    for layer, depth in ((1, 3), (3, 4)):
        info = export_draft(router, layer, tmp_path / f"d{layer}")
        assert (info.adapter, info.num_layers) == (router.heads.kinds[layer], depth)
        draft = AutoModelForCausalLM.from_pretrained(tmp_path / f"d{layer}").eval()
        with torch.no_grad():
            theirs = draft(ids).logits
        torch.testing.assert_close(theirs, router_exit_logits(router, layer, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("adapter", ["linear", "lowrank"])
def test_adapters_that_do_not_fold_are_refused_with_the_fix(tmp_path, adapter):
    router = EarlyExitRouter.from_model(tiny_llama(0), exit_layers=[1, 3], adapter=adapter)
    with pytest.raises(ValueError, match="--adapter postnorm"):
        export_draft(router, 3, tmp_path / "draft")
    with pytest.raises(ValueError, match="exit layers are"):
        export_draft(router, 2, tmp_path / "draft")
    assert not (tmp_path / "draft").exists()


def test_cli_export_draft(tmp_path, capsys):
    router = EarlyExitRouter.from_model(tiny_llama(0), tiny_tokenizer(), exit_layers=[1, 3], adapter="postnorm")
    randomize_adapters(router)
    router.model.save_pretrained(tmp_path / "base")  # heads are saved separately, below
    router.save_pretrained(tmp_path / "router")
    config_path = tmp_path / "router" / "early_exit_config.json"
    saved = json.loads(config_path.read_text())
    saved["base_model"]["name_or_path"] = str(tmp_path / "base")
    config_path.write_text(json.dumps(saved))
    tiny_tokenizer().save_pretrained(tmp_path / "base")
    args = ["export-draft", "--model", str(tmp_path / "router"), "--exit-layer", "1", "--out", str(tmp_path / "d")]
    assert main(args) == 0
    assert "speculative_config" in capsys.readouterr().out
    draft = AutoModelForCausalLM.from_pretrained(tmp_path / "d").eval()
    ids = prompt(3, length=8)
    with torch.no_grad():
        torch.testing.assert_close(draft(ids).logits, router_exit_logits(router, 1, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("adapter", ["postnorm", "identity"])
def test_tied_embeddings_stay_tied_unless_the_head_is_folded(tmp_path, adapter):
    from transformers import LlamaConfig, LlamaForCausalLM

    from .test_architectures import COMMON

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**COMMON, "tie_word_embeddings": True})).eval()  # as in SmolLM2
    router = EarlyExitRouter.from_model(model, exit_layers=[2], adapter=adapter)
    randomize_adapters(router, seed=4)
    export_draft(router, 2, tmp_path / "draft")
    draft = AutoModelForCausalLM.from_pretrained(tmp_path / "draft").eval()
    tied = draft.lm_head.weight.data_ptr() == draft.model.embed_tokens.weight.data_ptr()
    assert tied == (adapter == "identity")
    torch.testing.assert_close(model.lm_head.weight, model.model.embed_tokens.weight)  # the base is untouched
    ids = prompt(5, length=10)
    with torch.no_grad():
        torch.testing.assert_close(draft(ids).logits, router_exit_logits(router, 2, ids), atol=1e-4, rtol=1e-4)

"""Nothing of the router leaks into the user's model: not into its checkpoint, and not after an error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from early_exit_router import EarlyExitRouter
from early_exit_router.integrations import hf_generate
from early_exit_router.training.config import TrainingConfig
from early_exit_router.training.distill import train_heads
from early_exit_router.training.gates import train_gates
from early_exit_router.training.hidden_states import build_cache

from .conftest import MIXED, assert_same_model, model_fingerprint, prompt, tiny_llama


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_a_patched_model_saves_exactly_the_base_checkpoint(tmp_path):
    model = tiny_llama(0)
    model.save_pretrained(tmp_path / "base")
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **MIXED)
    router.heads.add_gates(32)  # gates too: nothing of the router may reach the base checkpoint
    router.generate(prompt(0), max_new_tokens=6)
    model.save_pretrained(tmp_path / "patched")
    assert folder_bytes(tmp_path / "patched") == folder_bytes(tmp_path / "base")
    assert not any("early_exit" in k for k in model.state_dict())


def test_the_heads_follow_the_model_to_another_dtype():
    model = tiny_llama(0)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **MIXED)
    model.to(torch.float64)
    out = router.generate(prompt(0), max_new_tokens=6)
    assert all(p.dtype == torch.float64 for p in router.heads.parameters())
    with router.disabled():
        ref = model.generate(prompt(0), max_new_tokens=6, do_sample=False)
    assert out.stats.new_tokens == 6 and out.sequences.shape == ref.shape


def test_an_error_in_the_middle_of_patching_leaves_the_model_untouched(monkeypatch):
    model = tiny_llama(0)
    before = model_fingerprint(model)

    class Broken(hf_generate.RoutedGenerate):
        def __init__(self, router):
            raise RuntimeError("injected")

    monkeypatch.setattr(hf_generate, "RoutedGenerate", Broken)
    with pytest.raises(RuntimeError, match="injected"):
        EarlyExitRouter.from_model(model, exit_layers=[1, 3])
    assert_same_model(before, model_fingerprint(model))
    assert "_early_exit_router" not in model.__dict__
    monkeypatch.undo()
    EarlyExitRouter.from_model(model, exit_layers=[1, 3]).unpatch()  # and it can be patched afterwards


def test_an_error_in_the_middle_of_training_leaves_the_model_as_it_was():
    model = tiny_llama(0)
    model.model.layers[0].mlp.requires_grad_(False)  # the user's own choices must come back as they were
    model.train()
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3])
    before = model_fingerprint(model)
    seqs = torch.randint(1, 90, (4, 32), generator=torch.Generator().manual_seed(0)).tolist()
    cache = build_cache(router.stack, [1, 3], seqs, chunk_len=32, progress=False)
    broken = build_cache(router.stack, [1], seqs, chunk_len=32, progress=False)  # no states for exit 3
    with pytest.raises(KeyError):
        train_heads(router, broken, TrainingConfig(max_steps=3, batch_tokens=16), progress=False)
    assert_same_model(before, model_fingerprint(model))
    assert not router.heads.training
    # A successful run gives the flags back too.
    train_heads(router, cache, TrainingConfig(max_steps=3, batch_tokens=16), progress=False)
    train_gates(router, cache, cache, TrainingConfig(gate_steps=3))
    assert_same_model(before, model_fingerprint(model))


def test_a_plain_load_generate_and_save_print_nothing(tmp_path):
    """In a fresh interpreter (where transformers imports torchao, installed for the tests): building a router,
    generating and saving print nothing the caller did not ask for."""
    import subprocess
    import sys

    script = f"""
from early_exit_router import EarlyExitRouter
import torch
from transformers import LlamaConfig, LlamaForCausalLM
config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=64)
router = EarlyExitRouter.from_model(LlamaForCausalLM(config).eval(), exit_layers=[1], policy="fixed")
router.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, mode="verify")
router.save_pretrained({str(tmp_path / "saved")!r})
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "" and done.stderr == "", (done.stdout, done.stderr)

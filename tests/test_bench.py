"""`bench`, `calibrate` and `generate --trace` end to end on tiny random models (no speed is asserted)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json

import pytest
import torch

from early_exit_router import EarlyExitRouter
from early_exit_router.bench.bench import (
    CONTROL,
    ENGINE_CONTROL,
    HF_COMPILED,
    NO_GUARD,
    NO_REPAIR,
    BenchConfig,
    run_bench,
)
from early_exit_router.bench.trace import render_trace, trace_legend
from early_exit_router.cli import main
from early_exit_router.routing.costs import cpu_model
from early_exit_router.training.calibrate import (
    CalibrationConfig,
    Candidate,
    QualityTarget,
    binomial_cdf,
    calibrate,
    choose,
    speed_ties,
)

from .conftest import tiny_costs, tiny_llama, tiny_tokenizer

PROMPTS = [
    {"id": "t1", "category": "templated", "kind": "text", "prompt": "w5 w6 w7 w5 w6 w7 w5 w6"},
    {"id": "c1", "category": "dialogue", "kind": "chat", "prompt": "w9 w10 w11"},
    {"id": "t2", "category": "templated", "kind": "text", "prompt": "w20 w21 w22 w23"},
    {"id": "c2", "category": "dialogue", "kind": "chat", "prompt": "w30 w31"},
]
MIXED_CONFIG = dict(exit_layers=[1, 3], low_conf_threshold=0.0, entropy_threshold=0.0)


def tiny_router(seed: int = 0, **overrides) -> EarlyExitRouter:
    return EarlyExitRouter.from_model(tiny_llama(seed), tiny_tokenizer(), **{**MIXED_CONFIG, **overrides})


def test_bench_runs_every_arm_and_writes_json_and_png(tmp_path, monkeypatch):
    # An empty cost-model cache: the table is measured in this run, and must not count towards any arm.
    monkeypatch.setenv("EARLY_EXIT_ROUTER_CACHE", str(tmp_path / "cache"))
    router = tiny_router(high_conf_threshold=0.07)
    cfg = BenchConfig(
        hf_compiled=False, max_new_tokens=8, thresholds=(0.05,), prompt_lookup_num_tokens=3, warmup=False, repeats=1
    )
    assert BenchConfig().repeats == 2  # the README's tables: one repeat's ratios move by 8-10% on 2 cores
    result = run_bench(router, PROMPTS[:2], cfg, progress=False)

    arms = [a.name for a in result.arms]
    assert arms[:2] == [CONTROL, ENGINE_CONTROL]
    expected = {"router exit (loaded config)", "router exit @0.05", "router verify @0.05"}
    assert expected | {"router verify, n-gram tier only", "router verify, fixed cascade, no n-gram"} <= set(arms)
    assert "HF assisted, early exit 4" in arms and "HF prompt lookup 3" in arms
    assert len(result.records) == len(arms) * 2
    by_arm = {(row["category"], row["arm"]): row for row in result.summary}
    assert {c for c, _ in by_arm} == {"templated", "dialogue", "all"}
    control = by_arm[("all", CONTROL)]
    assert control["speedup"] == pytest.approx(1.0)
    assert control["compute_ratio"] == pytest.approx(1.0)  # the meter sees exactly one full pass per token
    assert control["teacher_forced_agreement"] == 1.0 and control["nll_ratio"] == pytest.approx(1.0)
    assert control["rouge_l"] == 1.0 and control["identical"] == 2
    assert by_arm[("all", ENGINE_CONTROL)]["compute_ratio"] == pytest.approx(1.0)
    for row in result.summary:
        if "verify" in row["arm"] or row["arm"].startswith("HF"):
            assert row["identical"] == row["runs"], row["arm"]  # lossless methods
            assert row["teacher_forced_agreement"] == 1.0
    exit_row = by_arm[("all", "router exit @0.05")]
    assert exit_row["hit_rate"] > 0 and sum(exit_row["exit_histogram"].values()) == exit_row["tokens"]
    full_depth = exit_row["exit_histogram"].get(5, 0)  # the histogram, not the engine's hit-rate formula
    assert exit_row["hit_rate"] == pytest.approx(1 - full_depth / exit_row["tokens"])
    assert 0 <= exit_row["teacher_forced_agreement"] <= 1
    assert exit_row["ttft_ms"] is not None and exit_row["itl_p50_ms"] is not None
    assert router.config.high_conf_threshold == 0.07  # the sweep restored the router's own config

    result.write_json(tmp_path / "bench.json")
    loaded = json.loads((tmp_path / "bench.json").read_text())
    assert loaded["meta"]["prompts"] == 2 and len(loaded["records"]) == len(result.records)
    result.plot(tmp_path / "bench.png")
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "### all" in result.markdown() and "| plain HF generate |" in result.markdown()
    loop = by_arm[("all", ENGINE_CONTROL)]["speedup"]  # every table carries the decode loop alone as its noise band
    assert result.markdown().count("Noise band: the decode loop alone") == 3
    assert f"ran at {loop:.2f}x of plain HF (±{abs(loop - 1):.0%})" in result.markdown()
    for mode in ("verify", "exit"):  # what the exits added over the n-gram tier alone, from the same run
        routed = by_arm[("all", f"router {mode} (loaded config)")]
        alone = by_arm[("all", f"router {mode}, n-gram tier only")]
        section = result.markdown().split("### all")[1].splitlines()
        line = next(x for x in section if x.startswith(f"Exits added in {mode} mode"))
        gain = routed["tokens_per_s"] / alone["tokens_per_s"] - 1
        assert f"{routed['tokens_per_s']:.1f} against {alone['tokens_per_s']:.1f} tok/s" in line
        assert f"({gain:+.1%}," in line and "tokens from exit heads" in line
        assert ("exit draft cycles" in line) == (mode == "verify")
    ceilings = result.meta["copy_ceiling"]  # the control's outputs replayed with perfect copies: never below plain
    assert set(ceilings) == {"templated", "dialogue", "all"} and min(ceilings.values()) >= 1.0
    assert result.markdown().count("Copy ceiling: ") == 3
    assert f"CPU ({cpu_model()})" in result.meta["machine"]  # records say which processor they ran on


def test_bench_refuses_bad_prompt_records():
    router = tiny_router()
    with pytest.raises(ValueError, match="lacks the field 'kind'"):
        run_bench(router, [{"id": "x", "category": "a", "prompt": "w5"}], progress=False)
    with pytest.raises(ValueError, match="kind must be 'text' or 'chat'"):
        run_bench(router, [{"id": "x", "category": "a", "kind": "code", "prompt": "w5"}], progress=False)
    with pytest.raises(ValueError, match="No prompts"):
        run_bench(router, [], progress=False)


CANDIDATES = (0.3, 0.12, 0.09, 0.07, 0.05, 0.03)


@pytest.mark.parametrize("method", ["ltt", "empirical"])
def test_calibrate_meets_its_target_on_its_calibration_split(method):
    router = tiny_router(seed=1)
    target = QualityTarget(min_agreement=0.6)
    cfg = CalibrationConfig(target, candidates=CANDIDATES, method=method, delta=0.2, max_new_tokens=12)
    result = calibrate(router, PROMPTS[:2], PROMPTS[2:], cfg, progress=False)
    assert [c.threshold for c in result.candidates] == sorted(CANDIDATES, reverse=True)
    valid = [c for c in result.candidates if c.meets_target]
    assert valid, result.table()
    assert result.chosen_threshold in [c.threshold for c in valid]
    chosen = next(c for c in result.candidates if c.threshold == result.chosen_threshold)
    assert chosen.agreement >= 0.6  # the target holds on the calibration split
    if method == "ltt":
        assert all(c.p_value is not None and c.p_value <= 0.2 for c in valid)
        # fixed-sequence testing: the valid candidates are a prefix of the conservative-first order
        assert result.candidates[: len(valid)] == valid
    assert router.config.high_conf_threshold == router.config.low_conf_threshold == result.chosen_threshold
    # exit mode is swept without repairs, so the exit rule's own misses show; the router's holdback is back after
    assert any(c.disagreements for c in result.candidates) and router.config.holdback is None
    assert set(result.heldout) >= {"agreement", "nll_ratio", "speedup", "meets_target"}
    assert "held out" in result.table()


@pytest.mark.parametrize("holdback", [0, None])
def test_calibrate_for_a_consistency_target_bounds_the_outputs_that_differ(holdback):
    """A sequence-level target: the share of outputs identical to the full model's, tested over outputs (LTT); exit
    mode runs under the router's holdback. Without repairs only conservative thresholds keep outputs identical;
    with them every output is, so the sweep's fastest candidate wins."""
    router = tiny_router(seed=1, holdback=holdback)
    cfg = CalibrationConfig(QualityTarget(min_consistency=0.5), candidates=CANDIDATES, delta=0.5, max_new_tokens=12)
    result = calibrate(router, PROMPTS[:2], PROMPTS[2:], cfg, progress=False)
    assert all(c.outputs == 2 for c in result.candidates)
    for c in result.candidates:  # the p-value is over outputs, not tokens
        assert c.p_value == pytest.approx(binomial_cdf(c.outputs - c.consistent, c.outputs, 0.5))
    if holdback is None:
        assert all(c.consistent == c.outputs and c.meets_target for c in result.candidates)
    else:  # lossy: aggressive thresholds change outputs; two outputs pass at delta 0.5 only if both are identical
        assert any(c.consistent < c.outputs for c in result.candidates)
        valid = [c for c in result.candidates if c.meets_target]
        assert result.candidates[: len(valid)] == valid and all(c.consistent == c.outputs for c in valid)
    assert result.chosen_threshold is not None and router.config.high_conf_threshold == result.chosen_threshold
    assert router.config.target_agreement is None and router.config.holdback == holdback  # thresholds stay put
    assert "consistency" in result.heldout and "outputs identical to the full model's >= 0.5" in result.table()


def test_calibrate_with_an_unreachable_target_chooses_nothing_and_keeps_the_config():
    router = tiny_router(seed=1, high_conf_threshold=0.5)
    cfg = CalibrationConfig(QualityTarget(min_agreement=1.0), candidates=(0.05, 0.03), max_new_tokens=12)
    result = calibrate(router, PROMPTS[:2], PROMPTS[2:], cfg, progress=False)
    assert result.chosen_threshold is None and not result.heldout
    assert router.config.high_conf_threshold == 0.5
    assert "No candidate threshold meets the target" in result.table()


def test_a_candidate_as_fast_as_the_fastest_within_the_noise_ties_and_the_tie_goes_to_the_one_that_exits_most():
    def candidate(threshold, per_prompt, hit_rate, compute):
        speedups = dict(zip("abcd", per_prompt))
        mean = sum(per_prompt) / len(per_prompt)
        return Candidate(threshold, 600, 6, 0.99, 1.0, mean, compute, hit_rate, True, prompt_speedups=speedups)

    fastest = candidate(0.9, [1.30, 1.10, 1.45, 1.20], 0.42, 1.74)
    noisy = candidate(0.85, [1.33, 1.02, 1.44, 1.13], 0.51, 1.83)  # slower on average, within the prompts' noise
    slower = candidate(0.8, [1.20, 1.00, 1.34, 1.10], 0.55, 1.80)  # slower on every prompt: no tie
    target = QualityTarget(min_agreement=0.95)
    assert speed_ties(noisy, fastest, 2.0) and not speed_ties(slower, fastest, 2.0)
    assert choose([fastest, noisy], CalibrationConfig(target)).threshold == 0.85
    assert choose([fastest, noisy], CalibrationConfig(target, speed_tie_z=0.0)).threshold == 0.9  # the fastest
    assert choose([fastest, slower], CalibrationConfig(target)).threshold == 0.9
    assert choose([fastest, noisy, slower], CalibrationConfig(target, objective="compute")).threshold == 0.9
    assert not speed_ties(candidate(0.7, [1.3], 0.6, 1.0), fastest, 2.0)  # one shared prompt: no spread to test
    # Pooled, `fastest` is faster; per prompt the other's mean log ratio is above zero: only z > 0 lets it tie.
    skewed = candidate(0.75, [1.32, 1.12, 1.44, 1.21], 0.6, 1.9)
    skewed.speedup = 1.2
    assert choose([fastest, skewed], CalibrationConfig(target, speed_tie_z=0.0)).threshold == 0.9
    with pytest.raises(ValueError, match="speed_tie_z"):
        CalibrationConfig(target, speed_tie_z=-1)


def test_trace_marks_depth_changes_in_plain_text_and_colours_for_terminals():
    tok = tiny_tokenizer()
    coloured, plain = render_trace(tok, [5, 6, 7, 8], [1, 1, 5, -1], num_layers=6, exit_layers=[1, 3])
    assert plain == "[L1]w5 w6[full] w7[ngram] w8"
    assert "\033[32mw5\033[0m" in coloured and "\033[35m w8\033[0m" in coloured
    assert trace_legend(6, [1, 3], [1, 1, 5, -1], colour=False) == "depths: [ngram: 1]  [L1: 2]  [L3: 0]  [full: 1]"
    with pytest.raises(ValueError, match="depths"):
        render_trace(tok, [5, 6], [1], num_layers=6, exit_layers=[1])


@pytest.fixture
def tiny_folder(tmp_path):
    folder = tmp_path / "tiny"
    tiny_llama(0).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def test_cli_generate_trace_bench_and_calibrate(tiny_folder, tmp_path, capsys):
    options = ["--exit-layers", "1,3", "--low-conf-threshold", "0", "--entropy-threshold", "0"]
    args = ["generate", "w5 w6 w7", "--model", str(tiny_folder), "--no-chat", "--max-new-tokens", "6", "--trace"]
    assert main(args + options + ["--high-conf-threshold", "0.05"]) == 0
    out = capsys.readouterr().out
    assert "--- trace ---" in out and "depths: " in out and "[" in out.split("--- trace ---")[1]

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    bench_dir = tmp_path / "bench"
    bench = ["bench", "--model", str(tiny_folder), "--prompts", str(prompts), "--max-new-tokens", "4"]
    bench += [
        "--thresholds",
        "0.05",
        "--modes",
        "exit",
        "--no-ngram",
        "--no-fixed-cascade",
        "--assistant-early-exit",
        "",
    ]
    bench += ["--no-hf-compiled", "--no-compiled"]  # both compile: test_hf_compiled_arm..., tests/test_compiled.py
    assert main(bench + ["--prompt-lookup", "0", "--out", str(bench_dir), "--quiet"] + options) == 0
    assert (bench_dir / "bench.png").is_file()
    assert {r["arm"] for r in json.loads((bench_dir / "bench.json").read_text())["summary"]} == {
        CONTROL,
        ENGINE_CONTROL,
        "router exit (loaded config)",
        NO_REPAIR,
        NO_GUARD,
        "router exit @0.05",
    }

    calibrated = tmp_path / "calibrated"
    calib = ["calibrate", "--model", str(tiny_folder), "--prompts", str(prompts), "--out", str(calibrated)]
    calib += [
        "--target-agreement",
        "0.01",
        "--method",
        "empirical",
        "--candidates",
        "0.3,0.05",
        "--max-new-tokens",
        "6",
    ]
    assert main(calib + ["--quiet"] + options) == 0
    report = json.loads((calibrated / "calibration_report.json").read_text())
    reloaded = EarlyExitRouter.from_pretrained(calibrated)  # the saved folder carries the chosen threshold
    assert reloaded.config.high_conf_threshold == report["chosen_threshold"]
    # calibrate's own --target-agreement is the calibration target, and exit mode's quality target once saved
    assert reloaded.config.target_agreement == 0.01
    assert main(["calibrate", "--model", str(tiny_folder), "--out", str(calibrated), "--target-agreement", "2"]) == 2
    bad = ["calibrate", "--model", str(tiny_folder), "--out", str(calibrated), "--min-consistency", "1.5"]
    assert main(bad) == 2 and "min_consistency must be in" in capsys.readouterr().err


def test_cli_refuses_bad_files_outputs_devices_and_ignored_options_with_a_message(tiny_folder, tmp_path, capsys):
    """Mistakes in files and options: exit status 2 and a line that says what to fix, never a traceback, and before
    the model loads (an --out that cannot be a folder is not found only when the run's results are written)."""
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text(json.dumps(PROMPTS[0]) + "\nnot json\n")
    no_prompt = tmp_path / "no-prompt.jsonl"
    no_prompt.write_text(json.dumps({"id": "a", "category": "c", "kind": "text"}) + "\n")
    cases = {
        ("bench-batch", "--prompts", str(no_prompt)): "line 1 lacks the field(s) prompt",
        ("eval-heads", "--prompts", str(no_prompt)): "line 1 lacks the field(s) prompt",
        ("bench", "--prompts", str(bad_json)): "line 2 is not JSON",
        ("bench", "--prompts", str(tmp_path)): "cannot read it",
        ("bench", "--out", str(a_file)): "is a file, not a folder",
        ("export-draft", "--exit-layer", "2", "--out", str(a_file / "draft")): "is a file, not a folder",
        ("eval-heads", "--json", str(tmp_path)): "is a folder",
        ("generate", "x", "--device", "bogus"): "is not a device name",
        ("generate", "x", "--temperature", "0.5"): "add --do-sample",  # greedy would ignore it
    }
    if not torch.cuda.is_available():
        cases[("generate", "x", "--device", "cuda")] = "cannot be used on this machine"
    for args, message in cases.items():
        assert main([*args, "--model", str(tiny_folder)]) == 2, args
        assert message in capsys.readouterr().err, args
    with pytest.raises(SystemExit) as refused:  # a usage error, not uvicorn's traceback once the model has loaded
        main(["serve", "--port", "70000", "--model", str(tiny_folder)])
    assert refused.value.code == 2 and "0..65535" in capsys.readouterr().err


def test_generate_output_reports_each_tokens_depth():
    router = tiny_router(high_conf_threshold=0.05)
    ids = torch.tensor([[5, 6, 7, 8]])
    out = router.generate(ids, max_new_tokens=10)
    assert len(out.depths) == 10 and out.depths[0] == 5  # the prefill's token is always full depth
    assert set(out.depths) <= {1, 3, 5}
    assert sum(d != 5 for d in out.depths) / 10 == pytest.approx(out.stats.hit_rate)
    with router.disabled():
        assert router.generate(ids, max_new_tokens=4).depths == [5] * 4


def test_shapes_are_the_published_models_sizes():
    from early_exit_router.models.shapes import SHAPES, default_exit_layers, random_model

    counts = {"llama-3.2-1b": 1_235_814_400, "llama-3-8b": 8_030_261_248}  # the models' published parameter counts
    for name in SHAPES:
        model = random_model(name, device="meta")  # sizes only: no memory
        assert sum({id(p): p.numel() for p in model.parameters()}.values()) == counts[name]
    assert default_exit_layers(16) == [2, 4, 8] and default_exit_layers(32) == [4, 8, 16]
    with pytest.raises(ValueError, match="use one of llama-3.2-1b"):
        random_model("llama-9b", device="meta")


def test_cli_profile_times_a_published_shape_with_random_weights(tmp_path, monkeypatch, capsys):
    from early_exit_router.models import shapes

    tiny = dict(shapes.SHAPES["llama-3.2-1b"], vocab_size=96, hidden_size=32, intermediate_size=64, head_dim=8)
    monkeypatch.setitem(shapes.SHAPES, "llama-3.2-1b", dict(tiny, num_attention_heads=4, num_key_value_heads=2))
    monkeypatch.setenv("EARLY_EXIT_ROUTER_CACHE", str(tmp_path / "cache"))
    assert main(["profile", "--shape", "llama-3.2-1b"]) == 0
    out = capsys.readouterr().out
    assert "random llama-3.2-1b: 16 layers, exits at [2, 4, 8]" in out and "| exit L2 | exit L4 | exit L8 |" in out
    assert main(["profile", "--shape", "llama-3.2-1b", "--exit-layers", "3"]) == 0
    assert "| exit L3 |" in capsys.readouterr().out
    assert main(["profile", "--shape", "llama-3.2-1b", "--quantize", "int8"]) == 2
    assert "drop --quantize" in capsys.readouterr().err


def test_cli_profile_prints_the_cost_table_and_each_exits_break_even(tiny_folder, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EARLY_EXIT_ROUTER_CACHE", str(tmp_path / "cache"))
    assert main(["profile", "--model", str(tiny_folder), "--exit-layers", "1,3"]) == 0
    out = capsys.readouterr().out
    assert "plain decoding step" in out and "What the cost policy chooses" in out
    line = next(row for row in out.splitlines() if row.startswith("Exit mode asks an exit"))
    assert "L1 " in line and "L3 " in line
    assert "proposal at a context of 8,192 tokens" in out and "of a plain step" in out


def test_a_sequence_of_requests_keeps_the_store_between_its_calls_and_reports_the_first_call_apart(monkeypatch):
    from early_exit_router.bench.prompts import request_units

    sequence = [
        {"id": f"s{k}", "category": "repeated", "kind": "text", "prompt": f"w5 w6 w{7 + k}", "sequence": "s"}
        for k in range(3)
    ]
    prompts = [PROMPTS[0], sequence[0], PROMPTS[2], sequence[1], sequence[2]]
    assert request_units(prompts) == [[0], [1, 3, 4], [2]]  # a sequence runs as one unit, its calls in file order
    router = tiny_router(high_conf_threshold=0.07)
    cleared = []
    monkeypatch.setattr(router, "clear_ngram_store", lambda: cleared.append(True))
    cfg = BenchConfig(max_new_tokens=4, thresholds=(), prompt_lookup_num_tokens=0, assistant_early_exit=(),
                      hf_compiled=False, ngram=False, fixed_cascade=False, warmup=False, repeats=1)  # fmt: skip
    result = run_bench(router, prompts, cfg, progress=False)
    router_arms = [a for a in result.arms if a.kind == "router"]
    # the store is emptied before every router run except a sequence's later calls
    assert len(cleared) == len(router_arms) * (len(prompts) - 2)
    for arm in result.arms:  # each arm ran the sequence's calls back to back, in order
        ids = [r.prompt_id for r in result.records if r.arm == arm.name]
        assert ids[ids.index("s0") : ids.index("s0") + 3] == ["s0", "s1", "s2"]
    categories = {r.prompt_id: r.category for r in result.records}
    assert categories["s0"] == "repeated, first call" and categories["s1"] == categories["s2"] == "repeated"
    assert {row["category"] for row in result.summary} >= {"repeated", "repeated, first call"}
    with pytest.raises(ValueError, match="sequence"):
        run_bench(router, [{**sequence[0], "sequence": 3}], cfg, progress=False)


def test_a_lower_precision_bench_scores_every_output_against_the_model_at_float32():
    reference = tiny_llama(0).eval()  # float32
    router = EarlyExitRouter.from_model(tiny_llama(0).to(torch.bfloat16), tiny_tokenizer(), **MIXED_CONFIG)
    cfg = BenchConfig(max_new_tokens=6, thresholds=(0.05,), prompt_lookup_num_tokens=3, assistant_early_exit=(),
                      hf_compiled=False, ngram=False, fixed_cascade=False, warmup=False, repeats=1)  # fmt: skip
    loads = []
    result = run_bench(router, PROMPTS[:2], cfg, progress=False, reference=lambda: loads.append(1) or reference)
    assert loads == [1]  # loaded once, after the timed runs
    assert result.meta["dtype"] == "bfloat16" and result.meta["reference_dtype"] == "float32"
    by_prompt = {item["id"]: router.encode(item["prompt"], chat=item["kind"] == "chat")[0].tolist() for item in PROMPTS}
    from early_exit_router.bench.metrics import teacher_forced_score

    for record in result.records:  # each output judged by the float32 model, teacher-forced
        expected = teacher_forced_score(reference, by_prompt[record.prompt_id], record.new_ids).disagreements
        assert record.quality["reference_disagreements"] == expected
    for row in result.summary:
        runs = [r for r in result.records if r.arm == row["arm"] and row["category"] in ("all", r.category)]
        wrong = sum(r.quality["reference_disagreements"] for r in runs)
        assert row["reference_agreement"] == pytest.approx(1 - wrong / row["tokens"])
    assert "float32 agr." in result.markdown()
    plain = run_bench(router, PROMPTS[:1], cfg, progress=False)  # no reference: no column, no field
    assert plain.summary[0]["reference_agreement"] is None and "float32 agr." not in plain.markdown()


def test_a_cost_table_gone_stale_is_measured_again_between_runs_not_inside_one(monkeypatch):
    router = tiny_router(high_conf_threshold=0.07)
    events: list[str] = []
    inside: list[bool] = []  # the decoder a run builds reads the table too: those calls do not count
    costs, generate = router.costs, router.generate

    def counted_costs(*args, **kwargs):
        if not inside:
            events.append("costs")
        return costs(*args, **kwargs)

    def counted_generate(*args, **kwargs):
        events.append("generate")
        inside.append(True)
        try:
            return generate(*args, **kwargs)
        finally:
            inside.pop()

    monkeypatch.setattr(router, "costs", counted_costs)
    monkeypatch.setattr(router, "generate", counted_generate)
    cfg = BenchConfig(max_new_tokens=4, thresholds=(), prompt_lookup_num_tokens=0, assistant_early_exit=(),
                      hf_compiled=False, ngram=False, fixed_cascade=False, warmup=False, repeats=1)  # fmt: skip
    run_bench(router, PROMPTS[:2], cfg, progress=False)
    runs = [k for k, e in enumerate(events) if e == "generate"]
    assert runs and all(events[k - 1] == "costs" for k in runs)  # the bench's own check, just before each run


def test_with_prepacked_weights_the_loop_alone_is_reported_as_their_gain_not_as_a_noise_band():
    from early_exit_router.bench.report import format_markdown

    cfg = BenchConfig(max_new_tokens=4, thresholds=(), warmup=False, hf_compiled=False, repeats=1,
                      prompt_lookup_num_tokens=0, assistant_early_exit=())  # fmt: skip
    result = run_bench(tiny_router(), PROMPTS[:1], cfg, progress=False)
    assert result.meta["packed_weights"] == 0 and "Noise band" in result.markdown()
    packed = format_markdown({**result.meta, "packed_weights": 211}, result.summary)
    assert "Noise band" not in packed and "The decode loop alone, from prepacked weights, ran at" in packed


def test_from_pretrained_pays_the_first_calls_costs_at_load_and_keeps_nothing_of_it(tiny_folder, tmp_path, monkeypatch):
    monkeypatch.setenv("EARLY_EXIT_ROUTER_CACHE", str(tmp_path / "cache"))
    warm = EarlyExitRouter.from_pretrained(str(tiny_folder), exit_layers=[1, 3])
    assert warm._measured is not None  # the cost table is ready before the first call
    assert warm._ngram_store is None and warm.last_stats is None  # the throw-away decode left nothing behind
    cold = EarlyExitRouter.from_pretrained(str(tiny_folder), exit_layers=[1, 3], warm_up=False)
    assert cold._measured is None
    ids = torch.tensor([[5, 6, 7, 5, 6, 7]])
    assert torch.equal(warm.generate(ids, 8, mode="verify").sequences, cold.generate(ids, 8, mode="verify").sequences)


def test_warm_up_runs_every_chunk_width_a_draft_can_take_once_and_leaves_the_model_as_it_was(tmp_path, monkeypatch):
    import dataclasses

    from early_exit_router.routing.costs import chunk_widths, warm_widths

    monkeypatch.setenv("EARLY_EXIT_ROUTER_CACHE", str(tmp_path / "cache"))
    router = tiny_router(policy="cost")
    cfg = router.config
    widths = chunk_widths(cfg, router.costs)
    longest = 1 + max(cfg.max_pending, cfg.ngram_draft, cfg.ngram_tree_nodes)
    assert set(range(1, longest + 1)) <= set(widths)
    assert {router.costs().layer_pad(w) for w in range(2, longest + 1)} <= set(widths)  # what the engine pads to
    assert chunk_widths(dataclasses.replace(cfg, policy="fixed"), None) == list(range(1, longest + 1))
    seen: dict[int, list[int]] = {}
    hooks = [
        layer.register_forward_pre_hook(lambda m, args, kw, j=j: seen.setdefault(j, []).append(args[0].shape[1]),
                                        with_kwargs=True)
        for j, layer in enumerate(router.stack.layers)
    ]  # fmt: skip
    before = {k: v.clone() for k, v in router.stack.model.state_dict().items()}
    try:
        warm_widths(router.stack, widths)
    finally:
        for hook in hooks:
            hook.remove()
    assert seen == {0: widths}  # one layer of the (shared) shapes at every width; the later layers reuse its kernels
    after = router.stack.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_the_bench_command_scores_against_float32_exactly_when_the_precision_is_lowered():
    from types import SimpleNamespace

    from early_exit_router.cli.bench import _reference_dtype

    def router(dtype):
        return SimpleNamespace(stack=SimpleNamespace(dtype=dtype))

    def args(reference="auto", quantize=None):
        return SimpleNamespace(reference_dtype=reference, quantize=quantize)

    assert _reference_dtype(args(), router(torch.bfloat16)) == "float32"
    assert _reference_dtype(args(quantize="int8"), router(torch.float32)) == "float32"
    assert _reference_dtype(args(), router(torch.float32)) is None
    assert _reference_dtype(args("none"), router(torch.bfloat16)) is None
    assert _reference_dtype(args("float32"), router(torch.float32)) == "float32"


def test_a_sampled_bench_gives_every_arm_the_same_seed_per_prompt():
    import zlib

    router = tiny_router(high_conf_threshold=0.07)
    arms = dict(
        thresholds=(), modes=("verify",), prompt_lookup_num_tokens=3, assistant_early_exit=(), fixed_cascade=False
    )
    cfg = BenchConfig(hf_compiled=False, max_new_tokens=8, warmup=False, repeats=1, temperature=0.7, **arms)
    result = run_bench(router, PROMPTS[:2], cfg, progress=False)
    assert result.meta["decoding"] == "sampled at temperature 0.7" and "sampled at temperature 0.7" in result.markdown()
    by_arm = {(r.arm, r.prompt_id): r.new_ids for r in result.records}
    for item in PROMPTS[:2]:
        ids = router.encode(item["prompt"], chat=item["kind"] == "chat")
        seed = zlib.crc32(f"{item['id']}:0".encode())
        with router.disabled() as model:
            torch.manual_seed(seed)
            plain = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=True,
                                   temperature=0.7, top_k=0, top_p=1.0)[0, ids.shape[1] :].tolist()  # fmt: skip
        assert by_arm[(CONTROL, item["id"])] == plain  # HF sampling from the prompt's seed
        # the decode loop alone draws exactly what HF draws from the same seed, so the seed is shared for real
        assert by_arm[(ENGINE_CONTROL, item["id"])] == plain
        routed = router.generate(ids, 8, mode="verify", do_sample=True, temperature=0.7, top_k=0, top_p=1.0, seed=seed)
        router.clear_ngram_store()
        assert by_arm[("router verify (loaded config)", item["id"])] == routed.sequences[0, ids.shape[1] :].tolist()
    with pytest.raises(ValueError, match="temperature"):
        run_bench(router, PROMPTS[:1], BenchConfig(hf_compiled=False, temperature=-1.0), progress=False)


def test_other_heads_for_the_same_base_run_beside_the_loaded_ones_in_one_process(tmp_path, monkeypatch, capsys):
    """`bench --compare-heads`: each other set of heads runs at its loaded config in every mode on its own copy of
    the model, under the bench router's cost table, is metered on that copy, stays lossless in verify mode, and the
    report sets it against the loaded heads; heads for another base, and a folder without heads, are refused with
    what to give."""
    monkeypatch.setenv("EARLY_EXIT_ROUTER_CACHE", str(tmp_path / "cache"))
    router, other = tiny_router(high_conf_threshold=0.07), tiny_router(high_conf_threshold=0.05)
    cfg = BenchConfig(
        hf_compiled=False, max_new_tokens=8, thresholds=(), fixed_cascade=False, assistant_early_exit=(), warmup=False
    )
    cfg.prompt_lookup_num_tokens, cfg.repeats = 0, 1
    router.cost_model = tiny_costs()["flat"]  # one table, fixed, whatever the tiny model's timings say
    tables, generate = [], other.generate  # every run of the other heads decides from the bench router's table

    def spy(*args, **kwargs):
        tables.append(other.cost_model is router.costs())
        return generate(*args, **kwargs)

    monkeypatch.setattr(other, "generate", spy)
    result = run_bench(router, PROMPTS[:2], cfg, progress=False, others={"eager": other})
    assert len(tables) == 4 and all(tables) and other.cost_model is None  # 2 prompts per mode; then given back

    arms = {a.name: a for a in result.arms}
    assert arms["router verify (heads eager)"].heads == arms["router exit (heads eager)"].heads == "eager"
    by_arm = {(row["category"], row["arm"]): row for row in result.summary}
    verify, exit_row = by_arm[("all", "router verify (heads eager)")], by_arm[("all", "router exit (heads eager)")]
    assert verify["identical"] == verify["runs"] == 2 and verify["teacher_forced_agreement"] == 1.0
    assert verify["compute_ratio"] is not None and exit_row["compute_ratio"] is not None  # metered on its own copy
    assert exit_row["hit_rate"] > 0 and other.config.high_conf_threshold == 0.05
    assert result.markdown().splitlines()[1] == f"heads eager: {other.describe()}"
    section = result.markdown().split("### all")[1].splitlines()
    for mode, row in (("verify", verify), ("exit", exit_row)):
        loaded = by_arm[("all", f"router {mode} (loaded config)")]
        line = next(x for x in section if x.startswith(f"Heads eager in {mode} mode: "))
        assert f"{row['tokens_per_s']:.1f} against {loaded['tokens_per_s']:.1f} tok/s with the loaded heads" in line
        assert ("exit draft cycles" in line) == (mode == "verify")

    for base in (tiny_llama(0, layers=8), tiny_llama(1)):  # another depth; the same shape with other weights
        wrong = EarlyExitRouter.from_model(base, tiny_tokenizer(), **MIXED_CONFIG)
        with pytest.raises(ValueError, match="compare heads trained for one base model"):
            run_bench(router, PROMPTS[:1], cfg, progress=False, others={"wrong": wrong})
    args = ["bench", "--model", str(tmp_path / "none"), "--compare-heads", str(tmp_path), "--out", str(tmp_path / "o")]
    assert main(args) == 2 and "not a saved router folder" in capsys.readouterr().err


def test_prompts_with_a_check_are_scored_correct_from_the_decoded_answer_and_summarized_per_arm():
    from early_exit_router.bench.checks import check_answer

    router = tiny_router(high_conf_threshold=0.05)
    cfg = BenchConfig(max_new_tokens=6, thresholds=(0.05,), modes=("exit",), prompt_lookup_num_tokens=0, repeats=1,
                      hf_compiled=False, assistant_early_exit=(), ngram=False, fixed_cascade=False,
                      warmup=False)  # fmt: skip
    ids = router.encode(PROMPTS[0]["prompt"])
    with router.disabled() as model:  # the control's first word: a check that plain greedy passes
        first = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False)[0, -1]
    passes = {"kind": "contains", "all": [router.tokenizer.decode([int(first)])]}
    fails = {"kind": "contains", "all": ["w96"]}  # outside the tiny vocabulary: never produced
    prompts = [{**PROMPTS[0], "check": passes}, {**PROMPTS[1], "check": fails}, PROMPTS[2]]  # the third: no check
    result = run_bench(router, prompts, cfg, progress=False)
    checks = {item["id"]: item.get("check") for item in prompts}
    for record in result.records:
        if checks[record.prompt_id] is None:
            assert "correct" not in record.quality
        else:
            text = router.tokenizer.decode(record.new_ids, skip_special_tokens=True)
            assert record.quality["correct"] == check_answer(checks[record.prompt_id], text)
    by_arm = {(row["category"], row["arm"]): row for row in result.summary}
    control = by_arm[("all", CONTROL)]
    assert (control["correct"], control["checked"]) == (1, 2)
    for (category, _), row in by_arm.items():
        runs = [r for r in result.records if r.arm == row["arm"] and category in ("all", r.category)]
        verdicts = [r.quality["correct"] for r in runs if "correct" in r.quality]
        assert (row["correct"], row["checked"]) == ((sum(verdicts), len(verdicts)) if verdicts else (None, None))
        assert row["control_checked"] == row["checked"]  # the control's count over the same prompts, in every row
    assert by_arm[("all", "router exit @0.05")]["control_correct"] == 1
    markdown = result.markdown()
    assert "correct = answers that pass their prompt's check" in markdown and "| identical | correct |" in markdown
    assert "| plain HF generate |" in markdown and "| 1/2 |" in markdown.split("### all")[1]
    with pytest.raises(ValueError, match="Prompt 't1': Check .*unknown kind 'regex'"):
        run_bench(router, [{**PROMPTS[0], "check": {"kind": "regex"}}], cfg, progress=False)
    unchecked = run_bench(router, PROMPTS[:1], cfg, progress=False)  # no checks: no column, no counts
    assert unchecked.summary[0]["checked"] is None and "| correct |" not in unchecked.markdown()


def test_the_report_sets_each_lossy_arms_correct_answers_and_divergence_beside_the_controls():
    """Plain greedy 13/14 correct, exit mode 9/14: per arm whose outputs differ from the control's, how many
    differ, where they first differ on average, ROUGE-L, and the correct answers beside the control's."""
    from early_exit_router.bench.bench import Arm, RunRecord, summarize
    from early_exit_router.bench.report import format_markdown

    arms = [Arm(CONTROL, "plain", family="control"), Arm("router exit (loaded config)", "router", "exit"),
            Arm("router verify (loaded config)", "router", "verify")]  # fmt: skip
    records = []
    for k in range(14):
        for arm in arms:
            differs = arm.mode == "exit" and k < 6  # 6 outputs differ, first at tokens 10, 11, ... 15
            records.append(RunRecord(f"p{k}", "checkable", arm.name, 0, [5] * 20, 1.0, 0.1, [0.05] * 19, None,
                                     None, None, quality={
                "identical": not differs, "token_match": 0.5 if differs else 1.0,
                "first_divergence": 10 + k if differs else None, "disagreements": 1 if differs else 0,
                "nll_ratio": 1.0, "rouge_l": 0.5 if differs else 1.0,
                "correct": k != 13 and not (arm.mode == "exit" and k < 4),  # control 13/14, exit 9/14
            }))  # fmt: skip
    summary = summarize(records, arms)
    rows = {(row["category"], row["arm"]): row for row in summary}
    exit_row = rows[("all", "router exit (loaded config)")]
    assert (exit_row["correct"], exit_row["checked"], exit_row["control_correct"]) == (9, 14, 13)
    assert exit_row["first_divergence_mean"] == pytest.approx(12.5) and exit_row["first_divergence_median"] == 12.5
    assert exit_row["rouge_l"] == pytest.approx((6 * 0.5 + 8) / 14)
    assert rows[("all", CONTROL)]["first_divergence_mean"] is None
    meta = {"model": "tiny", "machine": "cpu", "dtype": "float32", "torch": "x", "transformers": "y", "prompts": 14,
            "bench_config": {"max_new_tokens": 20, "repeats": 1}, "num_layers": 6}  # fmt: skip
    section = format_markdown(meta, summary).split("### all")[1]
    assert "| 13/14 |" in section and "| 9/14 |" in section
    lines = [line for line in section.splitlines() if line.startswith("- ")]
    assert lines == [  # the lossless arms, identical throughout, get no line
        "- router exit (loaded config): 6/14 outputs differ, first at token 12.5 on average; ROUGE-L 0.79; "
        "correct 9/14 (plain HF generate: 13/14)."
    ]
    new_keys = ("correct", "checked", "control_correct", "control_checked", "first_divergence_mean")
    old = [{k: v for k, v in row.items() if k not in new_keys} for row in summary]
    assert "| correct |" not in format_markdown(meta, old)  # a bench.json from before the checks still renders


def test_the_bench_command_refuses_a_malformed_check_before_the_model_loads(tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({**PROMPTS[0], "check": {"kind": "sequence", "item": ["w5"]}}) + "\n")
    args = ["bench", "--model", str(tmp_path / "no-such-model"), "--prompts", str(prompts), "--out", str(tmp_path)]
    assert main(args) == 2
    assert "prompt 't1': Check" in capsys.readouterr().err  # said before any model is looked for


def test_the_report_counts_exit_modes_repairs_per_arm():
    from early_exit_router.bench.bench import Arm, RunRecord, summarize
    from early_exit_router.bench.report import format_markdown

    arms = [Arm(CONTROL, "plain", family="control"), Arm("router exit (loaded config)", "router", "exit"),
            Arm(NO_REPAIR, "router", "exit", {"holdback": 0})]  # fmt: skip
    quality = {"identical": True, "token_match": 1.0, "first_divergence": None, "disagreements": 0, "nll_ratio": 1.0,
               "rouge_l": 1.0}  # fmt: skip
    records = []
    for k in range(3):
        for arm in arms:
            stats, lossy = None, arm.overrides != {}
            seen = dict(quality, identical=False, first_divergence=7) if lossy and k else dict(quality)
            if arm.kind == "router":
                repaired, released = (k + 1, 0) if not lossy else (0, 0)
                stats = {"exit_histogram": {"4": 2, "29": 18}, "hit_rate": 0.1, "new_tokens": 20, "plain_share": 0.0,
                         "routing_overhead": 0.01, "policy_cycles": {}, "repaired_tokens": repaired,
                         "released_unchecked": released, "repeat_refusals": int(lossy),
                         "first_divergence": 7 if lossy and k == 1 else None}  # fmt: skip
            records.append(RunRecord(f"p{k}", "list", arm.name, 0, [5] * 20, 1.0, 0.1, [0.05] * 19, None, None, stats,
                                     quality=seen))  # fmt: skip
    summary = summarize(records, arms)
    rows = {(row["category"], row["arm"]): row for row in summary}
    assert rows[("all", "router exit (loaded config)")]["repaired_tokens"] == 6
    assert rows[("all", NO_REPAIR)]["repaired_tokens"] == 0 and rows[("all", CONTROL)]["repaired_tokens"] == 0
    meta = {"model": "tiny", "machine": "cpu", "dtype": "float32", "torch": "x", "transformers": "y", "prompts": 3,
            "bench_config": {"max_new_tokens": 20, "repeats": 1}, "num_layers": 30}  # fmt: skip
    section = format_markdown(meta, summary).split("### all")[1]
    lines = section.splitlines()
    assert (
        "- router exit (loaded config): 6 wrong exited tokens repaired before release, 0 released unchecked; 0 outputs "
        "left the full model's by the router's own account (its first divergence is bench's in 3/3 runs); the repeat "
        "guard sent 0 exits deeper." in lines
    )
    # the router saw one of the two outputs that left the plain model's (the other past its last check)
    assert (
        f"- {NO_REPAIR}: 0 wrong exited tokens repaired before release, 0 released unchecked; 1 output left the full "
        "model's by the router's own account (its first divergence is bench's in 2/3 runs); the repeat guard sent 3 "
        "exits deeper." in lines
    )


def test_hf_compiled_arm_runs_hf_static_cache_compiled_and_reports_speedups_over_it():
    # The anchor every speedup is also measured against: HF generate with its static cache and the decode step
    # compiled by torch.compile (on a CPU too, where generate compiles only when told to), one cache size for the run.
    router = tiny_router()
    model = router.model
    cfg = BenchConfig(max_new_tokens=6, thresholds=(), modes=("verify",), ngram=False, fixed_cascade=False,
                      prompt_lookup_num_tokens=0, assistant_early_exit=(), warmup=False, repeats=1)  # fmt: skip
    result = run_bench(router, PROMPTS[:2], cfg, progress=False)
    arms = [a.name for a in result.arms]
    assert arms[:2] == [CONTROL, HF_COMPILED]
    assert hasattr(model, "_compiled_call")  # generate took its compiled path
    rows = {(row["category"], row["arm"]): row for row in result.summary}
    anchor = rows[("all", HF_COMPILED)]
    assert anchor["identical"] == anchor["runs"] == 2  # the same greedy tokens as plain HF
    assert anchor["speedup_compiled"] == pytest.approx(1.0)
    for row in rows.values():  # every row: over the control and over the anchor, from the same run
        assert row["speedup_compiled"] == pytest.approx(
            row["speedup"] / rows[(row["category"], HF_COMPILED)]["speedup"]
        )
    assert "vs HF compiled" in result.markdown()
    assert router.model is model


def test_a_compiled_arm_is_prepared_and_warmed_up_with_the_compute_meter_off(monkeypatch):
    """The compute meter's hooks would be traced into a graph and compile it again at every count: a compiled arm's
    cost table (measured on its graphs) and its warm-up run with them removed, the eager arms' with them."""
    from early_exit_router.bench import bench as bench_module

    router = tiny_router(1)
    seen = []
    prepare = bench_module._Runner.prepare

    def watched(self, arm):
        seen.append((arm.compiled, any(layer._forward_pre_hooks for layer in self.router.stack.layers)))
        return prepare(self, arm)

    monkeypatch.setattr(bench_module._Runner, "prepare", watched)
    cfg = BenchConfig(modes=("verify",), thresholds=(), fixed_cascade=False, prompt_lookup_num_tokens=0,
                      assistant_early_exit=(), hf_compiled=False, max_new_tokens=6, repeats=1)  # fmt: skip
    result = run_bench(router, PROMPTS[:1], cfg, progress=False)
    assert {compiled for compiled, _ in seen} == {True, False}
    assert all(hooks != compiled for compiled, hooks in seen)
    assert all(row["identical"] == row["runs"] for row in result.summary)
    # the compiled default's exits against its own compiled n-gram tier, from the same run
    assert "router verify, n-gram tier only, compiled" in [arm.name for arm in result.arms]
    assert "Exits added in verify mode, compiled: " in result.markdown()


class FakeLlama:
    """`llama_cpp.Llama` as the bench calls it, decoding greedily with a copy of the tiny model (so its outputs equal
    plain HF's), and recording how it was built and called."""

    model = None  # the copy it decodes with
    made: list[FakeLlama] = []

    def __init__(self, **kwargs) -> None:
        self.kwargs, self.resets, self.calls = kwargs, 0, []
        FakeLlama.made.append(self)

    def reset(self) -> None:
        self.resets += 1

    def close(self) -> None:
        self.closed = True

    def generate(self, tokens, **sampling):
        self.calls.append((list(tokens), sampling, self.resets))
        ids = torch.tensor([tokens])
        while True:
            with torch.no_grad():
                token = int(self.model(ids).logits[0, -1].argmax())
            yield token
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)


def fake_llama_cpp(monkeypatch) -> None:
    """An installed llama-cpp-python, as far as the bench can tell."""
    import importlib.machinery
    import sys
    import types

    module = types.ModuleType("llama_cpp")
    module.__spec__ = importlib.machinery.ModuleSpec("llama_cpp", None)
    module.Llama, module.__version__ = FakeLlama, "0.0-test"
    monkeypatch.setitem(sys.modules, "llama_cpp", module)
    monkeypatch.setattr(FakeLlama, "made", [])


def test_llama_cpp_runs_the_same_gguf_greedily_as_a_reference_arm_where_it_is_installed(tmp_path, monkeypatch):
    from early_exit_router.bench.arms import build_arms
    from early_exit_router.bench.llama_cpp_arm import LLAMA_CPP

    router = tiny_router()
    cfg = BenchConfig(max_new_tokens=6, thresholds=(), modes=("verify",), ngram=False, fixed_cascade=False,
                      prompt_lookup_num_tokens=0, assistant_early_exit=(), hf_compiled=False, compiled=False,
                      warmup=False, repeats=1)  # fmt: skip
    assert LLAMA_CPP not in [a.name for a in build_arms(router, cfg)]  # a base from no GGUF file
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    router.name_or_path = str(gguf)
    if importlib.util.find_spec("llama_cpp") is None:  # not installed: no arm
        assert LLAMA_CPP not in [a.name for a in build_arms(router, cfg)]
    fake_llama_cpp(monkeypatch)
    FakeLlama.model = tiny_llama(0)
    assert [a.name for a in build_arms(router, cfg)][:2] == [CONTROL, LLAMA_CPP]
    for off in ({"llama_cpp": False}, {"temperature": 0.7}):  # turned off, or sampling (its sampler is its own)
        assert LLAMA_CPP not in [a.name for a in build_arms(router, dataclasses.replace(cfg, **off))]
    router.adapted_from = (tmp_path,)  # an adapt-base folder's weights are not the file's
    assert LLAMA_CPP not in [a.name for a in build_arms(router, cfg)]
    router.adapted_from = None
    result = run_bench(router, PROMPTS[:2], cfg, progress=False)
    (llm,) = FakeLlama.made  # loaded once, for the run's longest call
    longest = max(router.encode(p["prompt"], chat=p["kind"] == "chat").shape[1] for p in PROMPTS[:2])
    assert llm.kwargs["model_path"] == str(gguf) and llm.kwargs["n_ctx"] == longest + 6
    assert llm.kwargs["n_threads"] == torch.get_num_threads() and llm.kwargs["n_gpu_layers"] == 0
    assert [resets for *_, resets in llm.calls] == [1, 2]  # nothing kept from the run before
    assert all(s["temp"] == 0.0 and s["top_k"] == 1 for _, s, _ in llm.calls)
    row = {r["arm"]: r for r in result.summary if r["category"] == "all"}[LLAMA_CPP]
    assert row["identical"] == row["runs"] == 2
    runs = [r for r in result.records if r.arm == LLAMA_CPP]
    assert all(len(r.new_ids) == 6 and r.compute_ratio is None and r.inter_token_s for r in runs)
    assert llm.closed  # freed by the bench, not left to interpreter shutdown
    assert result.meta["llama_cpp"] == f"llama-cpp-python 0.0-test, tiny.gguf, {torch.get_num_threads()} threads"
    assert LLAMA_CPP in result.markdown()
    result.plot(tmp_path / "bench.png")
    assert (tmp_path / "bench.png").stat().st_size > 0


def test_the_llama_cpp_runner_stops_after_an_end_token_as_hf_does(tmp_path, monkeypatch):
    from early_exit_router.bench.llama_cpp_arm import LlamaCppRunner

    fake_llama_cpp(monkeypatch)
    FakeLlama.model = tiny_llama(0)
    runner = LlamaCppRunner(tmp_path / "tiny.gguf", 64, 1)
    ids = torch.tensor([[5, 6, 7]])
    free, _ = runner.generate(ids, 8, eos=())
    tokens, times = runner.generate(ids, 8, eos=[free[2]])
    assert tokens == free[: free.index(free[2]) + 1] and len(times) == len(tokens)  # the end token kept
    assert times == sorted(times)

"""Quantized bases (torchao weight-only int8 and int4 on the CPU): routed, exact against the same quantized model."""

from __future__ import annotations

import pytest
import torch

from early_exit_router import EarlyExitRouter
from early_exit_router.bench.memory import memory_budget
from early_exit_router.integrations.export import export_draft

from .conftest import MIXED, NEVER_EXIT, assert_cache_matches_full_forward, prompt, tiny_llama

torchao = pytest.importorskip("torchao")


def quantized(kind: str, seed: int = 0):
    from torchao.quantization import Int8WeightOnlyConfig, IntxWeightOnlyConfig, quantize_
    from torchao.quantization.granularity import PerGroup

    model = tiny_llama(seed)
    config = Int8WeightOnlyConfig() if kind == "int8" else IntxWeightOnlyConfig(torch.int4, PerGroup(32))
    quantize_(model, config)
    return model


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_quantized_base_runs_routed_and_exact(kind):
    model = quantized(kind)
    ids = prompt(0)
    ref = model.generate(ids, max_new_tokens=20, do_sample=False)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **NEVER_EXIT)
    assert router.stack.quantized
    assert torch.equal(router.generate(ids, max_new_tokens=20).sequences, ref)
    router.config = router.config.replace(**dict(MIXED, draft_vocab_size=32))  # a trimmed head from int rows
    out = router.generate(ids, max_new_tokens=20, mode="verify")
    assert torch.equal(out.sequences, ref) and out.stats.drafts_judged > 0
    assert_cache_matches_full_forward(model, out.sequences, out.cache)
    # The heads stay dense, in the compute dtype.
    assert all(p.dtype == torch.float32 and type(p) is torch.nn.Parameter for p in router.heads.parameters())
    assert router.heads.draft_head(router.stack, 32).weight.dtype == torch.float32


def test_memory_counts_the_quantized_bytes_and_export_refuses_them(tmp_path):
    dense = EarlyExitRouter.from_model(tiny_llama(0), exit_layers=[1, 3], adapter="postnorm")
    small = EarlyExitRouter.from_model(quantized("int4"), exit_layers=[1, 3], adapter="postnorm")
    assert memory_budget(small, 64).base_weights < 0.5 * memory_budget(dense, 64).base_weights
    with pytest.raises(ValueError, match="quantized weights"):
        export_draft(small, 1, tmp_path / "draft")


def test_heads_saved_from_the_dense_model_load_onto_its_quantized_copy(tmp_path):
    from early_exit_router.heads.checkpoint import load_router

    router = EarlyExitRouter.from_model(tiny_llama(0), exit_layers=[1, 3], **MIXED)
    router.save_pretrained(tmp_path / "heads")
    loaded = EarlyExitRouter._from_saved(quantized("int8"), None, load_router(tmp_path / "heads"), None, "int8")
    assert loaded.exit_layers == [1, 3]


def test_quantization_choices_fail_clearly_before_loading():
    from early_exit_router.models.quantization import check_quantization

    with pytest.raises(ValueError, match="choose one of int8, int4"):
        check_quantization("int3", "cpu")
    with pytest.raises(ValueError, match="bitsandbytes\\) runs on CUDA only.*'int8' / 'int4'"):
        check_quantization("bnb-4bit", "cpu")
    check_quantization("int8", "cpu")  # torchao is installed with the test extra
    check_quantization(None, "cpu")


def test_quantized_loading_keeps_its_own_cost_model_key():
    from early_exit_router.models.quantization import quantize_loaded
    from early_exit_router.routing.costs import cost_key

    dense = EarlyExitRouter.from_model(tiny_llama(0), exit_layers=[1, 3])
    model = tiny_llama(0)
    quantize_loaded(model, "int8")
    small = EarlyExitRouter.from_model(model, exit_layers=[1, 3])
    assert cost_key(dense.stack, 0)["weights"] == ["dense"]
    assert cost_key(small.stack, 0)["weights"] != ["dense"]


def test_the_compute_meter_counts_a_quantized_base_like_the_dense_one():
    from early_exit_router.bench.compute import ComputeMeter

    counts = []
    for model in (tiny_llama(0), quantized("int4")):
        router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **NEVER_EXIT)
        with ComputeMeter(router.stack, router.heads) as meter:
            router.generate(prompt(0), max_new_tokens=4)
        counts.append((meter.count.layer_macs, meter.count.head_macs))
    assert counts[0] == counts[1] and counts[0][0] > 0

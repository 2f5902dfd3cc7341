"""The memory budget: weights counted once, the KV cache measured per layer, against what generation holds."""

from __future__ import annotations

import pytest
import torch

from early_exit_router import EarlyExitRouter
from early_exit_router.bench.memory import cache_bytes, measured_bytes, memory_budget
from early_exit_router.heads.draft import half_rows_pay

from .conftest import MIXED, tiny_llama


@pytest.mark.parametrize("context", [16, 64])
def test_the_budget_matches_what_a_generation_holds(context):
    router = EarlyExitRouter.from_model(tiny_llama(0), exit_layers=[1, 3], **dict(MIXED, draft_vocab_size=32))
    budget = memory_budget(router, context)
    model = router.model
    assert budget.base_weights == sum(p.numel() * 4 for p in model.parameters()) - (
        model.lm_head.weight.numel() * 4 if model.config.tie_word_embeddings else 0
    ) + sum(b.numel() * b.element_size() for b in model.buffers())
    assert budget.heads == router.num_added_parameters() * 4
    assert budget.draft_head == 32 * 32 * (2 if half_rows_pay("cpu") else 4)  # float16 rows where they pay
    out = router.generate(torch.randint(1, 90, (1, context)), max_new_tokens=1, mode="verify")
    assert cache_bytes(out.cache) == budget.kv_cache
    measured = measured_bytes(router, context)
    assert abs(measured - (budget.total - budget.fill_workspace)) <= 0.1 * measured


def test_prepacked_copies_count_in_the_budget(monkeypatch):
    from early_exit_router.models import kernels, packed

    if kernels.packing_supported(torch.device("cpu"), torch.float32) is not None:
        pytest.skip("this torch build has no MKL packed GEMM")
    monkeypatch.setitem(packed.MIN_ELEMENTS, torch.float32, 0)  # pack the tiny model's weights
    router = EarlyExitRouter.from_model(tiny_llama(0), exit_layers=[1, 3])
    budget = memory_budget(router, 16)
    assert budget.packed_weights == router.stack.packed_weights.nbytes > 0
    router.stack.use_packed_weights(False)
    unpacked = memory_budget(router, 16)
    assert unpacked.packed_weights == 0 and unpacked.total == budget.total - budget.packed_weights


def test_a_block_adapters_packed_layer_counts_in_the_budget(monkeypatch):
    from early_exit_router.models import kernels, packed

    if kernels.packing_supported(torch.device("cpu"), torch.float32) is not None:
        pytest.skip("this torch build has no float32 packed product")
    monkeypatch.setitem(packed.MIN_ELEMENTS, torch.float32, 0)
    router = EarlyExitRouter.from_model(tiny_llama(0), exit_layers=[1, 3], exit_adapters={"1": "block"})
    block = router.heads.adapter(1).block
    layer_bytes = sum(m.weight.nbytes for m in block.modules() if isinstance(m, torch.nn.Linear))
    copies = len(kernels.float32_kernel().layer_rows)
    assert memory_budget(router, 16).packed_weights == router.stack.packed_weights.nbytes + layer_bytes * copies

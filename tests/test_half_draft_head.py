"""The float16 trimmed draft head (`half_draft_head`): half the bytes, logits within rounding of float32's, products
of more rows than the CPU's fast path takes from the upcast weight, verify mode exact, its own cost table."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from early_exit_router import EarlyExitRouter
from early_exit_router.decode.drafters import ExitDrafter
from early_exit_router.heads.draft import HALF_ROWS_ON_CPU, DraftHead, half_rows_pay, keeps_half_rows
from early_exit_router.routing import costs

from .conftest import MIXED, VOCAB, prompt, tiny_llama

RANKED = dict(MIXED, draft_vocab_size=32)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, HALF_ROWS_ON_CPU, HALF_ROWS_ON_CPU + 1, 16])
def test_half_rows_give_the_products_of_their_rounded_weights(rows, bias):
    torch.manual_seed(0)
    head = nn.Linear(32, VOCAB, bias=bias)
    ids = torch.tensor([0, 5, 9, 17, 40, 41, 77, 95])
    full, half = DraftHead(head, ids), DraftHead(head, ids, half=True)
    assert full.weight.dtype == torch.float32 and half.weight.dtype == torch.float16
    assert half.weight.nbytes * 2 == full.weight.nbytes and torch.equal(half.token_ids, full.token_ids)
    x = torch.randn(rows, 32) * 3
    out = half(x)
    assert out.dtype == torch.float32 and out.shape == (rows, len(ids))
    rounded_bias = None if half.bias is None else half.bias.float()
    exact = nn.functional.linear(x, half.weight.float(), rounded_bias)  # the rounded weights' product in float32
    if rows > HALF_ROWS_ON_CPU:  # wider: the weight upcast, the product float32's exactly
        assert torch.equal(out, exact)
    else:  # a matrix-vector product of float16 operands accumulated in float32, rounded to float16
        torch.testing.assert_close(out, exact, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(out, full(x), rtol=1e-2, atol=1e-2)
    assert torch.equal(out.argmax(-1), full(x).argmax(-1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_model_keeps_its_rows_and_one_cost_table(dtype):
    router = EarlyExitRouter.from_model(tiny_llama(0, dtype=dtype), exit_layers=[1, 3], **RANKED)
    stack, heads = router.stack, router.heads
    draft = heads.draft_head(stack, 32, half=True)
    assert draft is heads.draft_head(stack, 32) and draft.weight.dtype == dtype  # one head, built once
    normed = torch.randn(2, 3, 32, dtype=dtype)
    assert draft(normed).dtype == dtype and draft(normed).shape == (2, 3, 32)
    on, off = router.config, router.config.replace(half_draft_head=False)
    assert costs.config_key(stack, on) == costs.config_key(stack, off)  # the same head: the same table


def test_float16_rows_only_where_they_pay(monkeypatch):
    """An x86 CPU with torch's float16 matrix-vector path (torch 2.6 on); GPUs keep float32 rows until measured."""
    cpu = SimpleNamespace(dtype=torch.float32, device=torch.device("cpu"))
    assert keeps_half_rows(cpu, True) == half_rows_pay("cpu") and not keeps_half_rows(cpu, False)
    assert not keeps_half_rows(SimpleNamespace(dtype=torch.float32, device=torch.device("cuda")), True)
    half_rows_pay.cache_clear()
    monkeypatch.setattr(torch, "__version__", "2.5.1")
    try:
        assert not half_rows_pay("cpu")
    finally:
        monkeypatch.undo()
        half_rows_pay.cache_clear()


# the CPU this runs on keeps float16 rows where torch multiplies them fast (x86, torch 2.6 on)
HALF = torch.float16 if half_rows_pay("cpu") else torch.float32


def test_decodes_draft_from_the_half_head_by_default_and_verify_stays_exact():
    model = tiny_llama(0)
    ids = prompt(2, 8)
    reference = model.generate(ids, max_new_tokens=24, do_sample=False)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **RANKED)
    stack, heads, config = router.stack, router.heads, router.config
    assert config.half_draft_head
    assert ExitDrafter(stack, heads, config, [1, 3]).draft.weight.dtype == HALF
    off = config.replace(half_draft_head=False)
    assert ExitDrafter(stack, heads, off, [1, 3]).draft.weight.dtype == torch.float32
    assert heads.nbytes(stack, 32, half=True)[1] * 4 == heads.nbytes(stack, 32)[1] * HALF.itemsize
    for cfg in ({}, {"half_draft_head": False}):
        out = router.generate(ids, max_new_tokens=24, mode="verify", config=cfg)
        assert torch.equal(out.sequences, reference)
        assert sum(v for k, v in out.stats.exit_histogram.items() if k in (1, 3)) > 0  # the exits drafted


def test_the_half_head_has_a_cost_table_of_its_own():
    router = EarlyExitRouter.from_model(tiny_llama(0), exit_layers=[1, 3], **RANKED)
    on = costs.config_key(router.stack, router.config)
    off = costs.config_key(router.stack, router.config.replace(half_draft_head=False))
    assert on["half_draft_head"] == (HALF == torch.float16) and not off["half_draft_head"]
    assert costs.cache_path(on) != costs.cache_path(off) or HALF == torch.float32
    built, real = [], router.heads.draft_head
    router.heads.draft_head = lambda *args: built.append(real(*args).weight.dtype) or real(*args)
    table = costs.measure(router.stack, router.heads, 32, chunks=(1, 2), reps=1, rounds=1, half_draft=True)
    assert table.key == on and table.draft_head_ms > 0 and built == [HALF]  # the head decodes run was timed

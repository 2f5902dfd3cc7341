"""Exit mode free-running: where the output leaves the full model's (`GenerationStats.first_divergence`), the repeat
guard that keeps the shallow heads from copying an earlier item (`RouterConfig.repeat_guard`), and the controller,
which does not loosen on checks that read a prefix the full model never wrote."""

from __future__ import annotations

import pytest
import torch

from early_exit_router import EarlyExitRouter, RouterConfig
from early_exit_router.bench.metrics import first_divergence
from early_exit_router.routing.exit_rule import ExitRule, word_ids

from .conftest import ALWAYS_EXIT, MIXED, VOCAB, prompt, tiny_llama


def word_tokenizer():
    """A word-level tokenizer for the tiny models whose tokens are words: '<bos>', '<unk>', then 'wab', 'wac', ..."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    names = {f"w{chr(97 + i // 26)}{chr(97 + i % 26)}": i for i in range(2, VOCAB)}
    backend = Tokenizer(WordLevel({"<bos>": 0, "<unk>": 1, **names}, unk_token="<unk>"))
    backend.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<bos>")


def greedy(model, ids, n):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=n, do_sample=False)


def test_word_ids_are_the_tokens_of_three_letters_or_more():
    tokenizer = word_tokenizer()
    assert word_ids(tokenizer) == frozenset(range(2, VOCAB)) and word_ids(None) == frozenset()
    assert word_ids(tokenizer) is word_ids(tokenizer)  # read once per tokenizer


def test_the_guard_reads_only_the_generated_window():
    rule = ExitRule(RouterConfig(repeat_guard=3), VOCAB, frozenset({5, 6}))
    seq = [5, 9, 6, 9, 9, 9]  # prompt [5, 9], then 6, 9, 9, 9
    assert rule.repeats([(seq, 2)], [6]) is False  # 6 is outside the last 3 generated tokens
    assert rule.repeats([(seq[:-1], 2)], [6]) is True
    assert rule.repeats([(seq, 0)], [9]) is False  # not a word
    assert rule.repeats([(seq, 2)], [5]) is False  # only in the prompt
    assert ExitRule(RouterConfig(repeat_guard=0), VOCAB, frozenset({6})).repeats([(seq[:-1], 2)], [6]) is False


@pytest.mark.parametrize("bad", [-1, 2.5, "8"])
def test_a_bad_repeat_guard_is_refused(bad):
    with pytest.raises(ValueError, match="repeat_guard"):
        RouterConfig(repeat_guard=bad)


@pytest.mark.parametrize("holdback", [0, 2])
def test_lossy_exit_mode_never_exits_a_word_the_recent_output_holds(holdback):
    """Heads that always exit, tokens released unchecked: with the guard, no token that left at an exit repeats a
    word among the 8 generated tokens before it (they went deeper instead, counted once per token); without it, some
    do. Repaired (holdback None) the guard stays out of the way: repairs catch a copy, and the output is the full
    model's either way."""
    model = tiny_llama(0)
    ids = prompt(0)
    ref = greedy(model, ids, 40)
    router = EarlyExitRouter.from_model(model, word_tokenizer(), exit_layers=[1, 3], **ALWAYS_EXIT)
    repeated = {}
    for window in (0, 8):
        out = router.generate(ids, 40, mode="exit", config={"holdback": holdback, "repeat_guard": window})
        new = out.sequences[0, ids.shape[1] :].tolist()
        exited = [j for j, depth in enumerate(out.depths) if depth != model.config.num_hidden_layers - 1]
        repeated[window] = [j for j in exited if new[j] in new[max(0, j - 8) : j]]
        full_depth = sum(depth == model.config.num_hidden_layers - 1 for depth in out.depths)
        assert (0 < out.stats.repeat_refusals <= full_depth) == bool(window)  # a refused token went deep
    assert repeated[0] and not repeated[8]
    assert "repeat guard sent" in out.stats.summary()
    repaired = router.generate(ids, 40, mode="exit", config={"holdback": None, "repeat_guard": 8})
    assert repaired.stats.repeat_refusals == 0 and torch.equal(repaired.sequences, ref)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_first_divergence_is_where_the_output_left_the_full_models(seed):
    """Lossy exit mode (holdback 0): the first released exited token a check finds wrong is exactly where the output
    first differs from the full model's greedy output (before it, the prefix was the full model's own). Repaired,
    the output never leaves it."""
    model = tiny_llama(seed)
    ids = prompt(seed)
    ref = greedy(model, ids, 40)[0, ids.shape[1] :].tolist()
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **MIXED)
    out = router.generate(ids, 40, mode="exit", config={"max_pending": 2})
    new = out.sequences[0, ids.shape[1] :].tolist()
    found = out.stats.first_divergence
    assert found is not None and found == first_divergence(ref, new)
    assert f"left the full model's at new token {found}" in out.stats.summary()
    assert router.generate(ids, 40, mode="exit", config={"holdback": None}).stats.first_divergence is None


def test_each_row_of_a_batch_reports_its_own_first_divergence():
    """A lossy exit-mode batch: each row's `first_divergence` is where its output left that row's greedy output."""
    from .test_batching import left_padded

    model = tiny_llama(1)
    lengths = [6, 9]
    ids, mask = left_padded(lengths, seed=3)
    refs = [greedy(model, ids[r : r + 1, ids.shape[1] - n :], 30)[0, n:].tolist() for r, n in enumerate(lengths)]
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **MIXED)  # (model.generate routes from here on)
    out = router.generate(ids, 30, mode="exit", attention_mask=mask, config={"max_pending": 2})
    for r, ref in enumerate(refs):
        assert out.row_stats[r].first_divergence == first_divergence(ref, out.sequences[r, ids.shape[1] :].tolist())
    firsts = [s.first_divergence for s in out.row_stats if s.first_divergence is not None]
    assert firsts and out.stats.first_divergence == min(firsts)


def test_the_controller_does_not_loosen_once_the_output_diverged():
    """Checks after a divergence read a prefix the full model never wrote (a wrong list item cascades while every
    check passes): evidence that would loosen the thresholds leaves them where they are; tightening still works."""
    rule = ExitRule(RouterConfig(high_conf_threshold=0.8, low_conf_threshold=0.8, target_agreement=0.9), VOCAB)
    shifts = {}
    for diverged in (False, True):
        state = rule.new_state()
        state.diverged = diverged
        state.quality.add_tokens(8, 0)
        state.quality.add_checks([True] * 200)
        rule.adjust(state)
        shifts[diverged] = state.threshold_shift
        state.quality.add_checks([False] * 200)
        rule.adjust(state)
        assert state.threshold_shift > shifts[diverged]
    assert shifts[False] < 0 and shifts[True] == 0

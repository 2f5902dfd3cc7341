"""Stop rules inside multi-token drafts: every rule sees every token, as in plain decoding.

The n-gram tier appends several tokens at once. A stop rule that fires on one of them must end generation right
there (exit mode) or, in verify mode, right there once the draft is verified; plain HF is the reference.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from early_exit_router import EarlyExitRouter
from early_exit_router.decode.stopping import STOP_STRING_TAIL, DecodeRequest, ends_generation
from early_exit_router.routing.costs import CostModel

from .conftest import (
    ALWAYS_EXIT,
    MIXED,
    NEVER_EXIT,
    UNVERIFIED_NGRAM,
    assert_cache_matches_full_forward,
    prompt,
    tiny_llama,
    tiny_tokenizer,
)


def looping_prompt() -> torch.Tensor:
    """A prompt whose greedy continuation on tiny_llama(0) repeats itself, so the n-gram tier drafts runs."""
    return torch.tensor([[5, 17, 33, 41, 9, 5, 17, 33, 41, 9, 5, 17, 33, 41, 9, 5, 17]])


class StopOnToken(StoppingCriteria):
    """Stops once `token` was generated `times` times (counting only new tokens)."""

    def __init__(self, token: int, prompt_len: int, times: int = 1) -> None:
        self.token, self.prompt_len, self.times = token, prompt_len, times

    def __call__(self, input_ids, scores, **kwargs):
        done = (input_ids[:, self.prompt_len :] == self.token).sum(dim=1) >= self.times
        return done


def ngram_router(model, **overrides):
    """Exit mode keeps these drafts unverified, the lossy path where the stop rules were missed."""
    return EarlyExitRouter.from_model(
        model, exit_layers=[1, 3], ngram_draft=6, max_pending=8, **{**NEVER_EXIT, **UNVERIFIED_NGRAM, **overrides}
    )


def reference(model, ids, n, **kwargs):
    return model.generate(ids, max_new_tokens=n, do_sample=False, **kwargs)


def test_the_looping_prompt_really_drafts_with_the_ngram_tier():
    model = tiny_llama(0)
    out = ngram_router(model).generate(looping_prompt(), max_new_tokens=30, mode="verify")
    assert out.stats.exit_histogram.get(-1, 0) >= 10, out.stats.exit_histogram
    assert out.stats.mean_accepted_length >= 2


def unstopped_output(model, ids, n, mode) -> list[int]:
    """New tokens without a stop rule: plain HF greedy (verify mode), or the router's own exit-mode output (exit
    mode keeps n-gram drafts unverified, so its text is its own)."""
    if mode == "verify":
        return reference(model, ids, n)[0, ids.shape[1] :].tolist()
    router = ngram_router(model)
    new = router.generate(ids, max_new_tokens=n, mode="exit").sequences[0, ids.shape[1] :].tolist()
    router.unpatch()
    return new


def most_repeated(new: list[int]) -> int:
    """The token that recurs most in the looping part of the output, where the n-gram tier drafts."""
    tail = new[10:]
    return max(tail, key=tail.count)


def cut_at_stop(ids, new: list[int], stop_at) -> torch.Tensor:
    """Prompt + `new`, cut after the first token where `stop_at(new tokens so far)` holds."""
    end = next((k for k in range(1, len(new) + 1) if stop_at(new[:k])), len(new))
    return torch.cat([ids, torch.tensor([new[:end]])], dim=1)


@pytest.mark.parametrize("mode", ["exit", "verify"])
@pytest.mark.parametrize("extra", [1, 2])
def test_stopping_criteria_that_fire_mid_draft_stop_like_plain_decoding(mode, extra):
    model = tiny_llama(0)
    ids = looping_prompt()
    new = unstopped_output(model, ids, 30, mode)
    token = most_repeated(new)
    occurrence = new[:12].count(token) + extra  # an occurrence after the loop (and so the drafting) began
    expected = cut_at_stop(ids, new, lambda prefix: prefix.count(token) >= occurrence)
    assert expected.shape[1] < ids.shape[1] + 30  # the rule fires
    criteria = StoppingCriteriaList([StopOnToken(token, ids.shape[1], occurrence)])
    if mode == "verify":
        assert torch.equal(reference(model, ids, 30, stopping_criteria=criteria), expected)
    router = ngram_router(model)
    out = router.generate(ids, max_new_tokens=30, mode=mode, stopping_criteria=criteria)
    assert out.stats.exit_histogram.get(-1, 0) > 0
    assert torch.equal(out.sequences, expected)
    assert_cache_matches_full_forward(model, out.sequences, out.cache)


@pytest.mark.parametrize("mode", ["exit", "verify"])
@pytest.mark.parametrize("extra", [1, 2])
def test_stop_strings_inside_a_draft_stop_like_plain_decoding(mode, extra):
    tokenizer = tiny_tokenizer()
    model = tiny_llama(0)
    ids = looping_prompt()
    new = unstopped_output(model, ids, 30, mode)
    word = tokenizer.decode([most_repeated(new)])
    occurrence = tokenizer.decode(new[:12]).count(word) + extra
    expected = cut_at_stop(ids, new, lambda prefix: tokenizer.decode(prefix).count(word) >= occurrence)
    # a stop string that completes only at the chosen occurrence: the word repeated with what comes between
    text = tokenizer.decode(expected[0, ids.shape[1] :].tolist())
    stop = text[text.index(word) :]
    router = EarlyExitRouter.from_model(
        model, tokenizer, exit_layers=[1, 3], ngram_draft=6, max_pending=8, **{**NEVER_EXIT, **UNVERIFIED_NGRAM}
    )
    out = router.generate(ids, max_new_tokens=30, mode=mode, stop_strings=[stop])
    assert out.stats.exit_histogram.get(-1, 0) > 0
    assert torch.equal(out.sequences, expected)


@pytest.mark.parametrize("mode", ["exit", "verify"])
def test_eos_inside_a_draft_stops_like_hf(mode):
    model = tiny_llama(0)
    ids = looping_prompt()
    plain = reference(model, ids, 30)[0, ids.shape[1] :].tolist()
    eos = plain[15]  # generated first at position 6: its second occurrence sits inside a draft
    ref = reference(model, ids, 30, eos_token_id=eos, pad_token_id=eos)
    out = ngram_router(model).generate(ids, max_new_tokens=30, mode=mode, eos_token_id=eos)
    assert torch.equal(out.sequences, ref)
    assert out.sequences[0, -1] == eos


@pytest.mark.parametrize("n", range(1, 14))
def test_max_new_tokens_reached_mid_draft_is_exact(n):
    model = tiny_llama(0)
    ids = looping_prompt()
    ref = reference(model, ids, n)  # before patching: on a patched model, generate() itself routes
    out = ngram_router(model).generate(ids, max_new_tokens=n, mode="verify")
    assert torch.equal(out.sequences, ref)
    assert_cache_matches_full_forward(model, out.sequences, out.cache)


def test_eos_in_a_rejected_draft_does_not_stop_generation():
    """A draft that ends in EOS but is rejected before it must not end the output: decoding resumes."""
    model = tiny_llama(0)
    ids = looping_prompt()
    plain = reference(model, ids, 30)[0, ids.shape[1] :].tolist()
    # An id the prompt continues with in the *prompt* (so the n-gram tier drafts it) but never generated.
    eos = next(t for t in ids[0].tolist() if t not in plain)
    ref = reference(model, ids, 30, eos_token_id=eos, pad_token_id=eos)
    out = ngram_router(model).generate(ids, max_new_tokens=30, mode="verify", eos_token_id=eos)
    assert torch.equal(out.sequences, ref)
    assert out.sequences.shape[1] == ids.shape[1] + 30


def test_a_stop_string_may_begin_in_the_prompt_and_one_wholly_in_it_ends_nothing():
    """As HF's StopStringCriteria matches (over the whole input_ids): a stop string counts once it ends in the newest
    token, wherever it begins; found wholly in the prompt it stops nothing, and its next occurrence stops."""
    tokenizer = tiny_tokenizer()
    model = tiny_llama(0)
    ids = looping_prompt()  # ... w41 w9 w5 w17
    router = EarlyExitRouter.from_model(model, tokenizer, exit_layers=[1, 3], **NEVER_EXIT)
    new = router.generate(ids, max_new_tokens=12, mode="verify").sequences[0, ids.shape[1] :].tolist()

    def stopped(stop: str) -> list[int]:
        out = router.generate(ids, max_new_tokens=12, mode="verify", stop_strings=[stop])
        return out.sequences[0, ids.shape[1] :].tolist()

    text = tokenizer.decode(new)
    assert stopped(tokenizer.decode([17, new[0]])) == new[:1]  # begins with the prompt's last token
    assert "w33 w41" not in text and stopped("w33 w41") == new  # only in the prompt
    again = text.index("w41 w9")  # in the prompt and again in the output: that occurrence stops
    assert stopped("w41 w9") == new[: text[:again].count(" ") + 2]  # the words before it, then its two
    # The server's OpenAI `stop` looks at the completion's own text only.
    completion_only = DecodeRequest(12, stop_strings=("w17 w36",), tokenizer=tokenizer, stop_strings_from=2)
    assert not ends_generation(completion_only, [5, 17, 36], 2, lambda: ids)
    assert ends_generation(dataclasses.replace(completion_only, stop_strings_from=None), [5, 17, 36], 2, None)
    assert ends_generation(completion_only, [5, 17, 36, 17, 36], 4, None)  # from index 2 on, whatever the prompt


class Latching(StoppingCriteria):
    """Keeps every ids it is shown, and once `token` has ended them it stops for good, as lm-eval's multi-token EOS
    criterion keeps its state: shown a draft that is then refused, it would stop a sequence that never had `token`."""

    def __init__(self, token: int = -1) -> None:
        self.token, self.seen, self.hit = token, [], False

    def __call__(self, input_ids, scores, **kwargs):
        self.seen.append(tuple(input_ids[0].tolist()))
        self.hit = self.hit or int(input_ids[0, -1]) == self.token
        return torch.full((input_ids.shape[0],), self.hit)


def trees_router(model):
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], acceptance_prior=0.5, ngram_min_size=1)
    router.cost_model = CostModel.synthetic(6, [1.0] * 16, [6.0] * 16, draft_head_ms=0.1)  # trees always pay
    return router


def copies_prompt() -> torch.Tensor:
    """A pattern three times, different tokens after it: some of the n-gram tier's copies go wrong."""
    pattern = prompt(1, length=4)
    return torch.cat([pattern, prompt(11, length=3), pattern, prompt(21, length=3), pattern], dim=1)


REFUSED_DRAFTS = {  # verify decodes whose drafts the deep pass partly refuses: (router, prompt)
    "exit drafts": (lambda m: EarlyExitRouter.from_model(m, exit_layers=[1, 3], **MIXED), lambda: prompt(3, 8)),
    "n-gram chains": (
        lambda m: EarlyExitRouter.from_model(m, exit_layers=[1, 3], **{**NEVER_EXIT, "ngram_tier": True}),
        copies_prompt,
    ),
    "n-gram trees": (trees_router, lambda: torch.randint(1, 5, (1, 48), generator=torch.Generator().manual_seed(0))),
}


@pytest.mark.parametrize("setup", list(REFUSED_DRAFTS))
def test_stopping_criteria_see_each_final_token_once_in_order_and_never_a_refused_draft(setup):
    make_router, make_prompt = REFUSED_DRAFTS[setup]
    model, ids, n = tiny_llama(0), make_prompt(), 40
    ref = reference(model, ids, n)  # before patching: on a patched model, generate() itself routes
    token = ref[0, ids.shape[1] + 25].item()  # a latch on it stops plain decoding there
    expected = reference(model, ids, n, stopping_criteria=StoppingCriteriaList([Latching(token)]))
    assert expected.shape[1] < ref.shape[1]
    router = make_router(model)
    criteria = Latching()
    out = router.generate(ids, max_new_tokens=n, mode="verify", stopping_criteria=StoppingCriteriaList([criteria]))
    assert out.stats.rejected_drafts > 0 and (setup != "n-gram trees" or out.stats.policy_cycles.get("tree", 0) > 0)
    assert torch.equal(out.sequences, ref)
    assert criteria.seen == [tuple(ref[0, : ids.shape[1] + k].tolist()) for k in range(1, n + 1)]
    out = router.generate(ids, max_new_tokens=n, mode="verify", stopping_criteria=[Latching(token)])  # a plain list
    assert torch.equal(out.sequences, expected)
    assert_cache_matches_full_forward(model, out.sequences, out.cache)


@pytest.mark.parametrize("design", ["per_row", "synchronous"])
def test_stopping_criteria_in_a_batch_see_each_rows_final_tokens_once(design):
    model, n = tiny_llama(1), 24
    ids = torch.cat([torch.zeros(1, 4, dtype=torch.long), prompt(1, length=5), prompt(2, length=9)], dim=1)
    ids = ids.reshape(2, 9)  # left-padded rows of 5 and 9 tokens
    mask = (torch.arange(9) >= torch.tensor([[4], [0]])).long()
    ref = reference(model, ids, n, attention_mask=mask, pad_token_id=0)
    router = EarlyExitRouter.from_model(
        model, exit_layers=[1, 3], **{**ALWAYS_EXIT, "ngram_tier": True, "batch_design": design}
    )
    criteria = Latching()
    criteria_list = StoppingCriteriaList([criteria])
    out = router.generate(ids, max_new_tokens=n, mode="verify", attention_mask=mask, stopping_criteria=criteria_list)
    assert torch.equal(out.sequences, ref) and out.stats.rejected_drafts > 0
    expected = [tuple(ref[r, : ids.shape[1] + k].tolist()) for r in range(2) for k in range(1, n + 1)]
    assert sorted(criteria.seen) == sorted(expected)


def test_a_stop_string_longer_than_the_default_tail_still_stops():
    """The decoded tail is long enough for the longest stop string, as HF's StopStringCriteria matches any length."""
    tokenizer = tiny_tokenizer()
    model = tiny_llama(3)
    ids = prompt(2, length=8)
    router = EarlyExitRouter.from_model(model, tokenizer, exit_layers=[1, 3], **NEVER_EXIT)
    new = router.generate(ids, max_new_tokens=60, mode="verify").sequences[0, ids.shape[1] :].tolist()
    stop = tokenizer.decode(new[10:50])  # 40 tokens of text
    context = ids[0].tolist()
    end = next(k for k in range(1, 61) if stop in tokenizer.decode(context + new[:k]))
    assert end > 32
    out = router.generate(ids, max_new_tokens=60, mode="verify", stop_strings=[stop])
    assert out.sequences[0, ids.shape[1] :].tolist() == new[:end]


def test_a_stop_string_split_by_more_skipped_special_tokens_than_the_tail_still_stops():
    """Where stop strings are matched in the text without special tokens (the server's, as its client reads it),
    the decoded tail counts only tokens that add text: a stop split by a long run of special tokens ends generation
    at the token that completes it, and nowhere before."""
    tokenizer = tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["w36"]})
    special = tokenizer.convert_tokens_to_ids("w36")
    prompt_ids = [5, 17, 33]
    tokens = [*prompt_ids, 90, 19, *[special] * (STOP_STRING_TAIL + 8), 42, 24]
    request = DecodeRequest(
        max_new_tokens=100, stop_strings=("w19 w42",), tokenizer=tokenizer, stop_strings_skip_special=True
    )

    def stops(request: DecodeRequest) -> list[int]:
        """The lengths of `tokens` whose newest token ends generation."""
        lengths = range(len(prompt_ids) + 1, len(tokens) + 1)
        return [k for k in lengths if ends_generation(request, tokens[:k], len(prompt_ids), lambda: None)]

    assert stops(request)[0] == len(tokens) - 1  # at the 42, the last token but one
    assert not stops(dataclasses.replace(request, stop_strings_skip_special=False))  # HF's matching: "w36" is text

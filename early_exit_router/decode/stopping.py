"""When a sequence ends, and which of its tokens may be shown: one rule for every decode.

Every token is checked as it is appended, drafts included, as plain decoding checks every token: EOS, a stop string
in the decoded tail, or max_new_tokens. A stop found in a draft is tentative: the row drafts no further, and the stop
holds once the deep pass has verified that draft (a rejected draft takes its stop with it). The caller's stopping
criteria are opaque and may keep state (lm-eval's multi-token EOS criterion latches once it has seen its string), so
they see each token once it is final, in order, and never a draft the deep pass may refuse.
Streamers receive the prompt first, as HF's expect, then only final tokens (the streaming frontier): exit mode's
tokens at once, drafts in a verify cycle once the deep pass has judged them.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from transformers import StoppingCriteriaList

# Tokens (prompt included) decoded to look for a stop string ending in the newest one: at least this many, and
# enough for the longest stop string even where each token adds a single byte of a character (4 bytes at most).
STOP_STRING_TAIL = 32


@dataclass
class DecodeRequest:
    """What one sequence asks for, already validated."""

    max_new_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    stopping_criteria: Any = None  # transformers StoppingCriteriaList, or None
    streamer: Any = None  # transformers BaseStreamer, or None
    tokenizer: Any = None  # needed for stop_strings
    output_logits: bool = False
    # A stop string may begin in the prompt, as in HF's `generate` (None); the server's OpenAI `stop` looks at the
    # completion's text only: the text of the tokens from this index on (the prompt's before it are decoded with
    # them, so the first token's text is as it reads after the prompt).
    stop_strings_from: int | None = None
    # Stop strings are matched in the text with its special tokens, as HF's StopStringCriteria matches; the server
    # matches in the text its client receives, without them (True), as vLLM does.
    stop_strings_skip_special: bool = False

    def after_padding(self, padding: torch.Tensor) -> DecodeRequest:
        """This request for a batch row decoded without its (1, k) left padding: its stopping criteria see the padding
        first, as in HF's padded batch."""
        if self.stopping_criteria is None or not padding.numel():
            return self
        return dataclasses.replace(self, stopping_criteria=AfterPadding(self.stopping_criteria, padding))

    @cached_property
    def stop_string_tail(self) -> int:
        """How many of the newest tokens that add text are decoded to look for a stop string (see STOP_STRING_TAIL)."""
        return max(STOP_STRING_TAIL, 4 * max(map(len, self.stop_strings), default=0) + 1)

    @cached_property
    def textless_ids(self) -> frozenset[int]:
        """The ids that add no text where stop strings are matched: the special tokens, where those are skipped."""
        if not self.stop_strings_skip_special or self.tokenizer is None:
            return frozenset()
        return frozenset(self.tokenizer.all_special_ids)


class AfterPadding:
    """Stopping criteria called with a row's (1, k) left padding before the ids they are given."""

    def __init__(self, criteria: Callable[..., Any], padding: torch.Tensor) -> None:
        self.criteria, self.padding = criteria, padding

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor | None, **kwargs: Any) -> Any:
        return self.criteria(torch.cat([self.padding, input_ids], dim=1), scores, **kwargs)


def as_token_ids(value: int | Iterable[int] | None) -> list[int]:
    """One token id or several (HF's `eos_token_id` and `pad_token_id` take either, as ints, tensors or numpy values;
    None: none) as a list of ints."""
    if value is None:
        return []
    if hasattr(value, "tolist"):  # a tensor or a numpy array or scalar: a 0-d one gives an int
        value = value.tolist()
    return [int(value)] if isinstance(value, int) else [int(e) for e in value]


def eos_ids_for(model: Any, tokenizer: Any, eos_token_id: int | Iterable[int] | None = None) -> list[int]:
    """The EOS ids a call stops at: `eos_token_id`, else `model`'s generation config's, else the tokenizer's."""
    if eos_token_id is None:
        eos_token_id = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        if eos_token_id is None and tokenizer is not None:
            eos_token_id = tokenizer.eos_token_id
    return as_token_ids(eos_token_id)


def pad_id_for(model: Any, tokenizer: Any, eos_ids: Iterable[int] | None = None) -> int:
    """What finished rows of a batch are filled with: the tokenizer's or the model's pad token, else the smallest of
    `eos_ids` (default: `eos_ids_for(model, tokenizer)`), else 0."""
    for candidate in (getattr(tokenizer, "pad_token_id", None), getattr(model.generation_config, "pad_token_id", None)):
        if ids := as_token_ids(candidate):  # an int, or a tensor or numpy value as HF takes it
            return ids[0]
    return min(eos_ids_for(model, tokenizer) if eos_ids is None else eos_ids, default=0)


def as_stop_strings(value: str | Iterable[str] | None) -> tuple[str, ...]:
    """One stop string or several (HF's `stop_strings` takes either) as the tuple a `DecodeRequest` holds."""
    strings = (value,) if isinstance(value, str) else tuple(value or ())
    if not all(isinstance(s, str) and s for s in strings):  # "" is found everywhere: it would end every call at once
        raise ValueError(f"stop_strings must be non-empty strings, got {value!r}: drop the empty ones.")
    return strings


def as_criteria(value: Any) -> Any:
    """The caller's stopping criteria as one callable: a plain list or tuple of criteria (HF's `generate` takes
    either) becomes a `StoppingCriteriaList`; None or an empty one, None."""
    if isinstance(value, (list, tuple)):
        return StoppingCriteriaList(value) if value else None
    return value


def ends_generation(
    request: DecodeRequest,
    tokens: list[int],
    prompt_len: int,
    input_ids: Callable[[], torch.Tensor],
    final: bool = True,
) -> bool:
    """Whether the newest of `tokens` (the prompt's, then the new ones) ends generation. `input_ids` gives the (1, n)
    ids a stopping criterion sees (built only when one is set). The stopping criteria run only on a `final` token
    (see the module docstring)."""
    new = len(tokens) - prompt_len
    ended = new >= request.max_new_tokens or (bool(new) and tokens[-1] in request.eos_token_ids)
    if not ended and request.stop_strings and new:
        ended = _stop_string_ends_here(request, tokens)
    # The criteria see every final token, the one another rule stops at too, as HF's StoppingCriteriaList calls
    # each of its criteria at every step.
    return (final and criteria_stop(request, input_ids)) or ended


def criteria_stop(request: DecodeRequest, input_ids: Callable[[], torch.Tensor]) -> bool:
    """Whether the caller's stopping criteria end generation at the newest of the (1, n) `input_ids()`. Their
    `scores` are None, as HF's generate hands them unless asked for per-step scores (`model.generate` then runs
    a caller's own criteria in plain HF)."""
    if request.stopping_criteria is None:
        return False
    return bool(torch.as_tensor(request.stopping_criteria(input_ids(), None)).any())


def _stop_string_ends_here(request: DecodeRequest, tokens: list[int]) -> bool:
    """Whether a stop string ends in the text of the last of `tokens`, as HF's `StopStringCriteria` matches: it may
    begin in earlier tokens, the prompt's too (from `stop_strings_from` on, where set), but one found wholly before
    the last token does not count (a stop string in the prompt ends nothing; its next occurrence does)."""

    def decode(ids: list[int]) -> str:
        return request.tokenizer.decode(ids, skip_special_tokens=request.stop_strings_skip_special)

    low = _tail_start(tokens, request.stop_string_tail, request.textless_ids)
    text, before = decode(tokens[low:]), decode(tokens[low:-1])
    shared = len(os.path.commonprefix([before, text]))  # text[shared:] is what the last token added
    first = request.stop_strings_from
    floor = len(decode(tokens[low:first])) if first is not None and first > low else 0  # where a stop may begin
    return any(text.find(s, max(floor, shared - len(s) + 1)) >= 0 for s in request.stop_strings)


def _tail_start(tokens: list[int], tail: int, textless: frozenset[int]) -> int:
    """Where the newest `tail` tokens of `tokens` that add text begin: tokens in `textless` (skipped special tokens)
    are passed over uncounted, so a stop string split by any number of them is still found whole."""
    if not textless:
        return max(len(tokens) - tail, 0)
    low, counted = len(tokens), 0
    while low > 0 and counted < tail:
        low -= 1
        counted += tokens[low] not in textless
    return low


class StreamFrontier:
    """What one sequence's streamer has been given: the prompt, then final tokens in order, each once."""

    def __init__(self, request: DecodeRequest, prompt: list[int]) -> None:
        self.streamer = request.streamer
        self.prompt_len = len(prompt)
        self.streamed = self.prompt_len
        if self.streamer is not None:
            self.streamer.put(torch.tensor(prompt))

    def advance(self, tokens: list[int], upto: int) -> None:
        """Hand the streamer the tokens before index `upto` of `tokens` (prompt included) it has not had."""
        if self.streamer is not None and upto > self.streamed:
            self.streamer.put(torch.tensor(tokens[self.streamed : upto]))
        self.streamed = max(self.streamed, upto)

    def end(self) -> None:
        if self.streamer is not None:
            self.streamer.end()

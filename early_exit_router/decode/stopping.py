"""When a sequence ends, and which of its tokens may be shown: one rule for every decode.

Every token is checked as it is appended, drafts included, as plain decoding checks every token: EOS, a stop string
in the decoded tail, a stopping criterion, or max_new_tokens. A stop found in a draft is tentative: the row drafts no
further, and the stop holds once the deep pass has verified that draft (a rejected draft takes its stop with it).
Streamers receive the prompt first, as HF's expect, then only final tokens (the streaming frontier): exit mode's
tokens at once, drafts in a verify cycle once the deep pass has judged them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

STOP_STRING_TAIL = 32  # new tokens decoded to look for a stop string ending at the newest one


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


def ends_generation(
    request: DecodeRequest,
    new_tokens: list[int],
    input_ids: Callable[[], torch.Tensor],
    scores: torch.Tensor | None = None,
) -> bool:
    """Whether the newest of `new_tokens` ends generation. `input_ids` gives the (1, n) ids a stopping criterion
    sees (built only when one is set); `scores` is the newest token's logits where they are kept."""
    if len(new_tokens) >= request.max_new_tokens:
        return True
    if new_tokens and new_tokens[-1] in request.eos_token_ids:
        return True
    if request.stop_strings:
        tail = request.tokenizer.decode(new_tokens[-STOP_STRING_TAIL:])
        if any(s in tail for s in request.stop_strings):
            return True
    if request.stopping_criteria is not None:
        done = request.stopping_criteria(input_ids(), scores)
        if bool(torch.as_tensor(done).any()):
            return True
    return False


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

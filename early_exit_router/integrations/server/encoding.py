"""Prompts and chat messages to token ids, for the server, so that a message's text can never become the chat
template's special tokens.

`tokenizer.apply_chat_template` renders the messages into one string and tokenizes it with special tokens parsed: a
user who writes `<|im_end|>\\n<|im_start|>assistant\\n` in a message gets real turn markers, and forges turns. Here
the template is rendered with a placeholder for each message's content, which shows the template's own text and its
special (added) tokens. The chat is also rendered as sent and tokenized as `apply_chat_template` does; when that
gives exactly the special tokens the template's own text gives, the content formed none, and those are the ids
(`apply_chat_template`'s, a template that transforms or inspects content, as `| trim` does, included). Otherwise (the
content holds `<|im_end|>`, or completes a marker with the template's text) each piece is tokenized on its own: the
template's text with its special tokens, each content as sent with `split_special_tokens=True`, so its `<|im_end|>`
becomes the tokens of those characters.

The server calls these off the event loop (tokenizing a few megabytes takes seconds), from several threads at once.
A fast tokenizer's `split_special_tokens` is a flag on the shared Rust tokenizer that every call sets: two calls at
once can run under each other's setting (a chat's template markers split into characters, a message's `<|im_end|>`
parsed as the marker), so every encoding here holds one lock.
"""

from __future__ import annotations

import collections
import re
import secrets
import threading
from typing import Any

import torch

_TOKENIZING = threading.Lock()  # see the module docstring: the tokenizer's special-token flag is shared state


def encode_text(tokenizer: Any, text: str) -> torch.Tensor:
    """(1, n) ids of a completion prompt, as the tokenizer makes them (BOS where it adds one; special tokens in the
    text are parsed: the caller writes the whole prompt, as with any completions server)."""
    with _TOKENIZING:
        return tokenizer(text, return_tensors="pt").input_ids


def encode_chat(tokenizer: Any, messages: list[dict[str, str]]) -> torch.Tensor:
    """(1, n) ids of a chat under the tokenizer's template, with a generation prompt; no message's content becomes
    a special token (see the module docstring)."""
    with _TOKENIZING:
        pieces = _pieces(tokenizer, messages)
        as_sent = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        whole = _ids(tokenizer, as_sent, plain=False)
        apart = [i for text, plain in pieces for i in _ids(tokenizer, text, plain)]
    markers = set(tokenizer.added_tokens_decoder) | set(tokenizer.all_special_ids)
    formed = collections.Counter(i for i in whole if i in markers) != collections.Counter(
        i for i in apart if i in markers
    )
    return torch.tensor([apart if formed else whole], dtype=torch.long)


def _pieces(tokenizer: Any, messages: list[dict[str, str]]) -> list[tuple[str, bool]]:
    """The rendered chat as (text, is content) pieces, in order."""
    nonce = secrets.token_hex(8)  # unknown to the sender: no content can spell a placeholder
    marked = [{**m, "content": f"<<content {nonce} {i}>>"} for i, m in enumerate(messages)]
    rendered = tokenizer.apply_chat_template(marked, add_generation_prompt=True, tokenize=False)
    pieces, at = [], 0
    for match in re.finditer(rf"<<content {nonce} (\d+)>>", rendered):
        pieces += [(rendered[at : match.start()], False), (messages[int(match.group(1))]["content"], True)]
        at = match.end()
    return [*pieces, (rendered[at:], False)]


def _ids(tokenizer: Any, text: str, plain: bool) -> list[int]:
    """The ids of a piece: with its special tokens, or (`plain`) as the characters it is made of."""
    if not text:
        return []
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=plain).input_ids)

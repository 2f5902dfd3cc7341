"""The text of one request as it streams: verified token ids in, pieces that are safe to send out."""

from __future__ import annotations

from typing import Any

# Prompt tokens decoded before the completion's: a tokenizer whose decoder strips a text's leading space
# (SentencePiece's, as Llama-2's and Mistral's) keeps the first token's, as the prompt's text continues into it.
CONTEXT_TOKENS = 5


class TextTracker:
    """Turns the verified token ids of one request into text pieces that are safe to send.

    Detokenises incrementally, as vLLM does: each new stretch of tokens is decoded together with the stretch before
    it (at first, the prompt's last tokens), and only the text it adds is kept, once it ends in a complete
    character (a token may hold part of a multi-byte character, which its next tokens complete). So a step costs the
    same at any length of the completion. Stop strings are looked for in the text the new tokens add and the tail
    before it, and any tail that could still become a stop string is held back, so a stop string never reaches the
    client, not even in part. The text skips special tokens, as the client receives it."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...], context: list[int] | tuple[int, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self._longest = max(map(len, stop), default=0)
        self._context = len(context[-CONTEXT_TOKENS:])
        self._tokens = list(context[-CONTEXT_TOKENS:])  # the context, then the completion's ids
        self._prefix = 0  # self._tokens[_prefix:_read] were decoded last, before the text not yet kept
        self._read = self._context
        self.kept = ""  # the completion's text up to its last complete character
        self.sent = 0  # characters already handed out
        self.stopped_at: int | None = None  # character index of the first stop string, once seen

    @property
    def ids(self) -> list[int]:
        """The completion's token ids so far."""
        return self._tokens[self._context :]

    def add(self, token_ids: list[int]) -> str:
        """Record newly verified tokens; return the text that may be sent now."""
        self._tokens.extend(token_ids)
        return self._release(final=False)

    def finish(self) -> str:
        """The rest of the text, at the end of the request."""
        return self._release(final=True)

    @property
    def text(self) -> str:
        return self.kept if self.stopped_at is None else self.kept[: self.stopped_at]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _keep_new_text(self, final: bool) -> None:
        """Add the text of the tokens not yet decoded to `kept`, unless it ends inside a character (until `final`)."""
        if self._read >= len(self._tokens):
            return
        before = self._decode(self._tokens[self._prefix : self._read])
        text = self._decode(self._tokens[self._prefix :])
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for its other bytes ...
            if not final:
                return
            text = text.rstrip("\ufffd")  # ... which max_tokens cut off: never send half a character (as vLLM)
        new = text[len(before) :]
        self.kept += new
        if new:  # tokens that add no text (special ones) stay in the next stretch's context, which decides spacing
            self._prefix = self._read
        self._read = len(self._tokens)
        if self.stopped_at is None and self.stop and new:
            start = max(0, len(self.kept) - len(new) - self._longest + 1)  # a stop found before was found then
            hits = [i for i in (self.kept.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.stopped_at = min(hits)

    def _release(self, final: bool) -> str:
        self._keep_new_text(final)
        end = len(self.kept) if self.stopped_at is None else self.stopped_at
        if not final and self.stopped_at is None:
            end -= _stop_prefix_overlap(self.kept[:end], self.stop)
        if end <= self.sent:
            return ""
        piece = self.kept[self.sent : end]
        self.sent = end
        return piece


def _stop_prefix_overlap(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best

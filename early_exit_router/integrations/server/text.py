"""The text of one request as it streams: verified token ids in, pieces that are safe to send out."""

from __future__ import annotations

from typing import Any


class TextTracker:
    """Turns the verified token ids of one request into text pieces that are safe to send.

    Detokenises the whole continuation each time (a token may complete a multi-byte character or change how the
    previous one decodes), holds back a trailing replacement character, and holds back any tail that could still
    become a stop string, so a stop string never reaches the client, not even in part."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.sent = 0  # characters already handed out
        self.stopped_at: int | None = None  # character index of the first stop string, once seen

    def add(self, token_ids: list[int]) -> str:
        """Record newly verified tokens; return the text that may be sent now."""
        self.ids.extend(token_ids)
        return self._release(final=False)

    def finish(self) -> str:
        """The rest of the text, at the end of the request."""
        return self._release(final=True)

    @property
    def text(self) -> str:
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        return full if self.stopped_at is None else full[: self.stopped_at]

    def _release(self, final: bool) -> str:
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if self.stopped_at is None:
            hits = [i for i in (full.find(s) for s in self.stop) if i >= 0]
            if hits:
                self.stopped_at = min(hits)
        end = len(full) if self.stopped_at is None else self.stopped_at
        if not final and self.stopped_at is None:
            if full.endswith("\ufffd"):  # an incomplete multi-byte character: wait for its other bytes
                end = len(full) - 1
            end -= _stop_prefix_overlap(full[:end], self.stop)
        if end <= self.sent:
            return ""
        piece = full[self.sent : end]
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

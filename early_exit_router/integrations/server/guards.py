"""What a request must pass before the app parses it: the API key, then the body's size. Both are plain ASGI
middleware, so an unauthenticated caller gets 401 before its body is read or validated (bad JSON included), and an
oversized body gets 413 as soon as its declared length, or the bytes read so far, pass the limit: a huge prompt is
never kept, parsed or tokenized. Its bytes are read on and dropped as they arrive, up to `drain_limit` (4x the limit,
at least 16 MiB) in all, so that a client sending the body whole reads the 413 rather than a reset connection; a body
declared longer than that, or one still coming past it, is answered at once and the connection closed unread (its
sender may see a reset), as is one whose client waits for `100 Continue` before sending it."""

from __future__ import annotations

import hmac
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from early_exit_router.integrations.server.protocol import error_body

DRAIN_BYTES = 16 << 20  # the least of an oversized body read on (and dropped) whatever the limit: see drain_limit


def drain_limit(max_bytes: int) -> int:
    """How many bytes of an oversized body are read in all (and dropped) before the 413, so that its sender reads it.

    A client that sends its whole body before it reads the answer (the `openai` client, requests, curl) gets a reset
    connection instead of the 413 when the server closes with bytes of the body still coming: the kernel answers
    unread data with RST, and the RST can destroy the 413 before the client reads it. Reading the body to its end
    avoids that. The bound: a body a few times the limit is the usual mistake (a long document pasted into a prompt)
    and 4x the limit covers it; the 16 MiB floor keeps a small `--max-request-bytes` from turning modest overshoots
    back into resets. The bytes are dropped as they arrive, so the drain costs transfer time, never memory; a sender
    past the bound is more likely broken or hostile than mistaken and is not read further."""
    return max(4 * max_bytes, DRAIN_BYTES)


class ApiKeyGuard:
    """Require `Authorization: Bearer <key>` (the scheme in any case) on every path but the open ones."""

    def __init__(self, app: ASGIApp, key: str, open_paths: frozenset[str]) -> None:
        self.app, self.key, self.open_paths = app, key.encode(), open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        message = "Missing or wrong API key: send the header 'Authorization: Bearer <key>'."
        response = JSONResponse(
            error_body(message, "authentication_error", code="invalid_api_key"),
            status_code=401,
            headers={"WWW-Authenticate": "Bearer"},
        )
        await response(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        scheme, _, token = Headers(scope=scope).get("authorization", "").strip().partition(" ")
        # RFC 9110: the scheme is case-insensitive ("bearer" is as good as "Bearer"); compare the key in constant time
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.key)


class BodyLimit:
    """Refuse request bodies over `max_bytes` with 413 (read on and dropped up to `drain_limit`, then answered); read
    the rest whole before the app sees them."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes, self.drain_bytes = app, max_bytes, drain_limit(max_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            # Read to its end and dropped when it fits the drain bound, so that its sender reads the 413. Answered
            # before a byte of it is read when it is longer, or when its sender waits for `100 Continue` (the first
            # read would send that and ask for the body).
            waits = "100-continue" in headers.get("expect", "").lower()
            if int(declared) <= self.drain_bytes and not waits and not await _discard(receive, self.drain_bytes):
                return  # the client went away: nobody to answer
            await self._too_large(scope, receive, send)
            return
        chunks, size = [], 0
        while True:  # chunked bodies declare no length: count what arrives
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client went away: nobody to answer
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                if message.get("more_body", False) and not await _discard(receive, self.drain_bytes, size):
                    return  # the client went away while the rest was dropped
                await self._too_large(scope, receive, send)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = (
            f"The request body is larger than this server accepts ({self.max_bytes} bytes; serve "
            "--max-request-bytes sets it): send a shorter prompt or fewer messages."
        )
        # Close the connection: past the drain bound the rest of the body stays unread, and reading on to find the
        # next request is what the bound refuses (a body read to its end closes it too: one rule for every 413).
        response = JSONResponse(
            error_body(message, code="request_too_large"), status_code=413, headers={"Connection": "close"}
        )
        await response(scope, receive, send)


async def _discard(receive: Receive, limit: int, read: int = 0) -> bool:
    """Read and drop the rest of a body while the bytes read in all (`read` so far) stay within `limit`: a client
    still sending when the connection closes gets a reset instead of the 413 it is owed. False if the client went
    away (nobody to answer); True once the body ended or passed `limit`."""
    while read <= limit:
        message = await receive()
        if message["type"] == "http.disconnect":
            return False
        read += len(message.get("body", b""))
        if not message.get("more_body", False):
            return True
    return True


def _replay(body: bytes, receive: Receive) -> Any:
    """A `receive` that hands the app the body already read, then the connection's own messages (a disconnect)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed

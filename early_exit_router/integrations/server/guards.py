"""What a request must pass before the app parses it: the API key, then the body's size. Both are plain ASGI
middleware, so an unauthenticated caller gets 401 before its body is read or validated (bad JSON included), and an
oversized body gets 413 as soon as its declared length, or the bytes read so far, pass the limit: a huge prompt is
never read whole, parsed or tokenized (a chunked one is read on, and dropped, for at most 1 MiB past the limit, so
that a client sending it whole gets the answer rather than a reset connection)."""

from __future__ import annotations

import hmac
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from early_exit_router.integrations.server.protocol import error_body

DRAIN_BYTES = 1 << 20  # an oversized chunked body is read on (and dropped) this far, so its sender reads the 413


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
    """Refuse request bodies over `max_bytes` with 413; read the rest whole before the app sees them."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(scope, receive, send)  # before a byte of it is read
            return
        chunks, size = [], 0
        while True:  # chunked bodies declare no length: count what arrives
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client went away: nobody to answer
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                if message.get("more_body", False):
                    await _discard(receive, DRAIN_BYTES)
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
        # The rest of the body stays unread: close the connection rather than read it to find the next request.
        response = JSONResponse(
            error_body(message, code="request_too_large"), status_code=413, headers={"Connection": "close"}
        )
        await response(scope, receive, send)


async def _discard(receive: Receive, limit: int) -> None:
    """Read and drop the rest of a body, up to `limit` bytes: a client still sending when the connection closes
    gets a reset instead of the 413 it is owed."""
    dropped = 0
    while dropped <= limit:
        message = await receive()
        dropped += len(message.get("body", b""))
        if message["type"] == "http.disconnect" or not message.get("more_body", False):
            return


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

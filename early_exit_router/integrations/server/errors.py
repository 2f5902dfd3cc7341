"""The server's errors, every one in OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`) with a 4xx or
5xx status, whatever refused the request: a handler (`ApiError`), request validation, routing (an unknown path, a
method a path does not take, a body that cannot be read) or an unexpected exception."""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from early_exit_router.integrations.server.protocol import SHAPES, error_body

ENDPOINTS = "/v1/completions, /v1/chat/completions, /v1/models, /health and /metrics"
KINDS = {401: "authentication_error", 403: "permission_error", 413: "invalid_request_error"}

# Clearer words than pydantic's for the errors strict types and finite floats give, by error type.
MESSAGES = {
    "finite_number": "{where} must be a finite number (NaN and Infinity are not accepted)",
    "int_type": "{where} must be a JSON integer, not {got}",
    "float_type": "{where} must be a JSON number, not {got}",
    "bool_type": "{where} must be true or false, not {got}",
    "string_type": "{where} must be a string, not {got}",
    "missing": "{where} is required",
    "extra_forbidden": "{where} is not a field this server knows",
}


class ApiError(Exception):
    """A request the server refuses: becomes an OpenAI-style error body."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = headers


def install_error_handlers(app: FastAPI, retry_after_s: int) -> None:
    """Answer every error `app` raises in OpenAI's shape (FastAPI's own are `{"detail": ...}`)."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, error: ApiError) -> JSONResponse:
        headers = dict(error.headers or {})
        if error.status in (429, 503):
            headers["Retry-After"] = str(retry_after_s)
        body = error_body(error.message, error.kind, error.param, error.code)
        return JSONResponse(body, status_code=error.status, headers=headers or None)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(error.errors()))
        if "json" not in (kind := request.headers.get("content-type", "")):  # the body was never read as JSON
            message = f"Send the body as JSON with the header Content-Type: application/json (got {kind or 'none'})."
        return JSONResponse(error_body(message, param=param), status_code=400)

    @app.exception_handler(HTTPException)  # Starlette's: unknown paths, wrong methods, unreadable bodies
    async def _http_error(request: Request, error: HTTPException) -> JSONResponse:
        status, method, path = error.status_code, request.method, request.url.path
        if status == 404:
            message = f"Invalid URL ({method} {path}): this server serves {ENDPOINTS}."
        elif status == 405:
            allowed = (error.headers or {}).get("Allow", "another method")
            message = f"{path} does not take {method}: use {allowed}."
        elif status == 400:  # FastAPI's "There was an error parsing the body": not UTF-8, say
            message = "The request body could not be read: send a UTF-8 encoded JSON object."
        else:
            message = str(error.detail)
        kind = KINDS.get(status, "server_error" if status >= 500 else "invalid_request_error")
        return JSONResponse(error_body(message, kind), status_code=status, headers=error.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        # A bug, not the request's fault; Starlette logs the traceback after this answer.
        message = f"Internal server error ({type(error).__name__}: {error}); the server keeps serving."
        return JSONResponse(error_body(message, "server_error"), status_code=500)


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """One message and the `param` it is about, from pydantic's errors for a request body.

    A field that takes several shapes (`prompt`: a string or a list) reports one error per shape; a value error of
    ours (a lone surrogate, a seed out of range) is the one to show, else the field's shapes are named."""
    if not errors:
        return "Invalid request.", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error")
        return f"The request body is not valid JSON{f' ({detail})' if detail else ''}.", None
    chosen = next((e for e in errors if e.get("type") == "value_error"), first)
    kind = chosen.get("type", "")
    loc = [p for p in chosen.get("loc", ()) if p != "body"]
    tag = next((i for i, p in enumerate(loc) if _is_shape_tag(p)), None)
    where = ".".join(str(p) for p in loc if not _is_shape_tag(p)) or None
    if kind == "value_error":
        text = str(chosen.get("msg", "invalid value")).removeprefix("Value error, ")
        message = f"{where}: {text}" if where else text
    elif tag and str(loc[tag - 1]) in SHAPES:  # a value of none of the field's shapes: name them
        where = ".".join(str(p) for p in loc[:tag])
        message = f"{where} must be {SHAPES[str(loc[tag - 1])]}."
    elif kind in MESSAGES:
        message = MESSAGES[kind].format(where=where or "the body", got=_shown(chosen.get("input"))) + "."
    else:
        text = str(chosen.get("msg", "invalid value"))
        message = f"{where}: {text}" if where else text
    return message, where


def _is_shape_tag(part: Any) -> bool:
    """Whether a location part names one shape of a union (`str`, `list[int]`, `function-after[...]`), not a field."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part)


def _shown(value: Any) -> str:
    """A value pydantic was given, as JSON and cut short, for messages (`"8"`, `8.0`, `null`, an array)."""
    if isinstance(value, (list, dict)):
        return "an array" if isinstance(value, list) else "an object"
    try:
        text = json.dumps(value)  # ASCII: a lone surrogate shows as its escape
    except (TypeError, ValueError):
        text = type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."

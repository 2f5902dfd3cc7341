"""`early-exit-router serve`: an OpenAI-compatible HTTP server over one router (FastAPI + uvicorn).

Endpoints: `/v1/completions` and `/v1/chat/completions` (with SSE streaming), `/v1/models` and `/v1/models/{id}`,
`/health`, and `/metrics` in the Prometheus text format. Requests go through `Scheduler` (a bounded queue and one
worker thread); a full queue answers 503 with `Retry-After`. A client that disconnects cancels its request. Every
error is an OpenAI-style body with a 4xx or 5xx status (`errors.py`), and the server keeps serving the others.

Before a request is parsed, `guards.py` checks its API key (401) and bounds its body (413). Prompts are tokenized
off the event loop (`encoding.py`: chat messages cannot forge the template's turn markers). The cost table the
policy decides from is measured (or loaded) at start-up, before the first request is accepted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.sse import EventSourceResponse, format_sse_event
from jinja2 import TemplateError
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from early_exit_router.decode.sampling import SamplingParams
from early_exit_router.integrations.server import encoding
from early_exit_router.integrations.server.errors import ApiError, install_error_handlers
from early_exit_router.integrations.server.guards import ApiKeyGuard, BodyLimit
from early_exit_router.integrations.server.protocol import (
    GREEDY_TEMPERATURE,
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
)
from early_exit_router.integrations.server.scheduler import Job, JobResult, QueueFull, Scheduler

__all__ = ["ApiError", "ServerSettings", "create_app"]

MAX_REQUEST_BYTES = 4 * 1024 * 1024  # far above any prompt a model's context holds, far below what stalls the server
DISCONNECT_CHECK_S = 0.25  # how often a non-streamed request looks for its client having gone


@dataclass
class ServerSettings:
    """What `serve` is started with."""

    model_name: str
    api_key: str | None = None  # when set, every path but /health needs `Authorization: Bearer <key>`
    metrics_require_key: bool = True  # /metrics needs the key too (when one is set); False leaves it open
    max_queue: int = 64
    max_running: int = 8
    default_max_tokens: int = 256  # chat requests without max_tokens
    max_request_bytes: int = MAX_REQUEST_BYTES  # larger bodies get 413, never kept or parsed (guards.BodyLimit)
    retry_after_s: int = 1
    routing_overrides: dict[str, Any] = field(default_factory=dict)  # RouterConfig fields for every request
    batching: bool = True  # share one batch per mode among requests that can (see scheduler.py)


def create_app(router: Any, settings: ServerSettings) -> FastAPI:
    """The FastAPI app serving `router`. Its scheduler starts with the app and stops with it."""
    if router.tokenizer is None:
        raise ValueError("The server needs a tokenizer: build the router with one.")
    if settings.max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be >= 1, got {settings.max_request_bytes}.")
    base = router.call_config(settings.routing_overrides or None)
    scheduler = Scheduler(router, settings.max_queue, settings.max_running, settings.batching, base)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # uvicorn accepts connections only after this: the cost table (measured once per model and machine, then
        # cached on disk) is ready before any request. It covers every chunk length whatever a request's
        # max_pending, and no request may change the draft vocabulary it is keyed by, so no request measures.
        try:
            with router.lock:
                router.costs(config=base)
            yield
        finally:
            scheduler.shutdown()

    app = FastAPI(title="early-exit-router", version=_version(), lifespan=lifespan)
    app.state.scheduler = scheduler
    install_error_handlers(app, settings.retry_after_s)
    # The last added runs first: the key is checked before a byte of the body is read.
    app.add_middleware(BodyLimit, max_bytes=settings.max_request_bytes)
    if settings.api_key:
        open_paths = {"/health"} | (set() if settings.metrics_require_key else {"/metrics"})
        app.add_middleware(ApiKeyGuard, key=settings.api_key, open_paths=frozenset(open_paths))
    registry = _registry(scheduler)
    started = time.time()
    card = {"id": settings.model_name, "object": "model", "created": int(started), "owned_by": "early-exit-router"}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": settings.model_name, "queue_depth": scheduler.queue_depth}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(registry).decode(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")  # ids may hold slashes (a served HF name)
    async def model(model_id: str) -> dict[str, Any]:
        _check_model(settings, model_id, param=None)
        return card

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        _check_model(settings, body.model)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
            vocab = router.stack.vocab_size
            if not all(0 <= p < vocab for p in prompt):  # before a tensor: an int beyond int64 would not fit one
                raise ApiError(400, f"Token ids must lie in [0, {vocab}).", param="prompt")
            ids = torch.tensor([prompt], dtype=torch.long)
        elif isinstance(prompt, list):
            if len(prompt) != 1:
                raise ApiError(
                    400, "Send one prompt per request (batches of prompts are not supported).", param="prompt"
                )
            ids = await asyncio.to_thread(encoding.encode_text, router.tokenizer, prompt[0])
        else:
            ids = await asyncio.to_thread(encoding.encode_text, router.tokenizer, prompt)
        job = _job(router, settings, body, ids, body.max_tokens)
        return await _respond(request, scheduler, settings, job, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        _check_model(settings, body.model)
        if not getattr(router.tokenizer, "chat_template", None):
            raise ApiError(400, "This model's tokenizer has no chat template: use /v1/completions.")
        messages = [{"role": m.role if m.role != "developer" else "system", "content": m.text()} for m in body.messages]
        try:
            ids = await asyncio.to_thread(encoding.encode_chat, router.tokenizer, messages)
        except TemplateError as error:  # the template's raise_exception: roles out of order, a system turn it lacks
            message = f"The model's chat template refuses these messages: {error}"
            raise ApiError(400, message, param="messages") from None
        max_tokens = body.max_completion_tokens or body.max_tokens
        job = _job(router, settings, body, ids, max_tokens)
        return await _respond(request, scheduler, settings, job, body, chat=True)

    return app


def _check_model(settings: ServerSettings, name: str, param: str | None = "model") -> None:
    """404 for a model this server does not serve (checked before any tokenizing)."""
    if name != settings.model_name:
        raise ApiError(
            404,
            f"The model {name!r} does not exist: this server serves {settings.model_name!r}.",
            param=param,
            code="model_not_found",
        )


def _job(router: Any, settings: ServerSettings, body: Any, ids: torch.Tensor, max_tokens: int | None) -> Job:
    """Validate a request against the model and build its job."""
    unsupported = body.unsupported()
    if unsupported:
        raise ApiError(400, f"Not supported by this server: {', '.join(unsupported)}.", param=unsupported[0])
    if ids.numel() == 0:
        raise ApiError(400, "The prompt is empty.", param="prompt")
    if int(ids.max()) >= router.stack.vocab_size or int(ids.min()) < 0:
        raise ApiError(400, f"Token ids must lie in [0, {router.stack.vocab_size}).", param="prompt")
    context = router.context_length
    if max_tokens is None:
        max_tokens = settings.default_max_tokens
        if context:
            max_tokens = min(max_tokens, context - ids.shape[1])
    if context and (ids.shape[1] + max_tokens > context or max_tokens < 1):
        raise ApiError(
            400,
            f"This model's context is {context} tokens; the prompt has {ids.shape[1]} and max_tokens asks for "
            f"{max_tokens}: shorten the prompt or lower max_tokens.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    options = body.early_exit
    try:
        config = router.call_config({**settings.routing_overrides, **(options.overrides() if options else {})})
    except (ValueError, TypeError) as error:
        raise ApiError(400, str(error), param="early_exit") from None
    mode = (options.mode if options else None) or config.mode
    greedy = body.temperature < GREEDY_TEMPERATURE
    params = SamplingParams(
        do_sample=not greedy,
        temperature=1.0 if greedy else body.temperature,
        top_p=None if body.top_p >= 1.0 else body.top_p,
        seed=body.seed,
    )
    ids = ids.to(router.stack.device)
    return Job(ids, max_tokens, mode, config, params, body.stop_strings())


async def _respond(
    request: Request, scheduler: Scheduler, settings: ServerSettings, job: Job, body: Any, chat: bool
) -> Any:
    job.loop = asyncio.get_running_loop()
    job.events = asyncio.Queue()
    try:
        scheduler.submit(job)
    except QueueFull as full:
        raise ApiError(503, f"The server is busy ({full}); retry shortly.", "server_error", code="overloaded") from None
    except RuntimeError as stopped:  # shutting down
        raise ApiError(503, f"{stopped} Retry shortly.", "server_error", code="unavailable") from None
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return EventSourceResponse(_stream(request, job, settings, chat, include_usage))
    result = await _wait(request, job)
    if result is None:  # the client went away; nobody reads this
        return JSONResponse(error_body("cancelled"), status_code=499)
    return _final_body(job, settings, result, chat)


async def _wait(request: Request, job: Job) -> JobResult | None:
    """Wait for the job's result; cancel it when the client disconnects meanwhile (looked for every
    DISCONNECT_CHECK_S, however often the job's events arrive: a decode sends one at nearly every step)."""
    assert job.events is not None
    loop = asyncio.get_running_loop()
    check_at = loop.time() + DISCONNECT_CHECK_S
    while True:
        try:
            kind, value = await asyncio.wait_for(job.events.get(), timeout=max(check_at - loop.time(), 0.0))
        except asyncio.TimeoutError:
            kind, value = None, None
        if kind == "done":
            return value
        if kind == "error":
            raise ApiError(500, f"Generation failed: {value}", "server_error")
        if loop.time() >= check_at:
            if await request.is_disconnected():
                job.cancel()
                return None
            check_at = loop.time() + DISCONNECT_CHECK_S


async def _stream(
    request: Request, job: Job, settings: ServerSettings, chat: bool, include_usage: bool
) -> AsyncIterator[bytes]:
    """The SSE events of one streamed request; closing the stream early (a disconnect) cancels the job."""
    assert job.events is not None
    kind_name = "chat.completion.chunk" if chat else "text_completion"
    head = {"id": _response_id(job, chat), "object": kind_name, "created": int(job.created)}
    head["model"] = settings.model_name
    if include_usage:  # every chunk carries the field, null until the last one, as OpenAI sends it
        head["usage"] = None
    try:
        if chat:
            yield _event({**head, "choices": [_chat_delta({"role": "assistant", "content": ""}, None)]})
        while True:
            kind, value = await job.events.get()
            if kind == "text":
                choice = _chat_delta({"content": value}, None) if chat else _text_choice(value, None)
                yield _event({**head, "choices": [choice]})
            elif kind == "error":
                yield _event(error_body(f"Generation failed: {value}", "server_error"))
                break
            else:
                result: JobResult = value
                choice = _chat_delta({}, result.finish_reason) if chat else _text_choice("", result.finish_reason)
                yield _event({**head, "choices": [choice], "early_exit": _routing(result)})
                if include_usage:
                    yield _event({**head, "choices": [], "usage": _usage(result)})  # replaces the null
                break
        yield format_sse_event(data_str="[DONE]")
    finally:
        job.cancel()  # no-op once finished; stops the decode when the client went away mid-stream


def _event(data: dict[str, Any]) -> bytes:
    """One SSE `data:` event carrying JSON (encoded by FastAPI's SSE formatter)."""
    return format_sse_event(data_str=json.dumps(data))


def _final_body(job: Job, settings: ServerSettings, result: JobResult, chat: bool) -> dict[str, Any]:
    if chat:
        message = {"role": "assistant", "content": result.text}
        choice = {"index": 0, "message": message, "finish_reason": result.finish_reason, "logprobs": None}
    else:
        choice = _text_choice(result.text, result.finish_reason)
    return {
        "id": _response_id(job, chat),
        "object": "chat.completion" if chat else "text_completion",
        "created": int(job.created),
        "model": settings.model_name,
        "choices": [choice],
        "usage": _usage(result),
        "early_exit": _routing(result),
    }


def _response_id(job: Job, chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{job.id}"


def _text_choice(text: str, finish_reason: str | None) -> dict[str, Any]:
    return {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}


def _chat_delta(delta: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
    return {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}


def _usage(result: JobResult) -> dict[str, int]:
    completion = len(result.token_ids)
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": result.prompt_tokens + completion,
    }


def _routing(result: JobResult) -> dict[str, Any]:
    """The extension block every response carries: how the request was routed."""
    s = result.stats
    return {
        "mode": s.mode,
        "hit_rate": round(s.hit_rate, 4),
        "exit_agreement": None if s.exit_agreement is None else round(s.exit_agreement, 4),
        "exit_checked": s.exit_checked,
        "repaired_tokens": s.repaired_tokens,  # exit mode: wrong exited tokens replaced before they were sent
        "released_unchecked": s.released_unchecked,
        "first_divergence": s.first_divergence,  # exit mode: the new token where the output left the full model's
        "repeat_refusals": s.repeat_refusals,  # exit mode: tokens the repeat guard sent deeper (the batch's)
        "draft_acceptance": None if s.draft_acceptance is None else round(s.draft_acceptance, 4),
        "drafts_judged": s.drafts_judged,
        "exits_suspended": s.exits_suspended,
        "plain_share": round(s.plain_share, 4),
        "exit_histogram": {str(k): v for k, v in s.exit_histogram.items()},
        "tokens_per_s": round(s.tokens_per_s, 2),
    }


def _registry(scheduler: Scheduler) -> CollectorRegistry:
    """A Prometheus registry of this app's own (never the process-global one: tests start several apps)."""
    registry = CollectorRegistry()
    Gauge("eer_queue_depth", "Requests waiting for the worker", registry=registry).set_function(
        lambda: scheduler.queue_depth
    )
    Gauge("eer_running_requests", "Requests being decoded", registry=registry).set_function(lambda: scheduler.running)
    Gauge("eer_running_batched_requests", "Running requests that share a batch", registry=registry).set_function(
        lambda: scheduler.batched
    )
    registry.register(_StatsCollector(scheduler))
    return registry


class _StatsCollector:
    """Exposes the scheduler's counters at scrape time."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def collect(self):
        s = self.scheduler.stats
        requests = CounterMetricFamily("eer_requests", "Requests by outcome", labels=["outcome"])
        for outcome, value in (
            ("finished", s.requests_finished),
            ("cancelled", s.requests_cancelled),
            ("failed", s.requests_failed),
            ("rejected", s.requests_rejected),
        ):
            requests.add_metric([outcome], value)
        yield requests
        yield CounterMetricFamily(
            "eer_batched_requests", "Requests that joined a shared batch", value=s.requests_batched
        )
        yield CounterMetricFamily(
            "eer_restarted_requests",
            "Batch members restarted on their own after their batch failed",
            value=s.requests_restarted,
        )
        yield CounterMetricFamily("eer_generated_tokens", "Tokens generated", value=s.tokens_generated)
        yield GaugeMetricFamily(
            "eer_tokens_per_second", "Generated tokens/s over the last minute", value=s.tokens_per_s()
        )
        tokens = s.tokens_generated
        yield GaugeMetricFamily(
            "eer_hit_rate",
            "Share of tokens that left at a shallow exit or the n-gram tier",
            value=_share(s.exited_tokens, tokens),
        )
        yield GaugeMetricFamily(
            "eer_exit_agreement",
            "Exit mode's quality: share of checked final early tokens the full model agreed with",
            value=_share(s.exit_agreed, s.exit_checked),
        )
        yield CounterMetricFamily(
            "eer_exits_suspended_requests",
            "Exit-mode requests whose exits stopped because no threshold held target_agreement",
            value=s.requests_exits_suspended,
        )
        yield GaugeMetricFamily(
            "eer_draft_acceptance",
            "Share of drafted tokens a verify cycle accepted",
            value=_share(s.drafts_accepted, s.drafts_judged),
        )
        yield GaugeMetricFamily(
            "eer_plain_share",
            "Share of tokens decoded plainly (the policy's fallback)",
            value=_share(s.plain_steps, tokens),
        )


def _share(part: float, whole: float) -> float:
    """A rate for a gauge: 0 before anything was counted."""
    return part / whole if whole else 0.0


def _version() -> str:
    from early_exit_router._version import __version__

    return __version__

"""The server's scheduler: a bounded queue of requests and one worker thread that decodes them.

Requests join and leave the running set between decode steps: the worker prefills a newly admitted request, then
advances every running request by one step in turn (round robin), so a short request is never stuck behind a long
one and a cancelled one stops within a step. Each step runs one sequence (batch size 1): steps of several requests
are interleaved, not yet batched into one forward pass.

The worker is the only thread that touches the model; it holds `router.lock` around every step, so direct
`router.generate` calls from other threads are served between steps and never interleave inside one. HTTP handlers
talk to it through `Job` objects: the worker reports text and the final result to the job's asyncio queue with
`loop.call_soon_threadsafe`, and reads the job's cancel flag before every step.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import RouterConfig
from ..engine import DecodeRequest, Decoding, Engine
from ..sampling import SamplingParams, TokenSelector
from ..stats import GenerationStats


class QueueFull(RuntimeError):
    """The bounded queue is full: the HTTP layer answers 503 with Retry-After."""


@dataclass(eq=False)  # identity, not field equality: jobs hold tensors
class Job:
    """One request as the worker sees it, and the channel back to its HTTP handler."""

    input_ids: torch.Tensor  # (1, n) prompt ids on the model's device
    max_new_tokens: int
    mode: str
    config: RouterConfig
    params: SamplingParams
    stop: tuple[str, ...] = ()
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue | None = None  # ("text", str) pieces, then ("done", JobResult) or ("error", Exception)
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: float = field(default_factory=time.time)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Stop decoding this request at the next step (a client that went away)."""
        self.cancelled.set()


@dataclass
class JobResult:
    """What a finished request produced."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    prompt_tokens: int
    stats: GenerationStats


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


class _JobStreamer:
    """The engine's streamer for one job: receives verified token ids, forwards safe text to the job."""

    def __init__(self, job: Job, tracker: TextTracker, scheduler: Scheduler) -> None:
        self.job, self.tracker, self.scheduler = job, tracker, scheduler
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # the engine puts the prompt first, like HF streamers expect
            self.prompt_seen = True
            return
        piece = self.tracker.add(value.reshape(-1).tolist())
        if piece:
            self.scheduler.emit(self.job, ("text", piece))

    def end(self) -> None:
        pass


@dataclass(eq=False)
class _Running:
    job: Job
    engine: Engine
    decoding: Decoding
    tracker: TextTracker


@dataclass
class SchedulerStats:
    """Counters for /metrics; the worker updates them, readers take a snapshot."""

    requests_finished: int = 0
    requests_cancelled: int = 0
    requests_failed: int = 0
    requests_rejected: int = 0
    tokens_generated: int = 0
    exited_tokens: int = 0
    checked_tokens: int = 0
    agreed_tokens: float = 0.0
    plain_steps: float = 0.0
    decode_seconds: float = 0.0
    recent: collections.deque = field(default_factory=lambda: collections.deque(maxlen=256))  # (time, tokens)

    def tokens_per_s(self, window_s: float = 60.0) -> float:
        """Generated tokens per second over the last `window_s` seconds."""
        now = time.time()
        tokens = sum(n for t, n in self.recent if now - t <= window_s)
        return tokens / window_s


class Scheduler:
    """Owns the worker thread. `submit` queues a job (or raises QueueFull); the worker does the rest."""

    def __init__(self, router: Any, max_queue: int = 64, max_running: int = 8) -> None:
        if max_queue < 1 or max_running < 1:
            raise ValueError(f"max_queue and max_running must be >= 1, got {max_queue} and {max_running}.")
        self.router = router
        self.max_queue = max_queue
        self.max_running = max_running
        self.stats = SchedulerStats()
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: list[_Running] = []
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._work, name="early-exit-router-scheduler", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------------------ HTTP-side API
    def submit(self, job: Job) -> None:
        with self._cond:
            if self._stop:
                raise RuntimeError("The scheduler is shut down.")
            if len(self._waiting) >= self.max_queue:
                self.stats.requests_rejected += 1
                raise QueueFull(f"{len(self._waiting)} requests are waiting (the queue holds {self.max_queue}).")
            self._waiting.append(job)
            self._cond.notify()

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the worker: running and waiting jobs get an error event."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout)

    def emit(self, job: Job, event: tuple[str, Any]) -> None:
        if job.loop is not None and job.events is not None and not job.loop.is_closed():
            job.loop.call_soon_threadsafe(job.events.put_nowait, event)

    # --------------------------------------------------------------------------------------------- the worker
    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not self._waiting and not self._running:
                    self._cond.wait()
                if self._stop:
                    break
                admitted = []
                while self._waiting and len(self._running) + len(admitted) < self.max_running:
                    admitted.append(self._waiting.popleft())
            for job in admitted:
                self._admit(job)
            for run in list(self._running):  # one step each, in turn
                self._advance(run)
        for run in self._running:
            self.emit(run.job, ("error", RuntimeError("The server is shutting down.")))
        for job in self._waiting:
            self.emit(job, ("error", RuntimeError("The server is shutting down.")))

    def _admit(self, job: Job) -> None:
        if job.cancelled.is_set():
            self.stats.requests_cancelled += 1
            return
        tracker = TextTracker(self.router.tokenizer, job.stop)
        request = DecodeRequest(
            mode=job.mode,
            max_new_tokens=job.max_new_tokens,
            eos_token_ids=frozenset(self.router._eos_ids(None)),
            stop_strings=job.stop,
            streamer=_JobStreamer(job, tracker, self),
            tokenizer=self.router.tokenizer,
        )
        try:
            with self.router.lock:
                engine = self.router.engine(job.config)
                selector = TokenSelector(job.params, self.router._stack.device, None)
                decoding = engine.start(job.input_ids, request, selector)
        except Exception as error:  # a failure of one request must not stop the worker
            self.stats.requests_failed += 1
            self.emit(job, ("error", error))
            return
        self._running.append(_Running(job, engine, decoding, tracker))

    def _advance(self, run: _Running) -> None:
        if run.job.cancelled.is_set():
            self._running.remove(run)
            self.stats.requests_cancelled += 1
            return
        try:
            with self.router.lock:
                done = run.engine.advance(run.decoding)
                if not done:
                    return
                sequences, stats, _, _, _ = run.engine.finish(run.decoding)
        except Exception as error:  # a failure of one request must not stop the worker
            self._running.remove(run)
            self.stats.requests_failed += 1
            self.emit(run.job, ("error", error))
            return
        self._running.remove(run)
        rest = run.tracker.finish()
        if rest:
            self.emit(run.job, ("text", rest))
        new_ids = sequences[0, run.job.input_ids.shape[1] :].tolist()
        result = JobResult(
            text=run.tracker.text,
            token_ids=new_ids,
            finish_reason=_finish_reason(new_ids, run, self.router),
            prompt_tokens=run.job.input_ids.shape[1],
            stats=stats,
        )
        self._count(stats)
        self.emit(run.job, ("done", result))

    def _count(self, stats: GenerationStats) -> None:
        s = self.stats
        s.requests_finished += 1
        s.tokens_generated += stats.new_tokens
        s.exited_tokens += round(stats.hit_rate * stats.new_tokens)
        s.checked_tokens += stats.exited_checked
        s.agreed_tokens += (stats.agreement or 0.0) * stats.exited_checked
        s.plain_steps += stats.plain_share * stats.new_tokens
        s.decode_seconds += stats.wall_time_s
        s.recent.append((time.time(), stats.new_tokens))


def _finish_reason(new_ids: list[int], run: _Running, router: Any) -> str:
    if run.tracker.stopped_at is not None or (new_ids and new_ids[-1] in set(router._eos_ids(None))):
        return "stop"
    return "length" if len(new_ids) >= run.job.max_new_tokens else "stop"

"""The server's scheduler: a bounded queue of requests and one worker thread that decodes them.

Requests join and leave the running set between decode steps (continuous batching). Requests that use the server's
routing config share one batch decoder per mode (and, in verify mode, one for sampled requests, which run per row):
a newcomer is prefilled alone and joins the batch where no drafts wait, and a finished or cancelled row leaves at
once. Requests that set routing options of their own run as one-sequence decoders, one step each in turn. Models
whose cache has sliding-window layers run every request that way (their cache rows do not line up).

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

from early_exit_router.config import RouterConfig
from early_exit_router.decode.loop import Decoder
from early_exit_router.decode.sampling import SamplingParams, TokenSelector
from early_exit_router.decode.state import Row
from early_exit_router.decode.stats import GenerationStats
from early_exit_router.decode.stopping import DecodeRequest
from early_exit_router.models import _compat


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
    """The decoder's streamer for one job: receives verified token ids, forwards safe text to the job."""

    def __init__(self, job: Job, tracker: TextTracker, scheduler: Scheduler) -> None:
        self.job, self.tracker, self.scheduler = job, tracker, scheduler
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # the decoder puts the prompt first, like HF streamers expect
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
    decoder: Decoder
    tracker: TextTracker


@dataclass(eq=False)
class _Group:
    """The batch of one mode, its members and the jobs waiting to join it."""

    batch: Decoder
    members: list[tuple[Row, Job, TextTracker]] = field(default_factory=list)
    joining: collections.deque = field(default_factory=collections.deque)

    @property
    def size(self) -> int:
        return len(self.members) + len(self.joining)


@dataclass
class SchedulerStats:
    """Counters for /metrics; the worker updates them, readers take a snapshot."""

    requests_finished: int = 0
    requests_cancelled: int = 0
    requests_failed: int = 0
    requests_rejected: int = 0
    requests_batched: int = 0  # requests that joined a shared batch
    tokens_generated: int = 0
    exited_tokens: int = 0
    exit_checked: int = 0  # final early tokens the deep pass checked (exit mode's quality sample)
    exit_agreed: float = 0.0
    drafts_judged: int = 0  # drafts a verify cycle judged
    drafts_accepted: float = 0.0
    plain_steps: float = 0.0
    recent: collections.deque = field(default_factory=lambda: collections.deque(maxlen=256))  # (time, tokens)

    def tokens_per_s(self, window_s: float = 60.0) -> float:
        """Generated tokens per second over the last `window_s` seconds."""
        now = time.time()
        tokens = sum(n for t, n in self.recent if now - t <= window_s)
        return tokens / window_s


class Scheduler:
    """Owns the worker thread. `submit` queues a job (or raises QueueFull); the worker does the rest."""

    def __init__(
        self,
        router: Any,
        max_queue: int = 64,
        max_running: int = 8,
        batching: bool = True,
        base_config: RouterConfig | None = None,
    ) -> None:
        if max_queue < 1 or max_running < 1:
            raise ValueError(f"max_queue and max_running must be >= 1, got {max_queue} and {max_running}.")
        self.router = router
        self.max_queue = max_queue
        self.max_running = max_running
        self.base_config = base_config or router.config  # requests with this config may share a batch
        self.batching = batching and _compat.cache_rows_can_change(router.stack.new_cache())
        self.stats = SchedulerStats()
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: list[_Running] = []
        self._groups: dict[tuple[str, bool], _Group] = {}  # (mode, per row) -> its batch
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
        return len(self._running) + sum(g.size for g in tuple(self._groups.values()))  # read by other threads too

    @property
    def batched(self) -> int:
        """Requests now decoded in a shared batch."""
        return sum(len(g.members) for g in tuple(self._groups.values()))

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
                while not self._stop and not self._waiting and not self.running:
                    self._cond.wait()
                if self._stop:
                    break
                admitted = []
                while self._waiting and self.running + len(admitted) < self.max_running:
                    admitted.append(self._waiting.popleft())
            for job in admitted:
                if self._batchable(job):
                    self._group(job).joining.append(job)
                else:
                    self._admit(job)
            # One batched step per mode. Empty groups stay: their batch keeps what it learnt about its exits.
            for group in list(self._groups.values()):
                if group.size:
                    self._step_group(group)
            for run in list(self._running):  # one step each, in turn
                self._advance(run)
        stopping = RuntimeError("The server is shutting down.")
        for job in [r.job for r in self._running] + list(self._waiting):
            self.emit(job, ("error", stopping))
        for group in self._groups.values():
            for job in [m[1] for m in group.members] + list(group.joining):
                self.emit(job, ("error", stopping))

    def _batchable(self, job: Job) -> bool:
        """Whether the job may share a batch: the server's routing (greedy or sampled: verify-mode sampling joins a
        per-row batch, where each row keeps its own distribution)."""
        sampling = job.params.do_sample
        return (
            self.batching and job.config == self.base_config and self.router.can_batch(job.config, job.mode, sampling)
        )

    def _group(self, job: Job) -> _Group:
        sampling = job.mode == "verify" and job.params.do_sample  # verify mode: sampled requests run per row
        key = (job.mode, sampling)
        group = self._groups.get(key)
        if group is None:
            with self.router.lock:
                batch = self.router.decoder(self.base_config, job.mode, batch=True, sampling=sampling)
            group = self._groups[key] = _Group(batch)
        return group

    @property
    def _eos(self) -> frozenset[int]:
        return frozenset(self.router.eos_token_ids())

    def _step_group(self, group: _Group) -> None:
        """Let waiting jobs join where no drafts wait, step the batch once, and retire finished or cancelled rows."""
        batch = group.batch
        try:
            with self.router.lock:
                while group.joining and batch.can_join():
                    job = group.joining.popleft()
                    if job.cancelled.is_set():
                        self.stats.requests_cancelled += 1
                        continue
                    tracker, request = self._decode_request(job)
                    row = batch.join(job.input_ids, request, TokenSelector(job.params, self.router.stack.device))
                    group.members.append((row, job, tracker))
                    self.stats.requests_batched += 1
                if batch.rows:
                    batch.step()
                leaving = []
                for member in list(group.members):
                    row, job, tracker = member
                    if job.cancelled.is_set():
                        self.stats.requests_cancelled += 1
                    elif row.done:
                        self._finish(job, tracker, row.output(), batch.stats(row))
                    else:
                        continue
                    leaving.append(row)
                    group.members.remove(member)
                batch.remove(leaving)
        except Exception as error:  # a failed step fails its batch's requests, never the worker
            for job in [m[1] for m in group.members] + list(group.joining):
                self.stats.requests_failed += 1
                self.emit(job, ("error", error))
            group.members.clear()
            group.joining.clear()
            group.batch.reset()

    def _decode_request(self, job: Job) -> tuple[TextTracker, DecodeRequest]:
        """The decoder's request for a job, streaming through a text tracker to the job's queue."""
        tracker = TextTracker(self.router.tokenizer, job.stop)
        request = DecodeRequest(
            max_new_tokens=job.max_new_tokens,
            eos_token_ids=self._eos,
            stop_strings=job.stop,
            streamer=_JobStreamer(job, tracker, self),
            tokenizer=self.router.tokenizer,
        )
        return tracker, request

    def _admit(self, job: Job) -> None:
        if job.cancelled.is_set():
            self.stats.requests_cancelled += 1
            return
        tracker, request = self._decode_request(job)
        try:
            with self.router.lock:
                decoder = self.router.decoder(job.config, job.mode)
                selector = TokenSelector(job.params, self.router.stack.device, None)
                decoder.prefill(job.input_ids, torch.ones_like(job.input_ids), [request], [selector])
        except Exception as error:  # a failure of one request must not stop the worker
            self.stats.requests_failed += 1
            self.emit(job, ("error", error))
            return
        self._running.append(_Running(job, decoder, tracker))

    def _advance(self, run: _Running) -> None:
        if run.job.cancelled.is_set():
            self._running.remove(run)
            self.stats.requests_cancelled += 1
            return
        try:
            with self.router.lock:
                if not run.decoder.finished:
                    run.decoder.step()
                if not run.decoder.finished:
                    return
                run.decoder.finish()
                row = run.decoder.rows[0]
                new_ids, stats = row.output(), run.decoder.stats(row)
        except Exception as error:  # a failure of one request must not stop the worker
            self._running.remove(run)
            self.stats.requests_failed += 1
            self.emit(run.job, ("error", error))
            return
        self._running.remove(run)
        self._finish(run.job, run.tracker, new_ids, stats)

    def _finish(self, job: Job, tracker: TextTracker, new_ids: list[int], stats: GenerationStats) -> None:
        """Send a finished request its remaining text and its result."""
        rest = tracker.finish()
        if rest:
            self.emit(job, ("text", rest))
        if tracker.stopped_at is not None or (new_ids and new_ids[-1] in self._eos):
            reason = "stop"
        else:
            reason = "length" if len(new_ids) >= job.max_new_tokens else "stop"
        result = JobResult(tracker.text, new_ids, reason, job.input_ids.shape[1], stats)
        self._count(stats)
        self.emit(job, ("done", result))

    def _count(self, stats: GenerationStats) -> None:
        s = self.stats
        s.requests_finished += 1
        s.tokens_generated += stats.new_tokens
        s.exited_tokens += round(stats.hit_rate * stats.new_tokens)
        s.exit_checked += stats.exit_checked
        s.exit_agreed += (stats.exit_agreement or 0.0) * stats.exit_checked
        s.drafts_judged += stats.drafts_judged
        s.drafts_accepted += (stats.draft_acceptance or 0.0) * stats.drafts_judged
        s.plain_steps += stats.plain_share * stats.new_tokens
        s.recent.append((time.time(), stats.new_tokens))

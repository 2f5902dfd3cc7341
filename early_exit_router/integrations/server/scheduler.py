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

One failing request never fails or strands another, and every request gets an answer. A failure that belongs to one
request (preparing it, prefilling it, stepping its own decoder, finishing it) answers that request with an error and
counts it as failed. A failure that may have left a shared batch half-changed (a newcomer joining, a batch step,
rows leaving) breaks the batch up: each member restarts on a decoder of its own from its prompt and the tokens it
has been sent, and generates the rest; the request that failed fails again there, alone, and the others finish.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

from early_exit_router.config import RouterConfig
from early_exit_router.decode.loop import Decoder
from early_exit_router.decode.noise import skip_positions
from early_exit_router.decode.sampling import SamplingParams, TokenSelector
from early_exit_router.decode.state import Row
from early_exit_router.decode.stats import GenerationStats
from early_exit_router.decode.stopping import DecodeRequest
from early_exit_router.integrations.server.text import TextTracker
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
    sent: list[int] = field(default_factory=list)  # tokens sent before a restart: the decoder's prompt ends with them


@dataclass(eq=False)
class _Group:
    """The batch of one mode, its members and the jobs waiting to join it."""

    key: tuple[str, bool]  # (mode, per row)
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
    requests_restarted: int = 0  # batch members restarted on their own after their batch failed
    tokens_generated: int = 0
    exited_tokens: int = 0
    exit_checked: int = 0  # final early tokens the deep pass checked (exit mode's quality sample)
    exit_agreed: float = 0.0
    requests_exits_suspended: int = 0  # exit-mode requests whose exits stopped (no threshold held the target)
    drafts_judged: int = 0  # drafts a verify cycle judged
    drafts_accepted: float = 0.0
    plain_steps: float = 0.0
    recent: collections.deque = field(default_factory=lambda: collections.deque(maxlen=256))  # (time, tokens)

    def count_finished(self, stats: GenerationStats) -> None:
        """Add a finished request and its routing statistics."""
        self.requests_finished += 1
        self.tokens_generated += stats.new_tokens
        self.exited_tokens += round(stats.hit_rate * stats.new_tokens)
        self.exit_checked += stats.exit_checked
        self.exit_agreed += (stats.exit_agreement or 0.0) * stats.exit_checked
        self.requests_exits_suspended += stats.exits_suspended is not None
        self.drafts_judged += stats.drafts_judged
        self.drafts_accepted += (stats.draft_acceptance or 0.0) * stats.drafts_judged
        self.plain_steps += stats.plain_share * stats.new_tokens
        self.recent.append((time.time(), stats.new_tokens))

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
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody is waiting any more
                job.loop.call_soon_threadsafe(job.events.put_nowait, event)

    def _work(self) -> None:
        while True:
            try:
                if not self._round():
                    break
            except Exception as crash:  # a bug of the scheduler's own: answer what is in flight, and serve on
                error = RuntimeError(f"The scheduler failed ({type(crash).__name__}: {crash}); retry the request.")
                for job in self._in_flight():
                    self._fail(job, error)
                self._running.clear()
                self._groups.clear()
        stopping = RuntimeError("The server is shutting down.")
        for job in self._in_flight() + list(self._waiting):
            self.emit(job, ("error", stopping))

    def _in_flight(self) -> list[Job]:
        """Every job the worker holds: running on its own, in a batch, or waiting to join one."""
        jobs = [r.job for r in self._running]
        for group in self._groups.values():
            jobs += [m[1] for m in group.members] + list(group.joining)
        return jobs

    def _round(self) -> bool:
        """Admit waiting jobs, step each batch once and each request on its own decoder once; False once stopped."""
        with self._cond:
            while not self._stop and not self._waiting and not self.running:
                self._cond.wait()
            if self._stop:
                return False
            self._waiting = _live(self._waiting, self.stats)
            admitted = []
            while self._waiting and self.running + len(admitted) < self.max_running:
                admitted.append(self._waiting.popleft())
        for job in admitted:
            self._place(job)
        # One batched step per mode. Empty groups stay: their batch keeps what it learnt about its exits.
        for group in list(self._groups.values()):
            if group.size:
                self._step_group(group)
        for run in list(self._running):  # one step each, in turn
            self._advance(run)
        return True

    def _place(self, job: Job) -> None:
        """Queue the job for its mode's batch, or start it on a decoder of its own."""
        try:
            if self._batchable(job):
                self._group(job).joining.append(job)
                return
        except Exception as error:  # building its mode's batch failed: this job's answer, the worker goes on
            self._fail(job, error)
            return
        self._admit(job)

    def _fail(self, job: Job, error: Exception) -> None:
        """Answer one request with its error and count it."""
        self.stats.requests_failed += 1
        self.emit(job, ("error", error))

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
            group = self._groups[key] = _Group(key, self._new_batch(key))
        return group

    def _new_batch(self, key: tuple[str, bool]) -> Decoder:
        mode, sampling = key
        with self.router.lock:
            return self.router.decoder(self.base_config, mode, batch=True, sampling=sampling)

    @property
    def _eos(self) -> frozenset[int]:
        return frozenset(self.router.eos_token_ids())

    def _step_group(self, group: _Group) -> None:
        """Let waiting jobs join where no drafts wait, step the batch once, and retire finished or cancelled rows."""
        with self.router.lock:
            self._join(group)
            try:
                group.batch.step()  # nothing without rows
            except Exception:  # which row failed is unknown, and the shared state may be half-changed
                self._break_up(group)
                return
            self._retire(group)

    def _join(self, group: _Group) -> None:
        while group.joining and group.batch.can_join():
            job = group.joining.popleft()
            if job.cancelled.is_set():
                self.stats.requests_cancelled += 1
                continue
            try:  # this request's own parts (a seed torch refuses fails here): the batch is untouched
                tracker = TextTracker(self.router.tokenizer, job.stop, job.input_ids[0].tolist())
                request = self._decode_request(job, tracker, job.max_new_tokens)
                selector = TokenSelector(job.params, self.router.stack.device)
            except Exception as error:
                self._fail(job, error)
                continue
            try:
                row = group.batch.join(job.input_ids, request, selector)
            except Exception as error:  # its prefill, or its merge into the batch, which may be half done
                self._fail(job, error)
                self._break_up(group)
                continue
            group.members.append((row, job, tracker))
            self.stats.requests_batched += 1

    def _retire(self, group: _Group) -> None:
        """Finished and cancelled rows leave the batch."""
        leaving = []
        for member in list(group.members):
            row, job, tracker = member
            if job.cancelled.is_set():
                self.stats.requests_cancelled += 1
            elif row.done:
                try:
                    self._finish(job, tracker, row.output(), group.batch.stats(row))
                except Exception as error:  # this request's text or statistics: its answer alone
                    self._fail(job, error)
            else:
                continue
            leaving.append(row)
            group.members.remove(member)
        try:
            group.batch.remove(leaving)
        except Exception:
            self._break_up(group)

    def _break_up(self, group: _Group) -> None:
        """The batch's shared state may be half-changed: start a fresh batch for the mode, and restart each member
        on a decoder of its own from the tokens it has been sent."""
        members, group.members = group.members, []
        group.batch.reset()  # drop its rows, whatever state they are in
        try:
            group.batch = self._new_batch(group.key)
        except Exception as error:  # no batch for this mode now: its waiting jobs fail, the next job tries again
            self._groups.pop(group.key, None)
            while group.joining:
                self._fail(group.joining.popleft(), error)
        for _, job, tracker in members:
            self.stats.requests_restarted += 1
            self._restart_alone(job, tracker)

    def _restart_alone(self, job: Job, tracker: TextTracker) -> None:
        """Continue a member of a broken batch alone from its prompt and the tokens it was sent (seeded sampling goes
        on as unbroken, see `_admit`; the response's `early_exit` block covers the part decoded after the restart)."""
        if job.cancelled.is_set():
            self.stats.requests_cancelled += 1
            return
        sent = list(tracker.ids)
        if len(sent) >= job.max_new_tokens or tracker.stopped_at is not None or (sent and sent[-1] in self._eos):
            try:  # nothing left to generate
                stats = GenerationStats(new_tokens=len(sent), mode=job.mode, num_layers=self.router.stack.num_layers)
                self._finish(job, tracker, sent, stats)
            except Exception as error:
                self._fail(job, error)
            return
        self._admit(job, tracker, sent)

    def _decode_request(self, job: Job, tracker: TextTracker, max_new_tokens: int) -> DecodeRequest:
        """The decoder's request for a job, streaming through its text tracker to the job's queue."""
        return DecodeRequest(
            max_new_tokens=max_new_tokens,
            eos_token_ids=self._eos,
            stop_strings=job.stop,
            streamer=_JobStreamer(job, tracker, self),
            tokenizer=self.router.tokenizer,
            stop_strings_from=job.input_ids.shape[1],  # OpenAI's `stop` ends the completion where its text has one
            stop_strings_skip_special=True,  # the text the tracker sends: a stop the client sees ends the decode
        )

    def _admit(self, job: Job, tracker: TextTracker | None = None, sent: list[int] | None = None) -> None:
        """Start the job on a one-sequence decoder of its own; `sent`: tokens it was sent before a restart (they
        follow its prompt, count against its max_new_tokens, and drew their positions' sampling noise)."""
        if job.cancelled.is_set():
            self.stats.requests_cancelled += 1
            return
        sent = sent or []
        try:
            tracker = tracker or TextTracker(self.router.tokenizer, job.stop, job.input_ids[0].tolist())
            request = self._decode_request(job, tracker, job.max_new_tokens - len(sent))
            ids = job.input_ids
            if sent:
                ids = torch.cat([ids, torch.tensor([sent], dtype=ids.dtype, device=ids.device)], dim=1)
            with self.router.lock:
                decoder = self.router.decoder(job.config, job.mode)
                selector = TokenSelector(job.params, self.router.stack.device, None)
                skip_positions(selector.generator, len(sent), self.router.stack.vocab_size, self.router.stack.device)
                decoder.prefill(ids, torch.ones_like(ids), [request], [selector])
        except Exception as error:  # a failure of one request must not stop the worker
            self._fail(job, error)
            return
        self._running.append(_Running(job, decoder, tracker, sent))

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
                new_ids, stats = run.sent + row.output(), _after_sent(run.decoder.stats(row), len(run.sent))
            self._running.remove(run)
            self._finish(run.job, run.tracker, new_ids, stats)
        except Exception as error:  # a failure of one request must not stop the worker
            if run in self._running:
                self._running.remove(run)
            self._fail(run.job, error)

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
        self.stats.count_finished(stats)
        self.emit(job, ("done", result))


def _live(waiting: collections.deque[Job], stats: SchedulerStats) -> collections.deque[Job]:
    """The waiting jobs whose clients are still there (the others counted cancelled): a client that left gives its
    place in the queue up at the worker's next step, not once a slot frees for it, so clients that time out and retry
    cannot fill the queue with requests nobody reads."""
    live = collections.deque(job for job in waiting if not job.cancelled.is_set())
    stats.requests_cancelled += len(waiting) - len(live)
    return live


def _after_sent(stats: GenerationStats, sent: int) -> GenerationStats:
    """A restarted request's statistics with its first divergence counted from its first new token, the `sent` tokens
    before the restart included (the rest covers the part decoded after it)."""
    if stats.first_divergence is not None:
        stats.first_divergence += sent
    return stats

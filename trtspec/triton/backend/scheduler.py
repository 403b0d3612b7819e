"""Continuous (iteration-level) batching for the text endpoints, without the Triton plumbing.

One Scheduler per orchestrator model instance owns one loop ``Batch``
(trtspec.speculative.loop): the model's execute() parses and queues each request through
``submit`` and returns at once; a worker thread calls ``step`` over and over. Each step drops
cancelled and timed-out requests, admits queued requests while the batch has room
(``max_active`` sequences: the engines' batch size), runs ONE draft + verify step over every
active sequence, streams that step's tokens, and answers each request the moment its last
row ends. So a request never waits for another request's generation to end, only for the
step in progress. A full queue answers at once with UNAVAILABLE.

``StepStats`` is the one place the counts of a step are gathered (for monitoring).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from trtspec.errors import RequestError
from trtspec.speculative.loop import Batch, GenerationResult
from trtspec.triton.backend.responses import Row, TextStream, row_tensors


class Unavailable(Exception):
    """The server cannot take the request now (queue full, timed out, unloading)."""

    triton_code = "UNAVAILABLE"


class Cancelled(Exception):
    """The client cancelled the request (or disconnected)."""

    triton_code = "CANCELLED"


class Endpoint(Protocol):
    """What the scheduler needs of an endpoint (orchestrator_core.Orchestrator)."""

    tokenizer: Any

    def parse(self, inputs: Mapping[str, np.ndarray]) -> list[Row]: ...

    def pack(self, rows: Sequence[Row], results: Sequence[GenerationResult]) -> dict[str, np.ndarray]: ...

    def new_batch(self) -> Batch: ...  # a loop Batch with this endpoint's drafter and verifier


class Reply(Protocol):
    """Where one request's answers go (a Triton response sender, or a test's list)."""

    def send(self, tensors: dict[str, np.ndarray], final: bool) -> None: ...

    def fail(self, err: Exception) -> None: ...  # one error response; ends the request

    def cancelled(self) -> bool: ...


@dataclass
class StepStats:
    """One scheduling step of one endpoint: what monitoring reads."""

    sequences: int  # sequences in the step (each got one target forward)
    queued: int  # requests still waiting after admission
    drafted: int  # draft tokens proposed, all sequences
    accepted: int  # of those, accepted by the target
    accepted_each: list[int]  # accepted drafts per sequence that drafted (acceptance lengths - 1)
    k: int  # the largest draft length asked this step
    finished: int  # requests answered this step
    cancelled: int  # requests dropped this step (cancelled or timed out)


@dataclass
class _Job:
    rows: list[Row]
    reply: Reply
    deadline_ns: int | None = None  # time.monotonic_ns() after which it is dropped
    timeout_ms: float = 0.0
    keys: list[int] = field(default_factory=list)  # batch keys, one per row, once admitted
    stream: TextStream | None = None


class Scheduler:
    def __init__(
        self,
        orch: Endpoint,
        max_active: int,
        max_queue: int,
        observe: Callable[[StepStats], None] | None = None,
    ):
        self.orch = orch
        self.max_active = max_active
        self.max_queue = max_queue
        self.observe = observe
        self.batch = self._new_batch()
        self.active: list[_Job] = []
        self.waiting: deque[_Job] = deque()
        self._cv = threading.Condition()
        # Tokenizers are not safe to use from two threads at once (a fast tokenizer raises
        # "Already borrowed"): parsing (execute's thread) and decoding (the worker) share it.
        self.tokenizer_lock = threading.Lock()
        self._stopping = False

    def _new_batch(self) -> Batch:
        return self.orch.new_batch()

    # -- the caller's side (execute) --------------------------------------------------------

    def submit(self, inputs: Mapping[str, np.ndarray], reply: Reply, timeout_us: int = 0) -> None:
        """Parse and queue one request; a bad or unplaceable request is answered at once."""
        try:
            with self.tokenizer_lock:
                rows = self.orch.parse(inputs)
        except RequestError as err:
            reply.fail(err)
            return
        except Exception as err:  # a tokenizer or chat-template failure: this request only
            reply.fail(RuntimeError(f"could not prepare the request: {type(err).__name__}: {err}"))
            return
        self.enqueue(rows, reply, timeout_us)

    def enqueue(self, rows: list[Row], reply: Reply, timeout_us: int = 0) -> None:
        job = _Job(rows, reply)
        if timeout_us > 0:  # the request's own timeout (Triton's `timeout` parameter)
            job.deadline_ns = time.monotonic_ns() + timeout_us * 1000
            job.timeout_ms = timeout_us / 1000
        if rows[0].stream:
            job.stream = TextStream(self.orch.tokenizer)
        with self._cv:
            if self._stopping:
                reply.fail(Unavailable("the model is unloading; retry on another instance or later"))
                return
            # Requests that will get a place at the next step are not waiting for one.
            free = self.max_active - sum(len(j.rows) for j in self.active)
            if len(self.waiting) >= self.max_queue + max(free, 0):
                reply.fail(
                    Unavailable(
                        f"the queue is full ({self.max_queue} requests waiting); retry later, "
                        "or raise serve.max_queue in the spec"
                    )
                )
                return
            self.waiting.append(job)
            self._cv.notify()

    # -- the worker's side ------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        with self._cv:
            return bool(self.active or self.waiting)

    def serve(self) -> None:
        """The worker thread: step while there is work, sleep until a request comes."""
        while True:
            with self._cv:
                while not self._stopping and not self.active and not self.waiting:
                    self._cv.wait()
                if self._stopping:
                    break
            self.step()
        self._fail_all(Unavailable("the model is unloading; retry later"))

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()

    def step(self) -> StepStats:
        """One round: drop cancelled, admit, one loop step, stream and answer."""
        dropped = self._drop_cancelled()
        self._admit()
        with self._cv:
            queued = len(self.waiting)
        stats = StepStats(0, queued, 0, 0, [], 0, 0, dropped)
        if self.batch.active:
            try:
                report = self.batch.step()
            except Exception as err:  # an engine failure fails the running requests, not the server
                failure = err if isinstance(err, RequestError) else RuntimeError(f"generation failed: {err}")
                self._fail_active(failure)
                self.batch = self._new_batch()
                return stats
            stats.sequences, stats.drafted, stats.accepted, stats.k = (
                report.sequences,
                report.drafted,
                report.accepted,
                report.k,
            )
            stats.accepted_each = list(report.accepted_each)
            stats.finished = self._answer(report.emitted)
        if self.observe is not None:
            self.observe(stats)
        return stats

    def _drop_cancelled(self) -> int:
        now = time.monotonic_ns()
        gone = 0
        for job in list(self.active):
            err = self._why_dropped(job, now)
            if err is not None:
                for key in job.keys:
                    self.batch.cancel(key)  # its sequence leaves before the next step
                with self._cv:
                    self.active.remove(job)
                job.reply.fail(err)
                gone += 1
        with self._cv:
            waiting = list(self.waiting)
        for job in waiting:
            err = self._why_dropped(job, now)
            if err is not None:
                with self._cv:
                    self.waiting.remove(job)
                job.reply.fail(err)
                gone += 1
        return gone

    def _why_dropped(self, job: _Job, now: int) -> Exception | None:
        if job.reply.cancelled():
            return Cancelled("the request was cancelled")
        if job.deadline_ns is not None and now > job.deadline_ns:
            return Unavailable(f"the request's timeout ({job.timeout_ms:g} ms) expired before it finished")
        return None

    def _admit(self) -> None:
        """Queued requests join the batch in arrival order while all their rows fit."""
        room = self.max_active - sum(len(j.keys) for j in self.active)
        while True:
            with self._cv:
                if not self.waiting or len(self.waiting[0].rows) > room:
                    return
                job = self.waiting.popleft()
            scheduled = time.time_ns()
            for row in job.rows:
                row.times["first_scheduled_time_ns"] = scheduled
                job.keys.append(self.batch.add(row.request))
            with self._cv:
                self.active.append(job)
            room -= len(job.rows)

    def _answer(self, emitted: dict[int, list[int]]) -> int:
        now = time.time_ns()
        answered = 0
        results = self.batch.results
        for job in list(self.active):
            for row, key in zip(job.rows, job.keys):
                if emitted.get(key) or (key in emitted and results[key].done):
                    # done without tokens: EOS came (the engine did produce it)
                    row.times.setdefault("first_token_time_ns", now)
                    row.times["last_token_time_ns"] = now
            done = all(results[key].done for key in job.keys)
            with self.tokenizer_lock:
                if job.stream is not None:
                    key = job.keys[0]
                    if emitted.get(key) or done:
                        tensors = job.stream.step(emitted.get(key, []), done)
                        if not done:
                            job.reply.send(tensors, False)
                        else:
                            res = self.batch.pop(key)
                            job.reply.send(tensors | row_tensors(job.rows, [res]), True)
                elif done:
                    job.reply.send(self.orch.pack(job.rows, [self.batch.pop(k) for k in job.keys]), True)
            if done:
                with self._cv:
                    self.active.remove(job)
                answered += 1
        return answered

    def _fail_active(self, err: Exception) -> None:
        with self._cv:
            failed, self.active = self.active, []
        for job in failed:
            job.reply.fail(err)

    def _fail_all(self, err: Exception) -> None:
        self._fail_active(err)
        with self._cv:
            waiting, self.waiting = list(self.waiting), deque()
        for job in waiting:
            job.reply.fail(err)

"""Continuous (iteration-level) batching for the text endpoints, without the Triton plumbing.

One Scheduler per orchestrator model instance owns one loop ``Batch``
(trtspec.speculative.loop): the model's execute() parses and queues each request through
``submit`` and returns at once; a worker thread calls ``step`` over and over. Each step drops
cancelled and timed-out requests, admits queued requests while the batch has room
(``max_active`` sequences: the engines' batch size), runs ONE draft + verify step over every
active sequence, streams that step's tokens, and answers each request the moment its last
row ends. So a request never waits for another request's generation to end, only for the
step in progress. A full queue answers at once with UNAVAILABLE.

Before each step it tells the batch whether it is saturated (``Batch.saturated``): a request
waits whose rows do not fit until a running sequence leaves. A step that drafts nothing then
decodes a longer chunk (loop.SATURATED_CHUNK forwards at most, instead of loop.DECODE_CHUNK):
the load cannot fall, since whoever leaves is replaced, so only how soon an end at EOS or a
stop, a cancel or a timeout is seen (and the waiting request admitted) changes, within that bound.

Every request it took gets at most one final answer, and exactly one while its sender works:
a failed answer (packing or a non-final send raised) is answered with that error, and only a
client that is gone (cancelled, or its sender refuses the error too) counts as a cancel. A
FINAL send that raises cannot be followed by anything: Triton's Python backend closes a
response sender before it writes the final response, so the error would be refused too; such
a request is logged (with its request id) and counted ``unsent``, never answered twice. A
raising ``fail()`` or observer never stops the others; if the worker itself dies, everything
it held and everything submitted later is answered UNAVAILABLE and ``ready`` turns False.
Every error swallowed here is logged through the backend's logger (log.py).

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
from trtspec.triton.backend import log
from trtspec.triton.backend.responses import Row, TextStream, log_prob_tensors, logits_tensors, row_tensors


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

    def request_id(self) -> str: ...  # the client's request id ('' when it sent none)


class Renewal(Protocol):
    """Something the endpoint changes only between batches (head_swap.HeadSwap: a new head):
    while ``due()``, no request is admitted; once the batch is empty, ``apply()`` and a new batch."""

    def due(self) -> bool: ...

    def apply(self) -> None: ...


def deliver(reply: Reply, err: Exception) -> bool:
    """Answer ``err`` as the request's final response; False when its sender refused (gone)."""
    try:
        reply.fail(err)
    except Exception as refused:
        log.warn(f"the error answer ({err}) could not be sent: {type(refused).__name__}: {refused}", log.request_id(reply))
        return False
    return True


def gone(reply: Reply) -> bool:
    """The client cancelled or disconnected; a sender that cannot tell counts as gone."""
    try:
        return bool(reply.cancelled())
    except Exception as err:
        log.warn(f"the request counts as cancelled: asking its sender raised {type(err).__name__}: {err}", log.request_id(reply))
        return True


@dataclass
class StepStats:
    """One scheduling step of one endpoint instance: what monitoring reads, in one place.
    The step's fields are the loop's (speculative.loop.StepReport); the rest is the
    scheduler's load."""

    sequences: int = 0  # sequences in the step (each got one target forward)
    drafted: int = 0  # draft tokens proposed, all sequences
    accepted: int = 0  # of those, accepted by the target
    accepted_each: list[int] = field(default_factory=list)  # per sequence that drafted
    draft_len: int = 0  # the largest draft length a sequence got this step (0: nobody drafted)
    num_draft_tokens: int = 0  # the largest num_draft_tokens of the step's requests (the configured k)
    extra_forwards: int = 0  # further one-token forwards: a target that kept decoding, a decode chunk
    chosen: list[str] = field(default_factory=list)  # adaptive: the policy's "drafter:k" per sequence
    queued: int = 0  # requests waiting for a place after this step's admissions
    held: int = 0  # sequences holding a place after the step (0 when idle)
    finished: int = 0  # requests answered this step
    cancelled: int = 0  # requests dropped this step (cancelled, disconnected, timed out)
    failed: int = 0  # requests answered with an error this step (their answer could not be made or sent)
    # Requests whose FINAL response raised as it was sent: the sender closes before it writes,
    # so nothing else can reach the client (logged with the request id).
    unsent: int = 0
    # Per sequence that left this step: (finish reason, output tokens); reason "cancelled"
    # when the client cancelled or it timed out, None when it failed.
    ended: list[tuple[str | None, int]] = field(default_factory=list)


@dataclass
class _Job:
    rows: list[Row]
    reply: Reply
    deadline_ns: int | None = None  # time.monotonic_ns() after which it is dropped
    timeout_ms: float = 0.0
    keys: list[int] = field(default_factory=list)  # batch keys, one per row, once admitted
    streams: list[TextStream] | None = None  # streaming: one per row (num_return_sequences)
    closed: set[int] = field(default_factory=set)  # streamed rows whose last response went out


class Scheduler:
    def __init__(
        self,
        orch: Endpoint,
        max_active: int,
        max_queue: int,
        observe: Callable[[StepStats], None] | None = None,
        answered: Callable[[list[Row], list[GenerationResult], str], None] | None = None,
        renewal: Renewal | None = None,
    ):
        self.orch = orch
        self.renewal = renewal
        # Called with a request's rows, results and id once its final answer went out
        # (serve.capture's Orchestrator.keep); never before, so it cannot delay an answer.
        self.answered = answered
        self.max_active = max_active
        self.max_queue = max_queue
        self.observe = observe
        self.batch = self._new_batch()
        self.active: list[_Job] = []
        self.waiting: deque[_Job] = deque()
        self._cv = threading.Condition()
        # Parsing encodes with the endpoint's own input tokenizer (orch.input_tokenizer), and the
        # worker decodes with orch.tokenizer, so one request's tokenization never holds up the
        # others' streams; this lock only keeps two parsing threads off one tokenizer (a fast
        # tokenizer raises "Already borrowed").
        self.parse_lock = threading.Lock()
        self._stopping = False
        self.dead: str | None = None  # why the worker stopped when nobody stopped it

    @property
    def ready(self) -> bool:
        """Takes requests: not unloading, and the worker (if one runs) has not died."""
        with self._cv:
            return not self._stopping and self.dead is None

    def _new_batch(self) -> Batch:
        return self.orch.new_batch()

    # -- the caller's side (execute) --------------------------------------------------------

    def submit(self, inputs: Mapping[str, np.ndarray], reply: Reply, timeout_us: int = 0) -> None:
        """Parse and queue one request; a bad or unplaceable request is answered at once."""
        if self.dead is not None:  # before parsing: nothing will run it
            deliver(reply, self._dead_error())
            return
        try:
            with self.parse_lock:
                rows = self.orch.parse(inputs)
        except RequestError as err:
            deliver(reply, err)
            return
        except Exception as err:  # a tokenizer or chat-template failure: this request only
            deliver(reply, RuntimeError(f"could not prepare the request: {type(err).__name__}: {err}"))
            return
        self.enqueue(rows, reply, timeout_us)

    def _dead_error(self) -> Unavailable:
        return Unavailable(
            f"this model instance's scheduler stopped ({self.dead}); retry on another instance, "
            "and reload the model (its readiness reports it)"
        )

    def enqueue(self, rows: list[Row], reply: Reply, timeout_us: int = 0) -> None:
        job = _Job(rows, reply)
        if timeout_us > 0:  # the request's own timeout (Triton's `timeout` parameter)
            job.deadline_ns = time.monotonic_ns() + timeout_us * 1000
            job.timeout_ms = timeout_us / 1000
        if rows[0].stream:
            job.streams = [TextStream(self.orch.tokenizer) for _ in rows]
        refused = None
        with self._cv:
            # Requests that will get a place at the next step are not waiting for one.
            free = self.max_active - sum(len(j.rows) for j in self.active)
            if self._stopping:
                refused = Unavailable("the model is unloading; retry on another instance or later")
            elif self.dead is not None:
                refused = self._dead_error()
            elif len(self.waiting) >= self.max_queue + max(free, 0):
                refused = Unavailable(
                    f"the queue is full ({self.max_queue} requests waiting); retry later, or raise serve.max_queue in the spec"
                )
            else:
                self.waiting.append(job)
                self._cv.notify()
        if refused is not None:  # answered outside the lock: a slow sender holds up nobody
            deliver(reply, refused)

    # -- the worker's side ------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        with self._cv:
            return bool(self.active or self.waiting)

    def serve(self) -> None:
        """The worker thread: step while there is work, sleep until a request comes. However
        it ends, what it holds is answered; ended by anything but stop(), it marks the
        scheduler dead so that later requests are refused and readiness turns False."""
        why: BaseException | None = None
        try:
            while True:
                with self._cv:
                    while not self._stopping and not self.active and not self.waiting and not self._renewal_due():
                        self._cv.wait()
                    if self._stopping:
                        break
                try:
                    self.step()
                except Exception as err:  # a bug here must not leave every later request hanging
                    log.error(f"the scheduler failed a step: {type(err).__name__}: {err}")
                    self._fail_active(RuntimeError(f"the scheduler failed: {type(err).__name__}: {err}"))
                    self.batch = self._new_batch()
        except BaseException as err:
            why = err
            raise
        finally:
            with self._cv:
                if not self._stopping:
                    self.dead = "its worker died" if why is None else f"its worker died: {type(why).__name__}: {why}"
            self.fail_all(self._dead_error() if self.dead else Unavailable("the model is unloading; retry later"))

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()

    def wake(self) -> None:
        """A renewal became due: an idle worker applies it now."""
        with self._cv:
            self._cv.notify_all()

    def _renewal_due(self) -> bool:
        return self.renewal is not None and self.renewal.due()

    def _admit_or_renew(self) -> None:
        """Admit, unless a renewal is due: then the requests in flight finish as they started,
        nothing joins them, and once none is left the renewal applies to a new batch."""
        if not self._renewal_due():
            self._admit()
        elif not self.active:
            self.renewal.apply()
            self.batch = self._new_batch()
            self._admit()

    def step(self) -> StepStats:
        """One round: drop cancelled, admit, one loop step, stream and answer."""
        stats = StepStats()
        self._drop_cancelled(stats)
        self._admit_or_renew()
        if self.batch.active:
            self.batch.saturated = self._saturated()
            try:
                report = self.batch.step()
            except Exception as err:  # an engine failure fails the running requests, not the server
                named = isinstance(err, RequestError) or hasattr(err, "triton_code")  # e.g. bls.EngineTimeout
                # answered by message; its traceback's frames would pin the step's arrays
                failure = err.with_traceback(None) if named else RuntimeError(f"generation failed: {err}")
                log.error(f"a step failed, failing its {len(self.active)} request(s): {type(err).__name__}: {err}")
                self._fail_active(failure, stats)
                self.batch = self._new_batch()
            else:
                stats.sequences, stats.drafted, stats.accepted, stats.draft_len = (
                    report.sequences,
                    report.drafted,
                    report.accepted,
                    report.draft_len,
                )
                stats.accepted_each, stats.extra_forwards = list(report.accepted_each), report.extra_forwards
                stats.num_draft_tokens = report.num_draft_tokens
                stats.chosen = list(report.chosen)
                self._answer(report.emitted, stats)
        with self._cv:
            stats.queued = len(self.waiting)
            stats.held = self._held()
        if self.observe is not None:
            try:
                self.observe(stats)
            except Exception as err:  # monitoring must never fail the requests it watches
                log.error(f"the step observer (metrics) raised {type(err).__name__}: {err}; the requests go on")
        return stats

    def _held(self) -> int:
        """Rows the running requests still hold in the batch."""
        return sum(len(j.keys) for j in self.active)

    def _saturated(self) -> bool:
        """No queued request can join before a running sequence leaves, and one waits to take
        its place. Not while a renewal is due: nobody joins then, so the load only falls."""
        with self._cv:
            room = self.max_active - self._held()
            return bool(self.waiting) and len(self.waiting[0].rows) > room and not self._renewal_due()

    def _drop_cancelled(self, stats: StepStats) -> None:
        now = time.monotonic_ns()
        for job in list(self.active):
            err = self._why_dropped(job, now)
            if err is not None:
                for key in job.keys:
                    res = self.batch.cancel(key)  # its sequence leaves before the next step
                    stats.ended.append(("cancelled", len(res.output_ids)))
                with self._cv:
                    self.active.remove(job)
                deliver(job.reply, err)
                stats.cancelled += 1
        with self._cv:
            waiting = list(self.waiting)
        for job in waiting:
            err = self._why_dropped(job, now)
            if err is not None:
                with self._cv:
                    self.waiting.remove(job)
                deliver(job.reply, err)
                stats.cancelled += 1

    def _why_dropped(self, job: _Job, now: int) -> Exception | None:
        if gone(job.reply):
            return Cancelled("the request was cancelled")
        if job.deadline_ns is not None and now > job.deadline_ns:
            return Unavailable(f"the request's timeout ({job.timeout_ms:g} ms) expired before it finished")
        return None

    def _admit(self) -> None:
        """Queued requests join the batch in arrival order while all their rows fit."""
        room = self.max_active - self._held()
        while True:
            with self._cv:
                if self.waiting and len(self.waiting[0].rows) > self.max_active:
                    # can never fit (the parser bounds rows by the batch size; guard anyway)
                    big = self.waiting.popleft()
                else:
                    big = None
                    if not self.waiting or len(self.waiting[0].rows) > room:
                        return
                    job = self.waiting.popleft()
            if big is not None:
                deliver(big.reply, RequestError(f"{len(big.rows)} sequences exceed this model's batch of {self.max_active}"))
                continue
            with self._cv:  # active first: if adding fails, the failure handler answers it
                self.active.append(job)
            scheduled = time.time_ns()
            for row in job.rows:
                row.times["first_scheduled_time_ns"] = scheduled
                job.keys.append(self.batch.add(row.request))
            room -= len(job.rows)

    def _answer(self, emitted: dict[int, list[int]], stats: StepStats) -> None:
        now = time.time_ns()
        results = self.batch.results
        for job in list(self.active):
            for row, key in zip(job.rows, job.keys):
                if emitted.get(key) or (key in emitted and results[key].done):
                    # done without tokens: EOS came (the engine did produce it)
                    row.times.setdefault("first_token_time_ns", now)
                    row.times["last_token_time_ns"] = now
            mine = [results[key] for key in job.keys]
            done = all(res.done for res in mine)
            ended = [self.batch.pop(key) for key in job.keys] if done else []
            try:
                out = self._responses(job, mine, ended, emitted, done)
            except Exception as err:  # our own bug or a resource limit: the client is still there
                self._answer_failed(
                    job, done, ended, RuntimeError(f"could not build the response: {type(err).__name__}: {err}"), stats
                )
                continue
            final = False
            try:
                for n, tensors in enumerate(out):
                    final = done and n == len(out) - 1
                    job.reply.send(tensors, final)
            except Exception as err:
                if final:  # the sender closed before writing it: nothing more can be sent
                    self._final_unsent(job, ended, err, stats)
                else:
                    self._answer_failed(
                        job, done, ended, RuntimeError(f"could not send the response: {type(err).__name__}: {err}"), stats
                    )
                continue
            if done:
                stats.ended += [(res.finish_reason, len(res.output_ids)) for res in ended]
                with self._cv:
                    self.active.remove(job)
                stats.finished += 1
                if self.answered is not None:
                    try:
                        self.answered(job.rows, ended, job.reply.request_id())
                    except Exception as err:  # the answer is out; only what follows it failed
                        log.error(f"after the answer: {type(err).__name__}: {err}")

    def _responses(self, job: _Job, mine, ended, emitted, done: bool) -> list[dict]:
        if job.streams is not None:
            return self._stream_step(job, mine, emitted)
        if done and job.rows[0].separate:  # one response per prompt / sequence, as upstream
            return [self.orch.pack([row], [res]) for row, res in zip(job.rows, ended)]
        if done:
            return [self.orch.pack(job.rows, ended)]
        return []

    def _answer_failed(self, job: _Job, done: bool, ended: list[GenerationResult], err: Exception, stats: StepStats) -> None:
        """A response could not be built or sent: the request leaves with ``err`` as its answer
        while its sender still works (counted failed); a client that is gone (cancelled, or
        its sender refuses the error too) leaves as a cancel."""
        if not done:
            ended = [self.batch.cancel(key) for key in job.keys]
        with self._cv:
            self.active.remove(job)
        cancelled = gone(job.reply)
        answered = deliver(job.reply, Cancelled("the request was cancelled") if cancelled else err)
        if cancelled or not answered:
            stats.ended += [("cancelled", len(res.output_ids)) for res in ended]
            stats.cancelled += 1
        else:
            stats.ended += [(None, len(res.output_ids)) for res in ended]
            stats.failed += 1

    def _final_unsent(self, job: _Job, ended: list[GenerationResult], err: Exception, stats: StepStats) -> None:
        """The request's final response raised as it was sent. Triton's Python backend marks a
        response sender closed BEFORE it writes the final response, so an error answer would
        be refused as well: the request leaves unanswered, logged with its id and counted."""
        with self._cv:
            self.active.remove(job)
        log.error(
            f"the final response could not be sent ({type(err).__name__}: {err}); the sender is closed, so the "
            "client gets no answer for this request",
            log.request_id(job.reply),
        )
        stats.ended += [(None, len(res.output_ids)) for res in ended]
        stats.unsent += 1

    @staticmethod
    def _stream_step(job: _Job, results: list[GenerationResult], emitted: dict[int, list[int]]) -> list[dict]:
        """This step's streamed responses of a job: one per row that produced tokens or
        ended (its last response carries the row's whole-request tensors). Several rows (the prompts of a
        batch, num_return_sequences) each say their batch_index and sequence_index."""
        out = []
        for row, key, stream, res in zip(job.rows, job.keys, job.streams or [], results):
            if key in job.closed or not (emitted.get(key) or res.done):
                continue
            new = emitted.get(key, [])
            tensors = stream.step(new, res.done) | log_prob_tensors([row], [res])
            if row.want_logits:
                # Only rows not sent yet are held (this step's): the response has its own copy,
                # so a long stream holds one step's logits, not its whole answer's.
                tensors |= logits_tensors([row], [res])
                res.generation_logits.clear()
            if row.separate:
                tensors["sequence_index"] = np.array([[row.sequence_index]], dtype=np.int32)
                tensors["batch_index"] = np.array([[row.batch_index]], dtype=np.int32)
            if res.done or row.want_metrics:
                # upstream's streamed responses each carry the perf outputs (so far) when asked
                tensors |= row_tensors([row], [res])
            if res.done:
                job.closed.add(key)
            out.append(tensors)
        return out

    def _fail_active(self, err: Exception, stats: StepStats | None = None) -> None:
        with self._cv:
            failed, self.active = self.active, []
        for job in failed:
            if stats is not None:
                stats.ended += [(None, len(self.batch.results[k].output_ids)) for k in job.keys if k in self.batch.results]
            deliver(job.reply, err)

    def fail_all(self, err: Exception) -> None:
        """Answer every request held, running or waiting, with ``err`` (unload)."""
        self._fail_active(err)
        with self._cv:
            waiting, self.waiting = list(self.waiting), deque()
        for job in waiting:
            deliver(job.reply, err)

"""Continuous batching in the orchestrator, without a server: requests join a running batch
between steps, each is answered the moment it ends, cancelled or timed-out requests leave
within one step, a full queue is refused at once. Engine calls go to the same EngineCore
objects the engine models run (as in test_triton_cores), and every answer is compared token
by token with target-only generation in process."""

from __future__ import annotations

import time

import numpy as np
import pytest
from test_triton_cores import PROMPTS, _call, _cores, _orchestrator, _request

from trtspec.triton.backend.scheduler import Cancelled, Scheduler, Unavailable


class ListReply:
    """Records what the scheduler answers; ``cancel()`` plays a client that gives up. Like
    Triton's Python backend's response sender, it refuses anything after a final answer
    (counted in ``refused``: the tests check nothing was answered twice)."""

    def __init__(self):
        self.sent: list[tuple[dict, bool]] = []
        self.error: Exception | None = None
        self._cancelled = False
        self.refused = 0

    def _open(self):
        if self.finished:
            self.refused += 1
            raise RuntimeError("Unable to send response. Response sender has been closed.")

    def send(self, tensors, final):
        self._open()
        self.sent.append((tensors, final))

    def fail(self, err):
        self._open()
        self.error = err

    def cancelled(self):
        return self._cancelled

    def cancel(self):
        self._cancelled = True

    @property
    def finished(self) -> bool:
        return self.error is not None or any(final for _, final in self.sent)

    def ids(self) -> list[int]:
        assert self.error is None, self.error
        assert self.refused == 0, "answered after its final response"
        if len(self.sent) == 1:  # unary: one answer with the whole output
            out = self.sent[0][0]
            return out["output_ids"][0, : out["sequence_length"][0, 0]].tolist()
        return [t for tensors, _ in self.sent for t in tensors["output_ids"][0].tolist()]


def _target_only(dep, prompt, max_tokens):
    (res,) = dep.generate([dep.request(dep.encode(prompt), max_tokens)], speculative=False)
    return res.output_ids


def _step_until(scheduler, done, limit=500):
    for _ in range(limit):
        if done():
            return
        scheduler.step()
    raise AssertionError("the scheduler did not get there")


def _drain_as_target_only(scheduler, dep, *expected):
    """Steps ``scheduler`` until idle; each (reply, prompt, max_tokens) then holds the
    target-only answer to that prompt."""
    _step_until(scheduler, lambda: not scheduler.busy)
    for reply, prompt, max_tokens in expected:
        assert reply.ids() == _target_only(dep, prompt, max_tokens)


def test_a_late_request_joins_the_running_batch_and_is_answered_first(built):
    dep = built()
    scheduler = Scheduler(_orchestrator(dep), max_active=4, max_queue=8)
    long, short = ListReply(), ListReply()
    scheduler.submit(_request(PROMPTS[0], max_tokens=48), long)
    for _ in range(3):
        assert scheduler.step().sequences == 1
    scheduler.submit(_request(PROMPTS[1], max_tokens=6), short)
    stats = scheduler.step()
    assert stats.sequences == 2  # joined between steps, not after the long one ended
    _step_until(scheduler, lambda: short.finished)
    assert not long.finished  # the short one was answered while the long one runs on
    assert short.ids() == _target_only(dep, PROMPTS[1], 6)
    _step_until(scheduler, lambda: long.finished)
    assert long.ids() == _target_only(dep, PROMPTS[0], 48)
    assert not scheduler.busy and scheduler.batch.results == {}  # nothing held after


def test_streams_get_every_steps_tokens_and_one_final_with_metrics(built):
    dep = built()
    scheduler = Scheduler(_orchestrator(dep, decoupled=True), max_active=4, max_queue=8)
    streamed, unary = ListReply(), ListReply()
    scheduler.submit(_request(PROMPTS[2], max_tokens=24, stream=True), streamed)
    scheduler.submit(_request(PROMPTS[0], max_tokens=24), unary)
    assert scheduler.step().sequences == 2  # both in one step
    steps = 1
    while scheduler.busy:
        scheduler.step()
        steps += 1
        if not streamed.finished:
            assert len(streamed.sent) == steps  # a response after every step
    assert streamed.ids() == _target_only(dep, PROMPTS[2], 24)
    assert unary.ids() == _target_only(dep, PROMPTS[0], 24)
    assert [final for _, final in streamed.sent] == [False] * (len(streamed.sent) - 1) + [True]
    assert "perf_metrics_json" in streamed.sent[-1][0]


def test_admission_is_capped_at_the_engines_batch_size(built):
    dep = built()
    scheduler = Scheduler(_orchestrator(dep), max_active=2, max_queue=8)
    replies = [ListReply() for _ in range(3)]
    for r, n in zip(replies, (4, 30, 8)):
        scheduler.submit(_request(PROMPTS[0], max_tokens=n), r)
    stats = scheduler.step()
    assert (stats.sequences, stats.queued) == (2, 1)
    _step_until(scheduler, lambda: replies[0].finished)
    stats = scheduler.step()  # the first one's place goes to the waiting one
    assert (stats.sequences, stats.queued) == (2, 0)
    _step_until(scheduler, lambda: not scheduler.busy)
    assert [r.ids() for r in replies] == [_target_only(dep, PROMPTS[0], n) for n in (4, 30, 8)]


def test_a_cancelled_request_leaves_within_one_step(built):
    dep = built()
    scheduler = Scheduler(_orchestrator(dep, decoupled=True), max_active=2, max_queue=8)
    gone, stays, waits = ListReply(), ListReply(), ListReply()
    scheduler.submit(_request(PROMPTS[0], max_tokens=64, stream=True), gone)
    scheduler.submit(_request(PROMPTS[1], max_tokens=40), stays)
    scheduler.submit(_request(PROMPTS[2], max_tokens=10), waits)
    assert scheduler.step().queued == 1
    scheduler.step()
    gone.cancel()
    stats = scheduler.step()
    assert isinstance(gone.error, Cancelled) and stats.cancelled == 1
    streamed = sum(t["output_ids"].shape[1] for t, _ in gone.sent)
    assert stats.ended == [("cancelled", streamed)]  # the tokens it had streamed
    assert stats.sequences == 2 and stats.queued == 0  # its place went to the waiting request
    assert len(scheduler.batch.results) == 2  # its sequence is gone from the batch
    _drain_as_target_only(scheduler, dep, (stays, PROMPTS[1], 40), (waits, PROMPTS[2], 10))


def test_a_cancelled_waiting_request_frees_its_queue_place(built):
    dep = built()
    scheduler = Scheduler(_orchestrator(dep), max_active=1, max_queue=1)
    running, waiting, refused = ListReply(), ListReply(), ListReply()
    scheduler.submit(_request(PROMPTS[0], max_tokens=20), running)
    scheduler.step()
    scheduler.submit(_request(PROMPTS[1], max_tokens=4), waiting)
    scheduler.submit(_request(PROMPTS[1], max_tokens=4), refused)
    assert isinstance(refused.error, Unavailable) and "queue is full (1 requests waiting)" in str(refused.error)
    waiting.cancel()
    assert scheduler.step().cancelled == 1 and isinstance(waiting.error, Cancelled)
    again = ListReply()
    scheduler.submit(_request(PROMPTS[1], max_tokens=4), again)
    assert again.error is None
    _drain_as_target_only(scheduler, dep, (running, PROMPTS[0], 20), (again, PROMPTS[1], 4))


def test_a_burst_fills_the_free_places_before_the_queue(built):
    dep = built()
    scheduler = Scheduler(_orchestrator(dep), max_active=2, max_queue=1)
    replies = [ListReply() for _ in range(4)]
    for r in replies:  # all before the worker's next step
        scheduler.submit(_request(PROMPTS[0], max_tokens=3), r)
    assert [r.error for r in replies[:3]] == [None] * 3  # two places free, one queue place
    assert isinstance(replies[3].error, Unavailable)
    _step_until(scheduler, lambda: not scheduler.busy)
    assert all(r.ids() == _target_only(dep, PROMPTS[0], 3) for r in replies[:3])


def test_an_expired_timeout_frees_the_slot(built):
    dep = built()
    scheduler = Scheduler(_orchestrator(dep), max_active=4, max_queue=8)
    late = ListReply()
    scheduler.submit(_request(PROMPTS[0], max_tokens=64), late, timeout_us=1)
    time.sleep(0.01)
    stats = scheduler.step()
    assert stats.cancelled == 1 and stats.sequences == 0
    assert isinstance(late.error, Unavailable) and "timeout (0.001 ms) expired" in str(late.error)
    assert not scheduler.busy


def test_bad_requests_are_answered_at_submit(built):
    dep = built()
    scheduler = Scheduler(_orchestrator(dep), max_active=4, max_queue=8)
    bad = ListReply()
    scheduler.submit(_request(PROMPTS[0], max_tokens=0), bad)
    assert bad.error is not None and "max_tokens must be at least 1" in str(bad.error)
    assert not scheduler.busy


def test_an_engine_failure_fails_the_running_requests_and_the_next_ones_are_served(built):
    dep = built()
    cores = _cores(dep)
    real = _call(cores)
    broken = {"on": False}

    def call(model, inputs, names):
        if broken["on"]:
            raise RuntimeError("engine died")
        return real(model, inputs, names)

    orch = _orchestrator(dep)
    orch.call = call
    scheduler = Scheduler(orch, max_active=4, max_queue=8)
    first, second = ListReply(), ListReply()
    scheduler.submit(_request(PROMPTS[0], max_tokens=20), first)
    scheduler.step()
    broken["on"] = True
    scheduler.step()
    assert "generation failed: engine died" in str(first.error)
    broken["on"] = False
    scheduler.submit(_request(PROMPTS[0], max_tokens=20), second)
    _drain_as_target_only(scheduler, dep, (second, PROMPTS[0], 20))


@pytest.mark.parametrize("k", [1, 4])
def test_step_stats_count_what_the_loop_did(built, k):
    dep = built()
    seen = []
    scheduler = Scheduler(_orchestrator(dep), max_active=4, max_queue=8, observe=seen.append)
    reply = ListReply()
    scheduler.submit(_request(PROMPTS[1], max_tokens=24, num_draft_tokens=k), reply)
    _step_until(scheduler, lambda: not scheduler.busy)
    (ref,) = dep.generate([dep.request(dep.encode(PROMPTS[1]), 24, k)], speculative=True)
    assert seen[0].draft_len == 0 and seen[0].drafted == 0  # the prefill step drafts nothing
    assert sum(s.drafted for s in seen) == ref.metrics.drafted
    assert sum(s.accepted for s in seen) == ref.metrics.accepted
    assert sum(s.finished for s in seen) == 1 and seen[-1].finished == 1
    assert seen[-1].ended == [(ref.finish_reason, len(ref.output_ids))] and seen[-1].held == 0
    assert all(s.held == 1 and s.sequences == 1 for s in seen[:-1])
    expected = list(ref.metrics.histogram)
    expected[0] -= sum(1 for _, drafted in ref.steps if drafted == 0)  # steps that drafted nothing
    got = np.bincount([a for s in seen for a in s.accepted_each], minlength=len(expected)).tolist()
    assert got == expected


def test_a_client_whose_sender_fails_leaves_and_the_others_are_served(built):
    dep = built()
    scheduler = Scheduler(_orchestrator(dep, decoupled=True), max_active=4, max_queue=8)

    class GoneReply(ListReply):  # a closed sender refuses every answer, the error too
        def send(self, tensors, final):
            raise RuntimeError("Unable to send response. Response sender has been closed.")  # the stub's words

        def fail(self, err):
            raise RuntimeError("Unable to send response. Response sender has been closed.")

    gone, kept = GoneReply(), ListReply()
    scheduler.submit(_request(PROMPTS[0], max_tokens=30, stream=True), gone)
    scheduler.submit(_request(PROMPTS[1], max_tokens=12), kept)
    stats = scheduler.step()
    assert stats.cancelled == 1 and stats.held == 1  # its place is free after the first step
    _drain_as_target_only(scheduler, dep, (kept, PROMPTS[1], 12))

"""Fault injection into the Triton backend's cores, without a server: senders that raise at
each point, fail() that raises, an engine raising mid-batch, a dying worker, a hung engine
(BLS timeout), a disconnect mid-stream, a huge prompt and a burst while streams run, an
oversized logits request, the LLM API streaming endpoint's bound and cleanup.

For each: every request gets exactly one final answer or one named error, the scheduler
stays ready and answers identically afterwards (token by token against target-only), and
nothing is held (places, batch sequences, threads)."""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import replace

import numpy as np
import pytest
from test_scheduler import _step_until, _target_only
from test_triton_cores import PROMPTS, _call, _cores, _orchestrator, _request

from trtspec.errors import RequestError
from trtspec.triton.backend.bls import (
    ENGINE_CALL_THREADS,
    UNREADY_AFTER_TIMEOUTS,
    EngineCallsClosed,
    EngineTimeout,
    with_timeout,
)
from trtspec.triton.backend.scheduler import Cancelled, Scheduler, Unavailable

CLOSED = "Unable to send response. Response sender has been closed."  # the stub's words


class Recorder:
    """A Reply that records every answer, final or not, and can fail on purpose:
    ``send_raises`` (the n-th send raises, 1-based; "final": the final one), ``fail_raises``
    (fail() raises too: a closed sender), ``cancel_after`` (the client gives up after that
    many responses), ``cancelled_raises`` (cancelled() itself raises).

    It closes as Triton's Python backend's response sender does (response_sender.cc): a
    final send (a final response, an error, a bare final flag) marks it closed BEFORE the
    response is written, so a final whose write raises still closes it; every send after
    that raises the stub's words and is counted in ``refused``."""

    def __init__(self, send_raises=None, fail_raises=False, cancel_after=None, cancelled_raises=False):
        self.sent: list[tuple[dict, bool, float]] = []
        self.errors: list[Exception] = []
        self.send_raises, self.fail_raises = send_raises, fail_raises
        self.cancel_after, self.cancelled_raises = cancel_after, cancelled_raises
        self.sends = 0
        self.closed = 0  # bare final flags (llmapi streams whose client left)
        self.shut = False  # a final was sent (or tried): the sender refuses everything now
        self.refused = 0  # sends after the final

    def _write(self, final: bool) -> None:
        if self.shut:
            self.refused += 1
            raise RuntimeError(CLOSED)
        if final:
            self.shut = True  # before the write, as the stub does

    def send(self, tensors, final):
        self._write(final)
        self.sends += 1
        if self.send_raises == self.sends or (self.send_raises == "final" and final):
            raise RuntimeError("Failed to increase the shared memory pool size")
        self.sent.append((tensors, final, time.perf_counter()))

    def fail(self, err):
        if self.fail_raises:
            raise RuntimeError(CLOSED)
        self._write(True)
        self.errors.append(err)

    def cancelled(self):
        if self.cancelled_raises:
            raise RuntimeError("the request was released")
        return self.cancel_after is not None and len(self.sent) >= self.cancel_after

    def close(self):
        self._write(True)
        self.closed += 1

    def request_id(self):
        return f"req-{id(self)}"

    @property
    def answers(self) -> int:
        """Final answers that reached the client: final responses, errors, bare final flags."""
        return sum(final for _, final, _ in self.sent) + len(self.errors) + self.closed

    @property
    def error(self) -> Exception | None:
        return self.errors[0] if self.errors else None

    def ids(self) -> list[int]:
        assert not self.errors, self.errors
        finals = [t for t, final, _ in self.sent if final]
        if len(self.sent) == 1:  # unary: one answer with the whole output
            out = finals[0]
            return out["output_ids"][0, : out["sequence_length"][0, 0]].tolist()
        return [t for tensors, _, _ in self.sent for t in tensors["output_ids"][0].tolist()]


def _still_serves(scheduler: Scheduler, dep, stream: bool = False) -> None:
    """Nothing is held, the scheduler is ready, and a fresh request is answered identically."""
    assert not scheduler.busy and scheduler.batch.results == {} and scheduler.ready
    fresh = Recorder()
    scheduler.submit(_request(PROMPTS[1], max_tokens=10, stream=stream), fresh)
    _step_until(scheduler, lambda: fresh.answers)
    assert fresh.answers == 1 and fresh.refused == 0 and fresh.ids() == _target_only(dep, PROMPTS[1], 10)
    assert not scheduler.busy and scheduler.batch.results == {}


# -- a reply that cannot be built or sent ----------------------------------------------------


def test_a_response_that_cannot_be_built_is_answered_with_the_error(built):
    dep = built()
    orch = _orchestrator(dep)
    scheduler = Scheduler(orch, max_active=4, max_queue=8)
    real = orch.pack

    def pack(rows, results):
        if rows[0].request.max_tokens == 7:
            raise MemoryError("cannot allocate the output")
        return real(rows, results)

    orch.pack = pack
    broken, kept = Recorder(), Recorder()
    scheduler.submit(_request(PROMPTS[0], max_tokens=7), broken)
    scheduler.submit(_request(PROMPTS[2], max_tokens=12), kept)
    seen = []
    while scheduler.busy:
        seen.append(scheduler.step())
    assert broken.answers == 1 and "could not build the response: MemoryError" in str(broken.error)
    assert sum(s.failed for s in seen) == 1 and sum(s.cancelled for s in seen) == 0  # failed, not a cancel
    assert kept.ids() == _target_only(dep, PROMPTS[2], 12)
    _still_serves(scheduler, dep)


@pytest.mark.parametrize(("stream", "at"), [(True, 1), (True, 3)])
def test_a_sender_raising_at_each_point_gets_the_error_while_it_works(built, stream, at):
    dep = built()
    scheduler = Scheduler(_orchestrator(dep, decoupled=True), max_active=4, max_queue=8)
    broken, kept = Recorder(send_raises=at), Recorder()
    scheduler.submit(_request(PROMPTS[0], max_tokens=20, stream=stream), broken)
    scheduler.submit(_request(PROMPTS[2], max_tokens=20, stream=True), kept)
    seen = []
    while scheduler.busy:
        seen.append(scheduler.step())
    assert broken.answers == 1 and "could not send the response" in str(broken.error)
    assert sum(s.failed for s in seen) == 1 and sum(s.cancelled for s in seen) == 0
    assert kept.answers == 1 and kept.ids() == _target_only(dep, PROMPTS[2], 20)
    _still_serves(scheduler, dep, stream=True)


@pytest.mark.parametrize("stream", [True, False])
def test_a_final_that_cannot_be_sent_is_logged_and_counted_never_answered_twice(built, stream, caplog):
    """The sender closes before it writes a final response, so when that write raises
    nothing else can reach the client: the request is not answered a second time (no
    error after it), it is counted unsent (not a cancel), and the log names its request id."""
    from trtspec.triton.backend.metrics import EndpointMetrics, MemorySink

    dep = built()
    orch, sink = _orchestrator(dep, decoupled=True), MemorySink()
    orch.metrics = EndpointMetrics(sink, "m", "speculative", "m_0", dep.spec.speculative.max_draft_len)
    scheduler = Scheduler(orch, max_active=4, max_queue=8, observe=orch.observe_step)
    broken, kept = Recorder(send_raises="final"), Recorder()
    scheduler.submit(_request(PROMPTS[0], max_tokens=20, stream=stream), broken)
    scheduler.submit(_request(PROMPTS[2], max_tokens=20, stream=True), kept)
    seen = []
    with caplog.at_level("ERROR", logger="trtspec.triton.backend"):
        while scheduler.busy:
            seen.append(scheduler.step())
    assert broken.answers == 0 and broken.refused == 0  # nothing sent after the final that raised
    assert sum(s.unsent for s in seen) == 1
    assert sink.value("trtspec_responses_unsent_total", model="m", mode="speculative", instance="m_0").value == 1
    assert sum(s.failed for s in seen) == 0 and sum(s.cancelled for s in seen) == 0
    assert any("final response could not be sent" in r.message and broken.request_id() in r.message for r in caplog.records)
    assert kept.answers == 1 and kept.ids() == _target_only(dep, PROMPTS[2], 20)
    _still_serves(scheduler, dep, stream=True)


@pytest.mark.parametrize("cancelled_raises", [False, True])
def test_a_closed_sender_leaves_as_a_cancel_and_the_others_are_served(built, cancelled_raises):
    dep = built()
    scheduler = Scheduler(_orchestrator(dep, decoupled=True), max_active=4, max_queue=8)
    gone = Recorder(send_raises=2, fail_raises=True, cancelled_raises=cancelled_raises)
    kept = Recorder()
    scheduler.submit(_request(PROMPTS[0], max_tokens=30, stream=True), gone)
    scheduler.submit(_request(PROMPTS[1], max_tokens=12), kept)
    seen = []
    while scheduler.busy:
        seen.append(scheduler.step())
    assert gone.answers == 0  # nothing can reach it
    assert sum(s.cancelled for s in seen) == 1 and sum(s.failed for s in seen) == 0
    assert kept.ids() == _target_only(dep, PROMPTS[1], 12)
    _still_serves(scheduler, dep)


# -- fail() raising, the engine raising ------------------------------------------------------


def test_a_raising_fail_on_a_cancelled_request_never_stops_the_step(built):
    dep = built()
    scheduler = Scheduler(_orchestrator(dep, decoupled=True), max_active=4, max_queue=8)
    gone = Recorder(cancel_after=1, fail_raises=True)
    queued_gone = Recorder(fail_raises=True, cancelled_raises=True)  # waits, then its sender breaks
    kept = Recorder()
    scheduler.submit(_request(PROMPTS[0], max_tokens=30, stream=True), gone)
    scheduler.submit(_request(PROMPTS[2], max_tokens=16, stream=True), kept)
    scheduler.step()
    scheduler.max_active = 2  # the next one waits in the queue
    scheduler.submit(_request(PROMPTS[1], max_tokens=5), queued_gone)
    stats = scheduler.step()  # both leave here; their fail() raises
    assert stats.cancelled == 2 and len(scheduler.batch.results) == 1
    _step_until(scheduler, lambda: not scheduler.busy)
    assert kept.ids() == _target_only(dep, PROMPTS[2], 16)
    _still_serves(scheduler, dep)


def test_an_engine_raising_mid_batch_fails_each_running_request_once_even_if_one_fail_raises(built):
    dep = built()
    real = _call(_cores(dep))
    broken = {"on": False}

    def call(model, inputs, names):
        if broken["on"] and model == "tensorrt_llm":
            raise RuntimeError("CUDA error: an illegal memory access")
        return real(model, inputs, names)

    orch = _orchestrator(dep)
    orch.call = call
    scheduler = Scheduler(orch, max_active=4, max_queue=8)
    closed, first, second = Recorder(fail_raises=True), Recorder(), Recorder()
    for reply, prompt in zip((closed, first, second), PROMPTS):
        scheduler.submit(_request(prompt, max_tokens=20), reply)
    scheduler.step()
    broken["on"] = True
    stats = scheduler.step()
    assert [r.answers for r in (first, second)] == [1, 1]  # the raising fail() before them stopped nothing
    assert all("generation failed: CUDA error" in str(r.error) for r in (first, second))
    assert [reason for reason, _ in stats.ended] == [None, None, None]
    broken["on"] = False
    _still_serves(scheduler, dep)


# -- the worker ------------------------------------------------------------------------------


def _serve(scheduler: Scheduler) -> threading.Thread:
    worker = threading.Thread(target=scheduler.serve, name="test-scheduler", daemon=True)
    worker.start()
    return worker


def _wait(what, timeout=30.0):
    end = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < end, "timed out waiting"
        time.sleep(0.005)


def test_a_step_failure_on_the_worker_fails_the_running_requests_and_it_serves_on(built):
    dep = built()
    scheduler = Scheduler(_orchestrator(dep), max_active=4, max_queue=8)
    real_answer = scheduler._answer
    boom = {"left": 1}

    def answer(emitted, stats):
        if boom["left"]:
            boom["left"] -= 1
            raise KeyError("a scheduler bug")
        real_answer(emitted, stats)

    scheduler._answer = answer
    worker = _serve(scheduler)
    try:
        hit = Recorder()
        scheduler.submit(_request(PROMPTS[0], max_tokens=8), hit)
        _wait(lambda: hit.answers)
        assert hit.answers == 1 and "the scheduler failed: KeyError" in str(hit.error)
        after = Recorder()
        scheduler.submit(_request(PROMPTS[2], max_tokens=8), after)
        _wait(lambda: after.answers)
        assert after.ids() == _target_only(dep, PROMPTS[2], 8)
        assert scheduler.ready and worker.is_alive()
    finally:
        scheduler.stop()
        worker.join(10)
    assert not worker.is_alive()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the dying worker re-raises
def test_a_dying_worker_answers_everything_and_turns_unready(built):
    dep = built()
    orch = _orchestrator(dep)
    scheduler = Scheduler(orch, max_active=1, max_queue=8)
    gate = threading.Event()
    real_step = scheduler.step

    def step():
        gate.wait(10)  # let requests queue up first
        real_step()
        raise RuntimeError("a scheduler bug")

    def new_batch():  # and the recovery fails too: the worker cannot go on
        raise OSError("the drafter could not be made")

    scheduler.step = step
    worker = _serve(scheduler)
    replies = [Recorder(fail_raises=i == 0) for i in range(4)]  # the first one's fail() raises too
    for i, reply in enumerate(replies):
        scheduler.submit(_request(PROMPTS[i % 3], max_tokens=6), reply)
    orch.new_batch = new_batch
    gate.set()
    worker.join(10)
    assert not worker.is_alive()
    assert [r.answers for r in replies] == [0, 1, 1, 1]  # the closed sender got nothing; the rest one each
    assert not scheduler.ready and "worker died: OSError" in scheduler.dead
    assert all(isinstance(r.error, Unavailable) for r in replies[2:])  # the queued ones: UNAVAILABLE
    later = Recorder()
    t0 = time.monotonic()
    scheduler.submit(_request(PROMPTS[0], max_tokens=6), later)
    assert later.answers == 1 and isinstance(later.error, Unavailable) and time.monotonic() - t0 < 1
    assert "reload the model" in str(later.error)
    assert not scheduler.busy


# -- a hung engine model (BLS timeout) -------------------------------------------------------


def test_a_hung_engine_fails_the_step_by_name_and_the_next_request_is_served(built):
    dep = built()
    real = _call(_cores(dep))
    release, hung = threading.Event(), threading.Event()

    def call(model, inputs, names):
        if model == "tensorrt_llm" and not release.is_set():
            hung.set()
            release.wait(30)  # the engine model hangs until released
        return real(model, inputs, names)

    orch = _orchestrator(dep)
    orch.call = with_timeout(call, 0.5)
    scheduler = Scheduler(orch, max_active=4, max_queue=8)
    threads = threading.active_count()
    victim = Recorder()
    scheduler.submit(_request(PROMPTS[0], max_tokens=12), victim)
    t0 = time.monotonic()
    scheduler.step()
    assert 0.5 <= time.monotonic() - t0 < 5 and hung.is_set()
    assert victim.answers == 1 and isinstance(victim.error, EngineTimeout)
    assert "engine model tensorrt_llm did not answer within 0.5 s" in str(victim.error)
    release.set()
    _still_serves(scheduler, dep)
    # the abandoned call's thread serves the next calls: threads are the pool's, never one per call
    assert threading.active_count() - threads <= orch.call.workers <= 2
    assert orch.call.healthy


def test_a_hung_engine_holds_a_bounded_number_of_threads_and_readiness_follows_it():
    """Every call to a hung engine times out; the calls hold at most ENGINE_CALL_THREADS
    threads (those still in line are dropped), readiness turns False after
    UNREADY_AFTER_TIMEOUTS timeouts in a row, and True again once the engine answers."""
    release = threading.Event()
    ran = []

    def hung(model, inputs, names):
        ran.append(inputs["x"])
        release.wait(30)
        return {n: inputs["x"] for n in names}

    threads = threading.active_count()
    calls = with_timeout(hung, 0.05)
    for x in range(ENGINE_CALL_THREADS + 3):
        with pytest.raises(EngineTimeout, match="did not answer within 0.05 s"):
            calls("tensorrt_llm", {"x": x}, ["y"])
        assert threading.active_count() - threads <= ENGINE_CALL_THREADS
        assert calls.healthy == (x + 1 < UNREADY_AFTER_TIMEOUTS)
    release.set()
    _wait(lambda: len(ran) == ENGINE_CALL_THREADS)  # the ones still in line never ran
    assert calls("tensorrt_llm", {"x": 99}, ["y"]) == {"y": 99} and calls.healthy
    assert threading.active_count() - threads <= calls.workers == ENGINE_CALL_THREADS


def test_closing_the_engine_calls_ends_a_waiting_step_at_once():
    """Unload (EngineCalls.close) ends a call waiting on a hung engine now, not at its timeout."""
    release = threading.Event()
    calls = with_timeout(lambda model, inputs, names: release.wait(30), 60)
    errors = []

    def step():
        try:
            calls("tensorrt_llm", {}, [])
        except Exception as err:
            errors.append(err)

    waiting = threading.Thread(target=step)
    waiting.start()
    _wait(lambda: calls.workers == 1)
    t0 = time.monotonic()
    calls.close()
    waiting.join(10)
    assert time.monotonic() - t0 < 2 and isinstance(errors[0], EngineCallsClosed)
    assert errors[0].triton_code == "UNAVAILABLE" and "unloading" in str(errors[0])
    with pytest.raises(EngineCallsClosed):
        calls("tensorrt_llm", {}, [])
    release.set()


def test_the_engine_call_timeout_passes_answers_and_errors_through():
    timed = with_timeout(lambda model, inputs, names: {n: inputs["x"] for n in names}, 5)
    assert timed("m", {"x": 3}, ["a"]) == {"a": 3}

    def broken(model, inputs, names):
        raise RuntimeError("tensorrt_llm: bad input")

    with pytest.raises(RuntimeError, match="bad input"):
        with_timeout(broken, 5)("m", {}, [])


# -- a disconnect mid-stream -----------------------------------------------------------------


def test_a_disconnect_mid_stream_frees_its_sequence_within_one_step(built):
    dep = built()
    scheduler = Scheduler(_orchestrator(dep, decoupled=True), max_active=4, max_queue=8)
    gone, kept = Recorder(cancel_after=3), Recorder()
    scheduler.submit(_request(PROMPTS[0], max_tokens=40, stream=True), gone)
    scheduler.submit(_request(PROMPTS[1], max_tokens=20, stream=True), kept)
    _step_until(scheduler, lambda: len(gone.sent) >= 3)
    stats = scheduler.step()
    assert stats.cancelled == 1 and gone.answers == 1 and isinstance(gone.error, Cancelled)
    assert len(scheduler.batch.results) == 1
    _step_until(scheduler, lambda: not scheduler.busy)
    assert kept.ids() == _target_only(dep, PROMPTS[1], 20)
    _still_serves(scheduler, dep, stream=True)


# -- hostile sizes -----------------------------------------------------------------------------


def test_a_multi_megabyte_prompt_is_refused_before_tokenizing(built, monkeypatch):
    from trtspec.triton.backend import orchestrator_core

    dep = built()
    orch = _orchestrator(dep)
    scheduler = Scheduler(orch, max_active=4, max_queue=8)
    tokenized = []
    real = orchestrator_core.encode_prompt

    def spy(tokenizer, prompt, chat):
        tokenized.append(len(prompt))
        return real(tokenizer, prompt, chat)

    monkeypatch.setattr(orchestrator_core, "encode_prompt", spy)
    huge = Recorder()
    t0 = time.monotonic()
    scheduler.submit(_request("tell me a story. " * 250_000, max_tokens=8), huge)  # 4.25 MB
    took = time.monotonic() - t0
    assert huge.answers == 1 and isinstance(huge.error, RequestError)
    assert "text_input is 4250000 bytes, more than the" in str(huge.error) and "max_input_len 256" in str(huge.error)
    assert tokenized == [] and took < 2
    fits = Recorder()  # the longest prompt the limit lets through still reaches the token check
    scheduler.submit(_request("a" * orch.max_text_bytes, max_tokens=8), fits)
    assert "more than max_input_len 256" in str(fits.error)
    _still_serves(scheduler, dep)


def test_an_oversized_logits_request_is_refused_by_name(built):
    dep = built()
    orch = _orchestrator(dep)
    orch.s = replace(orch.s, max_response_mb=1)
    scheduler = Scheduler(orch, max_active=4, max_queue=8)
    vocab = dep.limits.vocab_size
    most = 2**20 // (vocab * 4)
    big, ok = Recorder(), Recorder()
    scheduler.submit(_request(PROMPTS[0], max_tokens=most + 1, return_generation_logits=True), big)
    assert big.answers == 1 and isinstance(big.error, RequestError)
    assert "return_generation_logits with max_tokens" in str(big.error) and f"ask at most {most} tokens" in str(big.error)
    assert "serve.max_response_mb" in str(big.error)
    scheduler.submit(_request(PROMPTS[0], max_tokens=min(most, 16), return_generation_logits=True), ok)
    _step_until(scheduler, lambda: ok.answers)
    logits = ok.sent[-1][0]["generation_logits"]
    assert ok.error is None and logits.shape[-1] == vocab and logits.nbytes <= 2**20
    _still_serves(scheduler, dep)


def test_a_logits_stream_holds_only_the_rows_not_sent_yet(built):
    """Streamed generation_logits are dropped once sent: between steps a sequence holds
    none, and the stream's rows are the unary answer's."""
    dep = built()
    scheduler = Scheduler(_orchestrator(dep, decoupled=True), max_active=4, max_queue=8)
    unary, stream = Recorder(), Recorder()
    scheduler.submit(_request(PROMPTS[0], max_tokens=24, return_generation_logits=True), unary)
    _step_until(scheduler, lambda: unary.answers)
    scheduler.submit(_request(PROMPTS[0], max_tokens=24, return_generation_logits=True, stream=True), stream)
    held = []
    while scheduler.busy:
        scheduler.step()
        held += [len(res.generation_logits) for res in scheduler.batch.results.values()]
    k = dep.spec.speculative.default_draft_tokens
    assert held and max(held) == 0 and len(stream.sent) > 1  # sent, then dropped, every step
    streamed = np.concatenate([t["generation_logits"][0, 0] for t, _, _ in stream.sent if "generation_logits" in t])
    whole = unary.sent[-1][0]["generation_logits"][0, 0]
    # the same rows (the prefix cache changes forward shapes, so float sums may differ in the last bits)
    assert 1 < k + 1 < len(whole) and streamed.shape == whole.shape and np.allclose(streamed, whole, atol=1e-4)
    assert streamed.argmax(-1).tolist() == stream.ids() == unary.ids()
    _still_serves(scheduler, dep)


# -- the goal: hostile traffic never stalls running streams --------------------------------------


def test_running_streams_keep_streaming_through_a_huge_prompt_and_a_burst(built, monkeypatch):
    """Two live streams on the worker thread while another thread (execute's) submits a
    4 MB prompt, a prompt that takes 3 s to tokenize (a long context's worth) and a burst of
    24 requests into a queue of 2: the hostile requests are refused within 2 s, and each
    stream's largest gap between responses stays within 3x its median gap. The target engine
    call takes 250 ms, so a step is steady and a busy 2-core machine's hiccups (up to ~0.7 s
    seen) stay inside 3x, while a stall behind a tokenization (3 s, 9 s before the fix) shows."""
    from trtspec.triton.backend import orchestrator_core

    dep = built()
    real = _call(_cores(dep))
    encode = orchestrator_core.encode_prompt

    def slow_encode(tokenizer, prompt, chat):
        if prompt == "slow":
            time.sleep(3.0)
        return encode(tokenizer, prompt, chat)

    monkeypatch.setattr(orchestrator_core, "encode_prompt", slow_encode)

    def call(model, inputs, names):
        if model == "tensorrt_llm":
            time.sleep(0.25)
        return real(model, inputs, names)

    orch = _orchestrator(dep, decoupled=True)
    orch.call = call
    scheduler = Scheduler(orch, max_active=2, max_queue=2)
    threads = threading.active_count()
    worker = _serve(scheduler)
    streams = [Recorder(), Recorder()]
    try:
        for reply, prompt in zip(streams, PROMPTS):
            scheduler.submit(_request(prompt, max_tokens=60, stream=True), reply)  # outlasts the hostile part
        _wait(lambda: all(len(r.sent) >= 4 for r in streams))
        refused: list[float] = []
        huge = Recorder()
        t0 = time.monotonic()
        scheduler.submit(_request("tell me a story. " * 250_000, max_tokens=8), huge)
        refused.append(time.monotonic() - t0)
        slow = Recorder()
        scheduler.submit(_request("slow", max_tokens=4), slow)  # parsed while the streams step
        burst = [Recorder() for _ in range(24)]
        for reply in burst:
            t0 = time.monotonic()
            scheduler.submit(_request(PROMPTS[2], max_tokens=4), reply)
            if reply.answers:
                refused.append(time.monotonic() - t0)
        _wait(lambda: all(r.answers for r in streams + burst + [slow]), timeout=120)
    finally:
        scheduler.stop()
        worker.join(10)
    assert isinstance(huge.error, RequestError) and max(refused) < 2
    assert slow.ids() == _target_only(dep, "slow", 4)
    queued = [r for r in burst if r.error is None]
    assert len(queued) == 1 and all(isinstance(r.error, Unavailable) for r in burst if r not in queued)
    assert all(r.ids() == _target_only(dep, PROMPTS[2], 4) for r in queued)
    for reply, prompt in zip(streams, PROMPTS):
        assert reply.answers == 1 and reply.ids() == _target_only(dep, prompt, 60)
        gaps = np.diff([t for _, _, t in reply.sent])
        assert max(gaps) <= 3 * statistics.median(gaps), (max(gaps), statistics.median(gaps))
    assert not worker.is_alive() and threading.active_count() == threads


# -- the LLM API streaming endpoint ------------------------------------------------------------


class _FakeResult:
    """An LLM API streaming result: one token per step; waits for ``gate`` before each."""

    def __init__(self, n: int, gate: threading.Event):
        self.n, self.gate, self.aborted = n, gate, False

    def __iter__(self):
        from types import SimpleNamespace

        ids: list[int] = []
        for i in range(self.n):
            assert self.gate.wait(30)
            if self.aborted:
                return
            ids.append(5 + i)
            out = SimpleNamespace(token_ids=list(ids), token_ids_diff=[5 + i], request_perf_metrics=None)
            yield SimpleNamespace(outputs=[out], finished=i == self.n - 1)

    def abort(self):
        self.aborted = True


class _FakeLLM:
    def __init__(self):
        self.gate = threading.Event()
        self.results: list[_FakeResult] = []

    def generate_async(self, ids, params, streaming=False):
        self.results.append(_FakeResult(params.max_tokens, self.gate))
        return self.results[-1]


def _llmapi(dep, max_queue):
    from trtspec.speculative.llmapi import load_api
    from trtspec.triton.backend.llmapi_core import LlmapiEndpoint

    settings = replace(_orchestrator(dep).s, decoupled=True, margins_supported=False, sampling_supported=False)
    llm = _FakeLLM()
    return LlmapiEndpoint(settings, dep.tokenizer, dep.end_ids, llm, load_api("double", "1.2"), max_queue=max_queue), llm


def _llmapi_request(prompt, max_tokens):
    inputs = _request(prompt, max_tokens=max_tokens, stream=True)
    del inputs["return_perf_metrics"]
    return inputs


def test_llmapi_streams_are_bounded_by_the_queue_and_give_their_places_back(built):
    dep = built()
    endpoint, llm = _llmapi(dep, max_queue=1)
    assert endpoint.max_streams == dep.limits.max_batch_size + 1
    threads = threading.active_count()
    replies = [Recorder() for _ in range(endpoint.max_streams + 2)]
    started = [endpoint.submit_stream(_llmapi_request(PROMPTS[0], 3), r) for r in replies]
    assert sum(t is not None for t in started) == endpoint.max_streams
    refused = replies[endpoint.max_streams :]
    assert all(r.answers == 1 and isinstance(r.error, Unavailable) for r in refused)
    assert f"queue is full ({endpoint.max_streams} streams in flight)" in str(refused[0].error)
    llm.gate.set()
    for t in started[: endpoint.max_streams]:
        t.join(10)
    for r in replies[: endpoint.max_streams]:
        assert r.answers == 1 and r.error is None and [t for x, _, _ in r.sent for t in x["output_ids"][0]] == [5, 6, 7]
    assert threading.active_count() == threads
    again = [Recorder() for _ in range(endpoint.max_streams)]  # every place was given back
    for t in [endpoint.submit_stream(_llmapi_request(PROMPTS[1], 2), r) for r in again]:
        t.join(10)
    assert all(r.answers == 1 and r.error is None for r in again)


@pytest.mark.parametrize("fail_raises", [False, True])
def test_llmapi_a_send_raising_mid_stream_aborts_the_generation_and_never_raises(built, fail_raises):
    dep = built()
    endpoint, llm = _llmapi(dep, max_queue=0)
    llm.gate.set()
    broken = Recorder(send_raises=2, fail_raises=fail_raises)
    endpoint.submit_stream(_llmapi_request(PROMPTS[0], 8), broken).join(10)  # the thread ended without raising
    assert llm.results[0].aborted  # the generation does not run on holding its KV cache
    assert broken.answers == (0 if fail_raises else 1)
    if not fail_raises:
        assert "Failed to increase the shared memory pool size" in str(broken.error)
    cancelled = Recorder(cancel_after=2)
    endpoint.submit_stream(_llmapi_request(PROMPTS[0], 8), cancelled).join(10)
    assert llm.results[1].aborted and cancelled.closed == 1 and cancelled.answers == 1
    full = [Recorder() for _ in range(endpoint.max_streams)]  # both places came back
    for t in [endpoint.submit_stream(_llmapi_request(PROMPTS[1], 2), r) for r in full]:
        t.join(10)
    assert all(r.answers == 1 and r.error is None for r in full)
    assert not any(r.aborted for r in llm.results[2:])  # finished streams are not aborted


# -- the same on a real tritonserver (127.0.0.1, gRPC) ------------------------------------------


@pytest.fixture(scope="module")
def hostile_server(tmp_path_factory, tiny_ckpts):
    """Tiny engines, one instance per endpoint with 2 places and 1 queue place, and a 1 MB
    response cap (serve.max_response_mb) so a modest logits request is over it."""
    pytest.importorskip("tritonclient.grpc", reason="needs the serve extra: pip install 'trtspec[serve]'")
    from conftest import serve_tiny

    overrides = {"build.max_batch_size": 2, "serve.instance_count": 1, "serve.max_queue": 1, "serve.max_response_mb": 1}
    yield from serve_tiny(tmp_path_factory, tiny_ckpts, "hostile", **overrides)


def _grpc_inputs(prompt: str, max_tokens: int, stream: bool, **flags):
    from trtspec.triton.request import infer_inputs

    values = {"text_input": prompt, "max_tokens": max_tokens, "apply_chat_template": True, "exclude_input_in_output": True}
    return infer_inputs(values | {"stream": stream} | flags)


class _GrpcStream:
    """One request on its own gRPC stream to the decoupled endpoint; every response's arrival."""

    def __init__(self, endpoint: str, prompt: str, max_tokens: int, stream: bool = True, **flags):
        import queue

        import tritonclient.grpc as grpcclient

        from trtspec.layout import BLS_STREAMING_MODEL

        self.client = grpcclient.InferenceServerClient(endpoint)
        self.events: queue.Queue = queue.Queue()
        self.at: list[float] = []
        self.tokens: list[int] = []
        self.error = None
        self.done = False
        self.sent_at = time.monotonic()
        self.client.start_stream(callback=lambda result, error: self.events.put((time.monotonic(), result, error)))
        inputs = _grpc_inputs(prompt, max_tokens, stream, **flags)
        self.client.async_stream_infer(BLS_STREAMING_MODEL, inputs, enable_empty_final_response=True)

    def read(self, until, timeout=300):
        end = time.monotonic() + timeout
        while not self.done and not until(self):
            at, result, error = self.events.get(timeout=max(end - time.monotonic(), 0.001))
            if error is not None:
                self.error, self.done = error, True
                self.at.append(at)
                continue
            ids = result.as_numpy("output_ids")
            if ids is not None and ids.size:
                self.tokens += ids[0, : int(result.as_numpy("sequence_length")[0, 0])].tolist()
                self.at.append(at)
            self.done = result.get_response().parameters["triton_final_response"].bool_param
        return self

    def close(self):
        self.client.stop_stream()
        self.client.close()


@pytest.mark.server
def test_a_real_server_keeps_streaming_through_hostile_requests(hostile_server):
    """On tritonserver: while two streams run, a 4 MB prompt, an over-the-cap logits request
    and a burst of 6 into the full endpoint are each answered within 2 s (the hostile ones
    refused by name, one of the burst queued); the streams end identical to target-only, and
    the server answers the same again afterwards. (The streams' gap ratio is asserted at the
    core level above, where a step's time is steady: here a ~35 ms step on a shared 2-core
    machine shows 4-5x gaps with no hostile traffic at all.)"""
    server, dep = hostile_server
    url = server.grpc_endpoint
    streams = [_GrpcStream(url, prompt, 150) for prompt in PROMPTS[:2]]
    hostile: list[_GrpcStream] = []
    try:
        for s in streams:
            s.read(lambda s: len(s.at) >= 3)
        hostile.append(_GrpcStream(url, "tell me a story. " * 250_000, 8, stream=False))
        # 2 sequences x 400 tokens x 384 vocab x 4 bytes = 1.2 MB, over the 1 MB cap
        hostile.append(_GrpcStream(url, PROMPTS[2], 400, stream=False, return_generation_logits=True, num_return_sequences=2))
        hostile += [_GrpcStream(url, PROMPTS[2], 4, stream=False) for _ in range(6)]
        for h in hostile:
            h.read(lambda h: h.error is not None or h.tokens, timeout=30)
        for s in streams:
            s.read(lambda s: False)
        for h in hostile:
            h.read(lambda h: False)
    finally:
        for s in streams + hostile:
            s.close()
    huge, logits, burst = hostile[0], hostile[1], hostile[2:]
    # (a gRPC stream's error carries the message; its code is the stream's, not the request's)
    assert huge.error is not None and "text_input is 4250000 bytes" in huge.error.message()
    assert huge.at[0] - huge.sent_at < 2
    assert logits.error is not None and "serve.max_response_mb" in logits.error.message()
    assert logits.at[0] - logits.sent_at < 2
    queued = [b for b in burst if b.error is None]
    refused = [b for b in burst if b.error is not None]
    assert len(queued) == 1 and queued[0].tokens == _target_only(dep, PROMPTS[2], 4)
    assert all("the queue is full (1 requests waiting)" in b.error.message() and b.at[0] - b.sent_at < 2 for b in refused)
    for s, prompt in zip(streams, PROMPTS):
        assert s.error is None and s.tokens == _target_only(dep, prompt, 150)
    again = _GrpcStream(url, PROMPTS[1], 10).read(lambda s: False)
    again.close()
    assert again.error is None and again.tokens == _target_only(dep, PROMPTS[1], 10)
    _a_direct_engine_call_is_refused(url, dep)


def _a_direct_engine_call_is_refused(url: str, dep) -> None:
    """The engine models answer only the repository's own BLS models (callers.py): a client
    calling one directly, with or without a guessed key, is refused by name."""
    import tritonclient.grpc as grpcclient

    from trtspec.layout import ENGINE_MODELS

    ids = np.array([dep.encode(PROMPTS[0])], dtype=np.int32)
    for params in (None, {"trtspec_caller": "0" * 32}):
        inputs = []
        for name, arr in (
            ("input_ids", ids),
            ("input_lengths", np.array([[ids.shape[1]]], np.int32)),
            ("request_output_len", np.array([[4]], np.int32)),
        ):
            tensor = grpcclient.InferInput(name, list(arr.shape), "INT32")
            tensor.set_data_from_numpy(arr)
            inputs.append(tensor)
        with pytest.raises(Exception, match="is internal to this model repository"):
            grpcclient.InferenceServerClient(url).infer(ENGINE_MODELS["target"], inputs, parameters=params)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the dying worker re-raises
def test_the_orchestrator_models_readiness_follows_its_worker(built, monkeypatch):
    """models/orchestrator.py's is_ready() (what Triton asks where python_backend supports
    user readiness): True while the worker serves, False once it died; the control, which
    has no worker, is ready."""
    import sys
    import types

    names = ["triton_python_backend_utils", "trtspec.triton.backend.models", "trtspec.triton.backend.models.pb"]
    names.append("trtspec.triton.backend.models.orchestrator")
    for name in names:  # imported here against a stand-in, then forgotten again
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", types.ModuleType("triton_python_backend_utils"))
    monkeypatch.setenv("GOMP_SPINCOUNT", "10000")  # models/__init__ would set it for the stub
    from trtspec.triton.backend.models.orchestrator import TritonPythonModel

    try:
        dep = built()
        orch = _orchestrator(dep)
        model = object.__new__(TritonPythonModel)
        model.scheduler = Scheduler(orch, max_active=2, max_queue=2)
        model.worker = _serve(model.scheduler)
        model.calls = None  # engine calls without a timeout (test_backend_models covers them)
        assert model.is_ready()

        def new_batch():
            raise OSError("the drafter could not be made")

        def step():
            raise RuntimeError("a scheduler bug")

        model.scheduler.step, orch.new_batch = step, new_batch
        reply = Recorder()
        model.scheduler.submit(_request(PROMPTS[0], max_tokens=4), reply)
        model.worker.join(10)
        assert not model.is_ready() and isinstance(reply.error, Unavailable)
        control = object.__new__(TritonPythonModel)
        control.scheduler = None
        assert control.is_ready()
    finally:
        for name in names[1:]:
            sys.modules.pop(name, None)

"""The Triton model classes (trtspec/triton/backend/models/) and the backend's own guards,
run against a stand-in for triton_python_backend_utils whose response sender closes as the
real one does (tests/pb_standin.py): execute() answers each request once even when one of
its batch cannot be read, readiness follows the engine models' timeouts, unload answers
every held request at once, swallowed errors reach Triton's log with the request id, a
raising metrics observer fails nobody, and stored errors do not pin request arrays."""

from __future__ import annotations

import gc
import json
import os
import threading
import time
import types
import weakref

import numpy as np
import pb_standin
import pytest
from test_faults import _serve, _wait
from test_scheduler import _step_until, _target_only
from test_triton_cores import PROMPTS, _call, _cores, _orchestrator, _request

from trtspec.errors import RequestError
from trtspec.speculative.requests import Limits
from trtspec.triton.backend.bls import UNREADY_AFTER_TIMEOUTS, with_timeout
from trtspec.triton.backend.engine_core import EngineCore
from trtspec.triton.backend.scheduler import Scheduler


@pytest.fixture
def pb(monkeypatch):
    module = pb_standin.install(monkeypatch)
    yield module
    pb_standin.forget()


def _model(scheduler, calls=None, orch=None):
    from trtspec.triton.backend.models.orchestrator import TritonPythonModel

    model = object.__new__(TritonPythonModel)
    model.scheduler, model.calls, model.core = scheduler, calls, orch
    model.key, model.client_scopes = "server-key", False
    model.sink = types.SimpleNamespace(close=lambda: None)
    return model


def _ids(sender) -> list[int]:
    ((response, flags),) = sender.responses
    assert flags == pb_standin.FINAL and not response.has_error(), sender.errors
    out = {t.name(): t.as_numpy() for t in response.output_tensors}
    return out["output_ids"][0, : out["sequence_length"][0, 0]].tolist()


def test_execute_answers_a_request_it_cannot_read_alone_and_never_raises(built, pb):
    """One unreadable request in a batch: it alone gets one error (and a log line with its id);
    the others, already queued, get their own answers once (a raising execute() would have
    made Triton answer all of them with its error too)."""
    dep = built()
    scheduler = Scheduler(_orchestrator(dep), max_active=4, max_queue=8)
    model = _model(scheduler)
    good = pb_standin.Request(_request(PROMPTS[0], max_tokens=6), "good-1")
    bad = pb_standin.Request(_request(PROMPTS[1], max_tokens=6), "bad-2", unreadable=True)
    late = pb_standin.Request(_request(PROMPTS[2], max_tokens=6), "good-3")
    assert model.execute([good, bad, late]) is None
    assert bad.sender.finals == 1 and "could not take the request" in bad.sender.errors[0]
    assert any(level == "error" and "'bad-2'" in line for level, line in pb.Logger.lines)
    _step_until(scheduler, lambda: not scheduler.busy)
    assert _ids(good.sender) == _target_only(dep, PROMPTS[0], 6)
    assert _ids(late.sender) == _target_only(dep, PROMPTS[2], 6)
    assert all(r.sender.refused == 0 for r in (good, bad, late))


def test_a_final_that_cannot_be_written_is_logged_through_triton_with_the_request_id(built, pb):
    dep = built()
    scheduler = Scheduler(_orchestrator(dep), max_active=4, max_queue=8)
    model = _model(scheduler)
    broken = pb_standin.Request(
        _request(PROMPTS[0], max_tokens=6), "big-1", sender=pb_standin.ResponseSender(write_raises="final")
    )
    kept = pb_standin.Request(_request(PROMPTS[2], max_tokens=6), "ok-2")
    model.execute([broken, kept])
    seen = []
    while scheduler.busy:
        seen.append(scheduler.step())
    assert broken.sender.responses == [] and broken.sender.refused == 0  # nothing after the final that raised
    assert sum(s.unsent for s in seen) == 1
    assert any("final response could not be sent" in line and "'big-1'" in line for _, line in pb.Logger.lines)
    assert _ids(kept.sender) == _target_only(dep, PROMPTS[2], 6)


def test_readiness_turns_false_after_engine_timeouts_and_back_when_one_answers(built, pb):
    dep = built()
    release = threading.Event()

    def hung(model, inputs, names):
        release.wait(30)
        return {n: np.zeros(1) for n in names}

    calls = with_timeout(hung, 0.05)
    scheduler = Scheduler(_orchestrator(dep), max_active=2, max_queue=2)
    model = _model(scheduler, calls)
    model.worker = _serve(scheduler)
    try:
        assert model.is_ready()
        for _ in range(UNREADY_AFTER_TIMEOUTS):
            assert model.is_ready()
            with pytest.raises(RuntimeError, match="did not answer"):
                calls("tensorrt_llm", {}, ["y"])
        assert not model.is_ready()
        release.set()
        _wait(model.is_ready)  # the engine answered (the abandoned requests): ready again
    finally:
        scheduler.stop()
        model.worker.join(10)


def test_unload_answers_every_held_request_at_once_while_a_step_waits_on_a_hung_engine(built, pb):
    """finalize() closes the engine calls, so the step waiting on a hung engine ends now
    (not at its 60 s timeout): the running and the queued requests each get one UNAVAILABLE
    answer before finalize returns."""
    dep = built()
    real = _call(_cores(dep))
    release, hung = threading.Event(), threading.Event()

    def call(model, inputs, names):
        if model == "tensorrt_llm":
            hung.set()
            release.wait(60)
        return real(model, inputs, names)

    orch = _orchestrator(dep)
    orch.call = calls = with_timeout(call, 60)
    scheduler = Scheduler(orch, max_active=1, max_queue=4)
    model = _model(scheduler, calls, orch)
    model.worker = _serve(scheduler)
    requests = [pb_standin.Request(_request(p, max_tokens=6), f"r{i}") for i, p in enumerate(PROMPTS)]
    model.execute(requests)
    _wait(hung.is_set)
    t0 = time.monotonic()
    model.finalize()
    assert time.monotonic() - t0 < 5 and not model.worker.is_alive()
    for r in requests:
        assert r.sender.finals == 1 and r.sender.refused == 0
        assert "unloading" in r.sender.errors[0]
    release.set()


def test_a_raising_metrics_observer_fails_no_request(built, caplog):
    dep = built()

    def observe(stats):
        raise ValueError("a metric family was unregistered")

    scheduler = Scheduler(_orchestrator(dep), max_active=4, max_queue=8, observe=observe)
    from test_faults import Recorder

    reply = Recorder()
    with caplog.at_level("ERROR", logger="trtspec.triton.backend"):
        scheduler.submit(_request(PROMPTS[0], max_tokens=8), reply)
        _step_until(scheduler, lambda: reply.answers)
    assert reply.answers == 1 and reply.ids() == _target_only(dep, PROMPTS[0], 8)
    assert any("observer (metrics) raised ValueError" in r.message for r in caplog.records)


def test_an_error_kept_as_an_answer_does_not_pin_the_request_arrays():
    """An error stored as a request's answer carries no traceback: its frames would hold the
    request's arrays in a reference cycle, alive until the garbage collector ran."""

    def run(items):
        raise AssertionError("never runs: the request is refused first")

    core = EngineCore(run, Limits(vocab_size=32, max_seq_len=64, max_draft_len=4, max_batch_size=2))
    ids = np.full((1, 8), 99, dtype=np.int32)  # outside the vocabulary: refused while parsing
    alive = weakref.ref(ids)
    request = {"input_ids": ids, "input_lengths": np.array([[8]], np.int32), "request_output_len": np.array([[2]], np.int32)}
    gc.disable()
    try:
        (answer,) = core.infer([request])
        del request, ids
        assert isinstance(answer, RequestError) and alive() is None
    finally:
        gc.enable()


def test_an_engine_model_checks_sizes_before_it_converts_any_row():
    """A request wider than the engine can hold is refused from its shape alone: no row
    becomes a Python list (a million-token row would be a list of a million ints first)."""
    import tracemalloc

    def run(items):
        raise AssertionError("never runs: the request is refused first")

    limits = Limits(vocab_size=32, max_seq_len=64, max_draft_len=4, max_batch_size=2)
    core = EngineCore(run, limits)
    wide = np.full((1, 1_000_000), 7, dtype=np.int32)
    request = {
        "input_ids": wide,
        "input_lengths": np.array([[1_000_000]], np.int32),
        "request_output_len": np.array([[1]], np.int32),
    }
    tracemalloc.start()
    try:
        (answer,) = core.infer([request])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert isinstance(answer, RequestError) and "input_ids is 1000000 tokens wide" in str(answer)
    assert "at most 64 tokens per sequence (max_seq_len)" in str(answer)
    assert peak < 2**20  # the old order built an 8 MB list of the row before checking it
    # within the width, an id outside the vocabulary is still named (read from the array)
    bad = {"input_ids": np.array([[1, 2, 40]], np.int32), "input_lengths": np.array([[3]], np.int32)}
    (answer,) = core.infer([bad | {"request_output_len": np.array([[1]], np.int32)}])
    assert isinstance(answer, RequestError) and "token id 40 is outside the vocabulary (0..31)" in str(answer)


def test_the_caller_key_is_one_per_server_private_and_checked(tmp_path):
    import subprocess

    from trtspec.triton.backend import callers

    server, other = os.getpid(), os.getppid()  # two live "servers"
    key = callers.server_key(server, tmp_path)
    assert key and callers.server_key(server, tmp_path) == key  # every stub of the server reads the same
    assert callers.server_key(other, tmp_path) != key  # another server, another key
    assert (callers.key_path(server, tmp_path).stat().st_mode & 0o777) == 0o600
    assert callers.from_inside(f'{{"{callers.CALLER_PARAMETER}": "{key}"}}', key)
    for given in ("{}", '{"trtspec_caller": "guess"}', '{"trtspec_caller": 1}', "not json", None):
        assert not callers.from_inside(given, key)
    # no key could be made or read: fail closed, nobody is inside (not even a claimed key)
    assert not callers.from_inside("{}", None) and not callers.from_inside(f'{{"trtspec_caller": "{key}"}}', None)
    assert callers.caller_of("{}", key) == callers.ANYONE and callers.caller_of(None, None) == callers.ANYONE
    assert callers.caller_of('{"trtspec_caller": "guess"}', key) == callers.WRONG_KEY
    assert callers.caller_of(f'{{"trtspec_caller": "{key}"}}', None) == callers.WRONG_KEY
    assert callers.server_key(1, tmp_path / "missing") is None
    # a new key removes the files of servers that are gone, never a live one's
    gone = subprocess.Popen(["true"])
    gone.wait()
    callers.key_path(gone.pid, tmp_path).write_text("old")
    callers.key_path(other, tmp_path).unlink()
    callers.server_key(other, tmp_path)
    assert not callers.key_path(gone.pid, tmp_path).exists()
    assert callers.server_key(server, tmp_path) == key


def test_an_engine_model_answers_only_its_repositorys_bls_models(pb, tmp_path):
    """A direct call to an engine model is refused by name before its inputs are read (it
    would take KV-cache slots and queue places from the speculative endpoints' sequences);
    the endpoints' BLS requests carry the server's caller key and are served."""
    from trtspec.triton.backend import callers
    from trtspec.triton.backend.models import pb as models_pb
    from trtspec.triton.backend.models.engine_model import TritonPythonModel

    key = callers.server_key(777, tmp_path)
    served = []

    class Core:
        def infer(self, inputs):
            served.extend(inputs)
            return [{"output_ids": np.zeros((1, 1, 1), np.int32)} for _ in inputs]

    model = object.__new__(TritonPythonModel)
    model.core, model.key, model.name = Core(), key, "tensorrt_llm"
    models_pb._request("tensorrt_llm", {"input_ids": np.zeros((1, 2), np.int32)}, ["output_ids"], 0, key)
    (bls,) = pb.InferenceRequest.made
    assert bls.parameters == {callers.CALLER_PARAMETER: key}
    inside = pb_standin.Request({"input_ids": np.ones((1, 2), np.int32)}, parameters=json.dumps(bls.parameters))
    outside = pb_standin.Request({"input_ids": np.ones((1, 2), np.int32)}, unreadable=True)  # never read
    guessed = pb_standin.Request({}, unreadable=True, parameters='{"trtspec_caller": "0123"}')
    answers = model.execute([outside, inside, guessed])
    assert len(served) == 1 and served[0]["input_ids"].sum() == 2
    assert not answers[1].has_error()
    for refused in (answers[0], answers[2]):
        assert refused.has_error() and refused.error().code == "INVALID_ARG"
        assert "tensorrt_llm is internal to this model repository" in refused.error().message()


def test_an_engine_model_without_a_caller_key_refuses_every_request_by_name(pb):
    """Where the key file cannot be made or read the gate fails closed: every request, even one
    claiming a key, is refused with the error that names the fix; none reaches the engine."""
    from trtspec.triton.backend.models.engine_model import TritonPythonModel

    class Core:
        def infer(self, inputs):
            assert not inputs, "no request may reach the engine"
            return []

    model = object.__new__(TritonPythonModel)
    model.core, model.key, model.name = Core(), None, "tensorrt_llm"
    plain = pb_standin.Request({"input_ids": np.ones((1, 2), np.int32)}, unreadable=True)
    claimed = pb_standin.Request({}, unreadable=True, parameters='{"trtspec_caller": "0123"}')
    for answer in model.execute([plain, claimed]):
        assert answer.has_error() and answer.error().code == "INTERNAL"
        assert "tensorrt_llm refuses every request: this tritonserver could not make or read its caller key" in (
            answer.error().message()
        )
        assert "give tritonserver a writable /dev/shm" in answer.error().message()


def test_the_front_finds_the_caller_key_of_the_server_on_its_port(tmp_path):
    import socket

    from trtspec.triton.backend import callers

    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        assert callers.key_for_port(port, tmp_path) is None  # this process has no key file yet
        key = callers.server_key(os.getpid(), tmp_path)
        assert callers.key_for_port(port, tmp_path) == key
    assert callers.key_for_port(port, tmp_path) is None  # nobody listens there now


def _engine_inputs(ids=(5, 6, 7), lengths=None, out_len=2, draft=None, **extra):
    inputs = {
        "input_ids": np.array([list(ids)], np.int32),
        "input_lengths": np.array([[len(ids) if lengths is None else lengths]], np.int32),
        "request_output_len": np.array([[out_len]], np.int32),
    }
    if draft is not None:
        inputs["draft_input_ids"] = np.array([list(draft)], np.int32)
    return inputs | {k: np.array([[v]]) for k, v in extra.items()}


ENGINE_BAD_REQUESTS = [
    # (draft model?, inputs, expected text): what an engine model answers a malformed request
    # of the endpoints (clients cannot reach it: test_an_engine_model_answers_only_its_repositorys_bls_models)
    (False, _engine_inputs(ids=(5, 6, 99999)), "token id 99999 is outside the vocabulary"),
    (False, _engine_inputs(ids=(5, -2)), "token id -2 is outside the vocabulary"),
    (False, _engine_inputs(draft=(1, 2, 400), out_len=4), "token id 400 is outside the vocabulary"),
    (False, _engine_inputs(draft=(1, 2, 3)), "request_output_len 2 must be at least len(draft_input_ids) + 1 = 4"),
    (False, _engine_inputs(draft=list(range(9)), out_len=10), "9 draft tokens exceed max_draft_len 8"),
    (False, _engine_inputs(lengths=7), "input_lengths[0] is 7"),
    (False, _engine_inputs(out_len=0), "request_output_len must be at least 1"),
    (False, _engine_inputs(out_len=600), "exceeds max_seq_len 512"),
    (False, _engine_inputs(streaming=True), "streaming=true needs a decoupled model"),
    (True, _engine_inputs(draft=(1, 2), out_len=3), "built without speculative decoding"),
    (False, {k: v for k, v in _engine_inputs().items() if k != "input_lengths"}, "input_lengths"),
    # every input has a checked range (penalties, temperature, bias weights and min_tokens:
    # Processing; hidden_states_from: answer_features): these were taken before
    (False, _engine_inputs(out_len=1, return_top_k=17), "return_top_k must be in 0..16"),
    (False, _engine_inputs(out_len=1, return_top_k=384), "return_top_k must be in 0..16"),
    (False, _engine_inputs(end_id=384), "end_id must be a token id (0..383) or -1"),
    (False, _engine_inputs(end_id=-2), "end_id must be a token id (0..383) or -1"),
    (False, _engine_inputs(pad_id=-5), "pad_id must be a token id (0..383)"),
]


@pytest.mark.parametrize(("draft_model", "inputs", "text"), ENGINE_BAD_REQUESTS)
def test_an_engine_model_names_what_is_wrong_with_a_request(draft_model, inputs, text):
    def run(items):
        raise AssertionError("never runs: the request is refused first")

    limits = Limits(vocab_size=384, max_seq_len=512, max_draft_len=0 if draft_model else 8, max_batch_size=4)
    (answer,) = EngineCore(run, limits).infer([inputs])
    assert isinstance(answer, RequestError) and text in str(answer)


def test_a_served_engine_makes_every_matmul_shape_at_load_and_a_one_shot_load_does_not(pb, monkeypatch, tmp_path):
    """The Triton engine model is a long-lived server: it loads its engine with every matmul
    shape made (TorchEngine.warm_matmuls, so serving never adds one); a plain load (verify,
    bench, distill: one-shot commands) does not pay for shapes it may never meet."""
    import inspect

    from trtspec.engines.torch.engine import TorchEngine
    from trtspec.triton.backend.models import engine_model

    assert inspect.signature(TorchEngine.load).parameters["warm"].default is False
    asked = {}

    def load(folder, slots=None, max_seq_len=None, device=None, warm=False, compiled=True):
        asked.update(folder=folder, slots=slots, warm=warm, compiled=compiled)
        raise RuntimeError("stop after the load")

    monkeypatch.setattr(engine_model.TorchEngine, "load", staticmethod(load))
    config = {
        "max_batch_size": 4,
        "parameters": {"engine_dir": {"string_value": str(tmp_path)}, "kv_cache_slots": {"string_value": "4"}},
    }
    with pytest.raises(RuntimeError, match="stop after the load"):
        engine_model.TritonPythonModel().initialize({"model_config": json.dumps(config), "model_name": "tensorrt_llm"})
    # served engines compile where measured faster (warm also compiles every kind at each count)
    assert asked == {"folder": tmp_path, "slots": 4, "warm": True, "compiled": True}

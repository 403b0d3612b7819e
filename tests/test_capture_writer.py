"""serve.capture's writer thread: a kept request's part is serialized, hashed, written and
bounded off the serving thread, from a bounded queue that drops (and counts) rather than make
serving wait, drained by close(); the parts are byte for byte those a direct write makes."""

from __future__ import annotations

import threading

import pytest
import torch

import trtspec.speculative.capture as capture
from trtspec.spec import CaptureSpec
from trtspec.speculative.capture import CaptureWriter, parts, read_capture
from trtspec.speculative.parts import SOFT_TOP_K, write_part

PROMPT, OUTPUT = [3, 4, 5, 6], [7, 8, 9]


class FakeEngine:
    """What a writer reads of the target: features and labels of every position it holds."""

    def __init__(self):
        self.every_row = None

    def capture_labels(self, k, every_row=True):
        self.k, self.every_row = k, every_row

    def features_of(self, tokens, start, stop):
        return torch.arange(stop - start, dtype=torch.float32).repeat(4, 1).T.contiguous() + tokens[0]

    def labels_of(self, tokens, start, stop):
        ids = torch.arange(SOFT_TOP_K).repeat(stop - start, 1) + torch.tensor(tokens[start:stop])[:, None]
        return ids.long(), -ids.float()


def _writer(tmp_path, clock=None, **kw):
    spec = CaptureSpec(dir=str(tmp_path), max_gb=1, sample=1.0)
    ticks = iter(range(10**9, 2 * 10**9))
    return CaptureWriter(spec, tmp_path, FakeEngine(), clock=clock or (lambda: next(ticks)), **kw)


@pytest.fixture
def held(monkeypatch):
    """write_part held back until ``release`` is set; ``started`` once a write began; the
    threads each write ran on."""
    started, release, threads = threading.Event(), threading.Event(), []
    write = capture.write_part

    def slow(*args, **kw):
        threads.append(threading.current_thread())
        started.set()
        assert release.wait(30)
        write(*args, **kw)

    monkeypatch.setattr(capture, "write_part", slow)
    return started, release, threads


def test_the_part_is_written_off_the_serving_thread(tmp_path, held):
    started, release, threads = held
    w = _writer(tmp_path)
    path = w.record("r0", PROMPT, OUTPUT, "bob/x")
    assert path is not None and started.wait(30)
    assert not path.exists()  # record() returned while its write is still held back
    release.set()
    w.flush()
    assert path.exists() and threads == [w.thread] and w.thread is not threading.current_thread()
    assert [c.record["request_id"] for c in read_capture(tmp_path)] == ["r0"]
    w.close()


def test_close_writes_every_queued_part_then_stops(tmp_path, held):
    started, release, _ = held
    w = _writer(tmp_path)
    paths = [w.record(f"r{i}", PROMPT, OUTPUT, "") for i in range(4)]
    assert started.wait(30) and all(paths)
    threading.Timer(0.2, release.set).start()
    w.close()
    assert parts(tmp_path) == sorted(paths) and not w.thread.is_alive()
    assert w.record("late", PROMPT, OUTPUT, "") is None and w.dropped == 1  # closed: not kept


def test_a_full_queue_drops_the_request_and_counts_it_never_waiting(tmp_path, held):
    started, release, _ = held
    w = _writer(tmp_path, queue_size=1)
    first = w.record("r0", PROMPT, OUTPUT, "")
    assert started.wait(30)  # the thread holds r0; the queue is empty
    second = w.record("r1", PROMPT, OUTPUT, "")  # queued
    assert w.record("r2", PROMPT, OUTPUT, "") is None and w.dropped == 1  # full: returned at once
    release.set()
    w.close()
    assert parts(tmp_path) == [first, second] and w.dropped == 1


def test_parts_are_identical_to_a_direct_write(tmp_path):
    w = _writer(tmp_path / "async", clock=lambda: 10**18)
    path = w.record("r0", PROMPT, OUTPUT, "bob/x")
    w.close()
    direct = tmp_path / "direct.safetensors"
    meta = {"request_id": "r0", "tenant": "bob", "scope": "bob/x", "time_ns": 10**18}
    write_part(direct, [w.sample_of(PROMPT, OUTPUT)], meta)
    assert path.read_bytes() == direct.read_bytes()


def test_a_failed_write_loses_only_its_part(tmp_path, monkeypatch):
    w = _writer(tmp_path)
    write = capture.write_part

    def failing(path, samples, meta):
        if meta["request_id"] == "r0":
            raise OSError("disk full")
        write(path, samples, meta)

    monkeypatch.setattr(capture, "write_part", failing)
    w.record("r0", PROMPT, OUTPUT, "")
    w.record("r1", PROMPT, OUTPUT, "")
    w.close()
    assert w.failed == 1 and [c.record["request_id"] for c in read_capture(tmp_path)] == ["r1"]


def test_unloading_the_target_engine_model_writes_the_queued_parts(tmp_path, held, monkeypatch):
    import pb_standin

    pb_standin.install(monkeypatch)
    try:
        from trtspec.triton.backend.models.engine_model import TritonPythonModel

        started, release, _ = held
        model = object.__new__(TritonPythonModel)
        model.capture = _writer(tmp_path)
        paths = [model.capture.record(f"r{i}", PROMPT, OUTPUT, "") for i in range(3)]
        assert started.wait(30)
        threading.Timer(0.2, release.set).start()
        model.finalize()  # what Triton calls on unload
        assert parts(tmp_path) == sorted(paths) and not model.capture.thread.is_alive()
    finally:
        pb_standin.forget()

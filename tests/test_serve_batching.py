"""Continuous batching and cancellation on a real tritonserver (127.0.0.1, gRPC).

One small server: tiny engines with max_batch_size 2, one instance per endpoint and one queue
place (serve.max_queue 1), so two live sequences fill an endpoint, a third request waits and a
fourth is refused. Every answer that
completes is compared token by token with target-only generation of the same engines in
process. The orderings asserted below are ones the old run-to-the-end batching could not
produce: a request that came later is answered while an earlier, longer one still streams.
"""

from __future__ import annotations

import queue
import time

import pytest

grpcclient = pytest.importorskip("tritonclient.grpc", reason="needs the serve extra: pip install 'trtspec[serve]'")
from conftest import serve_tiny  # noqa: E402
from test_serve import _bls, _ids  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from trtspec.layout import BLS_MODEL as BLS  # noqa: E402
from trtspec.layout import BLS_STREAMING_MODEL as BLS_STREAMING  # noqa: E402

pytestmark = pytest.mark.server

LONG = "The quick brown fox"  # the tiny target writes 400 tokens for it without an EOS
MID = "Triton serves models over HTTP and gRPC."
SHORT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def small(tmp_path_factory, tiny_ckpts):
    yield from serve_tiny(
        tmp_path_factory, tiny_ckpts, "batching", **{"build.max_batch_size": 2, "serve.instance_count": 1, "serve.max_queue": 1}
    )


def _target_only(dep, prompt, max_tokens):
    (res,) = dep.generate([dep.request(dep.encode(prompt), max_tokens)], speculative=False)
    return res.output_ids


class Stream:
    """One request on its own gRPC stream (the decoupled endpoint takes no unary calls);
    ``stream`` False asks for one response. Remembers when its final response came."""

    def __init__(self, endpoint, prompt, max_tokens, name, stream=True, timeout=None):
        self.client = grpcclient.InferenceServerClient(endpoint)
        self.events: queue.Queue = queue.Queue()
        self.tokens: list[int] = []
        self.final_at: float | None = None
        self.error = None
        self.client.start_stream(
            callback=lambda result, error: self.events.put((time.monotonic(), result, error)), stream_timeout=timeout
        )
        inputs = _bls(prompt, max_tokens, stream=stream)
        self.client.async_stream_infer(BLS_STREAMING, inputs, request_id=name, enable_empty_final_response=True)

    def wait_tokens(self, n=1, timeout=300):
        """Read responses until at least n tokens came (or the request ended)."""
        deadline = time.monotonic() + timeout
        while len(self.tokens) < n and not self.ended:
            self._read(deadline - time.monotonic())

    def wait_final(self, timeout=300):
        deadline = time.monotonic() + timeout
        while not self.ended:
            self._read(deadline - time.monotonic())
        return self

    @property
    def ended(self) -> bool:
        return self.final_at is not None or self.error is not None

    def _read(self, timeout):
        at, result, error = self.events.get(timeout=max(timeout, 0.001))
        if error is not None:
            self.error, self.final_at = error, at
            return
        ids = result.as_numpy("output_ids")
        if ids is not None and ids.size:
            # A streamed step holds [1, n] new tokens; a one-response answer its whole
            # output, sequence_length long.
            n = int(result.as_numpy("sequence_length")[0, 0])
            self.tokens += ids[0, :n].tolist()
        if result.get_response().parameters["triton_final_response"].bool_param:
            self.final_at = at

    def cancel(self):
        self.client.stop_stream(cancel_requests=True)

    def close(self):
        self.client.stop_stream()


def a_cancelled_stream_leaves(endpoint: str, prompt: str) -> None:
    """A long stream cancelled after its first token and closed; the server gets a second to
    drop it (the caller then checks the next request is answered exactly)."""
    long = Stream(endpoint, prompt, 300, "cancelled")
    try:
        long.wait_tokens(1)
        long.cancel()
    finally:
        long.close()
    time.sleep(1)


def test_a_later_request_joins_the_running_batch_and_is_answered_first(small):
    server, dep = small
    long = Stream(server.grpc_endpoint, LONG, 160, "long")
    short = None
    try:
        long.wait_tokens(1)  # generating now
        short = Stream(server.grpc_endpoint, SHORT, 6, "short", stream=False).wait_final()
        assert short.error is None, short.error
        assert not long.ended  # answered while the long stream still runs
        long.wait_final()
    finally:
        long.close()
        if short:
            short.close()
    assert long.error is None, long.error
    assert short.tokens == _target_only(dep, SHORT, 6)
    assert long.tokens == _target_only(dep, LONG, 160)


def test_a_cancelled_stream_frees_its_place_within_a_step(small):
    server, dep = small
    doomed = Stream(server.grpc_endpoint, LONG, 400, "doomed")
    other = Stream(server.grpc_endpoint, MID, 200, "other")
    waiting = None
    try:
        doomed.wait_tokens(1)
        other.wait_tokens(1)  # both places of the endpoint are taken
        waiting = Stream(server.grpc_endpoint, SHORT, 4, "waiting", stream=False)
        time.sleep(0.5)  # queued behind the two streams
        assert not waiting.ended
        doomed.cancel()
        waiting.wait_final()
        # It got the cancelled stream's place: without that it would have waited for `other`.
        assert waiting.error is None, waiting.error
        assert not other.ended
        other.wait_final()
    finally:
        other.close()
        if waiting:
            waiting.close()
    assert waiting.tokens == _target_only(dep, SHORT, 4)
    assert other.error is None and other.tokens == _target_only(dep, MID, 200)
    # The server keeps serving, both endpoints.
    c = grpcclient.InferenceServerClient(server.grpc_endpoint)
    assert _ids(c.infer(BLS, _bls(SHORT, 5))) == _target_only(dep, SHORT, 5)


def test_an_expired_client_deadline_frees_its_place(small):
    server, dep = small
    other = Stream(server.grpc_endpoint, MID, 200, "other2")
    expired = waiting = None
    try:
        other.wait_tokens(1)
        expired = Stream(server.grpc_endpoint, LONG, 400, "expired", stream=False, timeout=0.3).wait_final()
        assert expired.error is not None and "Deadline" in str(expired.error)
        # The endpoint has two places; were the expired request still generating, this one
        # would wait for it (400 tokens) or for `other` (200).
        waiting = Stream(server.grpc_endpoint, SHORT, 4, "waiting2", stream=False).wait_final()
        assert waiting.error is None, waiting.error
        assert not other.ended
        other.wait_final()
    finally:
        for s in (other, expired, waiting):
            if s:
                s.close()
    assert waiting.tokens == _target_only(dep, SHORT, 4)
    assert other.tokens == _target_only(dep, MID, 200)


def test_a_full_queue_is_refused_at_once_as_unavailable(small):
    server, dep = small
    c = grpcclient.InferenceServerClient(server.grpc_endpoint)
    answers: dict[str, queue.Queue] = {name: queue.Queue() for name in ("first", "second", "queued")}

    def send(name, prompt, max_tokens):
        return c.async_infer(BLS, _bls(prompt, max_tokens), callback=lambda result, error: answers[name].put((result, error)))

    first, second = send("first", LONG, 400), send("second", MID, 400)
    time.sleep(0.5)  # both places of the unary endpoint taken
    send("queued", SHORT, 4)
    time.sleep(0.5)  # the one queue place (serve.max_queue: 1) is taken
    start = time.monotonic()
    with pytest.raises(InferenceServerException) as refused:
        c.infer(BLS, _bls(SHORT, 4))
    assert time.monotonic() - start < 5  # at once, not after the 400-token requests
    assert refused.value.status() == "StatusCode.UNAVAILABLE"
    assert "queue is full (1 requests waiting)" in refused.value.message()
    first.cancel()
    second.cancel()
    result, error = answers["queued"].get(timeout=300)
    assert error is None, error
    assert _ids(result) == _target_only(dep, SHORT, 4)

"""Hostile requests, nine kinds, against a real tritonserver on 127.0.0.1 (the tiny pair) and
the OpenAI front before it: each is answered exactly once, by an error that names what is
wrong (a client that leaves mid-stream: its request ends once, as cancelled), and afterwards
the server is ready and answers an ordinary request exactly as target-only decoding does.

gRPC (the BLS endpoint): a huge input, a wrong data type, out-of-range values, a missing
tensor, text that is not UTF-8, a wrong shape. HTTP (the OpenAI front, served with the
connection bounds `trtspec openai` serves it with): a partial body from a client that stalls
(slow loris), a head that dribbles in, a flood of slow clients and connections over the cap, a
JSON body over the limit, a stream the client drops, a request without an API key whose body
never ends."""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import select
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import replace

import numpy as np
import pytest
from conftest import serve_app, serve_tiny

grpcclient = pytest.importorskip("tritonclient.grpc", reason="needs the serve extra: pip install 'trtspec[serve]'")
from tritonclient.utils import InferenceServerException  # noqa: E402

from trtspec.layout import BLS_MODEL  # noqa: E402
from trtspec.triton.server.process import free_ports  # noqa: E402

PROMPT = "The quick brown fox"
BODY_TIMEOUT_S = 2.0  # the front's body deadline in this test (default 30 s)
HEAD_TIMEOUT_S = 2.0  # the front's head deadline in this test (default 10 s)
CAP = 4  # the capped front's connection cap (default 512)
API_KEY = "sk-hostile-0123456789abcdef"


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_ckpts):
    """(server, in-process Deployment, OpenAI front's base URL)."""
    pytest.importorskip("uvicorn")
    for server, dep in serve_tiny(tmp_path_factory, tiny_ckpts, "hostile-nine"):
        for front in _serve_front(server, head_timeout_s=HEAD_TIMEOUT_S, body_timeout_s=BODY_TIMEOUT_S):
            yield server, dep, front


@pytest.fixture
def capped(stack):
    """(server, Deployment, base URL of a front on the same server holding at most CAP
    connections, its head and body deadlines far away)."""
    server, dep, _ = stack
    for front in _serve_front(server, max_connections=CAP, head_timeout_s=60, body_timeout_s=60):
        yield server, dep, front


@pytest.fixture
def keyed(stack):
    """(server, Deployment, base URL of a front on the same server that needs API_KEY, its
    body limit 64 KiB: a refused body is drained up to 1 MiB)."""
    from trtspec.openai.keys import ApiKeys

    server, dep, _ = stack
    for front in _serve_front(server, keys=ApiKeys.single(API_KEY), max_body_bytes=64 * 1024):
        yield server, dep, front


def _serve_front(server, keys=None, max_connections: int = 512, head_timeout_s: float = 10.0, **settings):
    """The OpenAI front on ``server`` as `trtspec openai` serves it (its connection bounds
    included), ``settings`` FrontSettings'; a generator for fixtures yielding its base URL."""
    from transformers import AutoTokenizer

    from trtspec.openai.app import create_app
    from trtspec.openai.connections import ConnectionBounds, server_options
    from trtspec.openai.run import caller_key, front_settings
    from trtspec.openai.triton import TritonText

    found, tok_dir = front_settings(server.command.model_repository)
    key = caller_key(server.grpc_endpoint, keys, found.suffix_scopes)
    backend = TritonText(server.grpc_endpoint, caller_key=key)
    app = create_app(backend, AutoTokenizer.from_pretrained(tok_dir), replace(found, **settings), keys)
    bounds = ConnectionBounds(head_timeout_s=head_timeout_s, max_connections=max_connections)
    for port in serve_app(app, log_level="critical", **server_options(bounds)):
        yield f"http://127.0.0.1:{port}"


# ---------------------------------------------------------------------------------- gRPC


def _t(name: str, value, datatype: str):
    dtype = {"BYTES": np.object_, "INT32": np.int32, "INT64": np.int64, "BOOL": np.bool_}[datatype]
    arr = np.array(value if isinstance(value, list) else [[value]], dtype=dtype)
    tensor = grpcclient.InferInput(name, list(arr.shape), datatype)
    tensor.set_data_from_numpy(arr)
    return tensor


def _inputs(text=PROMPT.encode(), max_tokens=8, **extra) -> dict:
    tensors = {
        "text_input": _t("text_input", text, "BYTES"),
        "max_tokens": _t("max_tokens", max_tokens, "INT32"),
        "apply_chat_template": _t("apply_chat_template", True, "BOOL"),
        "exclude_input_in_output": _t("exclude_input_in_output", True, "BOOL"),
    }
    return tensors | extra


GRPC_KINDS = {
    "huge_input": (lambda: _inputs(text=b"tell me a story. " * 250_000), r"text_input is 4250000 bytes"),
    "wrong_dtype": (lambda: _inputs() | {"max_tokens": _t("max_tokens", 8, "INT64")}, r"max_tokens.*INT64"),
    "out_of_range": (lambda: _inputs(max_tokens=-3), r"max_tokens must be at least 1"),
    "missing_tensor": (lambda: {k: v for k, v in _inputs().items() if k != "text_input"}, r"text_input"),
    "not_utf8": (lambda: _inputs(text=b"\xff\xfe caf\xe9"), r"not valid UTF-8"),
    "wrong_shape": (lambda: _inputs() | {"max_tokens": _t("max_tokens", [[5, 6]], "INT32")}, r"max_tokens"),
}


@pytest.mark.parametrize("kind", sorted(GRPC_KINDS))
def test_a_hostile_grpc_request_gets_one_named_error(stack, kind):
    server, dep, _ = stack
    make, named = GRPC_KINDS[kind]
    client = grpcclient.InferenceServerClient(server.grpc_endpoint)
    with pytest.raises(InferenceServerException) as err:
        client.infer(BLS_MODEL, list(make().values()), client_timeout=60)
    assert re.search(named, err.value.message()), err.value.message()
    _still_healthy(server, dep)


def test_a_draft_length_out_of_range_gets_one_named_error(stack):
    server, dep, _ = stack
    client = grpcclient.InferenceServerClient(server.grpc_endpoint)
    with pytest.raises(InferenceServerException, match=r"num_draft_tokens must be in 0\.\.8"):
        client.infer(BLS_MODEL, list(_inputs(num_draft_tokens=_t("num_draft_tokens", 99, "INT32")).values()))
    _still_healthy(server, dep)


# ---------------------------------------------------------------------------------- HTTP


def _raw_http(base: str, head: bytes, body: bytes, read_for: float) -> bytes:
    """Send ``head`` + ``body`` on one connection and read until the server closes it (or
    ``read_for`` seconds pass): every byte the server answered."""
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=read_for) as sock:
        sock.sendall(head + body)
        answer = b""
        deadline = time.monotonic() + read_for
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            answer += chunk
        return answer


def _one_response(answer: bytes) -> tuple[int, dict]:
    """The status and JSON error of the only HTTP response in ``answer``."""
    assert len(re.findall(rb"^HTTP/1\.1 \d{3} ", answer, re.M)) == 1, answer[:500]
    head, _, body = answer.partition(b"\r\n\r\n")
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return int(head.split()[1]), error


def _post_head(length: int) -> bytes:
    return (
        f"POST /v1/completions HTTP/1.1\r\nHost: front\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


def test_a_partial_body_from_a_stalled_client_gets_one_408(stack):
    """Slow loris: 20 of 200 declared bytes, then nothing. One 408 after the body deadline,
    the connection closed."""
    server, dep, front = stack
    started = time.monotonic()
    answer = _raw_http(front, _post_head(200), b'{"model": "x", "pro', read_for=BODY_TIMEOUT_S + 30)
    status, error = _one_response(answer)
    assert status == 408 and error["code"] == "request_timeout" and "did not arrive whole within 2 s" in error["message"]
    assert BODY_TIMEOUT_S <= time.monotonic() - started < BODY_TIMEOUT_S + 20
    _still_healthy(server, dep)


def test_an_oversized_json_body_gets_one_413(stack):
    server, dep, front = stack
    body = json.dumps({"model": dep.spec.name, "prompt": "word " * 400_000, "max_tokens": 4}).encode()  # 2 MB > 1 MiB
    status, error = _one_response(_raw_http(front, _post_head(len(body)), body, read_for=30))
    assert status == 413 and error["code"] == "request_too_large"
    _still_healthy(server, dep)


def test_a_body_that_is_not_utf8_gets_one_400(stack):
    server, dep, front = stack
    body = b'{"model": "' + dep.spec.name.encode() + b'", "prompt": "caf\xe9", "max_tokens": 4}'
    status, error = _one_response(_raw_http(front, _post_head(len(body)), body, read_for=30))
    assert status == 400 and error["type"] == "invalid_request_error"
    _still_healthy(server, dep)


def test_a_client_that_drops_its_stream_ends_its_request_once_as_cancelled(stack):
    """The front cancels the gRPC stream of a client that leaves: the endpoint counts the
    request cancelled exactly once and holds no sequence for it."""
    server, dep, front = stack
    before = _finished(server, "cancelled")
    body = json.dumps({"model": dep.spec.name, "prompt": PROMPT, "max_tokens": 400, "stream": True, "ignore_eos": True}).encode()
    host, port = front.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(_post_head(len(body)) + body)
        seen = b""
        while b"data: {" not in seen:  # the first streamed chunk: the request is decoding
            chunk = sock.recv(65536)
            assert chunk, seen
            seen += chunk
        assert seen.startswith(b"HTTP/1.1 200 ")
    deadline = time.monotonic() + 60
    while (_finished(server, "cancelled") - before, _gauge(server, "trtspec_active_sequences")) != (1, 0):
        assert time.monotonic() < deadline, (_finished(server, "cancelled") - before, _gauge(server, "trtspec_active_sequences"))
        time.sleep(0.2)
    time.sleep(1)
    assert _finished(server, "cancelled") - before == 1  # once, not again later
    _still_healthy(server, dep)


def test_a_head_that_dribbles_in_gets_one_408_and_its_connection_closed(stack):
    """Slow loris on the headers: a header byte every 0.25 s, never the blank line that ends
    them. One 408 after the head deadline, the connection closed; the front still answers."""
    server, dep, front = stack
    started, answer = time.monotonic(), b""
    with _connect(front, 0.25) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: front\r\nX-Slow: ")
        while time.monotonic() - started < HEAD_TIMEOUT_S + 30:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                with contextlib.suppress(OSError):  # closed meanwhile: the next recv says so
                    sock.sendall(b"a")
                continue
            if not chunk:
                break
            answer += chunk
    elapsed = time.monotonic() - started
    status, error = _one_response(answer)
    assert status == 408 and error["code"] == "request_timeout"
    assert "the request head did not arrive whole within 2 s" in error["message"]
    assert HEAD_TIMEOUT_S <= elapsed < HEAD_TIMEOUT_S + 20
    _front_answers(front, dep)
    _still_healthy(server, dep)


def test_trtspec_openai_head_timeout_sets_the_head_deadline(stack):
    """`trtspec openai --head-timeout 0.5`, served as a process: part of a head, then nothing,
    gets one 408 about 0.5 s on (not the 10 s default) and its connection closed."""
    server, dep, _ = stack
    (port,) = free_ports(1)
    cmd = [sys.executable, "-m", "trtspec", "openai", str(server.command.model_repository)]
    cmd += ["--url", server.grpc_endpoint, "--port", str(port), "--head-timeout", "0.5"]
    front = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_front(front, proc)
        with _connect(front, 30) as sock:
            started = time.monotonic()
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: front\r\nX-Stalled: ")
            answer = _rest(sock)
            elapsed = time.monotonic() - started
        status, error = _one_response(answer)
        assert status == 408 and error["code"] == "request_timeout"
        assert "the request head did not arrive whole within 0.5 s" in error["message"]
        assert 0.5 <= elapsed < 5, elapsed
        _front_answers(front, dep)
    finally:
        proc.terminate()
        proc.wait(30)


def _wait_for_front(front: str, proc: subprocess.Popen) -> None:
    """Until ``front`` answers /v1/models (``proc`` serving it)."""
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, f"trtspec openai exited {proc.returncode}: {proc.stderr.read()}"
        assert time.monotonic() < deadline, "trtspec openai did not start"
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(front + "/v1/models", timeout=5):
                return
        time.sleep(0.2)


def test_a_flood_of_slow_clients_cannot_crowd_out_an_ordinary_request(capped):
    """3 x CAP clients each send part of a head and stall. The front holds at most CAP
    connections: each new one closes the one that has waited longest for its head, at once (the
    head deadline is 60 s here) and without a byte, so an ordinary request is answered."""
    server, dep, front = capped
    slow = []
    try:
        for _ in range(3 * CAP):
            slow.append(_connect(front, 10))
            slow[-1].sendall(b"POST /v1/completions HTTP/1.1\r\nHost: fr")
        closed = [_closed_silently(sock, 10 if i < 2 * CAP else 0.5) for i, sock in enumerate(slow)]
        assert closed == [True] * (2 * CAP) + [False] * CAP
        _front_answers(front, dep)  # the first of its two connections closes the longest waiting
        closed = [_closed_silently(sock, 10 if i == 0 else 0.5) for i, sock in enumerate(slow[2 * CAP :])]
        assert closed == [True] + [False] * (CAP - 1)
    finally:
        for sock in slow:
            sock.close()
    _still_healthy(server, dep)


def test_over_the_cap_with_every_connection_inside_a_request_a_new_one_is_closed_at_once(capped):
    """CAP clients are inside requests (head in, body arriving): a further connection is closed
    at once without a byte, those CAP keep theirs, and once they leave the front answers."""
    server, dep, front = capped
    busy = []
    try:
        for _ in range(CAP):
            busy.append(_connect(front, 10))
            busy[-1].sendall(_post_head(100) + b'{"model": ')
        time.sleep(1)  # their heads are read
        with _connect(front, 10) as extra:
            assert _closed_silently(extra, 10)
        assert [_closed_silently(sock, 0.2) for sock in busy] == [False] * CAP
    finally:
        for sock in busy:
            sock.close()
    time.sleep(1)  # the front sees them leave
    _front_answers(front, dep)
    _still_healthy(server, dep)


def test_a_request_without_a_key_is_read_only_to_the_drain_bound_then_401_and_closed(keyed):
    """No API key, a body declared 1 TiB and streamed on without end: one 401 in OpenAI's shape
    (the key it sent never echoed), the body read and dropped only up to the drain bound (16 x
    the 64 KiB limit), then the connection closed; the front answers a keyed request after."""
    server, dep, front = keyed
    wrong = "sk-wrong-" + "f" * 24
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: front\r\nAuthorization: Bearer {wrong}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {1 << 40}\r\n\r\n"
    ).encode()
    sent, answer, closed = 0, b"", False
    with _connect(front, 30) as sock:
        sock.sendall(head)
        while sent < 128 << 20 and not closed:  # unbounded, it would take all 128 MiB
            try:
                if select.select([sock], [], [], 0)[0]:
                    chunk = sock.recv(65536)
                    answer, closed = answer + chunk, not chunk
                else:
                    sock.sendall(b" " * 65536)
                    sent += 65536
            except (BrokenPipeError, ConnectionResetError):
                closed = True
        answer += _rest(sock)  # the 401 may still be arriving when the send fails
    assert closed and sent <= 32 << 20, sent  # 1 MiB drained, the rest in the sockets' buffers
    status, error = _one_response(answer)
    assert status == 401 and error["code"] == "invalid_api_key"
    assert b"\r\nconnection: close\r\n" in answer.lower() and wrong.encode() not in answer
    _front_answers(front, dep, key=API_KEY)
    _still_healthy(server, dep)


def test_a_request_without_a_key_whose_body_arrives_gets_401_and_its_connection_serves_the_next(keyed):
    """A keep-alive client: its unauthenticated request's body is read whole, so the 401 leaves
    the connection open and in step, and the client's next (keyed) request on it is answered."""
    server, dep, front = keyed
    host, port = front.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    body = json.dumps({"model": dep.spec.name, "prompt": PROMPT, "max_tokens": 8}).encode()
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json", "Authorization": "Bearer sk-x"})
        first = conn.getresponse()
        assert first.status == 401 and json.loads(first.read())["error"]["code"] == "invalid_api_key"
        assert not first.will_close
        sock = conn.sock
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
        second = conn.getresponse()
        assert conn.sock is sock and second.status == 200 and json.loads(second.read())["choices"][0]["text"]
    finally:
        conn.close()
    _still_healthy(server, dep)


def _connect(front: str, timeout: float) -> socket.socket:
    host, port = front.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=timeout)


def _rest(sock: socket.socket) -> bytes:
    """What the server sent on ``sock`` that is not read yet, up to its close or reset."""
    sock.settimeout(10)
    rest = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            rest += chunk
    return rest


def _closed_silently(sock: socket.socket, wait: float) -> bool:
    """True: the server closed ``sock`` without sending a byte; False: still open ``wait`` s on."""
    sock.settimeout(wait)
    try:
        data = sock.recv(65536)
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True
    assert data == b"", data
    return True


def _front_answers(front: str, dep, key: str | None = None) -> None:
    """An ordinary completion through the front is answered, the speculative model's text
    equal to the target-only model's (one connection each)."""
    texts = []
    for model in (dep.spec.name, dep.spec.name + "-target-only"):
        body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 8}).encode()
        headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
        request = urllib.request.Request(front + "/v1/completions", data=body, headers=headers)
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request, timeout=120) as r:
            assert r.status == 200
            texts.append(json.loads(r.read())["choices"][0]["text"])
    assert texts[0] and texts[0] == texts[1], texts


# ---------------------------------------------------------------------------------- health


def _metrics(server) -> list[tuple[str, float]]:
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(server.metrics_url, timeout=10) as r:
        text = r.read().decode()
    return [(line.rsplit(" ", 1)[0], float(line.rsplit(" ", 1)[1])) for line in text.splitlines() if line.startswith("trtspec_")]


def _finished(server, reason: str) -> float:
    return sum(
        v for name, v in _metrics(server) if name.startswith("trtspec_requests_finished_total{") and f'reason="{reason}"' in name
    )


def _gauge(server, metric: str) -> float:
    return sum(v for name, v in _metrics(server) if name.startswith(metric + "{"))


def _still_healthy(server, dep) -> None:
    """Ready, and an ordinary request answered exactly as target-only decoding answers it."""
    client = grpcclient.InferenceServerClient(server.grpc_endpoint)
    assert server.is_running() and client.is_server_ready()
    result = client.infer(BLS_MODEL, list(_inputs().values()), client_timeout=120)
    got = result.as_numpy("output_ids")[0, : result.as_numpy("sequence_length")[0, 0]].tolist()
    (ref,) = dep.generate([dep.request(dep.encode(PROMPT), 8)], speculative=False)
    assert got == ref.output_ids

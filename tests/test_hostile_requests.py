"""Hostile requests, nine kinds, against a real tritonserver on 127.0.0.1 (the tiny pair) and
the OpenAI front before it: each is answered exactly once, by an error that names what is
wrong (a client that leaves mid-stream: its request ends once, as cancelled), and afterwards
the server is ready and answers an ordinary request exactly as target-only decoding does.

gRPC (the BLS endpoint): a huge input, a wrong data type, out-of-range values, a missing
tensor, text that is not UTF-8, a wrong shape. HTTP (the OpenAI front): a partial body from a
client that stalls (slow loris), a JSON body over the limit, a stream the client drops."""

from __future__ import annotations

import json
import re
import socket
import time
import urllib.request
from dataclasses import replace

import numpy as np
import pytest
from conftest import serve_app, serve_tiny

grpcclient = pytest.importorskip("tritonclient.grpc", reason="needs the serve extra: pip install 'trtspec[serve]'")
from tritonclient.utils import InferenceServerException  # noqa: E402

from trtspec.layout import BLS_MODEL  # noqa: E402

PROMPT = "The quick brown fox"
BODY_TIMEOUT_S = 2.0  # the front's body deadline in this test (default 30 s)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_ckpts):
    """(server, in-process Deployment, OpenAI front's base URL)."""
    pytest.importorskip("uvicorn")
    from transformers import AutoTokenizer

    from trtspec.openai.app import create_app
    from trtspec.openai.run import caller_key, front_settings
    from trtspec.openai.triton import TritonText

    for server, dep in serve_tiny(tmp_path_factory, tiny_ckpts, "hostile-nine"):
        settings, tok_dir = front_settings(server.command.model_repository)
        key = caller_key(server.grpc_endpoint, None, settings.suffix_scopes)
        backend = TritonText(server.grpc_endpoint, caller_key=key)
        app = create_app(backend, AutoTokenizer.from_pretrained(tok_dir), replace(settings, body_timeout_s=BODY_TIMEOUT_S))
        for port in serve_app(app, log_level="critical"):
            yield server, dep, f"http://127.0.0.1:{port}"


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

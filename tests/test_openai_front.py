"""The OpenAI front's failure paths, driven with the official `openai` client against the real
app on uvicorn (127.0.0.1) in front of a scripted deployment: every error in OpenAI's shape
with the status that says why, streamed or not; body limit; cancellation; n; log probs.
The same paths against a real tritonserver are in tests/test_serve.py (test_openai_*)."""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from conftest import serve_app
from tritonclient.utils import InferenceServerException

from trtspec.openai.app import FrontSettings, create_app, token_texts
from trtspec.openai.triton import DeploymentError, Piece, as_error

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
try:  # the HTTP client the installed openai is built on (httpx; httpx2 for openai 3)
    import httpx2 as httpx
except ImportError:
    import httpx

MODEL = "tiny"
MAX_SEQ_LEN = 512


class Scripted:
    """A TritonText stand-in: answers, fails or hangs as a test says, and records calls."""

    def __init__(self):
        self.calls: list = []
        self.cancelled = 0
        self.fail_unary: Exception | None = None
        self.fail_first: Exception | None = None  # stream: before any piece
        self.fail_after: Exception | None = None  # stream: after one piece
        self.hang = False
        self.fail_seed: int | None = None  # sampling: the call with this seed fails

    async def ready(self):
        return ["tensorrt_llm_bls"]

    async def close(self):
        pass

    async def complete(self, g):
        self.calls.append(g)
        try:
            if self.hang or (self.fail_seed is not None and g.sampling and g.sampling[2] != self.fail_seed):
                await asyncio.sleep(3600)
            if self.fail_seed is not None and g.sampling and g.sampling[2] == self.fail_seed:
                await asyncio.sleep(0.2)
                raise DeploymentError(500, "generation failed: boom (INTERNAL)")
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        if self.fail_unary is not None:
            raise self.fail_unary
        n = g.max_tokens
        return Piece("x" * n, True, "length", prompt_tokens=3, completion_tokens=n, draft_tokens=2 * n, accepted_draft_tokens=n)

    async def stream(self, g):
        self.calls.append(g)
        if self.fail_first is not None:
            raise self.fail_first
        for i in range(g.max_tokens):
            if i == 1 and self.fail_after is not None:
                raise self.fail_after
            final = i == g.max_tokens - 1
            yield Piece("y", final, "length" if final else None, prompt_tokens=3, completion_tokens=i + 1)


@pytest.fixture(scope="module")
def tokenizer(tiny_ckpts):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_ckpts["target"])


@pytest.fixture(scope="module")
def front(tokenizer):
    """(base url, the scripted deployment) with the app served on 127.0.0.1."""
    backend = Scripted()
    settings = FrontSettings(model=MODEL, max_seq_len=MAX_SEQ_LEN, created=0, max_body_bytes=64 * 1024)
    for port in serve_app(create_app(backend, tokenizer, settings), log_level="critical"):
        yield f"http://127.0.0.1:{port}", backend


@pytest.fixture
def scripted(front):
    _, backend = front
    for name, value in vars(Scripted()).items():
        setattr(backend, name, value)
    return backend


@pytest.fixture
def oai(front):
    return openai.OpenAI(
        base_url=front[0] + "/v1",
        api_key="unused",
        max_retries=0,
        timeout=30,
        http_client=openai.DefaultHttpxClient(trust_env=False),
    )


def _status_error(call) -> tuple[int, dict, object]:
    with pytest.raises(openai.APIStatusError) as err:
        call()
    body = err.value.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return err.value.status_code, body["error"], err.value.response


# ------------------------------------------------------------------------ statuses and shapes


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("failure", "status", "words"),
    [
        (DeploymentError(400, "num_draft_tokens must be in 0..8"), 400, "num_draft_tokens must be in 0..8"),
        (DeploymentError(503, "the queue is full (2 requests waiting) (UNAVAILABLE)"), 503, "the queue is full"),
        (DeploymentError(504, "the Triton deployment did not answer within 600 s"), 504, "did not answer"),
        (DeploymentError(500, "generation failed: boom (INTERNAL)"), 500, "generation failed"),
        (RuntimeError("a bug in the front's path"), 500, "internal error: RuntimeError: a bug"),
    ],
    ids=["invalid-arg", "queue-full", "deadline", "internal", "unexpected"],
)
def test_every_deployment_failure_is_openai_shaped_with_its_status(oai, scripted, stream, failure, status, words):
    if stream:
        scripted.fail_first = failure
    else:
        scripted.fail_unary = failure
    got, error, response = _status_error(
        lambda: (
            list(oai.completions.create(model=MODEL, prompt="hello", max_tokens=4, stream=stream))
            if stream
            else oai.completions.create(model=MODEL, prompt="hello", max_tokens=4)
        )
    )
    assert got == status and words in error["message"]
    assert error["type"] == ("invalid_request_error" if status == 400 else "server_error")
    assert (response.headers.get("retry-after") == "1") == (status == 503)


def test_an_error_mid_stream_is_an_openai_error_event_then_done(front, scripted):
    scripted.fail_after = DeploymentError(503, "the model is unloading; retry later (UNAVAILABLE)")
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 5, "stream": True}
    request = urllib.request.Request(
        front[0] + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request, timeout=30) as r:
        assert r.status == 200
        events = [line[len("data: ") :] for line in r.read().decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error == {
        "message": "the model is unloading; retry later (UNAVAILABLE)",
        "type": "server_error",
        "param": None,
        "code": "service_unavailable",
    }
    assert json.loads(events[0])["choices"][0]["text"] == "y"  # what came before the error
    # the official client raises it as an API error with the message
    client = openai.OpenAI(base_url=front[0] + "/v1", api_key="unused", max_retries=0, http_client=httpx.Client(trust_env=False))
    with pytest.raises(openai.APIError, match="the model is unloading"):
        list(client.completions.create(model=MODEL, prompt="hello", max_tokens=5, stream=True))


@pytest.mark.parametrize(
    ("err", "status", "words"),
    [
        (InferenceServerException("prompt too long", status="StatusCode.INVALID_ARGUMENT"), 400, "prompt too long"),
        (InferenceServerException("queue full", status="StatusCode.UNAVAILABLE"), 503, "queue full (UNAVAILABLE)"),
        (InferenceServerException("slow", status="StatusCode.DEADLINE_EXCEEDED"), 504, "did not answer within 7 s"),
        (InferenceServerException("stream error without a code"), 500, "stream error without a code (no status)"),
        (ValueError("numpy said no"), 500, "the call to the Triton deployment failed: ValueError: numpy said no"),
    ],
)
def test_grpc_failures_map_to_http_statuses(err, status, words):
    got = as_error(err, "127.0.0.1:1", 7)
    assert (got.status, words in got.message) == (status, True), got.message


def test_a_streamed_grpc_status_error_keeps_its_code():
    """With triton_grpc_error a stream ends in a grpc.RpcError carrying the status code."""

    class Rpc(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.INVALID_ARGUMENT

        def details(self):
            return "max_tokens too large"

    got = as_error(Rpc(), "127.0.0.1:1", 7)
    assert (got.status, got.message) == (400, "max_tokens too large")


def test_unknown_route_and_bad_json_are_openai_shaped(front):
    for method, path, data, status in (("GET", "/v1/nope", None, 404), ("POST", "/v1/completions", b"{not json", 400)):
        request = urllib.request.Request(front[0] + path, data, {"Content-Type": "application/json"}, method=method)
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request, timeout=10)
        assert err.value.code == status
        assert set(json.loads(err.value.read())["error"]) == {"message", "type", "param", "code"}


# ------------------------------------------------------------------------------- bounds


@pytest.mark.parametrize(
    ("field", "chat"),
    [("max_tokens", False), ("max_tokens", True), ("max_completion_tokens", True), ("num_draft_tokens", False)],
)
def test_counts_beyond_int32_are_refused_never_wrapped(oai, scripted, field, chat):
    big = {field: 2**31 + 8}  # numpy's int32 would wrap it to 8
    if chat:
        call = lambda: oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], extra_body=big)  # noqa: E731
    else:
        call = lambda: oai.completions.create(model=MODEL, prompt="hello", extra_body=big)  # noqa: E731
    status, error, _ = _status_error(call)
    assert status == 400 and f"{field}: Input should be less than or equal to 2147483647" in error["message"]
    assert scripted.calls == []  # nothing reached the deployment


def test_int32_inputs_are_checked_where_they_are_encoded():
    from trtspec.errors import RequestError
    from trtspec.triton.request import encode, infer_inputs

    assert encode({"max_tokens": 2**31 - 1})["max_tokens"].item() == 2**31 - 1
    for too_big in (lambda: encode({"max_tokens": 2**31}), lambda: infer_inputs({"max_tokens": 2**31 + 8})):
        with pytest.raises(RequestError, match="max_tokens must be at most 2147483647"):
            too_big()


def test_the_request_encoder_takes_each_type_from_the_contract():
    from trtspec.errors import RequestError
    from trtspec.triton.backend.contract import BLS_INPUTS
    from trtspec.triton.request import encode, wire_type

    arrays = encode({"text_input": "hi", "stop_words": ["a", "b"], "top_p": 0.5, "seed": 7, "stream": True, "min_tokens": 2})
    assert arrays["text_input"].tolist() == [[b"hi"]] and arrays["stop_words"].tolist() == [[b"a", b"b"]]
    assert {n: str(a.dtype) for n, a in arrays.items()} == {
        "text_input": "object",
        "stop_words": "object",
        "top_p": "float32",
        "seed": "uint64",
        "stream": "bool",
        "min_tokens": "int32",
    }
    assert all(wire_type(t.name) == t.data_type.removeprefix("TYPE_").replace("STRING", "BYTES") for t in BLS_INPUTS)
    with pytest.raises(RequestError, match="not_an_input is not an input of the tensorrt_llm_bls contract"):
        encode({"not_an_input": 1})


@pytest.mark.parametrize("declared", [True, False])
def test_a_body_over_the_limit_is_413(front, scripted, declared):
    body = json.dumps({"model": MODEL, "prompt": "word " * 20_000, "max_tokens": 4}).encode()  # ~100 KB > 64 KiB
    headers = {"Content-Type": "application/json"}
    with httpx.Client(trust_env=False) as client:
        if declared:
            r = client.post(front[0] + "/v1/completions", content=body, headers=headers)
        else:  # chunked: no Content-Length, the limit is counted as it arrives
            r = client.post(front[0] + "/v1/completions", content=iter([body[i : i + 8192] for i in range(0, len(body), 8192)]))
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large" and "exceeds 65536 bytes" in r.json()["error"]["message"]
    assert scripted.calls == []


# ------------------------------------------------------------------------ n and cancellation


def test_greedy_n_is_one_call_repeated(oai, scripted):
    out = oai.completions.create(model=MODEL, prompt="hello", max_tokens=4, n=16)
    assert len(scripted.calls) == 1
    assert [c.index for c in out.choices] == list(range(16)) and {c.text for c in out.choices} == {"xxxx"}
    assert out.usage.completion_tokens == 16 * 4


def test_sampled_n_one_failure_cancels_the_others(oai, scripted):
    scripted.fail_seed = 7 + 2  # choice 2 of seed 7
    status, error, _ = _status_error(
        lambda: oai.completions.create(model=MODEL, prompt="hello", max_tokens=4, n=4, temperature=0.8, seed=7)
    )
    assert status == 500 and "generation failed: boom" in error["message"]
    assert len(scripted.calls) == 4 and scripted.cancelled == 3


def test_a_disconnected_unary_client_cancels_its_call(front, scripted):
    scripted.hang = True
    with httpx.Client(trust_env=False) as client, pytest.raises(httpx.ReadTimeout):
        client.post(front[0] + "/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 4}, timeout=1.0)
    deadline = time.monotonic() + 10
    while scripted.cancelled == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert scripted.cancelled == 1


# ------------------------------------------------------------------------- extensions


def test_ignore_eos_and_continuous_usage_reach_the_deployment(oai, scripted):
    chunks = list(
        oai.completions.create(
            model=MODEL,
            prompt="hello",
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert scripted.calls[0].ignore_eos is True
    text_chunks = [c for c in chunks if c.choices and c.choices[0].text]
    assert [c.usage.completion_tokens for c in text_chunks] == [1, 2, 3]  # usage in every chunk, so far
    assert all(c.usage is not None and c.usage.prompt_tokens == 3 for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3


def test_user_narrows_the_tenants_suffix_cache_scope_and_suffix_cache_false_opts_out(oai, scripted):
    """Without keys every request is tenant "default": user narrows its scope to default/user,
    never replaces it."""
    from trtspec.openai.triton import TritonText

    oai.completions.create(model=MODEL, prompt="hello", max_tokens=2, user="tenant-é")
    oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    oai.completions.create(model=MODEL, prompt="hello", max_tokens=2, user="tenant-a", extra_body={"suffix_cache": False})
    sent = [{t.name(): t for t in TritonText._inputs(g, False)} for g in scripted.calls]
    assert sent[0]["suffix_cache_scope"].datatype() == "BYTES" and "suffix_cache" not in sent[0]
    assert scripted.calls[0].suffix_cache_scope == "default/tenant-é"
    assert scripted.calls[1].suffix_cache_scope == "default"  # no user: the tenant's own scope
    assert "suffix_cache_scope" not in sent[2] and sent[2]["suffix_cache"].datatype() == "BOOL"
    assert scripted.calls[2].suffix_cache is False
    status, error, _ = _status_error(lambda: oai.completions.create(model=MODEL, prompt="hello", max_tokens=2, user="x" * 300))
    assert status == 400 and "user is 300 bytes, more than 248" in error["message"]  # 256 less "default/"
    assert len(scripted.calls) == 3  # refused before the deployment


def test_log_prob_token_texts_are_incremental_and_equal_the_whole_decode(tokenizer):
    """token_texts decodes O(n) tokens in all (the old loop decoded every prefix: O(n^2)) and
    splits the text exactly where decoding every prefix would."""
    text = "héllo wörld, 日本語 🙂 and plain words " * 8
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    decoded = tokenizer.decode(ids, skip_special_tokens=True)

    def by_prefixes():  # the reference: what each prefix decodes to
        tokens, at = [], 0
        for n in range(1, len(ids) + 1):
            upto = tokenizer.decode(ids[:n], skip_special_tokens=True)
            end = at if upto.endswith("\ufffd") and n < len(ids) else min(len(upto), len(decoded))
            tokens.append(decoded[at:end])
            at = max(at, end)
        return tokens

    class Counting:
        decoded = 0

        def decode(self, part, **kw):
            Counting.decoded += len(part)
            return tokenizer.decode(part, **kw)

    tokens, offsets = token_texts(Counting(), ids, decoded)
    assert tokens == by_prefixes() and "".join(tokens) == decoded
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    assert Counting.decoded <= 8 * len(ids), (Counting.decoded, len(ids))  # linear, not ~n^2/2


# ------------------------------------------------------------------------ API keys and tenants

SECRET_A, SECRET_B = "sk-acme-0123456789abcdef", "sk-umbrella-fedcba9876543210"


@pytest.fixture
def keyed(tokenizer, tmp_path):
    """(base url, the scripted deployment, the key file) with keys required."""
    from trtspec.openai.keys import ApiKeys

    path = tmp_path / "keys.yaml"
    path.write_text(f"{SECRET_A}: acme\n{SECRET_B}: umbrella\n")
    backend = Scripted()
    settings = FrontSettings(model=MODEL, max_seq_len=MAX_SEQ_LEN, created=0)
    app = create_app(backend, tokenizer, settings, ApiKeys.from_file(path))
    for port in serve_app(app, log_level="critical"):
        yield f"http://127.0.0.1:{port}", backend, path


def _post(base: str, key: str | None, **body) -> httpx.Response:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    payload = {"model": MODEL, "prompt": "hello", "max_tokens": 2} | body
    return httpx.post(base + "/v1/completions", json=payload, headers=headers, timeout=30, trust_env=False)


def test_a_request_without_a_valid_key_is_401_in_openais_shape_and_never_reaches_the_deployment(keyed):
    base, backend, _ = keyed
    for key in (None, "sk-guess", SECRET_A[:-1], SECRET_A + "x", SECRET_A.upper()):
        r = _post(base, key)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json() == {
            "error": {
                "message": "the request has no valid API key; send `Authorization: Bearer <key>` with a key this server "
                "was given",
                "type": "invalid_request_error",
                "param": None,
                "code": "invalid_api_key",
            }
        }
    r = httpx.get(base + "/v1/models", trust_env=False)
    assert r.status_code == 401
    assert httpx.get(base + "/health", trust_env=False).status_code == 200  # a probe needs no key
    assert backend.calls == []
    client = openai.OpenAI(
        base_url=base + "/v1", api_key=SECRET_B, max_retries=0, http_client=openai.DefaultHttpxClient(trust_env=False)
    )
    assert client.completions.create(model=MODEL, prompt="hello", max_tokens=2).choices[0].text == "xx"


def test_the_scope_is_the_keys_tenant_and_user_only_narrows_it(keyed):
    base, backend, _ = keyed
    for key, user in ((SECRET_A, None), (SECRET_A, "bob"), (SECRET_B, "acme"), (SECRET_B, "../acme"), (SECRET_B, "")):
        assert _post(base, key, **({} if user is None else {"user": user})).status_code == 200
    scopes = [g.suffix_cache_scope for g in backend.calls]
    assert scopes == ["acme", "acme/bob", "umbrella/acme", "umbrella/../acme", "umbrella"]


def test_the_key_file_is_read_again_when_it_changes_and_a_broken_one_keeps_the_last_good_keys(keyed, caplog):
    base, backend, path = keyed
    path.write_text(f"{SECRET_B}: umbrella\nsk-new-tenant-00000000: initech\n")  # acme revoked, one added
    assert _post(base, SECRET_A).status_code == 401
    assert _post(base, "sk-new-tenant-00000000").status_code == 200
    assert backend.calls[-1].suffix_cache_scope == "initech"
    caplog.clear()
    path.write_text(f"{SECRET_B}: [not, a, tenant]\n")  # malformed: the last good keys stay
    assert _post(base, "sk-new-tenant-00000000").status_code == 200
    assert _post(base, SECRET_B).status_code == 200
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and f"API key file {path} changed but" in errors[0] and "keeping the last good keys" in errors[0]
    assert "the tenant of key 1 must be a non-empty name" in errors[0]
    assert not any(s in r.getMessage() for r in caplog.records for s in (SECRET_A, SECRET_B, "sk-new-tenant"))


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("sk-a: acme\nsk-b: a/b\n", "the tenant of key 2 holds '/'"),
        ("sk-a: ''\n", "the tenant of key 1 must be a non-empty name"),
        ("- sk-a\n", "must be a mapping of API key to tenant"),
        ("{sk-a: acme", "is not YAML or JSON"),
        ('{"sk a": "acme"}', "key 1 must be printable text without spaces"),
        ("sk-a: " + "t" * 65 + "\n", "longer than 64 bytes"),
    ],
)
def test_a_malformed_key_file_is_refused_at_start_naming_the_entry_not_the_key(tmp_path, text, words):
    from trtspec.errors import SpecError
    from trtspec.openai.keys import ApiKeys

    path = tmp_path / "keys.yaml"
    path.write_text(text)
    with pytest.raises(SpecError, match=re.escape(words)) as err:
        ApiKeys.from_file(path)
    assert "sk-a" not in str(err.value) and "sk a" not in str(err.value)


def test_with_keys_the_front_refuses_to_start_without_its_servers_caller_key_and_says_what_it_serves(monkeypatch):
    from trtspec.errors import ServerError
    from trtspec.openai import run
    from trtspec.openai.keys import ApiKeys

    keys = ApiKeys({SECRET_A: "acme", SECRET_B: "umbrella"})
    monkeypatch.setattr(run.callers, "key_for_port", lambda port: None)
    with pytest.raises(ServerError, match="cannot read the caller key of the Triton server at 127.0.0.1:8001") as err:
        run.caller_key("127.0.0.1:8001", keys, scopes=True)
    assert err.value.exit_code == 3
    assert run.caller_key("127.0.0.1:8001", None, scopes=True) is None  # single-tenant: nothing to keep apart
    assert run.caller_key("127.0.0.1:8001", keys, scopes=False) is None  # the deployment reads no scope
    assert "single-tenant deployment" in run.start_line(None, None, True)
    assert run.start_line(keys, "k", True) == "API keys required: 2 keys, 2 tenants, each its own suffix cache scope"
    assert SECRET_A not in run.start_line(keys, "k", True)


def test_capture_false_keeps_the_request_out_of_serve_capture(oai, scripted):
    from trtspec.openai.triton import TritonText

    oai.completions.create(model=MODEL, prompt="hello", max_tokens=2)
    oai.completions.create(model=MODEL, prompt="hello", max_tokens=2, extra_body={"capture": False})
    sent = [{t.name(): t for t in TritonText._inputs(g, False)} for g in scripted.calls]
    assert "capture" not in sent[0] and scripted.calls[0].capture is True  # the deployment's choice
    assert sent[1]["capture"].datatype() == "BOOL" and scripted.calls[1].capture is False


def test_trtspec_openai_serves_the_front_with_its_connection_bounds(monkeypatch):
    """`trtspec openai`'s uvicorn gets the bounded h11 protocol (head deadline, connection
    cap: tests/test_hostile_requests.py shows them at work) and no websockets."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    from trtspec.openai import run
    from trtspec.openai.connections import ConnectionBounds

    served = []
    monkeypatch.setattr(run, "make_app", lambda repo_dir, url, keys: "the app")
    monkeypatch.setattr(uvicorn, "run", lambda app, **options: served.append((app, options)))
    run.run(Path("repo"), "127.0.0.1:8001")
    run.run(Path("repo"), "127.0.0.1:8001", max_connections=7)
    run.run(Path("repo"), "127.0.0.1:8001", head_timeout_s=0.5)
    (app, default), (_, seven), (_, brief) = served
    assert app == "the app" and default["ws"] == seven["ws"] == "none"
    assert issubclass(default["http"], H11Protocol) and default["http"].limits == ConnectionBounds()
    assert seven["http"].limits == ConnectionBounds(max_connections=7) and seven["http"] is not default["http"]
    assert brief["http"].limits == ConnectionBounds(head_timeout_s=0.5)

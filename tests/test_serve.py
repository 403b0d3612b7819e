"""`trtspec repo/serve/stop` and `verify --url` against a real tritonserver on 127.0.0.1.

One server (tiny engines, two instances per orchestrator) serves most tests; a few start
their own small repository to test start failure, signals and detaching. Outputs are compared
token by token with in-process generation of the same engines.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

grpcclient = pytest.importorskip("tritonclient.grpc", reason="needs the serve extra: pip install 'trtspec[serve]'")
from conftest import processes_mentioning, serve_app, write_spec  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from trtspec.cli.app import app  # noqa: E402
from trtspec.errors import ServerError  # noqa: E402
from trtspec.layout import BLS_MODEL as BLS  # noqa: E402
from trtspec.layout import BLS_STREAMING_MODEL as BLS_STREAMING  # noqa: E402
from trtspec.layout import CONTROL_ENGINE_MODEL as CONTROL_ENGINE  # noqa: E402
from trtspec.layout import CONTROL_MODEL as CONTROL  # noqa: E402
from trtspec.layout import DRAFT_MODEL as DRAFT  # noqa: E402
from trtspec.layout import REPO_INFO  # noqa: E402
from trtspec.layout import TARGET_MODEL as TARGET  # noqa: E402
from trtspec.speculative.metrics import metrics_from_json  # noqa: E402
from trtspec.triton.repository import pbtxt  # noqa: E402
from trtspec.triton.repository.writer import write_repository  # noqa: E402
from trtspec.triton.server.install import find_tritonserver  # noqa: E402
from trtspec.triton.server.process import TritonServer, free_ports  # noqa: E402

PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):",
    "Triton serves models over HTTP and gRPC.",
    "Summarise the following text in one sentence.",
]
MAX_TOKENS = 24


@pytest.fixture(scope="session")
def deployment(tmp_path_factory, tiny_ckpts):
    """Built tiny engines, their spec, and the same engines loaded in process."""
    from trtspec.engines.build import build
    from trtspec.runtime import Deployment
    from trtspec.spec import load_spec

    folder = tmp_path_factory.mktemp("serve")
    loaded = load_spec(write_spec(folder, tiny_ckpts, **{"serve.instance_count": 2}))
    build(loaded, loaded.output_dir())
    return loaded, Deployment(loaded, loaded.output_dir())


@pytest.fixture(scope="session")
def backend_cache(tmp_path_factory):
    try:
        find_tritonserver()
    except ServerError as err:
        pytest.skip(str(err))
    return tmp_path_factory.mktemp("backend-cache")


@pytest.fixture(scope="session")
def served(deployment, backend_cache):
    loaded, _ = deployment
    repo = write_repository(loaded, loaded.output_dir(), loaded.base_dir / "repo")
    server = TritonServer.for_repository(repo, cache_root=backend_cache)
    server.start(loaded.base_dir / "server.log")
    server.wait_ready(timeout=900)
    yield server
    server.stop()
    assert processes_mentioning(str(repo)) == [], "tritonserver or stub processes survived stop()"


@pytest.fixture
def client(served):
    return grpcclient.InferenceServerClient(served.grpc_endpoint)


def _t(name, value, datatype, shape=None):
    if datatype == "BYTES":
        arr = np.array(value if shape == "raw" else [[value]], dtype=np.object_)
    else:
        arr = np.asarray(
            value if shape == "raw" else [[value]],
            dtype={"INT32": np.int32, "INT64": np.int64, "BOOL": np.bool_, "FP32": np.float32}[datatype],
        )
    tensor = grpcclient.InferInput(name, list(arr.shape), datatype)
    tensor.set_data_from_numpy(arr)
    return tensor


def _bls(prompt, max_tokens=MAX_TOKENS, k=None, **flags):
    inputs = [
        _t("text_input", prompt.encode(), "BYTES"),
        _t("max_tokens", max_tokens, "INT32"),
        _t("apply_chat_template", True, "BOOL"),
        _t("exclude_input_in_output", True, "BOOL"),
        _t("return_perf_metrics", True, "BOOL"),
    ]
    if k is not None:
        inputs.append(_t("num_draft_tokens", k, "INT32"))
    inputs += [_t(name, v, "BOOL") for name, v in flags.items()]
    return inputs


def _ids(result):
    return result.as_numpy("output_ids")[0, : result.as_numpy("sequence_length")[0, 0]].tolist()


def _stream(endpoint, inputs, request_id="s"):
    c = grpcclient.InferenceServerClient(endpoint)
    got: queue.Queue = queue.Queue()
    c.start_stream(callback=lambda result, error: got.put((result, error)))
    responses = []
    try:
        c.async_stream_infer(BLS_STREAMING, inputs, request_id=request_id, enable_empty_final_response=True)
        while True:
            result, error = got.get(timeout=120)
            if error is not None:
                raise error
            responses.append(result)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return responses
    finally:
        c.stop_stream()


def _reference(dep, prompt, speculative=True, k=None, max_tokens=MAX_TOKENS):
    (res,) = dep.generate([dep.request(dep.encode(prompt), max_tokens, k)], speculative=speculative)
    return res


# --------------------------------------------------------------------------------- repository


def test_repository_configs_parse_back_and_name_both_engines(deployment, tmp_path):
    loaded, _ = deployment
    repo = write_repository(loaded, loaded.output_dir(), tmp_path / "repo")
    names = sorted(p.name for p in repo.iterdir() if p.is_dir())
    assert names == sorted([TARGET, DRAFT, CONTROL_ENGINE, BLS, BLS_STREAMING, CONTROL, "ensemble"])
    for name in names:
        text = (repo / name / "config.pbtxt").read_text()
        msg = pbtxt.check_text(text)  # Triton's ModelConfig protobuf; refuses ${placeholders}
        if name == "ensemble":  # upstream's default model name: one step into the text endpoints
            assert msg.name == name and msg.platform == "ensemble"
            continue
        assert msg.name == name and msg.backend == "python"
        assert "from trtspec.triton.backend.models." in (repo / name / "1" / "model.py").read_text()
    bls = pbtxt.parse((repo / BLS / "config.pbtxt").read_text())
    assert bls.instance_group[0].count == 2 and not bls.model_transaction_policy.decoupled
    # The speculative endpoints bound their own queue (their execute() returns at once); the
    # control, which answers inside execute(), is bounded by Triton's queue policy.
    assert bls.parameters["max_queue"].string_value == str(loaded.spec.serve.max_queue) == "64"
    assert not bls.dynamic_batching.default_queue_policy.max_queue_size
    control_cfg = pbtxt.parse((repo / CONTROL / "config.pbtxt").read_text())
    assert control_cfg.dynamic_batching.default_queue_policy.max_queue_size == 64
    assert pbtxt.parse((repo / BLS_STREAMING / "config.pbtxt").read_text()).model_transaction_policy.decoupled
    assert bls.parameters["tensorrt_llm_draft_model_name"].string_value == DRAFT
    control = pbtxt.parse((repo / CONTROL / "config.pbtxt").read_text()).parameters
    assert control["mode"].string_value == "target_only"
    # The control path has its own copy of the target: no cache state shared with speculation.
    assert control["tensorrt_llm_model_name"].string_value == CONTROL_ENGINE
    assert bls.parameters["tensorrt_llm_model_name"].string_value == TARGET
    own = pbtxt.parse((repo / CONTROL_ENGINE / "config.pbtxt").read_text()).parameters
    assert own["engine_dir"].string_value == str(loaded.output_dir() / "target")
    engine = pbtxt.parse((repo / TARGET / "config.pbtxt").read_text())
    assert engine.parameters["engine_dir"].string_value == str(loaded.output_dir() / "target")
    assert engine.HasField("dynamic_batching")
    assert [i.name for i in engine.input][:4] == ["input_ids", "input_lengths", "request_output_len", "draft_input_ids"]
    assert json.loads((repo / REPO_INFO).read_text())["spec"] == loaded.spec.name
    assert not list(repo.rglob("triton")) and not list(tmp_path.glob(".repo.*"))  # no temp left


def test_ngram_repository_has_no_draft_model(tmp_path, tiny_ckpts):
    from trtspec.engines.build import build
    from trtspec.spec import load_spec

    loaded = load_spec(write_spec(tmp_path / "ng", tiny_ckpts, draft=None, **{"speculative.method": "ngram"}))
    build(loaded, loaded.output_dir())
    repo = write_repository(loaded, loaded.output_dir(), tmp_path / "repo")
    assert not (repo / DRAFT).exists()
    assert "tensorrt_llm_draft_model_name" not in pbtxt.parse((repo / BLS / "config.pbtxt").read_text()).parameters


def test_repo_command_refuses_missing_engines(tmp_path, tiny_ckpts):
    spec = write_spec(tmp_path / "nobuild", tiny_ckpts)
    result = CliRunner().invoke(app, ["repo", str(spec), "-o", str(tmp_path / "r")])
    assert result.exit_code == 2
    assert "run `trtspec build SPEC`" in result.output


# ------------------------------------------------------------------------------------ serving


@pytest.mark.server
@pytest.mark.parametrize("k", [None, 0, 2, 8])
def test_unary_matches_in_process_tokens_and_metrics(client, deployment, k):
    _, dep = deployment
    for prompt in PROMPTS[:2]:
        result = client.infer(BLS, _bls(prompt, k=k))
        ref = _reference(dep, prompt, k=k)
        assert _ids(result) == ref.output_ids
        assert metrics_from_json(result.as_numpy("perf_metrics_json")[0, 0].decode()) == ref.metrics
        assert result.as_numpy("total_draft_tokens")[0, 0] == ref.metrics.drafted
        assert result.as_numpy("total_accepted_draft_tokens")[0, 0] == ref.metrics.accepted
        assert result.as_numpy("text_output")[0].decode() == dep.decode(ref.output_ids)
        control = client.infer(CONTROL, _bls(prompt, k=k))
        assert _ids(control) == _reference(dep, prompt, speculative=False).output_ids == ref.output_ids


@pytest.mark.server
def test_output_includes_the_prompt_unless_excluded(client, deployment):
    _, dep = deployment
    inputs = [t for t in _bls(PROMPTS[0]) if t.name() != "exclude_input_in_output"]
    result = client.infer(BLS, inputs)
    prompt_ids = dep.encode(PROMPTS[0])
    assert _ids(result) == prompt_ids + _reference(dep, PROMPTS[0]).output_ids


@pytest.mark.server
def test_streaming_yields_the_unary_tokens_step_by_step(served, deployment):
    _, dep = deployment
    prompt = PROMPTS[2]
    responses = _stream(served.grpc_endpoint, _bls(prompt, stream=True))
    ref = _reference(dep, prompt)
    steps = [r.as_numpy("output_ids")[0].tolist() for r in responses]
    assert [tok for s in steps for tok in s] == ref.output_ids
    assert len(steps) == ref.metrics.target_forwards > 1  # one response per loop step
    assert "".join(r.as_numpy("text_output")[0].decode() for r in responses) == dep.decode(ref.output_ids)
    final = responses[-1]
    assert final.get_response().parameters["triton_final_response"].bool_param
    assert metrics_from_json(final.as_numpy("perf_metrics_json")[0, 0].decode()) == ref.metrics
    # every streamed response carries the perf outputs so far (upstream's client reads them all)
    drafted = [metrics_from_json(r.as_numpy("perf_metrics_json")[0, 0].decode()).drafted for r in responses]
    assert drafted == sorted(drafted) and drafted[-1] == ref.metrics.drafted


@pytest.mark.server
def test_concurrent_clients_all_match_target_only(served, deployment):
    _, dep = deployment
    expected = {p: _reference(dep, p, speculative=False).output_ids for p in PROMPTS}
    jobs = [
        (kind, PROMPTS[i % len(PROMPTS)], [None, 1, 4, 8][i % 4]) for i, kind in enumerate(["unary", "stream", "control"] * 4)
    ]  # 12 in flight
    outputs: dict[int, list[int]] = {}
    errors = []
    barrier = threading.Barrier(len(jobs))

    def work(n, kind, prompt, k):
        try:
            barrier.wait()
            if kind == "stream":
                steps = _stream(served.grpc_endpoint, _bls(prompt, k=k, stream=True), request_id=str(n))
                outputs[n] = [t for r in steps for t in r.as_numpy("output_ids")[0].tolist()]
            else:
                c = grpcclient.InferenceServerClient(served.grpc_endpoint)
                outputs[n] = _ids(c.infer(BLS if kind == "unary" else CONTROL, _bls(prompt, k=k)))
        except Exception as err:  # surfaced below
            errors.append(f"{kind} {prompt!r}: {err}")

    threads = [threading.Thread(target=work, args=(n, *job)) for n, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert errors == []
    for n, (_, prompt, _) in enumerate(jobs):
        assert outputs[n] == expected[prompt], f"job {n} ({jobs[n]}) differs from target-only"


@pytest.mark.server
def test_generate_endpoint_answers_json(served, deployment):
    _, dep = deployment
    body = json.dumps(
        {
            "text_input": PROMPTS[0],
            "max_tokens": 12,
            "stop_words": "",
            "exclude_input_in_output": True,
            "return_perf_metrics": True,
            "apply_chat_template": True,
        }
    ).encode()
    req = urllib.request.Request(f"http://{served.http_endpoint}/v2/models/{BLS}/generate", data=body, method="POST")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(req, timeout=60) as resp:
        answer = json.loads(resp.read())
    ref = _reference(dep, PROMPTS[0], max_tokens=12)
    assert answer["output_ids"] == ref.output_ids
    assert answer["text_output"] == dep.decode(ref.output_ids)
    assert answer["total_draft_tokens"] == ref.metrics.drafted


@pytest.mark.server
def test_stop_words_end_generation_like_in_process(client, deployment):
    _, dep = deployment
    full = _reference(dep, PROMPTS[0]).output_ids
    stop_text = dep.tokenizer.decode(full[5:7])
    stop_ids = tuple(dep.tokenizer(stop_text, add_special_tokens=False)["input_ids"])
    inputs = _bls(PROMPTS[0]) + [_t("stop_words", [[stop_text.encode()]], "BYTES", shape="raw")]
    got = _ids(client.infer(BLS, inputs))
    (ref,) = dep.generate([_with_stops(dep, PROMPTS[0], stop_ids)])
    assert got == ref.output_ids and len(got) < len(full)


def _with_stops(dep, prompt, stop_ids):
    req = dep.request(dep.encode(prompt), MAX_TOKENS)
    req.stop_sequences = (stop_ids,)
    return req


# ------------------------------------------------------------------------------- bad requests


def _engine(ids=(5, 6, 7), lengths=None, out_len=2, draft=None, raw=None):
    raw = raw or {}
    inputs = [
        raw.get("input_ids") or _t("input_ids", [list(ids)], "INT32", "raw"),
        raw.get("input_lengths") or _t("input_lengths", [[len(ids) if lengths is None else lengths]], "INT32", "raw"),
        _t("request_output_len", out_len, "INT32"),
    ]
    if draft is not None:
        inputs.append(_t("draft_input_ids", [list(draft)], "INT32", "raw"))
    return inputs


def _drop(inputs, name):
    return [t for t in inputs if t.name() != name]


def _replace(inputs, tensor):
    return _drop(inputs, tensor.name()) + [tensor]


BAD_REQUESTS = [
    # (model, inputs, expected text in the error)
    (BLS, lambda: _drop(_bls("hi"), "text_input"), "text_input"),
    (BLS, lambda: _drop(_bls("hi"), "max_tokens"), "max_tokens"),
    (BLS, lambda: _replace(_bls("hi"), _t("max_tokens", 5, "INT64")), "data-type is 'INT64'"),
    (BLS, lambda: _replace(_bls("hi"), _t("max_tokens", [[5, 6]], "INT32", "raw")), "max_tokens"),
    (BLS, lambda: _replace(_bls("hi"), _t("num_draft_tokens", 1.5, "FP32")), "data-type is 'FP32'"),
    (BLS, lambda: _bls(""), "text_input is empty"),
    (BLS, lambda: _bls("   \n"), "text_input is empty"),
    (BLS, lambda: _replace(_bls("hi"), _t("text_input", b"\xff\xfe", "BYTES")), "not valid UTF-8"),
    (BLS, lambda: _bls("hi", max_tokens=0), "max_tokens must be at least 1"),
    (BLS, lambda: _bls("hi", max_tokens=-3), "max_tokens must be at least 1"),
    (BLS, lambda: _bls("hi", max_tokens=100000), "exceeds max_seq_len 512"),
    (BLS, lambda: _bls("hi " * 300), "more than max_input_len 256"),
    (BLS, lambda: _bls("hi", k=9), "num_draft_tokens must be in 0..8"),
    (BLS, lambda: _bls("hi", k=-1), "num_draft_tokens must be in 0..8"),
    (CONTROL, lambda: _bls("hi", k=99), "num_draft_tokens must be in 0..8"),
    (BLS, lambda: _bls("hi") + [_t("end_id", 123456, "INT32")], "end_id 123456 is outside the vocabulary"),
    (BLS, lambda: _bls("hi") + [_t("pad_id", -1, "INT32")], "pad_id -1 is outside the vocabulary"),
    (BLS, lambda: _bls("hi", stream=True), "stream=true needs the decoupled model"),
    (
        BLS,
        lambda: [_t("text_input", [[b"a"]] * 5, "BYTES", "raw"), _t("max_tokens", [[4]] * 5, "INT32", "raw")],
        "batch-size must be <= 4",
    ),
    (BLS, lambda: [_t("text_input", [[b"a"], [b"b"]], "BYTES", "raw"), _t("max_tokens", [[4]], "INT32", "raw")], "batch size"),
    (BLS_STREAMING, lambda: _bls("hi"), "decoupled"),
    # The engine models answer only the repository's own BLS models (triton/backend/callers.py):
    # a client's request, well-formed or not, is refused by name before its inputs are read.
    # What they answer the endpoints' malformed requests: tests/test_backend_models.py.
    (TARGET, lambda: _engine(ids=(5, 6, 99999)), "tensorrt_llm is internal to this model repository"),
    (TARGET, lambda: _engine(), "tensorrt_llm is internal to this model repository"),
    (DRAFT, lambda: _engine(draft=(1, 2)), "tensorrt_llm_draft is internal to this model repository"),
    (CONTROL_ENGINE, lambda: _engine(), "tensorrt_llm_control is internal to this model repository"),
]


@pytest.mark.server
def test_bad_requests_get_clear_errors_while_others_are_served(served, deployment):
    _, dep = deployment
    assert len(BAD_REQUESTS) >= 20
    expected = _reference(dep, PROMPTS[3], max_tokens=48).output_ids
    bystander: dict = {}

    def other_client():  # streams the whole time the bad requests arrive
        steps = _stream(served.grpc_endpoint, _bls(PROMPTS[3], max_tokens=48, stream=True), request_id="bystander")
        bystander["ids"] = [t for r in steps for t in r.as_numpy("output_ids")[0].tolist()]

    thread = threading.Thread(target=other_client)
    thread.start()
    c = grpcclient.InferenceServerClient(served.grpc_endpoint)
    failures = []
    for model, make, text in BAD_REQUESTS:
        try:
            c.infer(model, make())  # unary, also to the decoupled model (refused by design)
            failures.append(f"{model}: no error (expected {text!r})")
        except InferenceServerException as err:
            if text not in str(err):
                failures.append(f"{model}: {err} (expected {text!r})")
        assert c.is_server_ready()
    thread.join(120)
    assert failures == []
    assert bystander.get("ids") == expected
    assert _ids(c.infer(BLS, _bls(PROMPTS[0]))) == _reference(dep, PROMPTS[0]).output_ids


# ---------------------------------------------------------------------- upstream's clients

# What TensorRT-LLM's triton_backend client end_to_end_grpc_client.py requests (written here
# from its behaviour, not copied): text_output, plus these with --return-perf-metrics.
UPSTREAM_PERF_OUTPUTS = [
    "kv_cache_alloc_new_blocks",
    "kv_cache_reused_blocks",
    "kv_cache_alloc_total_blocks",
    "arrival_time_ns",
    "first_scheduled_time_ns",
    "first_token_time_ns",
    "last_token_time_ns",
    "acceptance_rate",
    "total_accepted_draft_tokens",
    "total_draft_tokens",
]


def _as_upstream_client(endpoint, model, prompt, streaming=False, perf=False, max_tokens=MAX_TOKENS, want=(), **extra):
    """The tensors upstream's end_to_end_grpc_client sends with its defaults (beam_width 1,
    temperature 1.0, exclude_input_in_output false), always over the gRPC stream API, one
    [[value]] per input; returns the responses (or raises the first error)."""
    arrays = {
        "text_input": np.array([[prompt]]).astype(object),
        "max_tokens": np.array([[max_tokens]], dtype=np.int32),
        "stream": np.array([[streaming]], dtype=bool),
        "beam_width": np.array([[1]], dtype=np.int32),
        "temperature": np.array([[1.0]], dtype=np.float32),
        "exclude_input_in_output": np.array([[False]], dtype=bool),
    }
    if perf:
        arrays["return_perf_metrics"] = np.array([[True]], dtype=bool)
    arrays |= extra
    from tritonclient.utils import np_to_triton_dtype

    inputs = []
    for name, arr in arrays.items():
        t = grpcclient.InferInput(name, arr.shape, np_to_triton_dtype(arr.dtype))
        t.set_data_from_numpy(arr)
        inputs.append(t)
    names = ["text_output"] + (UPSTREAM_PERF_OUTPUTS if perf else []) + list(want)
    outputs = [grpcclient.InferRequestedOutput(n) for n in names]
    got: queue.Queue = queue.Queue()
    c = grpcclient.InferenceServerClient(endpoint)
    c.start_stream(callback=lambda result, error: got.put(error or result))
    c.async_stream_infer(model, inputs, outputs=outputs, request_id="upstream")
    c.stop_stream()  # waits for the server to finish the stream, as upstream's client does
    responses = []
    while not got.empty():
        item = got.get()
        if isinstance(item, InferenceServerException):
            raise item
        responses.append(item)
    return responses


@pytest.mark.server
@pytest.mark.parametrize("model", ["ensemble", BLS])
def test_upstream_client_gets_greedy_text_with_perf_metrics(served, deployment, model):
    _, dep = deployment
    prompt = PROMPTS[0]
    (result,) = _as_upstream_client(served.grpc_endpoint, model, prompt, perf=True)
    ref = dep.generate([dep.request(dep.encode(prompt, chat_template=False), MAX_TOKENS)], speculative=True)[0]
    ids = dep.encode(prompt, chat_template=False) + ref.output_ids
    assert result.as_numpy("text_output")[0].decode() == dep.decode(ids)
    assert result.as_numpy("total_draft_tokens")[0][0] == ref.metrics.drafted > 0
    assert result.as_numpy("total_accepted_draft_tokens")[0][0] == ref.metrics.accepted
    times = [int(result.as_numpy(n)[0][0]) for n in UPSTREAM_PERF_OUTPUTS[3:7]]
    assert 0 < times[0] <= times[1] <= times[2] <= times[3]  # arrival <= scheduled <= first <= last token
    # the target engine model's context-phase KV-cache blocks (32 tokens each), as upstream counts them
    new, reused, total = (int(result.as_numpy(n)[0][0]) for n in UPSTREAM_PERF_OUTPUTS[:3])
    assert reused + total == -(-len(dep.encode(prompt, chat_template=False)) // 32)
    assert 0 <= new <= total


@pytest.mark.server
def test_upstream_client_streams_from_the_ensemble(served, deployment):
    _, dep = deployment
    prompt = PROMPTS[1]
    responses = _as_upstream_client(served.grpc_endpoint, "ensemble", prompt, streaming=True)
    ref = dep.generate([dep.request(dep.encode(prompt, chat_template=False), MAX_TOKENS)], speculative=True)[0]
    assert len(responses) > 1
    assert "".join(r.as_numpy("text_output")[0].decode() for r in responses) == dep.decode(ref.output_ids)


@pytest.mark.server
@pytest.mark.parametrize(
    ("model", "extra", "message"),
    [
        ("ensemble", {"beam_width": np.array([[2]], dtype=np.int32)}, "beam search (beam_width=2) is not supported"),
        (BLS, {"num_return_sequences": np.array([[2]], dtype=np.int32)}, "num_return_sequences=2 answers with one"),
        (CONTROL, {"lora_task_id": np.array([[1]], dtype=np.uint64)}, "LoRA adapters (lora_task_id)"),
        ("ensemble", {"prompt_vocab_size": np.array([[4]], dtype=np.int32)}, "prompt tuning tables"),
        (BLS, {"repetition_penalty": np.array([[0.0]], dtype=np.float32)}, "repetition_penalty must be > 0"),
        (BLS, {"guided_decoding_guide_type": np.array([[b"json"]], dtype=object)}, "guided decoding"),
    ],
)
def test_upstream_fields_trtspec_lacks_are_named_errors(served, model, extra, message):
    with pytest.raises(InferenceServerException) as err:
        _as_upstream_client(served.grpc_endpoint, model, PROMPTS[0], **extra)
    assert message in str(err.value) and "unexpected" not in str(err.value)


@pytest.mark.server
def test_generate_endpoint_samples_with_upstream_fields_reproducibly_by_seed(served):
    """top_p/temperature/seed over HTTP generate: the same seed gives the same text on the
    speculative and control endpoints alike; other seeds give other samples."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def sample(model, seed):
        body = {"text_input": PROMPTS[0], "max_tokens": 12, "top_p": 0.95, "temperature": 1.0, "seed": seed}
        req = urllib.request.Request(
            f"http://{served.http_endpoint}/v2/models/{model}/generate", data=json.dumps(body).encode(), method="POST"
        )
        with opener.open(req, timeout=120) as resp:
            return json.loads(resp.read())["text_output"]

    for model in (BLS, CONTROL):
        first = sample(model, 3)
        assert sample(model, 3) == first
        assert len({first, sample(model, 4), sample(model, 5)}) > 1


# --------------------------------------------------------------------------- OpenAI front


@pytest.fixture(scope="module")
def openai_url(served, deployment):
    """`trtspec openai`'s app on uvicorn at 127.0.0.1, in front of the served repository."""
    pytest.importorskip("uvicorn")
    from trtspec.openai.run import make_app

    loaded, _ = deployment
    for port in serve_app(make_app(loaded.base_dir / "repo", served.grpc_endpoint)):
        yield f"http://127.0.0.1:{port}/v1"


@pytest.fixture
def oai(openai_url):
    openai = pytest.importorskip("openai")
    # trust_env=False: never route loopback traffic through a proxy from the environment.
    return openai.OpenAI(
        base_url=openai_url, api_key="unused", max_retries=0, timeout=120, http_client=openai.DefaultHttpxClient(trust_env=False)
    )


def _name(deployment):
    return deployment[0].spec.name


@pytest.mark.server
def test_openai_models_lists_speculative_and_control(oai, deployment):
    assert sorted(m.id for m in oai.models.list().data) == sorted([_name(deployment), _name(deployment) + "-target-only"])


@pytest.mark.server
@pytest.mark.parametrize("control", [False, True])
def test_openai_completion_is_the_greedy_generation(oai, deployment, control):
    _, dep = deployment
    prompt = PROMPTS[0]
    model = _name(deployment) + ("-target-only" if control else "")
    out = oai.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    ref = dep.generate([dep.request(dep.encode(prompt, chat_template=False), MAX_TOKENS)], speculative=not control)[0]
    assert out.choices[0].text == dep.decode(ref.output_ids)
    assert out.usage.prompt_tokens == len(dep.encode(prompt, chat_template=False))
    assert out.usage.completion_tokens == len(ref.output_ids)
    assert out.choices[0].finish_reason == ("length" if len(ref.output_ids) == MAX_TOKENS else "stop")
    details = out.usage.completion_tokens_details
    assert details.accepted_prediction_tokens == ref.metrics.accepted
    assert details.rejected_prediction_tokens == ref.metrics.drafted - ref.metrics.accepted
    assert (ref.metrics.drafted > 0) != control


@pytest.mark.server
def test_openai_temperature_samples_reproducibly_by_seed(oai, deployment):
    """temperature > 0 samples through the deployment's lossless sampler (streamed or not):
    a seed repeats its sample, on the speculative model and its control."""
    for model in (_name(deployment), _name(deployment) + "-target-only"):
        kw = {"model": model, "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0.9, "top_p": 0.95}
        a = oai.completions.create(seed=11, **kw).choices[0].text
        assert oai.completions.create(seed=11, **kw).choices[0].text == a
        streamed = "".join(c.choices[0].text for c in oai.completions.create(seed=11, stream=True, **kw) if c.choices)
        assert streamed == a
        assert len({a, *(oai.completions.create(seed=s, **kw).choices[0].text for s in (12, 13))}) > 1


@pytest.mark.server
def test_openai_chat_streams_the_same_text_with_usage(oai, deployment):
    _, dep = deployment
    prompt = PROMPTS[1]
    messages = [{"role": "user", "content": prompt}]
    ref = dep.generate([dep.request(dep.encode(prompt, chat_template=True), MAX_TOKENS)], speculative=True)[0]
    whole = oai.chat.completions.create(model=_name(deployment), messages=messages, max_tokens=MAX_TOKENS)
    assert whole.choices[0].message.content == dep.decode(ref.output_ids)
    chunks = list(
        oai.chat.completions.create(
            model=_name(deployment), messages=messages, max_tokens=MAX_TOKENS, stream=True, stream_options={"include_usage": True}
        )
    )
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(deltas) == dep.decode(ref.output_ids)
    assert sum(1 for d in deltas if d) > 1  # really streamed, step by step
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] in (["stop"], ["length"])
    assert chunks[-1].usage.completion_tokens == len(ref.output_ids)
    assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens == ref.metrics.accepted


@pytest.mark.server
@pytest.mark.parametrize("stream", [False, True])
def test_openai_stop_ends_before_the_stop_text(oai, deployment, stream):
    _, dep = deployment
    prompt = PROMPTS[2]
    full = dep.decode(dep.generate([dep.request(dep.encode(prompt, chat_template=False), MAX_TOKENS)])[0].output_ids)
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), "pick a stop string inside the text"
    kw = {"model": _name(deployment), "prompt": prompt, "max_tokens": MAX_TOKENS, "stop": [stop]}
    if stream:
        chunks = list(oai.completions.create(stream=True, **kw))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    else:
        out = oai.completions.create(**kw)
        text, finish = out.choices[0].text, [out.choices[0].finish_reason]
    assert text == full[: full.find(stop)]
    assert finish == ["stop"]


@pytest.mark.server
@pytest.mark.parametrize(
    ("kw", "status", "message"),
    [
        ({"n": 2, "stream": True}, 400, "n=2 with stream is not supported"),
        ({"presence_penalty": 2.5}, 400, "presence_penalty"),
        ({"logprobs": 2}, 400, "logprobs=2 asks for top alternatives"),
        ({"logprobs": 0, "stream": True}, 400, "logprobs with stream is not supported"),
        ({"logit_bias": {"5": 1.0}}, 400, "logit_bias (token ids) is not supported"),
        ({"extra_body": {"guided_json": {}}}, 400, "guided_json is not supported by trtspec"),
        ({"model": "gpt-4"}, 404, "model 'gpt-4' does not exist"),
        ({"max_tokens": 10_000}, 400, "max_tokens"),
        # the deployment's own INVALID_ARG, streamed: still 400 (the stream keeps its gRPC status)
        ({"max_tokens": 10_000, "stream": True}, 400, "exceeds max_seq_len"),
        ({"extra_body": {"num_draft_tokens": 99}, "stream": True}, 400, "num_draft_tokens must be in 0..8"),
        ({"extra_body": {"num_draft_tokens": 2**31 + 8}}, 400, "less than or equal to 2147483647"),
    ],
)
def test_openai_errors_have_openai_shape_and_name_the_field(oai, deployment, kw, status, message):
    openai = pytest.importorskip("openai")
    args = {"model": _name(deployment), "prompt": PROMPTS[0], "max_tokens": 8} | kw
    with pytest.raises(openai.APIStatusError) as err:
        out = oai.completions.create(**args)
        if args.get("stream"):
            list(out)
    assert err.value.status_code == status
    body = err.value.response.json()["error"]
    assert message in body["message"] and body["type"] in ("invalid_request_error", "server_error")


@pytest.mark.server
@pytest.mark.parametrize("control", [False, True])
def test_openai_penalties_and_logprobs_are_the_deployments(oai, deployment, control):
    """presence/frequency penalties and the repetition_penalty / min_tokens extensions reach
    the logits processing; logprobs are the target's log probs of the chosen tokens."""
    from trtspec.speculative.processing import Processing

    _, dep = deployment
    prompt = PROMPTS[2]
    model = _name(deployment) + ("-target-only" if control else "")
    kw = {"presence_penalty": 0.6, "frequency_penalty": 0.3}
    extra = {"repetition_penalty": 1.4, "min_tokens": 5}
    out = oai.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, logprobs=0, extra_body=extra, **kw)
    proc = Processing(repetition_penalty=1.4, presence_penalty=0.6, frequency_penalty=0.3, min_tokens=5)
    ids = dep.encode(prompt, chat_template=False)
    ref = dep.generate([dep.request(ids, MAX_TOKENS, processing=proc, log_probs=True)], speculative=not control)[0]
    plain = dep.generate([dep.request(ids, MAX_TOKENS)])[0]
    assert ref.output_ids != plain.output_ids
    assert out.choices[0].text == dep.decode(ref.output_ids)
    lp = out.choices[0].logprobs
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.token_logprobs == pytest.approx(ref.log_probs, abs=1e-4)
    chat = oai.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=8, logprobs=True, extra_body=extra, **kw
    )
    content = chat.choices[0].logprobs.content
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    assert all(t.logprob <= 0 for t in content)


@pytest.mark.server
def test_openai_n_choices_sample_with_consecutive_seeds(oai, deployment):
    kw = {"model": _name(deployment), "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0.9, "top_p": 0.95}
    out = oai.completions.create(n=3, seed=21, **kw)
    assert [c.index for c in out.choices] == [0, 1, 2]
    for i, choice in enumerate(out.choices):
        assert choice.text == oai.completions.create(seed=21 + i, **kw).choices[0].text
    assert out.usage.completion_tokens == sum(oai.completions.create(seed=21 + i, **kw).usage.completion_tokens for i in range(3))


@pytest.mark.server
def test_openai_greedy_n_sends_one_request(oai, deployment, served):
    """Greedy decoding is deterministic: n = 16 is one generation, answered 16 times."""
    stats = grpcclient.InferenceServerClient(served.grpc_endpoint)

    def count():
        return int(stats.get_inference_statistics(BLS, as_json=True)["model_stats"][0]["inference_count"] or 0)

    before = count()
    out = oai.completions.create(model=_name(deployment), prompt=PROMPTS[1], max_tokens=8, n=16)
    assert count() - before == 1
    assert len(out.choices) == 16 and len({c.text for c in out.choices}) == 1


@pytest.mark.server
@pytest.mark.parametrize("control", [False, True])
def test_openai_ignore_eos_generates_exactly_max_tokens_as_target_only_does(oai, deployment, control):
    """ignore_eos (end_id -1 on the Triton contract): no end token, exactly max_tokens; the
    same tokens on the speculative model and the control, equal to the loop without end ids."""
    from dataclasses import replace

    _, dep = deployment
    prompt, n = PROMPTS[3], 40
    model = _name(deployment) + ("-target-only" if control else "")
    out = oai.completions.create(model=model, prompt=prompt, max_tokens=n, extra_body={"ignore_eos": True})
    req = replace(dep.request(dep.encode(prompt, chat_template=False), n), end_ids=frozenset())
    ref = dep.generate([req], speculative=False)[0]
    assert len(ref.output_ids) == n
    assert out.usage.completion_tokens == n and out.choices[0].finish_reason == "length"
    assert out.choices[0].text == dep.decode(ref.output_ids)


@pytest.mark.server
def test_end_id_minus_one_is_no_end_token_on_the_contract(client):
    """The request's end_id stops at that token; -1 (TensorRT-LLM's ignore_eos) stops at none."""
    plain = client.infer(BLS, _bls(PROMPTS[0]))
    ids = _ids(plain)
    stop_at = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i])  # a token's first appearance
    ended = client.infer(BLS, _bls(PROMPTS[0]) + [_t("end_id", ids[stop_at], "INT32")])
    assert _ids(ended) == ids[:stop_at]
    free = client.infer(BLS, _bls(PROMPTS[0]) + [_t("end_id", -1, "INT32")])
    assert _ids(free) == ids and len(ids) == MAX_TOKENS


@pytest.mark.server
def test_openai_continuous_usage_is_in_every_chunk(oai, deployment):
    chunks = list(
        oai.chat.completions.create(
            model=_name(deployment),
            messages=[{"role": "user", "content": PROMPTS[0]}],
            max_tokens=MAX_TOKENS,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == chunks[-1].usage.completion_tokens > counts[0]
    assert chunks[-1].usage.completion_tokens_details is not None  # the final usage is the whole one


# ----------------------------------------------------------------------------------- verify


def _over_url(command: str, loaded, served, max_tokens: int) -> list[str]:
    """``command`` (verify, bench) on the served repository's gRPC endpoint with the first two prompts."""
    return [
        command,
        str(loaded.path),
        "--url",
        served.grpc_endpoint,
        "-p",
        PROMPTS[0],
        "-p",
        PROMPTS[1],
        "--max-tokens",
        str(max_tokens),
    ]


@pytest.mark.server
@pytest.mark.parametrize("stream", [False, True])
def test_verify_url_reports_identical(served, deployment, tmp_path, stream):
    loaded, _ = deployment
    report = tmp_path / "report.json"
    junit = tmp_path / "verify.xml"
    args = _over_url("verify", loaded, served, 16) + ["--json-file", str(report), "--junit", str(junit)]
    args += ["--html", str(tmp_path / "report.html")] + (["--stream"] if stream else [])
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(report.read_text())
    assert data["identical"] and data["mode"].startswith(f"grpc://{served.grpc_endpoint}")
    assert data["metrics"]["drafted"] > 0 and junit.is_file()
    page = (tmp_path / "report.html").read_text()  # the browser tests are in test_report_html.py
    assert "PASSED: all 2 prompts token-identical" in page and "divergences are <b>unclassified</b>" in page
    assert "reports no step boundaries" in page


@pytest.mark.server
def test_verify_sampling_over_the_server_draws_from_the_target_distribution(served, deployment, tmp_path):
    """--sampling with --url: the served speculative endpoint samples (temperature/top_p/seed
    over gRPC), the target engine built here scores every token; the chi-square test passes."""
    loaded, _ = deployment
    report = tmp_path / "sampling.json"
    args = _over_url("verify", loaded, served, 10)
    args += ["--sampling", "30", "--temperature", "0.9", "--top-p", "0.95", "--seed", "5", "--json-file", str(report)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    s = json.loads(report.read_text())["sampling"]
    assert s["samples_per_prompt"] == 30 and s["prompts"] == 2 and s["tokens"] >= 60
    assert s["p_value"] >= 0.01 and s["passed"] is True
    assert s["metrics"]["drafted"] > 0  # the samples came through the speculative loop
    assert "consistent with the target's distribution" in result.output


@pytest.mark.server
def test_verify_and_bench_url_report_the_served_default_draft_length(served, deployment, tiny_ckpts, tmp_path):
    """With no -k, the served endpoint drafts its own default_draft_tokens (a parameter of its
    config), and verify and bench report that one, not the local spec's."""
    loaded, _ = deployment
    served_k = loaded.spec.speculative.default_draft_tokens
    local = write_spec(tmp_path, tiny_ckpts, **{"speculative.default_draft_tokens": served_k + 1})
    common = ["--url", served.grpc_endpoint, "--engines", str(loaded.output_dir()), "-p", PROMPTS[0], "--max-tokens", "8"]
    result = CliRunner().invoke(app, ["verify", str(local), *common, "--json-file", str(tmp_path / "v.json")])
    assert result.exit_code == 0, result.output
    verified = json.loads((tmp_path / "v.json").read_text())
    assert verified["num_draft_tokens"] == served_k and len(verified["metrics"]["per_position_rate"]) == served_k
    result = CliRunner().invoke(app, ["bench", str(local), *common, "--sweep", "none", "-c", "1", "-o", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "bench.json").read_text())["k"] == served_k


def test_verify_url_unreachable_is_one_clear_error(deployment):
    loaded, _ = deployment
    (port,) = free_ports(1)
    result = CliRunner().invoke(app, ["verify", str(loaded.path), "--url", f"127.0.0.1:{port}", "-p", "x"])
    assert result.exit_code == 2
    assert f"cannot reach a Triton server at 127.0.0.1:{port}" in result.output
    assert "Traceback" not in result.output


def test_bench_url_measures_served_repository(served, deployment, tmp_path):
    loaded, _ = deployment
    result = CliRunner().invoke(app, _over_url("bench", loaded, served, 8) + ["--sweep", "2", "-c", "1,2", "-o", str(tmp_path)])
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["complete"] and data["mode"] == f"grpc://{served.grpc_endpoint}"
    assert data["target"]["tokens"] == data["speculative"]["tokens"] == 16
    assert data["speculative"]["ttft_p50"] > 0  # streamed: the first token is observed
    assert data["target"]["ttft_p50"] is None  # unary control: not observable
    assert data["metrics"]["drafted"] > 0 and data["costs"]["target_step"] > 0 and data["bound"] > 0
    assert [p["concurrency"] for p in data["concurrency"]] == [1, 2]


def test_bench_url_without_a_readable_caller_key_measures_all_but_step_costs(served, deployment, tmp_path, monkeypatch):
    """The engine models answer only the repository's own models: a bench that cannot read this
    server's caller key (another user's or machine's server) says so and measures the rest."""
    from trtspec.triton.backend import callers

    monkeypatch.setattr(callers, "local_keys", lambda folder=callers.SHM: [])
    loaded, _ = deployment
    args = ["bench", str(loaded.path), "--url", served.grpc_endpoint, "-p", PROMPTS[0], "--max-tokens", "8"]
    result = CliRunner().invoke(app, [*args, "--sweep", "none", "-c", "1", "-o", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "step costs not measured" in result.output
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["complete"] and data["costs"] is None and data["target"]["tokens"] == data["speculative"]["tokens"] == 8


def test_bench_url_unreachable_exit_2(deployment):
    loaded, _ = deployment
    (port,) = free_ports(1)
    result = CliRunner().invoke(app, ["bench", str(loaded.path), "--url", f"127.0.0.1:{port}", "-p", "x"])
    assert result.exit_code == 2 and f"cannot reach a Triton server at 127.0.0.1:{port}" in result.output


def test_verify_stream_needs_url(deployment):
    loaded, _ = deployment
    result = CliRunner().invoke(app, ["verify", str(loaded.path), "--stream", "-p", "x"])
    assert result.exit_code == 2 and "add --url" in result.output


# ------------------------------------------------------------------- serve: start, stop, fail


def _engine_only_repo(deployment, tmp_path, break_it=False) -> Path:
    """A small repository (the target engine model only): starts in seconds."""
    loaded, _ = deployment
    full = write_repository(loaded, loaded.output_dir(), tmp_path / "full")
    repo = tmp_path / "small"
    repo.mkdir()
    shutil.copytree(full / TARGET, repo / TARGET)
    if break_it:
        cfg = repo / TARGET / "config.pbtxt"
        cfg.write_text(cfg.read_text().replace(str(loaded.output_dir() / "target"), str(tmp_path / "no-such-engine")))
    return repo


def _port_args():
    http, grpc, metrics = free_ports(3)
    return ["--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics)]


def test_serve_dry_run_prints_command_and_environment(deployment):
    loaded, _ = deployment
    result = CliRunner().invoke(app, ["serve", str(loaded.path), "--dry-run", "--repo", str(loaded.base_dir / "dry")])
    assert result.exit_code == 0, result.output
    assert "--http-address=127.0.0.1" in result.output and "--grpc-port=8001" in result.output
    assert "PATH=" + sys.prefix in result.output and "LD_LIBRARY_PATH=" in result.output
    assert "ONEDNN_PRIMITIVE_CACHE_CAPACITY=640" in result.output and "LD_PRELOAD=" in result.output
    assert "<admin key>" in result.output  # never the key itself
    assert not (loaded.base_dir / "dry").exists()


@pytest.mark.server
def test_serve_fails_with_the_broken_models_log_lines(deployment, tmp_path, backend_cache, monkeypatch):
    monkeypatch.setenv("TRTSPEC_CACHE_DIR", str(backend_cache))
    repo = _engine_only_repo(deployment, tmp_path, break_it=True)
    result = CliRunner().invoke(app, ["serve", str(repo), *_port_args(), "--timeout", "120"])
    assert result.exit_code == 3, result.output
    assert "failed to load 'tensorrt_llm'" in result.output
    assert "no-such-engine does not exist" in result.output  # the model's own error
    assert processes_mentioning(str(repo)) == []


@pytest.mark.server
def test_serve_detach_then_stop_leaves_nothing(deployment, tmp_path, backend_cache, monkeypatch):
    monkeypatch.setenv("TRTSPEC_CACHE_DIR", str(backend_cache))
    repo = _engine_only_repo(deployment, tmp_path)
    pid_file = tmp_path / "run" / "server.json"
    ports = _port_args()
    result = CliRunner().invoke(app, ["serve", str(repo), *ports, "--detach", "--pid-file", str(pid_file)])
    try:
        assert result.exit_code == 0, result.output
        info = json.loads(pid_file.read_text())
        assert grpcclient.InferenceServerClient(info["grpc_endpoint"]).is_model_ready(TARGET)
        assert (tmp_path / "run" / "server.log").is_file()
    finally:
        stopped = CliRunner().invoke(app, ["stop", "--pid-file", str(pid_file)])
    assert stopped.exit_code == 0, stopped.output
    assert not pid_file.exists()
    assert processes_mentioning(str(repo)) == []


@pytest.mark.server
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 0), (signal.SIGINT, 130)])
def test_serve_forwards_signals_and_stops_every_stub(deployment, tmp_path, backend_cache, sig, code):
    repo = _engine_only_repo(deployment, tmp_path)
    env = dict(os.environ, TRTSPEC_CACHE_DIR=str(backend_cache))
    proc = subprocess.Popen(
        [sys.executable, "-m", "trtspec", "serve", str(repo), *_port_args()],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        # A shell that starts pytest in the background without job control hands every child
        # SIGINT ignored, and Python then keeps it ignored (as a server should); this test is
        # about what serve does with the signal, so its child starts with the default.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        line = ""
        deadline = time.monotonic() + 120
        while "ready in" not in line and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "serve exited before ready"
        assert "ready in" in line
        assert any("triton_python_backend_stub" in p for p in processes_mentioning(str(repo)))
        proc.send_signal(sig)
        assert proc.wait(60) == code
    finally:
        if proc.poll() is None:
            proc.kill()
    assert processes_mentioning(str(repo)) == []


def _processing_arrays(dep, prompt):
    """Upstream inputs asking for every logits-processing feature, with a bad word and a
    bias word taken from the plain greedy answer (so they change it)."""
    plain = dep.generate([dep.request(dep.encode(prompt, chat_template=False), MAX_TOKENS)], speculative=False)[0]
    return {
        "temperature": np.array([[1.0]], dtype=np.float32),
        "repetition_penalty": np.array([[1.3]], dtype=np.float32),
        "presence_penalty": np.array([[0.4]], dtype=np.float32),
        "frequency_penalty": np.array([[0.2]], dtype=np.float32),
        "min_tokens": np.array([[6]], dtype=np.int32),
        "bad_words": np.array([[dep.decode([plain.output_ids[2]]).encode()]], dtype=object),
        "embedding_bias_words": np.array([[dep.decode([plain.output_ids[5]]).encode()]], dtype=object),
        "embedding_bias_weights": np.array([[-2.5]], dtype=np.float32),
        "return_log_probs": np.array([[True]], dtype=bool),
    }, plain


@pytest.mark.server
@pytest.mark.parametrize("model", [BLS, CONTROL])
def test_logits_processing_and_log_probs_over_triton_match_in_process(served, deployment, model):
    """Penalties, min_tokens, bad_words and embedding bias from upstream's inputs: the
    served speculative and control endpoints give the in-process tokens, and the target's
    log probs of them."""
    from trtspec.triton.backend.contract import processing_of

    _, dep = deployment
    prompt = PROMPTS[2]
    arrays, plain = _processing_arrays(dep, prompt)
    (proc,) = processing_of(arrays, 1, dep.tokenizer, dep.target.vocab_size)
    ids = dep.encode(prompt, chat_template=False)
    req = dep.request(ids, MAX_TOKENS, processing=proc, log_probs=True)
    req.generation_logits = True
    ref = dep.generate([req], speculative=True)[0]
    assert ref.output_ids != plain.output_ids
    extra = arrays | {
        "exclude_input_in_output": np.array([[True]], dtype=bool),
        "return_generation_logits": np.array([[True]], dtype=bool),
    }
    names = ["text_output", "output_ids", "output_log_probs", "cum_log_probs", "generation_logits"]
    c = grpcclient.InferenceServerClient(served.grpc_endpoint)
    from tritonclient.utils import np_to_triton_dtype

    base = {"text_input": np.array([[prompt.encode()]], dtype=object), "max_tokens": np.array([[MAX_TOKENS]], dtype=np.int32)}
    inputs = []
    for name, arr in (base | extra).items():
        t = grpcclient.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
        t.set_data_from_numpy(arr)
        inputs.append(t)
    out = c.infer(model, inputs, outputs=[grpcclient.InferRequestedOutput(n) for n in names])
    assert out.as_numpy("output_ids").reshape(-1).tolist() == ref.output_ids
    lp = out.as_numpy("output_log_probs")
    assert lp.shape == (1, 1, len(ref.output_ids))
    assert lp.reshape(-1).tolist() == pytest.approx(ref.log_probs, abs=1e-4)
    assert out.as_numpy("cum_log_probs").reshape(-1)[0] == pytest.approx(sum(ref.log_probs), abs=1e-3)
    logits = out.as_numpy("generation_logits")  # [1, beam 1, tokens, vocab]: the target's own
    assert logits.shape[:3] == (1, 1, len(ref.output_ids))
    want = np.stack([t.numpy() for t in ref.generation_logits])
    assert np.allclose(logits[0, 0, :, : want.shape[1]], want, atol=1e-3)


@pytest.mark.server
def test_logits_processing_through_the_ensemble_as_upstream_clients_send_it(served, deployment):
    _, dep = deployment
    prompt = PROMPTS[2]
    arrays, _ = _processing_arrays(dep, prompt)
    from trtspec.triton.backend.contract import processing_of

    (proc,) = processing_of(arrays, 1, dep.tokenizer, dep.target.vocab_size)
    ids = dep.encode(prompt, chat_template=False)
    ref = dep.generate([dep.request(ids, MAX_TOKENS, processing=proc)], speculative=True)[0]
    (result,) = _as_upstream_client(served.grpc_endpoint, "ensemble", prompt, **arrays)
    assert result.as_numpy("text_output")[0].decode() == dep.decode(ids + ref.output_ids)


@pytest.mark.server
def test_num_return_sequences_answers_one_response_per_sequence(served, deployment):
    """As upstream's decoupled models: one response per sequence, each with its
    sequence_index, the last flagged final; greedy sequences are all the greedy answer,
    sampled ones draw with seed + i."""
    _, dep = deployment
    prompt = PROMPTS[0]
    n = np.array([[3]], dtype=np.int32)
    responses = _as_upstream_client(
        served.grpc_endpoint,
        BLS_STREAMING,
        prompt,
        want=["sequence_index"],
        num_return_sequences=n,
        top_k=np.array([[1]], dtype=np.int32),
    )
    ref = dep.generate([dep.request(dep.encode(prompt, chat_template=False), MAX_TOKENS)], speculative=True)[0]
    text = dep.decode(dep.encode(prompt, chat_template=False) + ref.output_ids)
    assert len(responses) == 3
    assert sorted(int(r.as_numpy("sequence_index")[0][0]) for r in responses) == [0, 1, 2]
    assert all(r.as_numpy("text_output")[0].decode() == text for r in responses)

    def sampled(seed):
        """Text per sequence_index of two sampled sequences, streamed."""
        texts: dict[int, str] = {0: "", 1: ""}
        for r in _as_upstream_client(
            served.grpc_endpoint,
            BLS_STREAMING,
            prompt,
            streaming=True,
            want=["sequence_index"],
            num_return_sequences=np.array([[2]], dtype=np.int32),
            top_p=np.array([[0.95]], dtype=np.float32),
            seed=np.array([[seed]], dtype=np.uint64),
        ):
            texts[int(r.as_numpy("sequence_index")[0][0])] += r.as_numpy("text_output")[0].decode()
        return texts

    texts = sampled(11)
    assert all(texts.values())
    assert sampled(12)[0] == texts[1]  # sequence 1 of seed 11 draws with seed 12


@pytest.mark.server
@pytest.mark.parametrize("streaming", [False, True])
def test_batched_prompts_on_a_decoupled_model_answer_one_response_each(served, deployment, streaming):
    """What upstream's client sends with --batch-inputs: one request, a batch of prompts, over
    the stream API; each prompt comes back on its own responses, tagged with batch_index."""
    from tritonclient.utils import np_to_triton_dtype

    _, dep = deployment
    prompts = PROMPTS[:2]
    arrays = {
        "text_input": np.array([[p] for p in prompts]).astype(object),
        "max_tokens": np.full((2, 1), MAX_TOKENS, dtype=np.int32),
        "stream": np.full((2, 1), streaming, dtype=bool),
        "beam_width": np.ones((2, 1), dtype=np.int32),
        "temperature": np.ones((2, 1), dtype=np.float32),
        "exclude_input_in_output": np.ones((2, 1), dtype=bool),
    }
    inputs = []
    for name, arr in arrays.items():
        t = grpcclient.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
        t.set_data_from_numpy(arr)
        inputs.append(t)
    got: queue.Queue = queue.Queue()
    c = grpcclient.InferenceServerClient(served.grpc_endpoint)
    c.start_stream(callback=lambda result, error: got.put(error or result))
    outputs = [grpcclient.InferRequestedOutput(n) for n in ("text_output", "batch_index")]
    c.async_stream_infer("ensemble", inputs, outputs=outputs, request_id="batch")
    c.stop_stream()
    texts = ["", ""]
    n = 0
    while not got.empty():
        item = got.get()
        assert not isinstance(item, InferenceServerException), str(item)
        texts[int(item.as_numpy("batch_index")[0][0])] += item.as_numpy("text_output")[0].decode()
        n += 1
    assert n >= 2 if not streaming else n > 2
    for prompt, text in zip(prompts, texts):
        ref = dep.generate([dep.request(dep.encode(prompt, chat_template=False), MAX_TOKENS)], speculative=True)[0]
        assert text == dep.decode(ref.output_ids)

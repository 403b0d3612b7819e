"""trtllm.runtime llmapi on CPU: the conformance double, in-process verify, and a real
tritonserver serving the llmapi models (build -> repo -> serve -> verify over gRPC).

The double (speculative/llmapi/double.py) stands in for tensorrt_llm: it refuses any argument the field
inventory of its TensorRT-LLM line lacks, so these tests fail when trtspec writes a key or a
spelling upstream would reject. The same code runs against the real library with
`--llmapi tensorrt_llm` (tests/test_llmapi_gpu.py, -m trtllm).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml
from conftest import processes_mentioning, write_spec
from typer.testing import CliRunner

from trtspec.cli.app import app
from trtspec.engines.build import build
from trtspec.runtime import LlmapiDeployment
from trtspec.spec import load_spec
from trtspec.speculative.llmapi.double import api as double_api

PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Triton serves models over HTTP and gRPC."]
MAX_TOKENS = 20


@pytest.fixture(scope="session")
def llmapi_built(tmp_path_factory, tiny_ckpts):
    folder = tmp_path_factory.mktemp("llmapi")
    loaded = load_spec(
        write_spec(
            folder,
            tiny_ckpts,
            backend="trtllm",
            **{"speculative.default_draft_tokens": None, "verify.max_tokens": MAX_TOKENS, "trtllm.line": "1.3+"},
        )
    )
    build(loaded, loaded.output_dir())
    return loaded


@pytest.fixture(scope="session")
def llmapi_dep(llmapi_built):
    return LlmapiDeployment(llmapi_built, llmapi_built.output_dir(), "double")


# ------------------------------------------------------------------ the double is strict


@pytest.mark.parametrize(
    "line, kwargs, needle",
    [
        ("1.2", {"model": "m", "max_batch_sizes": 2}, "LLM: max_batch_sizes: Extra inputs are not permitted (TensorRT-LLM 1.2)"),
        (
            "1.3+",
            {"model": "m", "fail_fast_on_attention_window_too_large": True},
            "fail_fast_on_attention_window_too_large: Extra inputs are not permitted (TensorRT-LLM 1.3+)",
        ),
        ("1.2", {"model": "m", "kv_cache_config": {"disk_cache_size": 1}}, "KvCacheConfig: disk_cache_size: Extra inputs"),
    ],
)
def test_double_llm_refuses_fields_its_line_lacks(line, kwargs, needle):
    with pytest.raises(ValueError, match="Extra inputs") as info:
        double_api(line).LLM(**kwargs)
    assert needle in str(info.value)


@pytest.mark.parametrize(
    "line, cfg, needle",
    [
        (
            "1.2",
            {"decoding_type": "Draft_Target", "max_draft_len": 4, "speculative_model": "d"},
            "Invalid decoding type: Draft_Target (TensorRT-LLM 1.2)",
        ),
        (
            "1.3+",
            {"decoding_type": "DraftTarget", "max_draft_len": 4, "speculative_model": "d"},
            "Invalid decoding type: DraftTarget (TensorRT-LLM 1.3+)",
        ),
        ("1.2", {"decoding_type": "Eagle3", "max_draft_len": 4, "speculative_model": "d"}, "Invalid decoding type: Eagle3"),
        ("1.3+", {"decoding_type": "Draft_Target", "max_draft_len": 4}, "speculative_model must be specified for Draft_Target"),
        (
            "1.2",
            {"decoding_type": "NGram", "max_draft_len": 4},
            "max_matching_ngram_size must be > 0 for NGram (TensorRT-LLM 1.2)",
        ),
        (
            "1.3+",
            {"decoding_type": "NGram", "max_draft_len": 0, "max_matching_ngram_size": 2},
            "max_draft_len must be > 0 for NGram",
        ),
        ("1.3+", {"decoding_type": "NGram", "max_draft_len": 2, "num_draft_tokens": 2}, "num_draft_tokens: Extra inputs"),
    ],
)
def test_double_speculative_config_follows_each_lines_rules(line, cfg, needle):
    with pytest.raises(ValueError) as info:
        double_api(line).update_llm_args_with_extra_dict({}, {"model": "m", "speculative_config": cfg})
    assert needle in str(info.value)


def test_double_sampling_params_refuse_unknown_and_non_greedy():
    sp = double_api("1.2").SamplingParams
    with pytest.raises(ValueError, match="max_new_tokens: Extra inputs"):
        sp(max_new_tokens=4)
    with pytest.raises(NotImplementedError, match="greedily"):
        sp(max_tokens=4, top_k=5)


def test_double_runs_eagle3_heads_in_upstreams_layout(tiny_ckpts, tmp_path):
    """Eagle3 (1.3+) / Eagle (1.2) with a head folder as upstream loads it: outputs identical to
    the control, drafts made; a head trained on other layers than captured is refused."""
    from test_eagle3 import random_head

    head = random_head(tiny_ckpts["target"], tmp_path / "head")
    ids = [5, 17, 42, 99, 7]
    for line, kind in (("1.3+", "Eagle3"), ("1.2", "Eagle")):
        a = double_api(line)
        base = {"model": str(tiny_ckpts["target"]), "dtype": "float32"}
        eagle = {"decoding_type": kind, "max_draft_len": 3, "speculative_model": str(head)}
        with pytest.raises(ValueError, match="Not enough hidden layers for default EAGLE3 capture"):
            a.LLM(**a.update_llm_args_with_extra_dict({}, base | {"speculative_config": eagle}))  # 2 layers: no default
        eagle["eagle3_layers_to_capture"] = [0, 1]
        spec = a.LLM(**a.update_llm_args_with_extra_dict({}, base | {"speculative_config": eagle}))
        ctrl = a.LLM(**a.update_llm_args_with_extra_dict({}, base))
        params = a.SamplingParams(max_tokens=24, return_perf_metrics=True)
        got = spec.generate([ids], params)[0].outputs[0]
        assert got.token_ids == ctrl.generate([ids], params)[0].outputs[0].token_ids and len(got.token_ids) == 24
        assert got.request_perf_metrics.speculative_decoding.total_draft_tokens > 0
    a = double_api("1.3+")
    with pytest.raises(ValueError, match="eagle3_layers_to_capture \\[1\\] differs"):
        a.LLM(
            **a.update_llm_args_with_extra_dict(
                {},
                {
                    "model": str(tiny_ckpts["target"]),
                    "speculative_config": {
                        "decoding_type": "Eagle3",
                        "max_draft_len": 3,
                        "speculative_model": str(head),
                        "eagle3_layers_to_capture": [1],
                    },
                },
            )
        )


def _stop_word(tok, ids: list[int], start: int) -> str:
    """A 2-token piece of ``ids`` at or after ``start`` whose text encodes back to those
    tokens and does not occur earlier: a stop word that ends generation exactly there."""
    for i in range(start, len(ids) - 2):
        word = tok.decode(ids[i : i + 2])
        seq = tok.encode(word, add_special_tokens=False)
        if seq == ids[i : i + 2] and not any(ids[j : j + 2] == seq for j in range(i)):
            return word
    raise AssertionError("no round-tripping stop word in this output")


def test_double_stop_strings_and_streaming_follow_upstream(llmapi_dep):
    """stop strings become token sequences and are cut unless include_stop_str_in_output;
    generate_async(streaming=True) yields each step's tokens, adding up to generate()'s;
    abort() ends a stream as 'cancelled'."""
    api, llm = llmapi_dep.api, llmapi_dep.speculative
    ids = llmapi_dep.tokenizer(PROMPTS[0])["input_ids"]
    full = llm.generate([ids], api.SamplingParams(max_tokens=MAX_TOKENS))[0].outputs[0]
    word = _stop_word(llmapi_dep.tokenizer, full.token_ids, 5)
    stop_ids = llmapi_dep.tokenizer.encode(word, add_special_tokens=False)
    cut = llm.generate([ids], api.SamplingParams(max_tokens=MAX_TOKENS, stop=[word]))[0].outputs[0]
    kept = llm.generate([ids], api.SamplingParams(max_tokens=MAX_TOKENS, stop=word, include_stop_str_in_output=True))
    kept = kept[0].outputs[0]
    end = next(i for i in range(len(full.token_ids)) if full.token_ids[: i + 1][-len(stop_ids) :] == stop_ids) + 1
    assert kept.token_ids == full.token_ids[:end] and kept.stop_reason == word and kept.finish_reason == "stop"
    assert cut.token_ids == full.token_ids[: end - len(stop_ids)]
    steps, result = [], llm.generate_async(ids, api.SamplingParams(max_tokens=MAX_TOKENS), streaming=True)
    for r in result:
        steps.append(list(r.outputs[0].token_ids_diff))
    assert len(steps) > 2 and sum(steps, []) == full.token_ids and result.outputs[0].finish_reason == "length"
    result = llm.generate_async(ids, api.SamplingParams(max_tokens=MAX_TOKENS), streaming=True)
    result.abort()
    assert list(result)[-1].outputs[0].finish_reason == "cancelled"


def test_ignore_eos_generates_exactly_max_tokens_on_the_llmapi_path(llmapi_dep):
    """The OpenAI front's ignore_eos reaches the LLM API endpoints as end_id -1 (no end ids):
    they ask for SamplingParams(ignore_eos=True), and the generation runs to max_tokens past
    a token that would otherwise have ended it."""
    from types import SimpleNamespace

    from trtspec.speculative.llmapi import greedy_params
    from trtspec.triton.backend.llmapi_core import LlmapiEndpoint

    api, llm = llmapi_dep.api, llmapi_dep.speculative
    ids = llmapi_dep.tokenizer(PROMPTS[0])["input_ids"]
    full = llm.generate([ids], api.SamplingParams(max_tokens=MAX_TOKENS))[0].outputs[0].token_ids
    end = full[3]  # as if it were the end id
    stops = llm.generate([ids], greedy_params(api, MAX_TOKENS, False, end))[0].outputs[0].token_ids
    assert stops == full[: full.index(end)]
    assert llm.generate([ids], greedy_params(api, MAX_TOKENS, False, end, ignore_eos=True))[0].outputs[0].token_ids == full
    core = LlmapiEndpoint.__new__(LlmapiEndpoint)
    core.api, core.speculative, core.default_end_ids = api, False, frozenset({2})
    row = SimpleNamespace(request=SimpleNamespace(end_ids=frozenset(), max_tokens=7))
    assert core._params(row, []).ignore_eos is True
    row.request.end_ids = frozenset({2})
    assert core._params(row, []).ignore_eos is False


def test_llmapi_eagle3_spec_builds_and_verifies_through_the_double(tmp_path, tiny_ckpts):
    from test_eagle3 import random_head

    ck = {"target": tiny_ckpts["target"], "head": random_head(tiny_ckpts["target"], tmp_path / "head")}
    over = {
        "speculative.method": "eagle3",
        "speculative.default_draft_tokens": None,
        "verify.max_tokens": 16,
        "trtllm.line": "1.3+",
    }
    loaded = load_spec(write_spec(tmp_path, ck, "head", backend="trtllm", **over))
    build(loaded, loaded.output_dir())
    cfg = yaml.safe_load((loaded.output_dir() / "llmapi" / "speculative.yaml").read_text())["speculative_config"]
    # 2 layers: upstream has no default capture for 2-5 layers, so the head's layers are written
    assert cfg["decoding_type"] == "Eagle3" and cfg["eagle3_layers_to_capture"] == [0, 1]
    report = tmp_path / "r.json"
    r = CliRunner().invoke(app, ["verify", str(loaded.path), "--llmapi", "double", "--json-file", str(report)])
    assert r.exit_code == 0, r.output
    data = json.loads(report.read_text())
    assert data["identical"] and data["metrics"]["drafted"] > 0


# ------------------------------------------------------------------ in process


def test_speculative_llm_matches_control_token_for_token(llmapi_dep):
    ids = llmapi_dep.tokenizer(PROMPTS[0])["input_ids"]
    spec = llmapi_dep.generate(ids, MAX_TOKENS, speculative=True)
    ctrl = llmapi_dep.generate(ids, MAX_TOKENS, speculative=False)
    assert spec.token_ids == ctrl.token_ids and len(spec.token_ids) == MAX_TOKENS
    stats = spec.request_perf_metrics.speculative_decoding
    assert stats.total_draft_tokens > 0 and 0 < stats.total_accepted_draft_tokens <= stats.total_draft_tokens
    assert ctrl.request_perf_metrics is None  # the control asks for no metrics


def test_verify_in_process_through_the_double(llmapi_built, tmp_path):
    report = tmp_path / "report.json"
    r = CliRunner().invoke(app, ["verify", str(llmapi_built.path), "--llmapi", "double", "--json-file", str(report)])
    assert r.exit_code == 0, r.output
    data = json.loads(report.read_text())
    assert data["identical"] and data["prompts"] == 5
    assert data["mode"] == "in-process (llmapi conformance double, not TensorRT-LLM)"
    assert data["metrics"]["drafted"] > 0 and data["metrics"]["accepted"] > 0


def test_verify_without_tensorrt_llm_is_one_clear_runtime_error(llmapi_built):
    r = CliRunner().invoke(app, ["verify", str(llmapi_built.path)])
    assert r.exit_code == 3
    assert "tensorrt_llm cannot be imported" in r.stderr and "--llmapi double" in r.stderr


# ------------------------------------------------------------------ Triton


@pytest.fixture(scope="session")
def llmapi_served(llmapi_built, tmp_path_factory):
    from trtspec.errors import ServerError
    from trtspec.triton.repository.writer import write_repository
    from trtspec.triton.server.install import find_tritonserver
    from trtspec.triton.server.process import TritonServer

    try:
        find_tritonserver()
    except ServerError as err:
        pytest.skip(str(err))
    repo = write_repository(llmapi_built, llmapi_built.output_dir(), llmapi_built.base_dir / "repo", "double")
    server = TritonServer.for_repository(repo, cache_root=tmp_path_factory.mktemp("backend-cache"))
    server.start(llmapi_built.base_dir / "server.log")
    server.wait_ready(timeout=300)
    yield repo, server
    server.stop()
    assert processes_mentioning(str(repo)) == [], "tritonserver or stub processes survived stop()"


def test_repository_model_yaml_is_upstreams_layout(llmapi_built, tmp_path):
    from trtspec.triton.repository.writer import write_repository

    repo = write_repository(llmapi_built, llmapi_built.output_dir(), tmp_path / "repo", "double")
    assert sorted(p.name for p in repo.iterdir() if p.is_dir()) == [
        "target_only",
        "tensorrt_llm_bls",
        "tensorrt_llm_bls_streaming",
    ]
    streaming = yaml.safe_load((repo / "tensorrt_llm_bls_streaming" / "1" / "model.yaml").read_text())
    assert streaming.pop("triton_config") == {"max_batch_size": 4, "decoupled": True}
    spec_yaml = yaml.safe_load((repo / "tensorrt_llm_bls" / "1" / "model.yaml").read_text())
    ctrl_yaml = yaml.safe_load((repo / "target_only" / "1" / "model.yaml").read_text())
    built = yaml.safe_load((llmapi_built.output_dir() / "llmapi" / "speculative.yaml").read_text())
    assert spec_yaml.pop("triton_config") == {"max_batch_size": 4, "decoupled": False}
    assert spec_yaml == built and spec_yaml["speculative_config"]["decoding_type"] == "Draft_Target"
    assert "speculative_config" not in ctrl_yaml


def test_served_endpoints_match_in_process_token_ids(llmapi_served, llmapi_dep):
    import tritonclient.grpc as grpcclient

    _, server = llmapi_served
    client = grpcclient.InferenceServerClient(server.grpc_endpoint)
    for prompt in PROMPTS:
        ids = llmapi_dep.tokenizer(prompt)["input_ids"]
        want = llmapi_dep.generate(ids, MAX_TOKENS, speculative=False).token_ids
        got = {}
        for model in ("tensorrt_llm_bls", "target_only"):
            inputs = []
            for name, value, dtype in (
                ("text_input", np.array([[prompt.encode()]], dtype=np.object_), "BYTES"),
                ("max_tokens", np.array([[MAX_TOKENS]], dtype=np.int32), "INT32"),
                ("exclude_input_in_output", np.array([[True]]), "BOOL"),
                ("return_perf_metrics", np.array([[True]]), "BOOL"),
            ):
                t = grpcclient.InferInput(name, list(value.shape), dtype)
                t.set_data_from_numpy(value)
                inputs.append(t)
            res = client.infer(model, inputs)
            got[model] = [int(x) for x in res.as_numpy("output_ids")[0][: int(res.as_numpy("sequence_length")[0][0])]]
            drafted = int(res.as_numpy("total_draft_tokens")[0][0])
            assert (drafted > 0) == (model == "tensorrt_llm_bls")
        assert got["tensorrt_llm_bls"] == got["target_only"] == want


def test_verify_over_grpc_reports_identical(llmapi_served, llmapi_built, tmp_path):
    _, server = llmapi_served
    report = tmp_path / "r.json"
    r = CliRunner().invoke(app, ["verify", str(llmapi_built.path), "--url", server.grpc_endpoint, "--json-file", str(report)])
    assert r.exit_code == 0, r.output
    data = json.loads(report.read_text())
    assert data["identical"] and data["metrics"]["drafted"] > 0


def test_a_bad_request_is_refused_and_the_server_carries_on(llmapi_served):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    _, server = llmapi_served
    client = grpcclient.InferenceServerClient(server.grpc_endpoint)

    def ask(max_tokens):
        inputs = []
        for name, value, dtype in (
            ("text_input", np.array([[b"hello"]], dtype=np.object_), "BYTES"),
            ("max_tokens", np.array([[max_tokens]], dtype=np.int32), "INT32"),
        ):
            t = grpcclient.InferInput(name, list(value.shape), dtype)
            t.set_data_from_numpy(value)
            inputs.append(t)
        return client.infer("tensorrt_llm_bls", inputs)

    with pytest.raises(InferenceServerException, match="exceeds max_seq_len"):
        ask(10_000)
    assert ask(3).as_numpy("sequence_length")[0][0] > 0


def _stream(server, model: str, prompt: str, max_tokens: int, stop: list[str] | None = None, cancel_after: int | None = None):
    """Responses of one gRPC stream: (output_ids per response, final tensors or error)."""
    import queue

    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_endpoint)
    got: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    inputs = []
    values = [
        ("text_input", np.array([[prompt.encode()]], dtype=np.object_), "BYTES"),
        ("max_tokens", np.array([[max_tokens]], dtype=np.int32), "INT32"),
        ("stream", np.array([[True]]), "BOOL"),
        ("return_perf_metrics", np.array([[True]]), "BOOL"),
    ]
    if stop:
        values.append(("stop_words", np.array([[w.encode() for w in stop]], dtype=np.object_), "BYTES"))
    for name, value, dtype in values:
        t = grpcclient.InferInput(name, list(value.shape), dtype)
        t.set_data_from_numpy(value)
        inputs.append(t)
    client.async_stream_infer(model, inputs, enable_empty_final_response=True)
    steps, final = [], None
    while True:
        result, error = got.get(timeout=120)
        if error is not None:
            final = error
            break
        resp = result.get_response()
        if result.as_numpy("output_ids") is not None:
            steps.append([int(x) for x in result.as_numpy("output_ids").reshape(-1)])
        if cancel_after is not None and len(steps) >= cancel_after:
            client.stop_stream(cancel_requests=True)
            return steps, "cancelled"
        if resp.parameters.get("triton_final_response") and resp.parameters["triton_final_response"].bool_param:
            final = result
            break
    client.stop_stream()
    return steps, final


def test_streaming_endpoint_streams_the_unary_tokens_step_by_step(llmapi_served, llmapi_dep):
    _, server = llmapi_served
    ids = llmapi_dep.tokenizer(PROMPTS[1])["input_ids"]
    want = llmapi_dep.generate(ids, MAX_TOKENS, speculative=False).token_ids
    steps, final = _stream(server, "tensorrt_llm_bls_streaming", PROMPTS[1], MAX_TOKENS)
    assert sum(steps, []) == want and len([s for s in steps if s]) > 2
    assert int(final.as_numpy("total_draft_tokens")[0][0]) > 0


def test_stop_words_on_llmapi_endpoints_end_where_the_loop_does(llmapi_served, llmapi_dep):
    """Served stop_words stop the speculative, streaming and control endpoints at the same
    token, the stop sequence kept, as the torch endpoints emit it."""
    import tritonclient.grpc as grpcclient

    from trtspec.speculative.loop import GenerationRequest, NoDrafter, generate
    from trtspec.speculative.verifier import LogitsVerifier

    _, server = llmapi_served
    tok = llmapi_dep.tokenizer
    ids = tok(PROMPTS[2])["input_ids"]
    full = llmapi_dep.generate(ids, MAX_TOKENS, speculative=False).token_ids
    word = _stop_word(tok, full, 6)
    seq = tuple(tok(word, add_special_tokens=False)["input_ids"])
    (ref,) = generate(
        [GenerationRequest(ids, MAX_TOKENS, 0, frozenset({tok.eos_token_id}), (seq,))],
        NoDrafter(),
        LogitsVerifier(llmapi_dep.control.target.run),
    )
    assert ref.finish_reason == "stop" and len(ref.output_ids) < MAX_TOKENS
    client = grpcclient.InferenceServerClient(server.grpc_endpoint)
    for model in ("tensorrt_llm_bls", "target_only"):
        inputs = []
        for name, value, dtype in (
            ("text_input", np.array([[PROMPTS[2].encode()]], dtype=np.object_), "BYTES"),
            ("max_tokens", np.array([[MAX_TOKENS]], dtype=np.int32), "INT32"),
            ("exclude_input_in_output", np.array([[True]]), "BOOL"),
            ("stop_words", np.array([[word.encode()]], dtype=np.object_), "BYTES"),
        ):
            t = grpcclient.InferInput(name, list(value.shape), dtype)
            t.set_data_from_numpy(value)
            inputs.append(t)
        res = client.infer(model, inputs)
        got = [int(x) for x in res.as_numpy("output_ids")[0][: int(res.as_numpy("sequence_length")[0][0])]]
        assert got == ref.output_ids, model
    steps, _ = _stream(server, "tensorrt_llm_bls_streaming", PROMPTS[2], MAX_TOKENS, stop=[word])
    assert sum(steps, []) == ref.output_ids


def test_a_cancelled_stream_frees_the_llm_for_the_next_request(llmapi_served, llmapi_dep):
    _, server = llmapi_served
    steps, final = _stream(server, "tensorrt_llm_bls_streaming", PROMPTS[0], 200, cancel_after=2)
    assert final == "cancelled"
    ids = llmapi_dep.tokenizer(PROMPTS[0])["input_ids"]
    want = llmapi_dep.generate(ids, MAX_TOKENS, speculative=False).token_ids
    steps, final = _stream(server, "tensorrt_llm_bls_streaming", PROMPTS[0], MAX_TOKENS)
    assert sum(steps, []) == want


def test_verify_over_grpc_streams_through_the_llmapi_streaming_model(llmapi_served, llmapi_built, tmp_path):
    _, server = llmapi_served
    report = tmp_path / "r.json"
    args = ["verify", str(llmapi_built.path), "--url", server.grpc_endpoint, "--stream", "--json-file", str(report)]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    assert json.loads(report.read_text())["identical"]


def test_bench_in_process_through_the_double(llmapi_built, tmp_path):
    """`trtspec bench` on an llmapi spec: both paths measured through the LLM API (streamed, so
    TTFT is real), whole-request acceptance, concurrency; a sweep is refused with the fix."""
    out = tmp_path / "bench.json"
    args = ["bench", str(llmapi_built.path), "--llmapi", "double", "-p", PROMPTS[0], "-p", PROMPTS[1], "--max-tokens", "12"]
    r = CliRunner().invoke(app, [*args, "-c", "1,2", "-o", str(tmp_path / "o"), "--json-file", str(out)])
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    assert data["mode"] == "in-process (llmapi conformance double, not TensorRT-LLM)" and data["complete"]
    assert data["target"]["tokens"] == data["speculative"]["tokens"] == 24
    assert data["metrics"]["drafted"] > 0 and data["costs"] is None and data["sweep"] == []
    assert [p["concurrency"] for p in data["concurrency"]] == [1, 2]
    assert data["speculative"]["ttft_p50"] < data["speculative"]["latency_p50"]
    r = CliRunner().invoke(app, [*args, "--sweep", "1-2"])
    assert r.exit_code == 2 and "--sweep none" in r.output

"""switch_off.min_acceptance_rate (the mean over the last N drafting steps of accepted /
drafted tokens) on every runtime whose loop is trtspec's: the in-process torch runtime, the
Triton endpoints' parameters (torch and TensorRT-LLM engine models), and a real tritonserver.

Window 1, rate 1.0: the first drafting step that keeps less than all its drafts switches
speculation off for good, so a second request drafts nothing and answers the same tokens."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import endpoint_params, serve_tiny, write_spec

from trtspec.spec import SwitchOffSpec, load_spec

RATE_OFF = {"speculative.switch_off": {"window": 1, "min_acceptance_rate": 1.0}}
PROMPT = "The quick brown fox"
MAX_TOKENS = 16


def test_the_in_process_runtime_switches_off_on_the_rate(tmp_path, tiny_ckpts):
    from trtspec.engines.build import build
    from trtspec.runtime import Deployment

    loaded = load_spec(write_spec(tmp_path, tiny_ckpts, **RATE_OFF))
    build(loaded, loaded.output_dir())
    dep = Deployment(loaded, loaded.output_dir())
    assert dep.policy.switch.per_step and dep.policy.switch.threshold == 1.0
    ids = dep.encode(PROMPT)
    (first,) = dep.generate([dep.request(ids, MAX_TOKENS)])
    assert 0 < first.metrics.accepted < first.metrics.drafted and dep.policy.switch.off
    (second,) = dep.generate([dep.request(ids, MAX_TOKENS)])
    (alone,) = dep.generate([dep.request(ids, MAX_TOKENS)], speculative=False)
    assert second.metrics.drafted == 0 and second.output_ids == first.output_ids == alone.output_ids


@pytest.mark.parametrize(
    "backend",
    [{}, {"backend": "trtllm", "trtllm.runtime": "engine", "trtllm.line": "1.2"}],
    ids=["torch", "trtllm-engine"],
)
def test_the_endpoints_parameters_carry_the_rate_to_the_orchestrator(tmp_path, tiny_ckpts, backend):
    from trtspec.triton.backend.params import EngineEndpointParams, load_aware

    loaded = load_spec(write_spec(tmp_path, tiny_ckpts, **backend, **RATE_OFF))
    fields = load_aware(loaded.spec.speculative)
    params = endpoint_params(**fields).to_params()
    assert json.loads(params["switch_off"]) == {"window": 1, "min_acceptance_rate": 1.0}
    back = EngineEndpointParams.from_params(params)
    assert back.switch_off == SwitchOffSpec(window=1, min_acceptance_rate=1.0) and back.to_params() == params
    policy = back.settings(decoupled=False, max_batch_size=4).load_policy()
    assert policy.switch.per_step and (policy.switch.window, policy.switch.threshold) == (1, 1.0)


def test_a_written_length_switch_off_still_reads_back_as_the_length():
    """A repository written with the length threshold ({"window", "min_acceptance_length"})
    reads back as that threshold, counted per finished request."""
    from trtspec.triton.backend.params import EngineEndpointParams

    params = {**endpoint_params().to_params()}
    params["switch_off"] = json.dumps({"window": 16, "min_acceptance_length": 1.3})
    policy = EngineEndpointParams.from_params(params).settings(decoupled=False, max_batch_size=4).load_policy()
    assert not policy.switch.per_step and (policy.switch.window, policy.switch.threshold) == (16, 1.3)


@pytest.fixture(scope="module")
def rate_server(tmp_path_factory, tiny_ckpts):
    yield from serve_tiny(tmp_path_factory, tiny_ckpts, "rate-switch-off", **RATE_OFF)


def test_a_real_server_switches_off_on_the_rate_for_good(rate_server):
    """One speculative endpoint instance holds one policy: its first request drafts and keeps
    less than all, after which every request is answered undrafted with the same tokens."""
    grpcclient = pytest.importorskip("tritonclient.grpc")
    from trtspec.layout import BLS_MODEL

    server, dep = rate_server
    client = grpcclient.InferenceServerClient(server.grpc_endpoint)
    (ref,) = dep.generate([dep.request(dep.encode(PROMPT), MAX_TOKENS)], speculative=False)
    answers = []
    for _ in range(2):
        result = client.infer(BLS_MODEL, _request(grpcclient))
        length = int(result.as_numpy("sequence_length")[0, 0])
        drafted = int(result.as_numpy("total_draft_tokens")[0, 0])
        accepted = int(result.as_numpy("total_accepted_draft_tokens")[0, 0])
        answers.append((result.as_numpy("output_ids")[0, :length].tolist(), drafted, accepted))
    (first, drafted, accepted), (second, drafted_after, _) = answers
    assert 0 < accepted < drafted and drafted_after == 0
    assert first == second == ref.output_ids


def _request(grpcclient) -> list:
    def tensor(name, value, datatype, dtype):
        arr = np.array([[value]], dtype=dtype)
        t = grpcclient.InferInput(name, list(arr.shape), datatype)
        t.set_data_from_numpy(arr)
        return t

    return [
        tensor("text_input", PROMPT.encode(), "BYTES", np.object_),
        tensor("max_tokens", MAX_TOKENS, "INT32", np.int32),
        tensor("apply_chat_template", True, "BOOL", np.bool_),
        tensor("exclude_input_in_output", True, "BOOL", np.bool_),
        tensor("return_perf_metrics", True, "BOOL", np.bool_),
    ]

"""serve.capture on a real tritonserver (127.0.0.1): the endpoint picks the answered requests
by id, the target engine model keeps them (prompt + response, features, labels) in the
capture folder, and a request sent with capture false is never kept."""

from __future__ import annotations

import time

import numpy as np
import pytest

grpcclient = pytest.importorskip("tritonclient.grpc", reason="needs the serve extra: pip install 'trtspec[serve]'")

from trtspec.layout import BLS_MODEL, CONTROL_MODEL, TARGET_MODEL  # noqa: E402
from trtspec.speculative.capture import read_capture  # noqa: E402

PROMPTS = ["The quick brown fox", "def fibonacci(n):", "SELECT name FROM"]


@pytest.fixture(scope="module")
def captured_served(tmp_path_factory, tiny_ckpts):
    from exact_head import serve_exact_eagle3

    capture = {"dir": "captured", "max_gb": 1, "sample": 1.0}
    yield from serve_exact_eagle3(tmp_path_factory, tiny_ckpts, "capture-serve", **{"serve.capture": capture})


def _inputs(prompt: str, capture: bool | None):
    def t(name, value, dtype):
        arr = np.array([[value]], dtype=np.object_ if dtype == "BYTES" else {"INT32": np.int32, "BOOL": np.bool_}[dtype])
        x = grpcclient.InferInput(name, [1, 1], dtype)
        x.set_data_from_numpy(arr)
        return x

    out = [
        t("text_input", prompt.encode(), "BYTES"),
        t("max_tokens", 12, "INT32"),
        t("num_draft_tokens", 3, "INT32"),
        t("apply_chat_template", True, "BOOL"),
        t("exclude_input_in_output", True, "BOOL"),
    ]
    return out if capture is None else out + [t("capture", capture, "BOOL")]


def _kept(folder, n: int, wait_s: float = 60.0) -> list:
    """The parts once ``n`` are there (the target keeps them after the answer, on its own thread)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        got = read_capture(folder)
        if len(got) >= n:
            return got
        time.sleep(0.2)
    return read_capture(folder)


@pytest.mark.server
def test_the_repository_declares_the_capture_contract_on_the_target_only(captured_served):
    _, _, _, repo = captured_served
    target_cfg = (repo / TARGET_MODEL / "config.pbtxt").read_text()
    assert "capture_request_id" in target_cfg
    assert "capture_kept" in target_cfg and "captured" in target_cfg
    assert "captured" not in (repo / CONTROL_MODEL / "config.pbtxt").read_text()  # the control keeps nothing


@pytest.mark.server
def test_served_requests_are_kept_by_the_target_and_opted_out_ones_never(captured_served):
    loaded, dep, server, _ = captured_served
    folder = loaded.capture_dir()
    client = grpcclient.InferenceServerClient(server.grpc_endpoint)
    answers = {}
    for i, prompt in enumerate(PROMPTS):
        result = client.infer(BLS_MODEL, _inputs(prompt, None if i == 0 else i == 1), request_id=f"req-{i}")
        answers[f"req-{i}"] = (prompt, result.as_numpy("output_ids")[0, : result.as_numpy("sequence_length")[0, 0]].tolist())
    kept = _kept(folder, 2)
    time.sleep(1.0)  # anything the opted-out request would have added has had its time
    kept = {c.record["request_id"]: c for c in read_capture(folder)}
    assert sorted(kept) == ["req-0", "req-1"]  # req-2 sent capture false
    for rid, c in kept.items():
        prompt, output = answers[rid]
        prompt_ids = dep.encode(prompt)
        assert c.sample.tokens.tolist() == prompt_ids + output[:-1]
        assert c.sample.prompt_len == len(prompt_ids)
        assert c.sample.labels[len(prompt_ids) - 1 :].tolist() == output  # greedy: the target's own labels
        # labels from the steps the engine model served (no second forward): none where no step scored
        assert (c.sample.top_ids[: len(prompt_ids) - 1] == -1).all()
        assert c.record["tenant"] == "" and c.sample.features.shape[0] == len(prompt_ids) + len(output) - 1

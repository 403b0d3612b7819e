"""method eagle3 on a real tritonserver (127.0.0.1): the head in the text endpoints, the
target's features from the target engine model, tokens identical to target-only."""

from __future__ import annotations

import json

import numpy as np
import pytest

grpcclient = pytest.importorskip("tritonclient.grpc", reason="needs the serve extra: pip install 'trtspec[serve]'")
from typer.testing import CliRunner  # noqa: E402

from trtspec.cli.app import app  # noqa: E402
from trtspec.layout import BLS_MODEL, CONTROL_MODEL, DRAFT_MODEL, TARGET_MODEL  # noqa: E402
from trtspec.speculative.metrics import metrics_from_json  # noqa: E402

PROMPTS = ["The quick brown fox", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def eagle_served(tmp_path_factory, tiny_ckpts):
    from exact_head import serve_exact_eagle3

    yield from serve_exact_eagle3(tmp_path_factory, tiny_ckpts, "eagle-serve")


def _bls(prompt: str, k: int, max_tokens: int = 30):
    def t(name, value, dtype):
        arr = np.array([[value]], dtype=np.object_ if dtype == "BYTES" else {"INT32": np.int32, "BOOL": np.bool_}[dtype])
        x = grpcclient.InferInput(name, [1, 1], dtype)
        x.set_data_from_numpy(arr)
        return x

    return [
        t("text_input", prompt.encode(), "BYTES"),
        t("max_tokens", max_tokens, "INT32"),
        t("num_draft_tokens", k, "INT32"),
        t("apply_chat_template", True, "BOOL"),
        t("exclude_input_in_output", True, "BOOL"),
        t("return_perf_metrics", True, "BOOL"),
    ]


@pytest.mark.server
def test_repository_has_no_draft_model_and_a_feature_contract(eagle_served):
    _, _, _, repo = eagle_served
    assert not (repo / DRAFT_MODEL).exists()
    target_cfg = (repo / TARGET_MODEL / "config.pbtxt").read_text()
    assert "hidden_states_from" in target_cfg and "capture_layers" in target_cfg
    assert "eagle3_head_dir" in (repo / BLS_MODEL / "config.pbtxt").read_text()


@pytest.mark.server
def test_served_eagle3_equals_in_process_and_accepts_every_draft(eagle_served):
    _, dep, server, _ = eagle_served
    client = grpcclient.InferenceServerClient(server.grpc_endpoint)
    for prompt in PROMPTS:
        result = client.infer(BLS_MODEL, _bls(prompt, 6))
        ids = result.as_numpy("output_ids")[0, : result.as_numpy("sequence_length")[0, 0]].tolist()
        dep.forget_prefixes()
        (ref,) = dep.generate([dep.request(dep.encode(prompt), 30, 6)])
        assert ids == ref.output_ids
        metrics = metrics_from_json(result.as_numpy("perf_metrics_json")[0, 0].decode())
        assert metrics == ref.metrics
        assert metrics.drafted > 0 and metrics.accepted == metrics.drafted
        control = client.infer(CONTROL_MODEL, _bls(prompt, 6))
        assert control.as_numpy("output_ids")[0, : control.as_numpy("sequence_length")[0, 0]].tolist() == ids


@pytest.mark.server
def test_verify_url_on_eagle3(eagle_served, tmp_path):
    loaded, _, server, _ = eagle_served
    report = tmp_path / "report.json"
    r = CliRunner().invoke(
        app,
        [
            "verify",
            str(loaded.path),
            "--url",
            server.grpc_endpoint,
            "-p",
            PROMPTS[0],
            "--max-tokens",
            "16",
            "--json-file",
            str(report),
        ],
    )
    assert r.exit_code == 0, r.output
    data = json.loads(report.read_text())
    assert data["identical"] and data["metrics"]["drafted"] > 0

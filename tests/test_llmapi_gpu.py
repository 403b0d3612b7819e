"""trtllm.runtime llmapi against the real TensorRT-LLM on a GPU: the same code the CPU tests
run through the conformance double (tests/test_llmapi_serve.py), with --llmapi tensorrt_llm.

Skipped cleanly without tensorrt_llm or CUDA. Run with `make test-gpu` (pytest -m trtllm) in a
TensorRT-LLM container (1.2.x: set TRTSPEC_TRTLLM_LINE=1.2; 1.3+: TRTSPEC_TRTLLM_LINE=1.3+).
Models: the tiny random Llama pair of test_trtllm_gpu.py (head size 64), or real checkpoints
from TRTSPEC_GPU_TARGET / TRTSPEC_GPU_DRAFT (HF folders).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from conftest import require_trtllm_gpu
from typer.testing import CliRunner

pytestmark = [pytest.mark.trtllm, pytest.mark.timeout(3600)]

torch = require_trtllm_gpu()

from trtspec.cli.app import app  # noqa: E402


@pytest.fixture(scope="module", params=["draft_target", "ngram"])
def spec_path(request, tmp_path_factory) -> Path:
    from test_trtllm_gpu import _tiny_pair

    tmp = tmp_path_factory.mktemp(f"llmapi-gpu-{request.param}")
    target, draft = os.environ.get("TRTSPEC_GPU_TARGET"), os.environ.get("TRTSPEC_GPU_DRAFT")
    folders = {"target": Path(target), "draft": Path(draft)} if target and draft else _tiny_pair(tmp / "weights")
    spec = {
        "name": f"llmapi-gpu-{request.param.replace('_', '-')}",
        "backend": "trtllm",
        "trtllm": {"runtime": "llmapi", "line": os.environ.get("TRTSPEC_TRTLLM_LINE", "1.2")},
        "target": {"path": str(folders["target"]), "dtype": "float16"},
        "speculative": {"method": request.param, "max_draft_len": 4},
        "build": {"max_batch_size": 4, "max_input_len": 256, "max_seq_len": 512},
        "verify": {"prompts": ["The quick brown fox", "def fibonacci(n):"], "max_tokens": 32, "chat_template": False},
        "output_dir": str(tmp / "engines"),
        "serve": {"repo_dir": str(tmp / "repo")},
    }
    if request.param == "draft_target":
        spec["draft"] = {"path": str(folders["draft"]), "dtype": "float16"}
    path = tmp / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def test_build_then_verify_in_process_with_tensorrt_llm(spec_path, tmp_path):
    runner = CliRunner()
    r = runner.invoke(app, ["build", str(spec_path)])
    assert r.exit_code == 0, r.output
    report = tmp_path / "verify.json"
    r = runner.invoke(app, ["verify", str(spec_path), "--llmapi", "tensorrt_llm", "--json-file", str(report)])
    data = json.loads(report.read_text())
    assert data["mode"].startswith("in-process (tensorrt_llm ")
    assert r.exit_code == 0 and data["identical"], r.output
    assert data["metrics"]["drafted"] > 0

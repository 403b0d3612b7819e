"""End to end on a GPU inside the TensorRT-LLM container: build, serve, verify --url, stop.

Skipped cleanly elsewhere (no tensorrt_llm, no CUDA, no converter scripts). Run with
`make test-gpu` (pytest -m trtllm) inside nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3.

Models: a tiny random Llama pair built here (head size 64, which TensorRT-LLM's attention
kernels support), or real checkpoints from TRTSPEC_GPU_TARGET / TRTSPEC_GPU_DRAFT (HF folders).
"""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

import pytest
from conftest import require_trtllm_gpu
from typer.testing import CliRunner

from trtspec.engines.trtllm.families import EXAMPLES_ENV, examples_dir

pytestmark = [pytest.mark.trtllm, pytest.mark.timeout(3600)]

torch = require_trtllm_gpu()
if not Path(examples_dir(), "models/core/llama/convert_checkpoint.py").is_file():
    pytest.skip(f"TensorRT-LLM examples not found at {examples_dir()}; set {EXAMPLES_ENV}", allow_module_level=True)
if shutil.which("trtllm-build") is None or shutil.which("mpirun") is None:
    pytest.skip("trtllm-build or mpirun not on PATH", allow_module_level=True)

from trtspec.cli.app import app  # noqa: E402  (after the skips: imports the CLI only where it runs)


def _tiny_pair(out: Path) -> dict[str, Path]:
    """Target and a noisy copy as draft; 4 heads x 64 = hidden 256 (head size 64)."""
    from transformers import LlamaForCausalLM

    from trtspec.testing.tiny import llama_config, make_tokenizer

    tok = make_tokenizer()
    folders = {}
    torch.manual_seed(0)
    cfg = llama_config(512, tok, hidden=256, intermediate=512)  # 4 heads, 2 KV heads, untied
    target = LlamaForCausalLM(cfg).eval()
    for name, noise in (("target", 0.0), ("draft", 0.02)):
        model = LlamaForCausalLM(cfg).eval()
        model.load_state_dict(target.state_dict())
        with torch.no_grad():
            for p in model.parameters():
                p.add_(noise * torch.randn_like(p))
        folders[name] = out / name
        model.to(torch.float16).save_pretrained(folders[name])
        tok.save_pretrained(folders[name])
    return folders


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.fixture(scope="module")
def spec_path(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("trtllm")
    target = os.environ.get("TRTSPEC_GPU_TARGET")
    draft = os.environ.get("TRTSPEC_GPU_DRAFT")
    folders = {"target": Path(target), "draft": Path(draft)} if target and draft else _tiny_pair(tmp / "weights")
    http, grpc, metrics = _free_ports(3)
    spec = tmp / "spec.yaml"
    spec.write_text(
        "name: gpu-e2e\nbackend: trtllm\ntrtllm: {runtime: engine}\n"
        f"target:\n  path: {folders['target']}\n  dtype: float16\n"
        f"draft:\n  path: {folders['draft']}\n  dtype: float16\n"
        "speculative:\n  method: draft_target\n  max_draft_len: 4\n"
        "build:\n  max_batch_size: 2\n  max_input_len: 256\n  max_seq_len: 512\n"
        f"output_dir: {tmp / 'engines'}\n"
        f"serve:\n  http_port: {http}\n  grpc_port: {grpc}\n  metrics_port: {metrics}\n"
        f"  repo_dir: {tmp / 'repo'}\n"
        "verify:\n  prompts: ['The quick brown fox', 'def fibonacci(n):']\n  max_tokens: 32\n"
        "  chat_template: false\n"
    )
    return spec


def run(*args: str):
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, f"trtspec {' '.join(args)} -> {result.exit_code}\n{result.output}"
    return result


def test_build_serve_verify_identical(spec_path):
    run("build", str(spec_path))
    engines = spec_path.parent / "engines"
    for kind in ("target", "control", "draft"):
        manifest = (engines / kind / "manifest.json").read_text()
        assert '"backend": "trtllm"' in manifest and '"tensorrt_llm"' in manifest
    grpc = spec_path.read_text().split("grpc_port: ")[1].split()[0]
    run("serve", str(spec_path), "--detach")
    try:
        result = run("verify", str(spec_path), "--url", f"127.0.0.1:{grpc}")
        assert "identical" in result.output.lower()
    finally:
        run("stop")


def test_rebuild_is_a_no_op(spec_path):
    result = run("build", str(spec_path))
    assert "up to date" in result.output

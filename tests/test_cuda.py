"""The torch backend on a CUDA GPU: tiny random targets built, verified, served in process, and
a head distilled for a few steps, all with device cuda.

Skipped cleanly where torch sees no GPU (the CPU-side logic is tests/test_device.py). Run with
`pytest -m cuda`, or `make gpu-check` (lab/gpu_check.py runs these after its measurements).

Verify on a GPU keeps its meaning: greedy identity, where a divergence may only be a numerical
one (the GPU's kernels round a 1-row and a (k+1)-row forward differently; the verdicts replay
both shapes to tell). An algorithmic divergence fails.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import write_spec
from typer.testing import CliRunner

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(1800)]

if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU (or a CPU-only torch): the device logic is covered by tests/test_device.py", allow_module_level=True)

from test_distill import PROMPTS as DISTILL_PROMPTS  # noqa: E402

from trtspec.cli.app import app  # noqa: E402  (after the skip: the CLI is imported only where it runs)
from trtspec.spec import load_spec  # noqa: E402

runner = CliRunner()
PROMPTS = DISTILL_PROMPTS[:8]
DTYPES = ["float32", "bfloat16"] if torch.cuda.get_device_capability() >= (8, 0) else ["float32", "float16"]


def _spec(folder: Path, ckpts: dict, dtype: str, **overrides) -> Path:
    return write_spec(folder, ckpts, **{"device": "cuda", "target.dtype": dtype, "draft.dtype": dtype, **overrides})


@pytest.mark.parametrize("dtype", DTYPES)
def test_build_then_verify_on_cuda_is_identical_or_numerical(tmp_path, tiny_ckpts, dtype):
    spec = _spec(tmp_path, tiny_ckpts, dtype)
    r = runner.invoke(app, ["build", str(spec)])
    assert r.exit_code == 0, r.output
    report = tmp_path / "verify.json"
    r = runner.invoke(app, ["verify", str(spec), "--fail-on", "algorithmic", "--json-file", str(report), "-k", "4"])
    data = json.loads(report.read_text())
    assert r.exit_code == 0, (r.output, data["verdicts"])
    assert data["verdicts"]["algorithmic"] == 0 and data["verdicts"]["unclassified"] == 0
    assert data["metrics"]["accepted"] > 0  # the draft (the target plus noise) was really used


def test_device_flag_overrides_a_cpu_spec(tmp_path, tiny_ckpts):
    spec = write_spec(tmp_path, tiny_ckpts)  # device: cpu (the default)
    assert runner.invoke(app, ["build", str(spec)]).exit_code == 0
    r = runner.invoke(app, ["verify", str(spec), "--device", "cuda", "--fail-on", "algorithmic", "--max-tokens", "16"])
    assert r.exit_code == 0, r.output


def assert_identical_or_numerical(dep, reqs, base, spec) -> None:
    """Each speculative output equals its target-only one, or its first divergence replays as
    numerical (a near-tie the verifier's forward shape flipped): what verify passes with
    --fail-on algorithmic."""
    from trtspec.speculative.loop import PathRun
    from trtspec.verify.backends import InProcessBackend
    from trtspec.verify.identity import first_divergence

    backend = InProcessBackend(dep)
    for req, b, s in zip(reqs, base, spec):
        runs = [PathRun(r.output_ids, r.margins, r.metrics, 0.0, req.prompt_ids, r.steps) for r in (b, s)]
        div = first_divergence(*runs, str)
        if div is not None:
            verdict = backend.classify(*runs, div)
            assert verdict.verdict == "numerical", (div.describe(), verdict.reason)


def test_served_in_process_on_cuda(tmp_path, tiny_ckpts):
    """The in-process runtime on the GPU: every engine there, a batch of ragged requests
    generated at once, speculative identical to target-only (or numerically so)."""
    from trtspec.engines.build import build
    from trtspec.runtime import Deployment

    loaded = load_spec(_spec(tmp_path, tiny_ckpts, "float32"))
    build(loaded, loaded.output_dir())
    dep = Deployment(loaded, loaded.output_dir())
    assert dep.device.type == "cuda"
    for engine in dep.engines.values():
        assert engine.cache.k[0].is_cuda and next(engine.model.parameters()).is_cuda and engine.cos.is_cuda
        assert "does not apply" in engine.kernels.reason
    reqs = [dep.request(dep.encode(p), 24 + 4 * i) for i, p in enumerate(PROMPTS[:4])]
    dep.forget_prefixes()
    base = dep.generate(reqs, speculative=False)
    dep.forget_prefixes()
    spec = dep.generate(reqs, speculative=True)
    assert all(len(r.output_ids) > 0 for r in base)
    assert_identical_or_numerical(dep, reqs, base, spec)


def test_distill_on_cuda_for_a_few_steps(tmp_path, tiny_ckpts):
    """The target, capture and training on the GPU; the store on disk; the head written on the
    CPU (float32 safetensors) loads back on the GPU and drafts with identical outputs."""
    from safetensors.torch import load_file

    from trtspec.distill.run import DistillOptions, distill
    from trtspec.engines.build import build
    from trtspec.runtime import Deployment

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    spec = write_spec(tmp_path, {"target": tiny_ckpts["target"], "head": tmp_path / "head"}, "head", device="cuda", **{"speculative.method": "eagle3"})  # fmt: skip
    loaded = load_spec(spec)
    opts = DistillOptions(prompts=prompts, max_steps=6, eval_every=3, max_tokens=12, draft_vocab=120, batch_size=4, held_out=0.2)
    result = distill(loaded, opts)
    assert result.steps == 6
    weights = load_file(str(tmp_path / "head" / "model.safetensors"))
    assert all(t.device.type == "cpu" for t in weights.values())
    assert list((tmp_path / ".head.distill").glob("features-*"))  # the feature store went to disk
    manifest = json.loads((tmp_path / "head" / "trtspec-head.json").read_text())
    assert manifest["data"]["rates"]["generated_tokens"] > 0
    build(loaded, loaded.output_dir())
    dep = Deployment(loaded, loaded.output_dir())
    assert dep.head.device.type == "cuda"
    reqs = [dep.request(dep.encode(p), 16) for p in PROMPTS[:3]]
    dep.forget_prefixes()
    base = dep.generate(reqs, speculative=False)
    dep.forget_prefixes()
    assert_identical_or_numerical(dep, reqs, base, dep.generate(reqs, speculative=True))


def test_generation_rows_fit_this_gpu(tmp_path, tiny_ckpts):
    from transformers import AutoConfig

    from trtspec.distill.run import GEN_BATCH_MAX, generation_rows
    from trtspec.engines.build import build

    loaded = load_spec(write_spec(tmp_path, tiny_ckpts, device="cuda"))
    build(loaded, loaded.output_dir())
    folder = loaded.output_dir() / "target"
    rows = generation_rows(torch.device("cuda", torch.cuda.current_device()), folder, AutoConfig.from_pretrained(folder), 3, 513)
    assert 1 <= rows <= GEN_BATCH_MAX

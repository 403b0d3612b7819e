"""trtllm repository and serve plumbing, without TensorRT-LLM: fake engine folders stand in
for built engines (manifest + config), so the repository generation, its manifest checks and
the mpirun launch are exercised as `trtspec serve` runs them."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from trtspec.cli.app import app
from trtspec.engines.manifest import Manifest, SourceRecord, now, write_manifest
from trtspec.errors import EngineError
from trtspec.layout import BLS_MODEL as BLS
from trtspec.layout import CONTROL_MODEL as CONTROL
from trtspec.layout import KINDS_OF_ROLE, role_of
from trtspec.spec import load_spec
from trtspec.triton.repository import pbtxt
from trtspec.triton.repository.writer import write_repository

DATA = Path(__file__).parent / "data" / "specs"


def _fake_engines(loaded, out: Path, tokenizer_from: Path) -> None:
    spec = loaded.spec
    for role in spec.models():
        for kind in KINDS_OF_ROLE["trtllm"][role]:
            folder = out / kind
            (folder / "tokenizer").mkdir(parents=True)
            (folder / "config.json").write_text(json.dumps({"pretrained_config": {"vocab_size": 400}}))
            for f in tokenizer_from.glob("tokenizer*"):
                shutil.copy(f, folder / "tokenizer" / f.name)
            write_manifest(
                folder,
                Manifest(
                    complete=True,
                    name=spec.name,
                    role=kind,
                    backend="trtllm",
                    spec_hash=spec.build_hash(role_of(kind)),
                    dtype="bfloat16",
                    max_draft_len=0,
                    limits=spec.limits(role_of(kind)).model_dump(),
                    model_type="qwen2",
                    architecture="Qwen2ForCausalLM",
                    parameters=1,
                    source=SourceRecord(id="fake", weights={}),
                    files={},
                    versions={},
                    created=now(),
                ),
            )


@pytest.fixture
def trtllm_spec(tmp_path, tiny_ckpts):
    data = yaml.safe_load((DATA / "trtllm-tp2.yaml").read_text())
    for role in ("target", "draft"):
        data[role]["path"] = str((DATA / data[role]["path"]).resolve())
    data["output_dir"] = str(tmp_path / "engines")
    data["serve"]["repo_dir"] = str(tmp_path / "repo")
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    loaded = load_spec(path)
    _fake_engines(loaded, tmp_path / "engines", tiny_ckpts["target"])
    return loaded


def test_repository_for_trtllm_engines(trtllm_spec, tmp_path):
    repo = write_repository(trtllm_spec, trtllm_spec.output_dir(), tmp_path / "repo")
    names = sorted(p.name for p in repo.iterdir() if p.is_dir())
    assert names == sorted([BLS, CONTROL, "ensemble", "tensorrt_llm", "tensorrt_llm_control", "tensorrt_llm_draft"])
    control = pbtxt.parse((repo / CONTROL / "config.pbtxt").read_text())
    assert control.parameters["tensorrt_llm_model_name"].string_value == "tensorrt_llm_control"
    bls = pbtxt.parse((repo / BLS / "config.pbtxt").read_text())
    assert bls.parameters["tensorrt_llm_model_name"].string_value == "tensorrt_llm"
    assert bls.parameters["tensorrt_llm_draft_model_name"].string_value == "tensorrt_llm_draft"
    for engine in ("tensorrt_llm", "tensorrt_llm_control", "tensorrt_llm_draft"):
        text = (repo / engine / "config.pbtxt").read_text()
        msg = pbtxt.parse(text)
        assert msg.backend == "tensorrtllm" and not msg.model_transaction_policy.decoupled
        assert "${" not in text


def test_repository_refuses_engines_of_another_spec(trtllm_spec, tmp_path):
    (trtllm_spec.output_dir() / "control" / "manifest.json").unlink()
    with pytest.raises(EngineError, match="control has no manifest.json"):
        write_repository(trtllm_spec, trtllm_spec.output_dir(), tmp_path / "repo")


def test_serve_dry_run_prints_mpirun_orchestrator_launch(trtllm_spec, monkeypatch):
    monkeypatch.setenv("TRTSPEC_ADMIN_KEY", "dry-run-admin-key")
    r = CliRunner().invoke(app, ["serve", str(trtllm_spec.path), "--dry-run"])
    assert r.exit_code == 0, r.output
    first = r.stdout.splitlines()[0]
    # each rank is the rank module around its tritonserver; the key is exported by name only
    assert first.startswith(
        f"mpirun --allow-run-as-root -x TRTSPEC_ADMIN_KEY -n 1 {sys.executable} -m trtspec.triton.server.rank "
    )
    assert "dry-run-admin-key" not in r.output and "<admin key>" in first
    assert "--http-address=127.0.0.1" in first and "--disable-auto-complete-config" in first
    assert "TRTLLM_ORCHESTRATOR=1" in r.stdout
    assert not (trtllm_spec.base_dir / "repo").exists()  # a dry run writes nothing

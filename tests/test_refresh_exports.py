"""A refreshed head stays portable: the head `distill --from-capture` writes, and the head engine
`trtspec refresh` builds from it, have the layout vLLM's, SGLang's and TensorRT-LLM's EAGLE-3
loaders read (the checks of test_eagle3's loader-layout test), and the continued head builds
for the trtllm backend (LLM API files) and verifies identical through its conformance double.

vLLM itself loading it is `make test-vllm` (tests/test_vllm_head.py), which needs vLLM's own
environment."""

from __future__ import annotations

import json

import yaml
from conftest import write_spec
from test_distill_capture import _refine, served  # noqa: F401 - the fixture: a head and captured traffic
from test_eagle3 import assert_loader_layout
from typer.testing import CliRunner

from trtspec.cli.app import app
from trtspec.distill.refresh import build_head
from trtspec.engines.build import build
from trtspec.spec import load_spec


def _continued(served) -> object:  # noqa: F811
    root, spec, loaded = served
    out = root / "continued"
    if not out.is_dir():
        args = ["--from-capture", str(loaded.capture_dir()), "--init", str(root / "head"), "-o", str(out), "--max-steps", "4"]
        r = _refine(spec, *args, "--prompts", str(root / "prompts.jsonl"))
        assert r.exit_code == 0, r.output
    return out


def test_the_continued_head_and_the_head_refresh_builds_have_the_loaders_layout(served, tiny_ckpts):  # noqa: F811
    _, _, loaded = served
    continued = _continued(served)
    cfg, _ = assert_loader_layout(continued, tiny_ckpts["target"])
    assert json.loads((continued / "trtspec-head.json").read_text())["continued"]["held_requests"]
    built = build_head(loaded, continued, 2)
    assert built.parent.name == "v2" and built.parent.parent.name.endswith(".refresh")
    assert not (built.parent / "target").exists()  # the head alone
    built_cfg, _ = assert_loader_layout(built, tiny_ckpts["target"])
    assert {k: v for k, v in built_cfg.items() if k != "torch_dtype"} == {k: v for k, v in cfg.items() if k != "torch_dtype"}


def test_the_continued_head_builds_for_the_trtllm_backend_and_verifies_identical(served, tiny_ckpts, tmp_path):  # noqa: F811
    continued = _continued(served)
    llmapi = {"backend": "trtllm", "speculative.default_draft_tokens": None, "trtllm.line": "1.3+"}
    ck = {"target": tiny_ckpts["target"], "head": continued}
    over = {**llmapi, "speculative.method": "eagle3", "verify.max_tokens": 12}
    loaded = load_spec(write_spec(tmp_path, ck, "head", **over))
    build(loaded, loaded.output_dir())
    cfg = yaml.safe_load((loaded.output_dir() / "llmapi" / "speculative.yaml").read_text())["speculative_config"]
    assert cfg["decoding_type"] == "Eagle3" and cfg["speculative_model"] == str(continued.resolve())
    r = CliRunner().invoke(app, ["verify", str(loaded.path), "--llmapi", "double", "--json-file", str(tmp_path / "r.json")])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "r.json").read_text())["identical"]

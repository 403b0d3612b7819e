"""trtllm.runtime llmapi: spec rules, the argument files a build writes, and the inventory.

No GPU and no tensorrt_llm: the files are checked against the field inventory read from the
upstream sources (trtllm_lines/fields.py), parsed back as upstream's yaml.safe_load reads them.
"""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import write_spec
from typer.testing import CliRunner

from trtspec.cli.app import app
from trtspec.engines.build import BuildState, build
from trtspec.engines.trtllm import llmapi
from trtspec.errors import SpecError
from trtspec.spec import load_spec
from trtspec.trtllm_lines.fields import DECODING_TYPES, LINES, unknown_keys

LLMAPI = {"backend": "trtllm", "speculative.default_draft_tokens": None}


def spec_at(tmp_path, tiny_ckpts, draft="draft", **overrides):
    return load_spec(write_spec(tmp_path, tiny_ckpts, draft, **(LLMAPI | overrides)))


def spec_error(tmp_path, tiny_ckpts, draft="draft", **overrides) -> str:
    with pytest.raises(SpecError) as info:
        spec_at(tmp_path, tiny_ckpts, draft, **overrides)
    assert info.value.exit_code == 2
    return str(info.value)


def test_llmapi_is_the_default_runtime_and_1_2_the_default_line(tmp_path, tiny_ckpts):
    spec = spec_at(tmp_path, tiny_ckpts).spec
    assert (spec.trtllm.runtime, spec.trtllm.line) == ("llmapi", "1.2")


def test_engine_runtime_names_the_versions_it_needs(tmp_path, tiny_ckpts):
    msg = spec_error(tmp_path, tiny_ckpts, **{"trtllm.runtime": "engine", "trtllm.line": "1.3+"})
    assert msg.endswith(
        "(top level): trtllm.runtime engine needs TensorRT-LLM 1.2.x or older (trtllm-build and "
        "the tensorrtllm Triton backend were removed in 1.3); set trtllm.line: '1.2' or use "
        "trtllm.runtime: llmapi (needs TensorRT-LLM 1.2.x (trtllm.line: '1.2') or 1.3 and later "
        "(trtllm.line: '1.3+'))"
    )


@pytest.mark.parametrize(
    "overrides, needle",
    [
        ({"speculative.default_draft_tokens": 2}, "speculative.default_draft_tokens: the LLM API drafts max_draft_len"),
        ({"speculative.use_draft_logits": True}, "speculative.use_draft_logits: trtspec certifies greedy"),
        ({"draft.tp_size": 2, "target.tp_size": 2}, "draft.tp_size/pp_size/gpu_device_ids: under trtllm.runtime llmapi"),
        ({"trtllm.max_num_tokens": 8}, "trtllm.max_num_tokens (8) is below build.max_input_len (256)"),
        ({"trtllm.line": "1.4"}, "trtllm.line: Input should be '1.2' or '1.3+'"),
        ({"trtllm.runtime": "tensorrt"}, "trtllm.runtime: Input should be 'llmapi' or 'engine'"),
        ({"trtllm.speculative_model": "x"}, "trtllm.speculative_model: unknown key; remove or rename it (allowed: runtime, line"),
    ],
)
def test_llmapi_spec_refusals(tmp_path, tiny_ckpts, overrides, needle):
    assert needle in spec_error(tmp_path, tiny_ckpts, **overrides)


def test_eagle3_needs_a_head_and_not_the_legacy_engine_runtime(tmp_path, tiny_ckpts):
    assert "method eagle3 needs `draft`: the EAGLE-3 head folder" in spec_error(
        tmp_path / "a", tiny_ckpts, draft=None, **{"speculative.method": "eagle3"}
    )
    # (backend torch runs eagle3 heads itself: tests/test_eagle3.py)
    engine_msg = spec_error(tmp_path / "c", tiny_ckpts, **{"speculative.method": "eagle3", "trtllm.runtime": "engine"})
    assert "speculative.method eagle3: trtllm.runtime engine builds draft_target pairs only" in engine_msg


def test_trtllm_settings_refused_on_the_torch_backend(tmp_path, tiny_ckpts):
    msg = spec_error(tmp_path, tiny_ckpts, **{"backend": "torch", "trtllm.line": "1.3+"})
    assert "`trtllm` settings only apply to backend: trtllm; remove them" in msg


def test_every_decoding_type_we_write_is_in_the_line_inventory():
    for (method, line), name in llmapi.DECODING_TYPE.items():
        assert name in DECODING_TYPES[line], (method, line)
    # the spellings differ exactly where upstream differs
    assert llmapi.DECODING_TYPE[("draft_target", "1.2")] != llmapi.DECODING_TYPE[("draft_target", "1.3+")]
    assert (llmapi.DECODING_TYPE[("eagle3", "1.2")], llmapi.DECODING_TYPE[("eagle3", "1.3+")]) == ("Eagle", "Eagle3")


def test_the_inventory_check_catches_unknown_and_misspelt_keys():
    args = {
        "model": "m",
        "max_batch_sizes": 4,
        "kv_cache_config": {"enable_block_reuse": True, "reuse": 1},
        "speculative_config": {"decoding_type": "Draft_Target", "max_draft_len": 4},
    }
    assert [str(u) for u in unknown_keys(args, "1.2")] == [
        "max_batch_sizes (TensorRT-LLM 1.2)",
        "kv_cache_config.reuse (TensorRT-LLM 1.2)",
        "speculative_config.decoding_type=Draft_Target (TensorRT-LLM 1.2)",
    ]
    assert [str(u) for u in unknown_keys(args, "1.3+")] == [
        "max_batch_sizes (TensorRT-LLM 1.3+)",
        "kv_cache_config.reuse (TensorRT-LLM 1.3+)",
    ]


@pytest.mark.parametrize("line", LINES)
@pytest.mark.parametrize("method", ["draft_target", "ngram"])
def test_build_writes_checked_argument_files(tmp_path, tiny_ckpts, line, method):
    draft = None if method == "ngram" else "draft"
    loaded = spec_at(tmp_path, tiny_ckpts, draft, **{"speculative.method": method, "trtllm.line": line})
    out = loaded.output_dir()
    result = build(loaded, out)
    assert result.built == ["llmapi"]
    folder = out / "llmapi"
    assert sorted(p.name for p in folder.iterdir()) == ["control.yaml", "manifest.json", "speculative.yaml"]
    spec_args = yaml.safe_load((folder / "speculative.yaml").read_text())
    control = yaml.safe_load((folder / "control.yaml").read_text())
    for args in (spec_args, control):
        llmapi.check_keys(args, "test")  # every key in both lines (decoding_type respelt per line)
        assert unknown_keys(args, line) == []
    assert {k: v for k, v in spec_args.items() if k != "speculative_config"} == control
    assert control["model"] == str(tiny_ckpts["target"])
    assert control["trust_remote_code"] is False
    assert control["kv_cache_config"] == {"enable_block_reuse": True, "free_gpu_memory_fraction": 0.45}
    assert (control["max_batch_size"], control["max_input_len"], control["max_seq_len"]) == (4, 256, 512)
    sc = spec_args["speculative_config"]
    assert sc["decoding_type"] == llmapi.DECODING_TYPE[(method, line)]
    assert sc["max_draft_len"] == 8
    if method == "draft_target":
        assert sc["speculative_model"] == str(tiny_ckpts["draft"])
    else:
        assert sc["max_matching_ngram_size"] == 3
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["line"] == line and manifest["complete"] is True
    assert set(manifest["files"]) == {"speculative.yaml", "control.yaml"}
    # same spec and weights: nothing to do; --force rewrites
    assert build(loaded, out).units[0].state == BuildState.UP_TO_DATE
    assert build(loaded, out, force=True).units[0].state == BuildState.REBUILD
    assert not [p for p in out.iterdir() if ".tmp-" in p.name]


def test_trust_remote_code_comes_only_from_the_spec(tmp_path, tiny_ckpts):
    loaded = spec_at(tmp_path, tiny_ckpts, **{"target.trust_remote_code": True})
    args = llmapi.llm_args(loaded.spec, tiny_ckpts["target"], tiny_ckpts["draft"], speculative=True)
    assert args["trust_remote_code"] is True


def test_quantization_needs_a_prequantized_checkpoint(tmp_path, tiny_ckpts):
    loaded = spec_at(tmp_path, tiny_ckpts, **{"target.quantization": "fp8", "target.dtype": "bfloat16"})
    r = CliRunner().invoke(app, ["build", str(loaded.path)])
    assert r.exit_code == 2
    assert "the LLM API reads quantization from a pre-quantized checkpoint" in r.stderr
    assert not (loaded.output_dir() / "llmapi").exists()


def test_dry_run_prints_both_files_and_writes_nothing(tmp_path, tiny_ckpts):
    loaded = spec_at(tmp_path, tiny_ckpts, **{"trtllm.line": "1.3+"})
    r = CliRunner().invoke(app, ["build", str(loaded.path), "--dry-run"])
    assert r.exit_code == 0, r.output
    assert "--- speculative.yaml" in r.stdout and "--- control.yaml" in r.stdout
    assert "decoding_type: Draft_Target" in r.stdout
    assert not loaded.output_dir().exists()


def test_eagle3_takes_an_eagle3_head_and_refuses_a_plain_model(tmp_path, tiny_ckpts):
    import shutil

    plain = spec_at(tmp_path / "plain", tiny_ckpts, **{"speculative.method": "eagle3"})
    r = CliRunner().invoke(app, ["build", str(plain.path)])
    assert r.exit_code == 2
    assert "draft: method eagle3 needs an EAGLE-3 head checkpoint" in r.stderr
    head = tmp_path / "head"
    shutil.copytree(tiny_ckpts["draft"], head)
    cfg = json.loads((head / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLMEagle3"]
    (head / "config.json").write_text(json.dumps(cfg))
    loaded = load_spec(
        write_spec(tmp_path / "head-spec", {**tiny_ckpts, "head": head}, "head", **(LLMAPI | {"speculative.method": "eagle3"}))
    )
    build(loaded, loaded.output_dir())
    sc = yaml.safe_load((loaded.output_dir() / "llmapi" / "speculative.yaml").read_text())["speculative_config"]
    assert sc == {"decoding_type": "Eagle", "max_draft_len": 8, "speculative_model": str(head)}

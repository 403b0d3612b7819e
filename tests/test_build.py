"""Building engines: manifest, atomicity, no-op rebuilds, and refusals of bad input."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import write_spec

from trtspec.engines import build as builder
from trtspec.engines.manifest import read_manifest
from trtspec.errors import CheckpointError, EngineError, TrtspecError
from trtspec.runtime import Deployment
from trtspec.spec import load_spec


@pytest.fixture
def spec(tmp_path, tiny_ckpts):
    return load_spec(write_spec(tmp_path, tiny_ckpts))


def test_manifest_records_sources_and_versions(spec):
    builder.build(spec, spec.output_dir())
    m = read_manifest(spec.output_dir() / "draft")
    assert m.role == "draft" and m.backend == "torch" and m.complete
    assert m.spec_hash == spec.spec.build_hash("draft")
    assert m.source.id == spec.spec.draft.path
    assert set(m.source.weights) == {"model.safetensors"}
    assert len(m.source.weights["model.safetensors"].sha256) == 64
    assert m.dtype == "float32" and m.max_draft_len == 8
    assert set(m.versions) == {"trtspec", "torch", "transformers"}
    assert "model.safetensors" in m.files and "config.json" in m.files


def test_rebuild_is_a_noop_unless_forced(spec, capsys):
    out = spec.output_dir()
    builder.build(spec, out)
    stamp = (out / "target" / "manifest.json").stat().st_mtime_ns
    result = builder.build(spec, out)
    assert result.built == []
    assert "is up to date (same spec and weights); nothing to do" in capsys.readouterr().err
    assert (out / "target" / "manifest.json").stat().st_mtime_ns == stamp
    result = builder.build(spec, out, force=True)
    assert result.built == ["target", "draft"]
    assert (out / "target" / "manifest.json").stat().st_mtime_ns != stamp


def test_changed_source_weights_trigger_rebuild(tmp_path, tiny_ckpts):
    ckpts = dict(tiny_ckpts)
    ckpts["draft"] = tmp_path / "draft-copy"
    shutil.copytree(tiny_ckpts["draft"], ckpts["draft"])
    loaded = load_spec(write_spec(tmp_path, ckpts))
    builder.build(loaded, loaded.output_dir())
    shutil.copy(tiny_ckpts["unrelated"] / "model.safetensors", ckpts["draft"] / "model.safetensors")
    assert builder.build(loaded, loaded.output_dir()).built == ["draft"]


def test_interrupted_build_leaves_nothing_loadable(spec, monkeypatch):
    out = spec.output_dir()

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(builder, "write_manifest", boom)
    with pytest.raises(KeyboardInterrupt):
        builder.build(spec, out)
    assert not (out / "target").exists()
    assert list(out.glob(".*")) == []  # the temp folder was removed too
    with pytest.raises(EngineError, match="does not exist; run `trtspec build SPEC`"):
        Deployment(spec, out)


def test_folder_without_manifest_is_rejected(spec):
    out = spec.output_dir()
    builder.build(spec, out)
    (out / "draft" / "manifest.json").unlink()
    with pytest.raises(EngineError, match="has no manifest.json: not a complete engine"):
        Deployment(spec, out)
    # and a later build repairs it instead of calling it up to date
    assert builder.build(spec, out).built == ["draft"]


def test_truncated_weights_are_rejected(spec):
    out = spec.output_dir()
    builder.build(spec, out)
    w = out / "target" / "model.safetensors"
    w.write_bytes(w.read_bytes()[:100])
    with pytest.raises(EngineError, match="engine file model.safetensors is missing or truncated"):
        Deployment(spec, out)


def test_engines_from_another_spec_are_rejected(tmp_path, tiny_ckpts):
    loaded = load_spec(write_spec(tmp_path, tiny_ckpts))
    builder.build(loaded, loaded.output_dir())
    changed = load_spec(write_spec(tmp_path, tiny_ckpts, **{"draft.dtype": "bfloat16"}))
    with pytest.raises(EngineError, match="was built from a different spec"):
        Deployment(changed, changed.output_dir())


def test_pickle_weights_refused_unless_allowed(tmp_path, tiny_ckpts):
    import torch
    from safetensors.torch import load_file

    pk = tmp_path / "pickled"
    shutil.copytree(tiny_ckpts["target"], pk)
    state = load_file(pk / "model.safetensors")
    (pk / "model.safetensors").unlink()
    torch.save(state, pk / "pytorch_model.bin")
    ckpts = dict(tiny_ckpts, target=pk)
    loaded = load_spec(write_spec(tmp_path, ckpts))
    with pytest.raises(CheckpointError) as e:
        builder.build(loaded, loaded.output_dir())
    assert "only has pickle weights (pytorch_model.bin); pickle can run arbitrary code" in str(e.value)
    assert "pass --allow-pickle if you trust the source" in str(e.value)
    assert not loaded.output_dir().joinpath("target").exists()
    builder.build(loaded, loaded.output_dir(), allow_pickle=True)
    assert read_manifest(loaded.output_dir() / "target").source.weights.keys() == {"pytorch_model.bin"}


def test_incompatible_tokenizers_name_the_tokens(tmp_path, tiny_ckpts):
    loaded = load_spec(write_spec(tmp_path, tiny_ckpts, draft="other-vocab"))
    with pytest.raises(CheckpointError) as e:
        builder.build(loaded, loaded.output_dir())
    msg = str(e.value)
    assert msg.startswith("draft and target tokenizers are incompatible: ")
    assert "token(s) map to different ids (first: " in msg
    assert not (loaded.output_dir() / "target").exists()


def test_missing_checkpoint(tmp_path, tiny_ckpts):
    loaded = load_spec(write_spec(tmp_path, dict(tiny_ckpts, target=tmp_path / "nope")))
    with pytest.raises(CheckpointError, match=r"target.path: .*nope is not a folder"):
        builder.build(loaded, loaded.output_dir())


def test_unwritable_output_folder(tmp_path, tiny_ckpts):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    loaded = load_spec(write_spec(tmp_path, tiny_ckpts))
    with pytest.raises(TrtspecError, match="is not writable .* pass --output DIR"):
        builder.build(loaded, blocker / "engines")


def test_unsupported_architecture(tmp_path, tiny_ckpts):
    weird = tmp_path / "weird"
    shutil.copytree(tiny_ckpts["target"], weird)
    cfg = json.loads((weird / "config.json").read_text())
    cfg["model_type"] = "qwen3_moe"
    (weird / "config.json").write_text(json.dumps(cfg))
    loaded = load_spec(write_spec(tmp_path, dict(tiny_ckpts, target=weird, draft=weird)))
    with pytest.raises(CheckpointError) as e:
        builder.build(loaded, loaded.output_dir())
    assert str(e.value) == (
        "target: model_type 'qwen3_moe' is not supported by the torch backend (supported: "
        "llama, mistral, qwen2); use one of those families or backend: trtllm"
    )

"""Checkpoint intake: Hub ids through the HF cache (offline), and tokenizer comparison."""

from __future__ import annotations

import shutil

import pytest
from conftest import write_spec

from trtspec.checkpoints import compare_tokenizers, resolve
from trtspec.errors import CheckpointError
from trtspec.spec import load_spec

REV = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, tiny_ckpts, monkeypatch):
    """A Hugging Face cache holding org/tiny at REV, laid out as huggingface_hub writes it."""
    import huggingface_hub.constants as hc

    cache = tmp_path / "hf"
    snap = cache / "models--org--tiny" / "snapshots" / REV
    shutil.copytree(tiny_ckpts["target"], snap)
    (cache / "models--org--tiny" / "refs").mkdir()
    (cache / "models--org--tiny" / "refs" / "main").write_text(REV)
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    return cache


def _hub_spec(tmp_path, tiny_ckpts, revision=REV):
    path = write_spec(tmp_path, tiny_ckpts, **{"target.path": None, "target.repo": "org/tiny", "target.revision": revision})
    return load_spec(path)


def test_hub_repo_resolves_from_cache_offline(tmp_path, tiny_ckpts, hub_cache):
    ckpt = resolve(_hub_spec(tmp_path, tiny_ckpts), "target")
    assert ckpt.folder.name == REV
    assert [f.name for f in ckpt.weight_files] == ["model.safetensors"]
    assert ckpt.hf_config().model_type == "llama"


def test_hub_repo_missing_offline_says_how_to_fix(tmp_path, tiny_ckpts, hub_cache):
    loaded = _hub_spec(tmp_path, tiny_ckpts, revision="f" * 40)
    with pytest.raises(CheckpointError) as e:
        resolve(loaded, "target")
    assert "org/tiny@" + "f" * 40 + " is not in the Hugging Face cache and the Hub cannot be reached" in str(e.value)


def test_missing_gguf_file(tmp_path, tiny_ckpts):
    loaded = load_spec(write_spec(tmp_path, tiny_ckpts, **{"target.gguf_file": "nope.gguf"}))
    with pytest.raises(CheckpointError, match=r"target.gguf_file: .*nope.gguf not found"):
        resolve(loaded, "target")


def test_folder_without_config(tmp_path, tiny_ckpts):
    empty = tmp_path / "empty"
    empty.mkdir()
    loaded = load_spec(write_spec(tmp_path, dict(tiny_ckpts, target=empty)))
    with pytest.raises(CheckpointError, match="has no config.json; it is not a Hugging Face checkpoint"):
        resolve(loaded, "target")


def test_special_token_ids_must_match(tiny_ckpts):
    from transformers import AutoTokenizer

    a = AutoTokenizer.from_pretrained(tiny_ckpts["target"])
    b = AutoTokenizer.from_pretrained(tiny_ckpts["target"])
    assert compare_tokenizers(a, b).compatible
    b.pad_token = "<unk>"
    report = compare_tokenizers(a, b)
    assert not report.compatible
    assert report.problems == [f"pad_token_id differs: target {a.pad_token_id}, draft {b.pad_token_id}"]

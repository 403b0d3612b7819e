"""A damaged or foreign GGUF stops `trtspec check` and `trtspec build` with one line naming the
file (and the tensor), exit 2, nothing written: never a KeyError/ValueError/struct traceback."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import write_spec
from typer.testing import CliRunner

from trtspec.cache import cache_root
from trtspec.cli.app import app
from trtspec.errors import CheckpointError
from trtspec.gguf_check import check_gguf

gguf = pytest.importorskip("gguf")
runner = CliRunner()
HIDDEN, VOCAB, FFN = 32, 32, 64


def tiny_gguf(path: Path, extra: dict[str, np.ndarray] | None = None, q4_1: dict[str, np.ndarray] | None = None) -> Path:
    """A one-layer llama GGUF with the tensors the format defines for it (float32), plus ``extra``
    (float32) and ``q4_1`` (raw Q4_1 bytes)."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"<t{i}>".encode() for i in range(VOCAB)])
    w.add_token_scores([0.0] * VOCAB)
    w.add_token_types([1] * VOCAB)
    rng = np.random.default_rng(0)
    shapes = {
        "token_embd.weight": (VOCAB, HIDDEN),
        "output_norm.weight": (HIDDEN,),
        "output.weight": (VOCAB, HIDDEN),
        "blk.0.attn_norm.weight": (HIDDEN,),
        "blk.0.ffn_norm.weight": (HIDDEN,),
        "blk.0.attn_q.weight": (HIDDEN, HIDDEN),
        "blk.0.attn_k.weight": (16, HIDDEN),
        "blk.0.attn_v.weight": (16, HIDDEN),
        "blk.0.attn_output.weight": (HIDDEN, HIDDEN),
        "blk.0.ffn_gate.weight": (FFN, HIDDEN),
        "blk.0.ffn_up.weight": (FFN, HIDDEN),
        "blk.0.ffn_down.weight": (HIDDEN, FFN),
    }
    for name, shape in shapes.items():
        if name not in (q4_1 or {}):
            w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    for name, array in (extra or {}).items():
        w.add_tensor(name, array)
    for name, raw in (q4_1 or {}).items():
        w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _unknown(path: Path) -> None:
    tiny_gguf(path, extra={"blk.0.mystery.weight": np.zeros((4, 4), np.float32)})


def _truncated(path: Path) -> None:
    data = tiny_gguf(path).read_bytes()
    path.write_bytes(data[:-100])  # the last tensor's bytes end early


def _bad_magic(path: Path) -> None:
    data = tiny_gguf(path).read_bytes()
    path.write_bytes(b"GGML" + data[4:])


def _header_cut(path: Path) -> None:
    path.write_bytes(tiny_gguf(path).read_bytes()[:50])


DAMAGE = {
    "unknown tensor": (_unknown, "tensor blk.0.mystery.weight in {path} is not a tensor of this architecture"),
    "truncated tensor": (_truncated, "tensor blk.0.ffn_down.weight in {path} needs bytes up to"),
    "bad magic": (_bad_magic, "{path} is not a readable GGUF: it does not start with the GGUF magic bytes"),
    "header cut short": (_header_cut, "{path} is not a readable GGUF: the header ends inside"),
}


def test_a_whole_gguf_passes_the_check(tmp_path):
    check_gguf("target", tiny_gguf(tmp_path / "m.gguf"))


@pytest.mark.parametrize("command", ["check", "build"])
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_gguf_is_one_line_naming_the_tensor_and_file_exit_2_nothing_written(tmp_path, command, damage):
    make, message = DAMAGE[damage]
    weights = tmp_path / "weights"
    weights.mkdir()
    path = weights / "m.gguf"
    make(path)
    spec = write_spec(
        tmp_path / "spec", {"target": weights, "draft": weights}, **{"target.gguf_file": "m.gguf", "draft.gguf_file": "m.gguf"}
    )
    converted = set((cache_root() / "gguf").glob("*"))
    r = runner.invoke(app, [command, str(spec)])
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: target.gguf_file: "), r.output
    assert message.format(path=path) in lines[0] and "Traceback" not in r.output
    assert not (tmp_path / "spec" / "engines").exists() and set((cache_root() / "gguf").glob("*")) == converted


def test_a_q4_1_linear_of_the_wrong_rank_names_the_tensor(tmp_path):
    """Q4_1 blocks are read as they are for int4_wo engines: a linear stored with one dimension
    is refused by name, not with a ValueError from unpacking its shape."""
    from transformers import LlamaConfig

    from trtspec.engines.torch.gguf_blocks import read_q4_1

    flat = np.zeros((HIDDEN * HIDDEN // 32 * 20,), np.uint8)  # whole Q4_1 blocks, one dimension
    path = tiny_gguf(tmp_path / "m.gguf", q4_1={"blk.0.attn_q.weight": flat})
    check_gguf("target", path)  # the file itself is whole
    config = LlamaConfig(hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(CheckpointError, match=rf"tensor blk.0.attn_q.weight in {path} has shape \[1024\], not the \[in, out\]"):
        read_q4_1(path, config)

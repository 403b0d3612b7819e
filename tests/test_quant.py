"""Weight-only quantized torch engines (int8_wo, int4_wo): kernels against a dequantized float
reference, a GGUF's Q4_1 blocks taken exactly, build / manifest / check, and greedy speculative
decoding still token-identical to target-only with a quantized draft or target."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import write_spec
from safetensors import safe_open
from torch import nn

from trtspec.engines.check import check
from trtspec.engines.torch import gguf_blocks, quant
from trtspec.engines.torch.engine import WEIGHTS, TorchEngine
from trtspec.engines.torch.quant import GROUP, WeightOnlyLinear, quantize
from trtspec.errors import CheckpointError
from trtspec.spec import load_spec

# Kernel tolerances, stated once: float32 activations differ from the float reference only by
# the order of the sums (and the int4 kernel's z = min + 8 * scale rounding); bfloat16
# activations are rounded to 8 bits of mantissa, and so are the scales.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _weight(out=64, cols=96, seed=0) -> torch.Tensor:
    return torch.randn(out, cols, generator=torch.Generator().manual_seed(seed)) * 0.05


def _identity_weights(linear: WeightOnlyLinear) -> torch.Tensor:
    """The float weight [out, in] a kernel actually multiplies by: its output for the identity."""
    return linear(torch.eye(linear.in_features, dtype=linear.dtype)).float().t()


# -- kernels ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", quant.SCHEMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 5])
def test_kernel_matches_the_dequantized_float_reference(scheme, dtype, rows):
    qw = quantize(_weight(), scheme).cast(dtype)
    bias = torch.randn(64).to(dtype)
    linear = WeightOnlyLinear(qw, bias, dtype)
    x = torch.randn(2, rows, 96).to(dtype)
    want = x.float() @ qw.dequantize().t() + bias.float()  # [2, rows, 64]
    got = linear(x)
    assert got.dtype == dtype and got.shape == (2, rows, 64)
    torch.testing.assert_close(got.float(), want, **TOL[dtype])


@pytest.mark.parametrize("scheme", quant.SCHEMES)
def test_round_to_nearest_error_is_within_half_a_step(scheme):
    w = _weight(seed=1)
    qw = quantize(w, scheme)
    err = (qw.dequantize() - w).abs()
    step = qw.scales[:, None] if scheme == "int8_wo" else qw.scales.repeat_interleave(GROUP, 1)
    assert (err <= step / 2 + 1e-7).all()


def test_int4_codes_round_trip_through_the_stored_bytes():
    codes = torch.randint(0, 16, (32, 64), dtype=torch.uint8)
    packed = quant.pack_int4(codes)
    assert packed.shape == (32, 32) and packed.dtype == torch.uint8
    assert torch.equal(quant.unpack_int4(packed), codes)
    assert torch.equal(packed[0, 0], codes[0, 0] | (codes[0, 1] << 4))  # even column in the low nibble


def test_int4_float32_kernel_runs_q4_1_weights_exactly():
    """float16 scales and mins (a Q4_1 block's d and m) in a float32 engine: the kernel's weights
    are q * d + m bit for bit."""
    g = torch.Generator().manual_seed(2)
    out, cols = 32, 128
    codes = torch.randint(0, 16, (out, cols), generator=g, dtype=torch.uint8)
    d = (torch.rand(out, cols // GROUP, generator=g) * 0.01 + 1e-3).half().float()
    m = (-8 * d - torch.rand(out, cols // GROUP, generator=g) * 1e-3).half().float()
    qw = quant.QuantizedWeight("int4_wo", quant.pack_int4(codes), d, m)
    assert torch.equal(_identity_weights(WeightOnlyLinear(qw, None, torch.float32)), qw.dequantize())


def test_stacked_linears_equal_the_parts_side_by_side():
    parts = [WeightOnlyLinear(quantize(_weight(out, 64, seed=out), "int4_wo"), None, torch.float32) for out in (32, 16, 16)]
    x = torch.randn(3, 64)
    want = torch.cat([p(x) for p in parts], dim=-1)
    parts = [WeightOnlyLinear(quantize(_weight(out, 64, seed=out), "int4_wo"), None, torch.float32) for out in (32, 16, 16)]
    fused = WeightOnlyLinear.stack(parts)
    assert torch.equal(fused(x), want)


def test_packing_drops_the_stored_codes():
    linear = WeightOnlyLinear(quantize(_weight(), "int4_wo"), None, torch.bfloat16)
    linear.pack()
    assert linear.qweight is None and linear.scales is None and linear.mins is None
    packed = linear._kernel_weight.nbytes + linear._kernel_scales.nbytes  # what the kernel holds after pack()
    assert packed == 64 * 96 // 2 + 64 * (96 // GROUP) * 2 * 2  # codes + bf16 scale/zero pairs
    with pytest.raises(RuntimeError, match="no longer holds its stored codes"):
        linear.stored()


def test_int4_shapes_the_kernel_cannot_hold_are_named():
    assert quant.unsupported_shape("int4_wo", 64, 96) is None
    assert quant.unsupported_shape("int8_wo", 7, 50) is None
    assert quant.unsupported_shape("int4_wo", 64, 80) == (
        "int4_wo needs in_features divisible by 32 and out_features by 16 (the CPU kernel's groups and packing), not 64x80"
    )
    assert "not 40x64" in quant.unsupported_shape("int4_wo", 40, 64)


# -- GGUF Q4_1 blocks ---------------------------------------------------------------------------------


def _q4_1_bytes(codes: np.ndarray, d: np.ndarray, m: np.ndarray) -> np.ndarray:
    """llama.cpp's Q4_1 layout: per block d, m (float16) and 16 bytes, codes 0-15 in the low
    nibbles and 16-31 in the high ones."""
    out, blocks = d.shape
    c = codes.reshape(out, blocks, GROUP).astype(np.uint8)
    nibbles = c[..., :16] | (c[..., 16:] << 4)
    head = np.stack([d.astype(np.float16), m.astype(np.float16)], axis=-1).view(np.uint8).reshape(out, blocks, 4)
    return np.concatenate([head, nibbles], axis=-1).reshape(out, blocks * gguf_blocks.Q4_1_BYTES)


def test_q4_1_blocks_decode_to_what_gguf_dequantizes():
    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(3)
    out, cols = 16, 96
    codes = rng.integers(0, 16, (out, cols))
    d = rng.random((out, cols // GROUP)) * 0.01
    m = -rng.random((out, cols // GROUP)) * 0.1
    raw = _q4_1_bytes(codes, d, m)
    weight = gguf_blocks.decode_q4_1(raw, out, cols)
    reference = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_1).reshape(out, cols)
    assert np.array_equal(weight.dequantize().numpy(), reference)


def test_gguf_names_and_rope_row_order():
    assert gguf_blocks.hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj"
    assert gguf_blocks.hf_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj"
    assert gguf_blocks.hf_name("output.weight") == "lm_head"
    assert gguf_blocks.hf_name("token_embd.weight") is None and gguf_blocks.hf_name("blk.0.attn_norm.weight") is None
    # transformers' reverse permutation: per head, rows (0, 2, 4, ...) then (1, 3, 5, ...)
    w = torch.arange(16).view(16, 1).float()
    heads, half = 2, 4
    want = w.reshape(heads, half, 2, 1).swapaxes(2, 1).reshape(16, 1)
    assert torch.equal(w[gguf_blocks._rope_rows(16, heads)], want)
    assert gguf_blocks._rope_rows(8, 1).tolist() == [0, 2, 4, 6, 1, 3, 5, 7]


# -- engines: build, manifest, load, check, identity --------------------------------------------------


def _stored(folder) -> dict[str, torch.Tensor]:
    with safe_open(str(folder / WEIGHTS), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize(("scheme", "dtype"), [("int8_wo", "float32"), ("int4_wo", "bfloat16")])
def test_build_stores_codes_and_records_the_quantization(tmp_path, tiny_ckpts, scheme, dtype):
    from trtspec.engines.build import build

    plain = load_spec(write_spec(tmp_path / "plain", tiny_ckpts, **{"draft.dtype": dtype}))
    quantized = load_spec(write_spec(tmp_path / "q", tiny_ckpts, **{"draft.dtype": dtype, "draft.quantization": scheme}))
    for loaded in (plain, quantized):
        build(loaded, loaded.output_dir())
    float_folder, q_folder = plain.output_dir() / "draft", quantized.output_dir() / "draft"
    manifests = [json.loads((f / "manifest.json").read_text()) for f in (float_folder, q_folder)]
    assert manifests[0]["quantization"] == "none" and manifests[1]["quantization"] == scheme
    assert manifests[1]["parameters"] == manifests[0]["parameters"]  # the model's count, not the codes'
    stored, floats = _stored(q_folder), _stored(float_folder)
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        assert f"{name}.weight" not in stored
        assert stored[f"{name}.qweight"].dtype == (torch.int8 if scheme == "int8_wo" else torch.uint8)
        assert stored[f"{name}.scales"].dtype == getattr(torch, dtype)
    assert stored["lm_head.qweight"].dtype == torch.int8  # the head keeps 8 bits under int4_wo too
    assert stored["model.embed_tokens.weight"].dtype == getattr(torch, dtype)
    # what check says it saves is what the folder saves
    saved = sum(t.nbytes for t in floats.values()) - sum(t.nbytes for t in stored.values())
    report = check(quantized)
    draft = next(r for r in report.models if r["role"] == "draft")
    assert draft["quantization"] == scheme and draft["quantization_saves_bytes"] == saved > 0
    engine = TorchEngine.load(q_folder)
    # PyTorch's weight-only kernels, or the panel kernel's where measured faster (native.py)
    assert engine.kernels.layout.partition(":")[0] == scheme and engine.kernels.source in ("quantized", "measured", "cached")
    assert not [m for m in engine.model.modules() if isinstance(m, nn.Linear)]  # every Linear quantized


@pytest.mark.parametrize(("kernels", "layout"), [("0", "int4_wo"), ("panel", "int4_wo:panel")])
def test_loaded_engine_runs_the_stored_codes(tmp_path, tiny_ckpts, monkeypatch, kernels, layout):
    """A float32 int4_wo engine's logits equal a float model with the dequantized weights, to
    the float32 kernel tolerance, on PyTorch's weight-only kernels and on the panel kernel."""
    from trtspec.engines.torch import native

    if kernels == "panel" and native.panel_kernel() is None:
        pytest.skip("no C++ compiler: the panel kernel cannot be built")
    from transformers import AutoConfig

    from trtspec.engines.build import build
    from trtspec.engines.torch.engine import ForwardItem
    from trtspec.engines.torch.model import DecoderConfig, DecoderLM

    loaded = load_spec(write_spec(tmp_path, tiny_ckpts, **{"draft.quantization": "int4_wo"}))
    build(loaded, loaded.output_dir())
    folder = loaded.output_dir() / "draft"
    stored = _stored(folder)
    floats = {k: v for k, v in stored.items() if not k.endswith((".qweight", ".scales", ".mins"))}
    for name in {k.rsplit(".", 1)[0] for k in stored if k.endswith(".qweight")}:
        mins = stored.get(f"{name}.mins")
        floats[f"{name}.weight"] = quant.QuantizedWeight(
            quant.CODE_DTYPES[stored[f"{name}.qweight"].dtype], stored[f"{name}.qweight"], stored[f"{name}.scales"], mins
        ).dequantize()
    monkeypatch.setenv("TRTSPEC_ONEDNN", kernels)
    engine = TorchEngine.load(folder)
    monkeypatch.delenv("TRTSPEC_ONEDNN")
    assert engine.kernels.layout == layout
    hf_config = AutoConfig.from_pretrained(folder)
    model = DecoderLM.from_state_dict(DecoderConfig.from_hf(hf_config), floats)
    reference = TorchEngine(folder, engine.manifest, model, hf_config, slots=1)
    tokens = list(range(5, 30))
    got = engine.run([ForwardItem(tokens, 4)])[0]  # [4, vocab]
    want = reference.run([ForwardItem(tokens, 4)])[0]
    # The panel kernel sums each group as s * sum(x q) + m * sum(x) (the same weights, another
    # rounding order over 25 tokens' 2 layers): float32 rounding of that order, 2e-5 on logits ~1.
    tol = TOL[torch.float32] if kernels == "0" else {"rtol": 1e-4, "atol": 1e-4}
    torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize(
    "overrides",
    [
        {"draft.quantization": "int4_wo", "draft.dtype": "bfloat16"},
        {"draft.quantization": "int8_wo", "draft.dtype": "bfloat16"},
        {"target.quantization": "int8_wo", "draft.quantization": "int4_wo"},  # a quantized reference
    ],
    ids=["int4-draft", "int8-draft", "int8-target"],
)
def test_greedy_speculative_is_identical_with_quantized_engines(built, overrides):
    dep = built("draft", **overrides)
    assert dep.draft.manifest.quantization == overrides["draft.quantization"]
    for prompt in ("The quick brown fox", "def fibonacci(n):", "Triton serves models over HTTP and gRPC."):
        req = dep.request(dep.encode(prompt), 40, 4)
        (target,) = dep.generate([req], speculative=False)
        (spec,) = dep.generate([req], speculative=True)
        assert spec.output_ids == target.output_ids and len(target.output_ids) > 0
        assert spec.metrics.drafted > 0


def test_int4_refuses_a_model_the_kernel_cannot_hold(tmp_path):
    from transformers import LlamaForCausalLM

    from trtspec.testing.tiny import llama_config, make_tokenizer

    tok = make_tokenizer()
    folder = tmp_path / "odd"
    LlamaForCausalLM(llama_config(400, tok, intermediate=80)).save_pretrained(folder)
    tok.save_pretrained(folder)
    overrides = {"target.quantization": "int4_wo", "speculative.method": "ngram"}
    loaded = load_spec(write_spec(tmp_path, {"target": folder}, draft=None, **overrides))
    from trtspec.engines.build import build

    with pytest.raises(CheckpointError) as info:
        build(loaded, loaded.output_dir())
    assert str(info.value) == (
        "target.quantization: model.layers.0.mlp.down_proj: int4_wo needs in_features divisible by 32 and "
        "out_features by 16 (the CPU kernel's groups and packing), not 64x80; use int8_wo or quantization: none"
    )


@pytest.mark.slow
def test_demo_gguf_blocks_run_exactly_in_a_float32_engine(tmp_path):
    """The demo GGUF's Q4_1 blocks in a float32 int4_wo engine: the weights its kernel multiplies
    by are the float32 target's, bit for bit (the build also checks every block)."""
    import yaml
    from conftest import ROOT

    from trtspec.demo.weights import find_gguf
    from trtspec.engines.build import build

    pytest.importorskip("gguf")
    gguf = find_gguf()
    data = yaml.safe_load((ROOT / "engine_specs" / "smollm2-135m-cpu.yaml").read_text())
    for role in ("target", "draft"):
        data[role]["path"] = str(gguf.parent)
    data["draft"]["dtype"] = "float32"
    data["output_dir"] = str(tmp_path / "engines")
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(data))
    loaded = load_spec(tmp_path / "spec.yaml")
    build(loaded, loaded.output_dir())
    target = _stored(loaded.output_dir() / "target")
    draft = TorchEngine.load(loaded.output_dir() / "draft")
    for i in (0, 29):
        layer, prefix = draft.model.model.layers[i], f"model.layers.{i}."
        qkv = torch.cat([target[f"{prefix}self_attn.{p}_proj.weight"] for p in "qkv"])
        assert torch.equal(_identity_weights(layer.self_attn.qkv_proj), qkv)
        assert torch.equal(_identity_weights(layer.mlp.down_proj), target[f"{prefix}mlp.down_proj.weight"])

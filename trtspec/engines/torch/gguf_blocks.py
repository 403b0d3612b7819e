"""A GGUF's Q4_1 blocks as int4_wo weights, taken as they are (no re-quantization).

Q4_1 (llama.cpp): 32 weights a block, stored as a float16 scale d, a float16 min m and 16
bytes of 4-bit codes (the block's first 16 weights in the low nibbles, the last 16 in the high
ones); w = q * d + m. That is int4_wo's form with GROUP = 32 (quant.py), so the codes, d and m
are copied: the engine's weights are the GGUF's, exactly where the kernel's dtype holds d and m
(float32: always; the build checks every block against the checkpoint's dequantized weights).

The GGUF names its tensors its own way, and stores llama's q/k rows in another order than
Hugging Face checkpoints (transformers undoes it on load: reverse_permute_weights); both are
mapped here so each block lands in the row the float checkpoint has.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from trtspec.engines.torch.quant import GROUP, QuantizedWeight, pack_int4
from trtspec.errors import CheckpointError

Q4_1_BYTES = 2 + 2 + GROUP // 2  # d, m, codes

# GGUF tensor name (after "blk.N.") -> Hugging Face module name (after "model.layers.N.")
LAYER_LINEARS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
OUTPUT = ("output", "lm_head")
# Architectures whose GGUF q/k rows are permuted for llama.cpp's RoPE (transformers' list).
PERMUTED_QK = ("llama", "mistral")


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face Linear a GGUF weight tensor is, or None (not a Linear)."""
    base = gguf_name.removesuffix(".weight")
    if base == OUTPUT[0]:
        return OUTPUT[1]
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in LAYER_LINEARS:
        return f"model.layers.{parts[1]}.{LAYER_LINEARS[parts[2]]}"
    return None


def decode_q4_1(raw: np.ndarray, out_features: int, in_features: int) -> QuantizedWeight:
    """Q4_1 bytes [out, in/32 * 20] -> an int4_wo QuantizedWeight of [out, in]."""
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(out_features, in_features // GROUP, Q4_1_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]  # [out, in/32]
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0]
    nibbles = blocks[..., 4:]  # [out, in/32, 16]
    codes = np.concatenate((nibbles & 0xF, nibbles >> 4), axis=-1).reshape(out_features, in_features)
    return QuantizedWeight(
        "int4_wo",
        pack_int4(torch.from_numpy(codes)),
        torch.from_numpy(d.astype(np.float32)),
        torch.from_numpy(m.astype(np.float32)),
    )


def _rope_rows(rows: int, heads: int) -> torch.Tensor:
    """Row order that turns a GGUF q/k weight into the Hugging Face one (transformers'
    reverse_permute_weights: per head, the interleaved halves side by side)."""
    half = rows // heads // 2
    return torch.arange(rows).view(heads, half, 2).transpose(1, 2).reshape(rows)


def _take_rows(w: QuantizedWeight, order: torch.Tensor) -> QuantizedWeight:
    return QuantizedWeight(w.scheme, w.qweight[order], w.scales[order], w.mins[order])


def read_q4_1(path: Path, hf_config) -> dict[str, QuantizedWeight]:
    """Every Q4_1 Linear of a GGUF file, by Hugging Face module name (others are left out:
    the build quantizes them from the float weights)."""
    from gguf import GGMLQuantizationType, GGUFReader

    reader = GGUFReader(str(path))
    permuted = hf_config.model_type in PERMUTED_QK
    heads = {
        "self_attn.q_proj": hf_config.num_attention_heads,
        "self_attn.k_proj": getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
    }
    out: dict[str, QuantizedWeight] = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None or tensor.tensor_type != GGMLQuantizationType.Q4_1:
            continue
        role = name.rsplit(".", 2)[-2] + "." + name.rsplit(".", 1)[-1]
        rows_per = 2 * heads[role] if permuted and role in heads else 1  # whole heads of row pairs
        if len(tensor.shape) != 2 or int(tensor.shape[1]) % rows_per:
            raise CheckpointError(
                f"tensor {tensor.name} in {path} has shape {[int(n) for n in tensor.shape]}, not the "
                f"[in, out] of the Linear {name}; use a GGUF converted from this model"
            )
        in_features, out_features = (int(n) for n in tensor.shape)  # GGUF lists the fastest dimension first
        weight = decode_q4_1(np.asarray(tensor.data), out_features, in_features)
        if rows_per > 1:
            weight = _take_rows(weight, _rope_rows(out_features, heads[role]))
        out[name] = weight
    return out

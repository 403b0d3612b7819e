"""Weight-only quantized Linear layers of the torch engine: the spec's ``quantization: int8_wo``
and ``int4_wo`` (the activations stay in the engine dtype; only the weights are stored in 8 or
4 bits and widened inside the matmul).

  int8_wo  int8 codes, one scale per output row:        w = q * scale            (q in -127..127)
  int4_wo  4-bit codes in groups of GROUP along the input, a scale and a min per group:
                                                          w = q * scale + min      (q in 0..15)

int4_wo's group is llama.cpp's Q4_1 block (32 weights, a scale d and a min m), so a Q4_1 GGUF's
blocks are stored as they are (engines/torch/gguf_blocks.py) instead of being re-quantized from
floats; other sources are quantized here, round to nearest (per row / per group, min-max).

What the engine folder stores per quantized Linear, under its checkpoint name (the tensors are
the module's own parameters, so state dicts load with ``strict=True``):
  ``<name>.qweight``  int8 [out, in] | uint8 [out, in/2], two codes a byte, the even column in the low nibble
  ``<name>.scales``   [out] | [out, in/GROUP], in the engine dtype (what the kernels take)
  ``<name>.mins``     [out, in/GROUP] (int4_wo only), in the engine dtype
A float32 engine keeps a GGUF's float16 d and m exact; a bfloat16 one rounds them.

Kernels: PyTorch's CPU weight-only matmuls, ``_weight_int8pack_mm`` (per-row scales) and
``_weight_int4pack_mm_for_cpu`` (on codes re-laid once by ``_convert_weight_to_int4pack_for_cpu``;
it computes w = (q - 8) * s + z, so z = min + 8 * scale). With float32 activations the int4
kernel's weights equal the GGUF's dequantized weights bit for bit (tested); with bfloat16 the
scales and mins are rounded to bfloat16. On torch 2.13 (2-core Sapphire Rapids, one thread)
only bfloat16 activations run vectorized: a 576x3072 int4 matmul for one row took 115 us in
bfloat16 against 3060 us in float32 (oneDNN's float32 dense: 417 us), int8 137 vs 1198 us.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

SCHEMES = ("int8_wo", "int4_wo")
GROUP = 32  # int4_wo: weights per scale and min (a GGUF Q4_1 block)
INT4_ROWS = 16  # the int4 kernel's packing needs out_features divisible by this
INNER_K_TILES = 2  # the CPU int4 packing's tile parameter (any of 2, 4, 8; the layout is private)


@dataclass(frozen=True)
class QuantizedWeight:
    """One Linear's weight as the engine folder stores it (see the module docstring)."""

    scheme: str
    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        """(out_features, in_features) of the float weight."""
        out, cols = self.qweight.shape
        return out, cols * (2 if self.scheme == "int4_wo" else 1)

    def cast(self, dtype: torch.dtype) -> QuantizedWeight:
        """The same codes with the scales and mins in ``dtype``."""
        mins = self.mins.to(dtype) if self.mins is not None else None
        return QuantizedWeight(self.scheme, self.qweight, self.scales.to(dtype), mins)

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        """The state-dict entries of the Linear called ``name``."""
        out = {f"{name}.qweight": self.qweight, f"{name}.scales": self.scales}
        if self.mins is not None:
            out[f"{name}.mins"] = self.mins
        return out

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [out, in] the codes stand for (the reference the kernels are tested against)."""
        if self.scheme == "int8_wo":
            return self.qweight.float() * self.scales.float()[:, None]
        q = unpack_int4(self.qweight).float()  # [out, in]
        return q * self.scales.float().repeat_interleave(GROUP, 1) + self.mins.float().repeat_interleave(GROUP, 1)


def unsupported_shape(scheme: str, out_features: int, in_features: int) -> str | None:
    """Why ``scheme`` cannot hold an [out, in] weight, or None."""
    if scheme == "int4_wo" and (in_features % GROUP or out_features % INT4_ROWS):
        return (
            f"int4_wo needs in_features divisible by {GROUP} and out_features by {INT4_ROWS} "
            f"(the CPU kernel's groups and packing), not {out_features}x{in_features}"
        )
    return None


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Codes [out, in] in 0..15 -> bytes [out, in/2] (even column in the low nibble)."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """bytes [out, in/2] -> codes [out, in] (uint8, 0..15)."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(1)


def quantize(weight: torch.Tensor, scheme: str) -> QuantizedWeight:
    """Round-to-nearest weight-only quantization of a float weight [out, in]."""
    w = weight.detach().float()
    if scheme == "int8_wo":
        scales = w.abs().amax(dim=1) / 127  # [out]; symmetric, so 0 stays exactly 0
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))
        q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
        return QuantizedWeight(scheme, q, scales)
    if scheme == "int4_wo":
        out, cols = w.shape
        groups = w.view(out, cols // GROUP, GROUP)
        lo, hi = groups.amin(-1), groups.amax(-1)  # [out, in/GROUP]
        scales = (hi - lo) / 15
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # a constant group: q = 0
        q = torch.round((groups - lo[..., None]) / scales[..., None]).clamp(0, 15).view(out, cols)
        return QuantizedWeight(scheme, pack_int4(q), scales, lo)
    raise ValueError(f"unknown weight-only scheme {scheme!r} (known: {', '.join(SCHEMES)})")


class WeightOnlyLinear(nn.Module):
    """A Linear whose weight is a QuantizedWeight, run by PyTorch's CPU weight-only kernels on
    activations of ``dtype``. Its parameters are the stored tensors until ``pack`` re-lays them
    for the kernel (at the first forward at the latest); before that, ``stack`` fuses several
    (q/k/v, gate/up) into one, as DecoderLM.fuse_projections does with dense Linears."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.scheme = weight.scheme
        self.out_features, self.in_features = weight.shape
        # the activations' dtype by name: a compiled program calls this module without reading
        # it, and a torch.dtype held so could not be saved with the program (saved.py)
        self._dtype = str(dtype).removeprefix("torch.")
        self.qweight = nn.Parameter(weight.qweight, requires_grad=False)
        self.scales = nn.Parameter(weight.scales, requires_grad=False)
        self.mins = nn.Parameter(weight.mins, requires_grad=False) if weight.mins is not None else None
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self._kernel_weight: torch.Tensor | None = None  # set by pack()
        self._kernel_scales: torch.Tensor | None = None

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype."""
        return getattr(torch, self._dtype)

    @classmethod
    def empty(cls, scheme: str, out_features: int, in_features: int, bias: bool, dtype: torch.dtype) -> WeightOnlyLinear:
        """A module of the right shapes to load a state dict into (``assign=True``)."""
        if scheme == "int8_wo":
            codes = torch.empty(out_features, in_features, dtype=torch.int8)
            weight = QuantizedWeight(scheme, codes, torch.empty(out_features, dtype=dtype))
        else:
            groups = in_features // GROUP
            codes = torch.empty(out_features, in_features // 2, dtype=torch.uint8)
            weight = QuantizedWeight(
                scheme, codes, torch.empty(out_features, groups, dtype=dtype), torch.empty(out_features, groups, dtype=dtype)
            )
        return cls(weight, torch.empty(out_features, dtype=dtype) if bias else None, dtype)

    def stored(self) -> QuantizedWeight:
        if self._kernel_weight is not None:
            raise RuntimeError("a packed WeightOnlyLinear no longer holds its stored codes")
        mins = self.mins.detach() if self.mins is not None else None
        return QuantizedWeight(self.scheme, self.qweight.detach(), self.scales.detach(), mins)

    @classmethod
    def stack(cls, parts: list[WeightOnlyLinear]) -> WeightOnlyLinear:
        """One module whose output is the parts' outputs side by side (rows stacked)."""
        ws = [p.stored() for p in parts]
        mins = torch.cat([w.mins for w in ws]) if ws[0].mins is not None else None
        weight = QuantizedWeight(ws[0].scheme, torch.cat([w.qweight for w in ws]), torch.cat([w.scales for w in ws]), mins)
        bias = torch.cat([p.bias.detach() for p in parts]) if parts[0].bias is not None else None
        return cls(weight, bias, parts[0].dtype)

    def pack(self) -> None:
        """Re-lay the codes for the kernel once and drop the stored form (same bytes)."""
        if self._kernel_weight is not None:
            return
        w = self.stored()
        if self.scheme == "int8_wo":
            # Fresh copies: a tensor from a safetensors file can start at any byte, and the int8
            # kernel crashed (SIGSEGV) on such a weight, never on a freshly allocated one.
            self._kernel_weight = w.qweight.clone(memory_format=torch.contiguous_format)
            self._kernel_scales = w.scales.to(self.dtype, copy=True)
        else:
            codes = unpack_int4(w.qweight).to(torch.int32)  # [out, in]
            self._kernel_weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, INNER_K_TILES)
            scales = w.scales.float()
            zeros = w.mins.float() + 8 * scales  # the kernel's w = (q - 8) * s + z
            self._kernel_scales = torch.stack((scales.t(), zeros.t()), dim=-1).to(self.dtype).contiguous()  # [in/G, out, 2]
        self.qweight = self.scales = self.mins = None

    def kernel_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The codes and scales as the kernel reads them (int8_wo: codes [out, in], scales [out])."""
        if self._kernel_weight is None:
            self.pack()
        return self._kernel_weight, self._kernel_scales

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernel_weight is None:
            self.pack()
        flat = x.reshape(-1, self.in_features).contiguous()  # [rows, in]; the kernels read it as dense rows
        if self.scheme == "int8_wo":
            out = torch.ops.aten._weight_int8pack_mm(flat, self._kernel_weight, self._kernel_scales)
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self._kernel_weight, GROUP, self._kernel_scales)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)


# -- whole models ---------------------------------------------------------------------------------


def linear_names(model: nn.Module) -> list[str]:
    """Checkpoint names of the model's Linear layers (the decoder's projections and the LM head)."""
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]


def scheme_of(name: str, quantization: str) -> str:
    """The scheme a Linear is stored in under the spec's ``quantization``: the LM head keeps
    8 bits under int4_wo (as llama.cpp's Q4 files keep it in Q8_0). On the SmolLM2 demo,
    teacher-forced greedy agreement with the float32 target over 384 tokens: 4-bit layers
    with an int8 head 0.974, with a 4-bit head 0.854 (bfloat16 weights throughout: 0.979)."""
    return "int8_wo" if name == "lm_head" else quantization


def quantize_state(
    names: list[str],
    state: dict[str, torch.Tensor],
    quantization: str,
    dtype: torch.dtype,
    exact: dict[str, QuantizedWeight] | None = None,
) -> dict[str, torch.Tensor]:
    """``state`` with each Linear of ``names`` stored weight-only quantized (``scheme_of``;
    ``exact``: codes taken as they are, by name, where their scheme is the Linear's; the
    rest quantized from the float weights). A tied LM head gets its own codes; the embedding
    table stays float (one row a token is read from it). Scales and mins are stored in
    ``dtype``, the engine's: what its kernels read."""
    out = dict(state)
    for name in names:
        weight = out.pop(f"{name}.weight", None)
        if weight is None and name == "lm_head":
            weight = state["model.embed_tokens.weight"]  # tied
        scheme = scheme_of(name, quantization)
        given = (exact or {}).get(name)
        qw = given if given is not None and given.scheme == scheme else quantize(weight, scheme)
        if qw.shape != tuple(weight.shape):
            raise ValueError(f"{name}: quantized shape {qw.shape} != the weight's {tuple(weight.shape)}")
        out.update(qw.cast(dtype).tensors(name))
    return out


CODE_DTYPES = {torch.int8: "int8_wo", torch.uint8: "int4_wo"}  # a stored qweight's dtype says its scheme


def is_quantized(state: dict[str, torch.Tensor]) -> bool:
    """Whether a state dict stores any Linear weight-only quantized."""
    return any(name.endswith(".qweight") for name in state)


def swap_in_weight_only(model: nn.Module, state: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """Replace each Linear that ``state`` stores quantized by an empty WeightOnlyLinear of its
    shape and scheme, so that ``model.load_state_dict(state, strict=True, assign=True)`` fills them."""
    for name in [n[: -len(".qweight")] for n in state if n.endswith(".qweight")]:
        scheme = CODE_DTYPES.get(state[f"{name}.qweight"].dtype)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        dense = getattr(parent, child, None)
        if scheme is None or not isinstance(dense, nn.Linear):
            raise ValueError(f"{name}.qweight is no weight-only code of a Linear of this model")
        with torch.device("meta"):  # shapes only: the state's tensors are assigned
            empty = WeightOnlyLinear.empty(scheme, dense.out_features, dense.in_features, dense.bias is not None, dtype)
        setattr(parent, child, empty)


# -- memory (trtspec check) ---------------------------------------------------------------------


def stored_bytes(scheme: str, out_features: int, in_features: int, dtype_bytes: int) -> int:
    """Bytes one [out, in] Linear's weight takes as ``scheme`` ("none": float, ``dtype_bytes`` a weight)."""
    if scheme == "int8_wo":
        return out_features * in_features + out_features * dtype_bytes
    if scheme == "int4_wo":
        return out_features * in_features // 2 + 2 * out_features * (in_features // GROUP) * dtype_bytes
    return out_features * in_features * dtype_bytes


def linear_shapes(hf_config) -> dict[str, tuple[int, int]]:
    """(out, in) of one layer's Linears (by projection) and of the LM head, from a Llama-family config."""
    hidden, heads = hf_config.hidden_size, hf_config.num_attention_heads
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    inter = hf_config.intermediate_size
    return {
        "q_proj": (heads * head_dim, hidden),
        "k_proj": (kv * head_dim, hidden),
        "v_proj": (kv * head_dim, hidden),
        "o_proj": (hidden, heads * head_dim),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
        "lm_head": (hf_config.vocab_size, hidden),
    }


def bytes_saved(hf_config, quantization: str, dtype_bytes: int) -> int:
    """Weight bytes an engine saves with ``quantization`` against the same engine in float
    (negative would mean it costs more). A tied LM head shares the embedding's float table;
    quantized, it holds codes of its own while the table stays (one row a token is read)."""
    saved = 0
    for name, (out, cols) in linear_shapes(hf_config).items():
        count = 1 if name == "lm_head" else hf_config.num_hidden_layers
        scheme = scheme_of(name, quantization)
        tied = name == "lm_head" and getattr(hf_config, "tie_word_embeddings", False)
        before = 0 if tied else stored_bytes("none", out, cols, dtype_bytes)
        saved += count * (before - stored_bytes(scheme, out, cols, dtype_bytes))
    return saved

"""A Llama-family decoder in plain PyTorch with a static, slot-indexed KV cache.

Why not the transformers model: speculative decoding rewinds the cache after every rejected
draft and batches sequences that each sit at their own length. With a static cache indexed by
(slot, position), rewinding is setting an integer and batching ragged sequences is one masked
attention call (the gpt-fast design). Weights load unchanged from a Hugging Face safetensors
checkpoint (same parameter names), and RoPE variants come from transformers' own tables, so
logits match the transformers implementation (tested).

Supported ``model_type``: llama, mistral, qwen2 (biases are picked up from the checkpoint).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from trtspec.engines.torch.quant import WeightOnlyLinear, is_quantized, swap_in_weight_only
from trtspec.errors import SpecError
from trtspec.spec import MAX_TREE_NODES

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class DecoderConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    sliding_window: int | None

    @classmethod
    def from_hf(cls, hf) -> DecoderConfig:
        window = getattr(hf, "sliding_window", None)
        if hf.model_type == "qwen2" and not getattr(hf, "use_sliding_window", False):
            window = None
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        return cls(
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            sliding_window=window,
        )


def rope_tables(hf_config, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_positions, head_dim] in float32, any RoPE type transformers knows."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(hf_config, "rope_parameters", None) or {"rope_type": "default"}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        init = _default_rope
    else:
        init = ROPE_INIT_FUNCTIONS[rope_type]
    inv_freq, scaling = init(hf_config, torch.device("cpu"))
    pos = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq.float())  # [max_positions, head_dim/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
    return emb.cos() * scaling, emb.sin() * scaling


def _default_rope(hf_config, device):
    params = hf_config.rope_parameters
    dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    base = params["rope_theta"]
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return inv, 1.0


@functools.cache
def _half_signs(dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[-1] * (dim/2) + [1] * (dim/2): rotate_half's signs (a plain tensor, usable under autograd)."""
    with torch.inference_mode(False):
        return torch.cat((-torch.ones(dim // 2), torch.ones(dim - dim // 2))).to(dtype=dtype, device=device)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """cat(-x2, x1) over the last dimension's halves, as a roll and one multiply (bitwise the same:
    negating is exact): 2 ops instead of 5 with their views, 60 times a SmolLM2 decode step."""
    return x.roll(x.shape[-1] // 2, -1) * _half_signs(x.shape[-1], x.dtype, x.device)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One fused kernel instead of seven small ops (61 norms a SmolLM2 step); the same
            # float32 arithmetic (bitwise equal on the inputs tried).
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


# Cache rows past max_seq_len where a draft tree's nodes may sit (they are not a sequence:
# their positions, by depth, stay within max_seq_len): the most nodes a tree verifies, and
# the most a drafter scores while growing one (speculative/tree.py TreeGrowth).
TREE_ROWS = MAX_TREE_NODES


def tree_layout(parents: list[int] | tuple[int, ...]) -> tuple[list[int], torch.Tensor]:
    """Depths and the ancestor mask of a draft tree given by parent indices.

    Node i's parent is ``parents[i]`` (an earlier node, or -1: the token before the tree).
    Depth 1 is a child of that token. The mask [n, n] is True where node i may attend node j:
    j is i or one of its ancestors, so a node sees its own path and no sibling branch. A chain
    (parents -1, 0, 1, ...) gives the causal mask.
    """
    depths: list[int] = []
    mask = torch.zeros((len(parents), len(parents)), dtype=torch.bool)
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"tree node {i}: parent {p} must be -1 or an earlier node (0..{i - 1})")
        depths.append(1 if p < 0 else depths[p] + 1)
        if p >= 0:
            mask[i] = mask[p]
        mask[i, i] = True
    return depths, mask


class KVCache:
    """Static K/V buffers: per layer [slots, kv_heads, max_seq, head_dim].

    A slot's valid length lives outside (in the engine); rewinding is forgetting positions.
    """

    def __init__(self, cfg: DecoderConfig, slots: int, max_seq: int, dtype: torch.dtype):
        shape = (slots, cfg.num_kv_heads, max_seq, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in range(cfg.num_layers)]
        self.slots = slots
        self.max_seq = max_seq


RANGE_ROWS = 2  # rows in ascending slots attend over a view of their slots' range when it is at most this many times the rows


@dataclass
class StepInputs:
    """One batched forward over ragged sequences (right-padded to the longest)."""

    tokens: torch.Tensor  # [b, q] int64
    positions: torch.Tensor  # [b, q] int64; padding rows point at position 0
    slots: torch.Tensor  # [b] int64
    mask: torch.Tensor | None  # [b, 1, q, S] bool, True = may attend; None: attend to all S
    rows: list[tuple[int, int, int]]  # per row: (slot, first position, real tokens)
    span: int  # S: keys attended (max position + 1)
    # One row from position 0 with the plain causal mask (a prompt's first prefill chunk): the
    # attention kernel skips the masked half instead of reading the mask; the same result bit
    # for bit. Set by the engine, which alone knows the mask has no tree and no window.
    causal: bool = False
    # Derived once per step (not per layer), for batches of 2+ rows:
    first_slot: int | None = field(init=False, default=None)  # rows sit in consecutive slots from here
    writes: tuple[torch.Tensor, ...] | None = field(init=False, default=None)  # see __post_init__
    # Rows in ascending slots within a short range (a batch some of whose sequences finished):
    # (first slot, slots in the range, each row's place in it, the mask over the range).
    in_range: tuple[int, int, torch.Tensor, torch.Tensor | None] | None = field(init=False, default=None)

    def __post_init__(self):
        s0 = self.rows[0][0]
        slots = [slot for slot, _, _ in self.rows]
        if all(slot == s0 + i for i, slot in enumerate(slots)):
            self.first_slot = s0  # the K/V to attend is a view of the cache, no gather
        elif all(a < b for a, b in zip(slots, slots[1:])) and slots[-1] - s0 + 1 <= RANGE_ROWS * len(slots):
            self.in_range = self._range(s0, slots[-1] - s0 + 1)
        if len(self.rows) > 1:
            # Where each real token's K/V goes: (slot, position) and where it comes from:
            # (row, token); one scatter per layer instead of one slice copy per row.
            slot_i, pos_i, row_i, tok_i = [], [], [], []
            for r, (slot, start, n) in enumerate(self.rows):
                slot_i += [slot] * n
                pos_i += range(start, start + n)
                row_i += [r] * n
                tok_i += range(n)
            self.writes = tuple(torch.tensor(x, dtype=torch.long) for x in (slot_i, pos_i, row_i, tok_i))

    def _range(self, s0: int, n: int) -> tuple[int, int, torch.Tensor, torch.Tensor | None]:
        """Attention over the cache's slots s0..s0+n-1 as a view, the rows' queries placed among
        them: the slots between the rows are attended too (to key 0 only) and dropped, which
        costs less than gathering every row's keys and values each layer."""
        place = self.slots - s0  # [b]
        mask = None
        if self.mask is not None:
            mask = self.mask.new_zeros((n, *self.mask.shape[1:]))  # [n, 1, q, S]
            mask[..., 0] = True  # a slot between the rows sees key 0 only (no empty row)
            mask[place] = self.mask
        return s0, n, place, mask


class DenseLinear(nn.Linear):
    """nn.Linear run by its own kernel, called directly: ``mm`` (``addmm`` with a bias) on the
    flattened input and the transposed weight, which is what F.linear runs for these shapes, so
    the result is bitwise the same; F.linear on a [b, q, in] input gets there through linear ->
    t -> matmul -> view -> mm, and a SmolLM2 decode step makes 121 such calls."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)  # [rows, in]
        wt = self.weight.t()
        out = torch.mm(flat, wt) if self.bias is None else torch.addmm(self.bias, flat, wt)
        return out.view(*x.shape[:-1], self.out_features)


def _dense(linear: nn.Linear) -> DenseLinear:
    """The same parameters as a DenseLinear (no copy)."""
    with torch.device("meta"):
        dense = DenseLinear(linear.in_features, linear.out_features, bias=linear.bias is not None, dtype=linear.weight.dtype)
    dense.weight = linear.weight
    if linear.bias is not None:
        dense.bias = linear.bias
    return dense


def _fused_linear(parts: list[nn.Linear]) -> nn.Linear:
    """One Linear whose output is the parts' outputs side by side (their weight rows stacked)."""
    if isinstance(parts[0], WeightOnlyLinear):  # quantized: the codes' rows stacked (quant.py)
        return WeightOnlyLinear.stack(parts)
    weight = torch.cat([p.weight.detach() for p in parts])  # [sum(out), in]
    has_bias = parts[0].bias is not None
    with torch.device("meta"):
        fused = nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias, dtype=weight.dtype)
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if has_bias:
        fused.bias = nn.Parameter(torch.cat([p.bias.detach() for p in parts]), requires_grad=False)
    return fused


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, bias: bool, o_bias: bool):
        super().__init__()
        self.cfg = cfg
        h, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv * d, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv * d, bias=bias)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=o_bias)
        self.qkv_proj: nn.Module | None = None  # set by fuse(): q, k and v in one matmul

    def fuse(self) -> None:
        """Replace q/k/v_proj by one qkv_proj (inference only: the checkpoint names are gone)."""
        self.qkv_proj = _fused_linear([self.q_proj, self.k_proj, self.v_proj])
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x, cos, sin, step: StepInputs, k_cache, v_cache):
        b, q, _ = x.shape
        cfg = self.cfg
        h, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        # cos/sin: [b, 1, q, head_dim]
        if self.qkv_proj is not None:
            qkv = self.qkv_proj(x).view(b, q, h + 2 * kv, d).transpose(1, 2)  # [b, h + 2kv, q, d]
            qk = qkv[:, : h + kv]  # queries and keys rotated together: one set of RoPE ops
            qk = qk * cos + _rotate_half(qk) * sin
            xq, xk, xv = qk[:, :h], qk[:, h:], qkv[:, h + kv :]
        else:
            xq = self.q_proj(x).view(b, q, h, d).transpose(1, 2)
            xk = self.k_proj(x).view(b, q, kv, d).transpose(1, 2)
            xv = self.v_proj(x).view(b, q, kv, d).transpose(1, 2)
            xq = xq * cos + _rotate_half(xq) * sin
            xk = xk * cos + _rotate_half(xk) * sin
        # Only the real tokens are written (padding must never clobber another position).
        if step.writes is None:  # one row: its tokens are a contiguous run of positions
            slot, start, n = step.rows[0]
            k_cache[slot, :, start : start + n] = xk[0, :, :n]
            v_cache[slot, :, start : start + n] = xv[0, :, :n]
        else:
            slot_i, pos_i, row_i, tok_i = step.writes  # each [real tokens]
            k_cache[slot_i, :, pos_i] = xk[row_i, :, tok_i]  # [real tokens, kv_heads, head_dim]
            v_cache[slot_i, :, pos_i] = xv[row_i, :, tok_i]
        if step.first_slot is not None:  # consecutive slots (always so for one row): a view
            s0 = step.first_slot
            keys = k_cache[s0 : s0 + b, :, : step.span]  # [b, kv_heads, S, head_dim]
            values = v_cache[s0 : s0 + b, :, : step.span]
        elif step.in_range is not None:  # ascending slots in a short range: a view, queries placed in it
            s0, n, place, mask = step.in_range
            queries = xq.new_zeros((n, *xq.shape[1:]))  # [n, heads, q, head_dim]
            queries[place] = xq
            out = F.scaled_dot_product_attention(
                queries,
                k_cache[s0 : s0 + n, :, : step.span],
                v_cache[s0 : s0 + n, :, : step.span],
                attn_mask=mask,
                enable_gqa=cfg.num_heads != cfg.num_kv_heads,
            )[place]  # [b, heads, q, head_dim]
            return self.o_proj(out.transpose(1, 2).reshape(b, q, cfg.num_heads * cfg.head_dim))
        else:
            keys = k_cache[:, :, : step.span].index_select(0, step.slots)  # [b, kv_heads, S, head_dim]
            values = v_cache[:, :, : step.span].index_select(0, step.slots)
        out = F.scaled_dot_product_attention(
            xq,
            keys,
            values,
            attn_mask=None if step.causal else step.mask,
            is_causal=step.causal,
            enable_gqa=cfg.num_heads != cfg.num_kv_heads,
        )  # [b, heads, q, head_dim]
        return self.o_proj(out.transpose(1, 2).reshape(b, q, cfg.num_heads * cfg.head_dim))


PACKABLE = (torch.float32, torch.bfloat16)  # weight dtypes OneDnnLinear can hold

# The row counts a packed Linear's matmuls come in. oneDNN's primitive cache and PyTorch's
# ideep cache keep an entry per matmul shape (each bounded at 256 in a served deployment:
# CACHE_ENV, triton/server/install.py), so if every new prefill length were a new shape the
# two caches would keep filling for as long as new lengths come (the demo target's memory
# rose for the whole of a 10-minute soak). Up to EXACT_ROWS rows (decode steps, small
# verify steps) a matmul runs the rows it is given; a larger input is padded with zero rows
# to the next of four sizes per doubling (20, 24, 28, 32, 40, 48, ..., 224, 256: under a fifth
# of the rows run are padding) and run ROW_BLOCK rows at most a matmul, so a Linear meets at
# most 32 row counts whatever the prompt lengths and batch sizes (160 for a model's 5 packed
# weight shapes). A row's result does not depend on the rows beside it (matmul rows are
# independent; on the CPUs tried the values are bitwise the same, tested), so no token changes.
EXACT_ROWS = 16
ROW_BLOCK = 256
FIXED_ROWS_ENV = "TRTSPEC_FIXED_ROWS"  # "0": every packed matmul on the rows it is given


def fixed_rows_setting(value: str | None = None) -> bool:
    """``TRTSPEC_FIXED_ROWS`` (default 1): whether packed Linears run in the fixed row counts."""
    value = os.environ.get(FIXED_ROWS_ENV, "1") if value is None else value
    if value.strip() not in ("0", "1"):
        raise SpecError(f"{FIXED_ROWS_ENV}={value!r}: give 1 (matmuls in fixed row counts) or 0 (on the rows as given)")
    return value.strip() == "1"


def padded_rows(rows: int) -> int:
    """The row count a matmul of ``rows`` rows (at most ROW_BLOCK) runs."""
    if rows <= EXACT_ROWS:
        return rows
    step = 1 << ((rows - 1).bit_length() - 3)  # a quarter of the power of two below
    return -(-rows // step) * step


def row_blocks(rows: int) -> list[int]:
    """The row counts of the matmuls a packed Linear runs for an input of ``rows`` rows."""
    full, rest = divmod(rows, ROW_BLOCK)
    return [ROW_BLOCK] * full + ([padded_rows(rest)] if rest else [])


def row_counts(most: int) -> list[int]:
    """Every row count a packed Linear's matmuls run for inputs of 1..``most`` rows (ascending)."""
    return sorted({padded_rows(n) for n in range(1, min(most, ROW_BLOCK) + 1)})


class OneDnnLinear(nn.Module):
    """A Linear whose weight is reordered once into oneDNN's blocked layout (see
    DecoderLM.pack_linears_for_onednn) and run by oneDNN's matmul (_linear_pointwise) on the
    dense activations: no per-call conversion of the input or the output.

    The reorder is made without a batch-size hint: on a 2-core AVX-512 EPYC (one thread, all
    of SmolLM2's Linears, weights from memory) that layout ran 1 row in 17.0 ms, 4 rows in
    19.1 and 16 in 35.7, against 24.7 / 38.1 / 51.7 ms for one reordered for 1 row and
    32.6 / 56.3 / 87.4 ms for PyTorch's dense kernel. The former float32 form (an mkldnn
    tensor through mkldnn_linear) converted the input and the output on every call.
    bfloat16 weights go to oneDNN's bf16 matmul (AMX / avx512_bf16 where the CPU has them);
    PyTorch's dense bf16 Linear converts instead, and was slower than float32 on such a CPU
    (576x1536, batch 1: 87 vs 49 us; reordered bf16: 35 us).

    Inputs run in the fixed row counts of ``row_blocks`` (``fixed_rows``; False: as given)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach()
        # plain attributes: an opaque packed tensor, not a parameter
        self.weight = torch.ops.mkldnn._reorder_linear_weight(w.contiguous())
        self.bias = linear.bias.detach() if linear.bias is not None else None
        self.in_features, self.out_features, self.dtype = w.shape[1], w.shape[0], w.dtype
        self.fixed_rows = fixed_rows_setting()  # DecoderLM.fix_matmul_rows

    def _matmul(self, flat: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(flat, self.weight, self.bias, "none", [], "")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [rows, in]
        rows = flat.shape[0]
        blocks = row_blocks(rows) if self.fixed_rows else [rows]
        if blocks == [rows]:
            out = self._matmul(flat.contiguous())
        else:
            padded = flat.new_zeros((sum(blocks), flat.shape[1]))  # [sum(blocks), in]
            padded[:rows] = flat
            parts = [self._matmul(part) for part in padded.split(ROW_BLOCK)]  # each [block, out]
            out = (parts[0] if len(parts) == 1 else torch.cat(parts))[:rows]
        return out.view(*x.shape[:-1], self.out_features)


class ByRows(nn.Module):
    """One Linear in two forms: ``one`` runs inputs of fewer than ``threshold`` rows (a decode
    step, a short verify step, a small batch), ``many`` larger ones (a long verify step, a
    prefill, a large batch). The kernel choice keeps both where the fastest form differs by
    shape (kernels.py); both hold the same weights."""

    def __init__(self, one: nn.Module, many: nn.Module, threshold: int = 2):
        super().__init__()
        self.one, self.many, self.threshold = one, many, threshold

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.one(x) if x.numel() < self.threshold * x.shape[-1] else self.many(x)


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig, bias: bool):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=bias)
        self.gate_up_proj: nn.Module | None = None  # set by fuse(): gate and up in one matmul

    def fuse(self) -> None:
        """Replace gate/up_proj by one gate_up_proj (inference only)."""
        self.gate_up_proj = _fused_linear([self.gate_proj, self.up_proj])
        del self.gate_proj, self.up_proj

    def forward(self, x):
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, qkv_bias: bool, o_bias: bool, mlp_bias: bool):
        super().__init__()
        self.self_attn = Attention(cfg, qkv_bias, o_bias)
        self.mlp = MLP(cfg, mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, step, k_cache, v_cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, step, k_cache, v_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Body(nn.Module):
    def __init__(self, cfg: DecoderConfig, qkv_bias: bool, o_bias: bool, mlp_bias: bool):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, qkv_bias, o_bias, mlp_bias) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DecoderLM(nn.Module):
    """Parameter names mirror transformers' *ForCausalLM so checkpoints load as they are."""

    def __init__(self, cfg: DecoderConfig, qkv_bias=False, o_bias=False, mlp_bias=False):
        super().__init__()
        self.cfg = cfg
        self.model = _Body(cfg, qkv_bias, o_bias, mlp_bias)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @classmethod
    def from_state_dict(cls, cfg: DecoderConfig, state: dict[str, torch.Tensor]) -> DecoderLM:
        """Build without initialising weights, then adopt the checkpoint's tensors."""
        qkv_bias = "model.layers.0.self_attn.q_proj.bias" in state
        o_bias = "model.layers.0.self_attn.o_proj.bias" in state
        mlp_bias = "model.layers.0.mlp.gate_proj.bias" in state
        with torch.device("meta"):
            model = cls(cfg, qkv_bias, o_bias, mlp_bias)
        state = dict(state)
        if is_quantized(state):  # weight-only quantized Linears (quant.py), activations in the embedding's dtype
            swap_in_weight_only(model, state, state["model.embed_tokens.weight"].dtype)
        if "lm_head.weight" not in state and "lm_head.qweight" not in state:
            if not cfg.tie_word_embeddings:
                raise KeyError("lm_head.weight")
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        model.load_state_dict(state, strict=True, assign=True)
        return model.eval()

    def fuse_projections(self) -> None:
        """One matmul for each layer's q, k and v, and one for its gate and up projections
        (the same weights, rows stacked): 4 Linear calls a layer instead of 7, each a larger
        matrix-vector product. Called at load, before the kernel choice; the EAGLE-3 head and
        training keep the separate projections."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        for module in list(self.modules()):
            for name, child in list(module.named_children()):
                if type(child) is nn.Linear:
                    setattr(module, name, _dense(child))

    def pack_linears_for_onednn(self, head_only: bool = False) -> bool:
        """Re-lay every float32 or bfloat16 Linear's weight (``head_only``: the LM head's) in
        oneDNN's blocked format.

        Measured on the demo target (SmolLM2-135M, 2-core AVX-512 EPYC): one decode step
        38 -> 31 ms, a 6-token verify forward 62 -> 40 ms; on a CPU without native bf16 the
        bfloat16 draft was slower packed (23 -> 29 ms), on one with AMX faster. Whether it is
        faster depends on the CPU: engines/torch/kernels.py measures and decides at load.
        Returns whether it packed anything.
        """
        if not torch.backends.mkldnn.is_available() or self.lm_head.weight.dtype not in PACKABLE:
            return False
        if head_only:
            self.lm_head = OneDnnLinear(self.lm_head)
            return True
        for module in list(self.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(module, name, OneDnnLinear(child))
        return True

    def fix_matmul_rows(self, fixed: bool = True) -> None:
        """Run the packed Linears' matmuls in the fixed row counts of ``row_blocks`` (the
        default) or each input as it comes (``False``: to measure what the fixed counts cost)."""
        for module in self.modules():
            if isinstance(module, OneDnnLinear):
                module.fixed_rows = fixed

    def _packed_row_ranges(self, rows: int, head_rows: int) -> dict[tuple, tuple[OneDnnLinear, int, int]]:
        """One packed Linear per matmul shape (in, out, bias, dtype) with the least and most rows
        its matmuls can be given: a ByRows split gives its ``many`` form ``threshold`` rows and up,
        its ``one`` form fewer; the LM head gets at most ``head_rows``, every other Linear ``rows``."""
        bounds: dict[int, tuple[int, int]] = {}
        for module in self.modules():
            if isinstance(module, ByRows):
                bounds[id(module.many)], bounds[id(module.one)] = (module.threshold, rows), (1, module.threshold - 1)
        heads = {id(m) for m in self.lm_head.modules()}
        out: dict[tuple, tuple[OneDnnLinear, int, int]] = {}
        for module in self.modules():
            if isinstance(module, OneDnnLinear) and module.fixed_rows:
                low, high = bounds.get(id(module), (1, rows))
                high = min(high, head_rows) if id(module) in heads else high
                key = (module.in_features, module.out_features, module.bias is not None, module.dtype, id(module) in heads)
                a, lo, hi = out.get(key, (module, low, high))
                out[key] = (a, min(lo, low), max(hi, high))
        return out

    @torch.inference_mode()
    def warm_matmuls(self, rows: int, head_rows: int) -> int:
        """Run every packed matmul shape once in each row count a forward can give it (at most
        ``rows`` rows a forward, ``head_rows`` through the LM head), at the thread count set now.

        Why: oneDNN's primitive cache and ideep's keep an entry per matmul shape and thread
        count, so a served engine whose thread governor tries another count now and then kept
        adding entries for as long as it served (the demo target grew +33 MiB over a 10-minute
        soak, still rising; operations.md: memory). Made at load, the whole bounded set is there
        before the first request. Returns the matmuls run."""
        run = 0
        for module, low, high in self._packed_row_ranges(rows, head_rows).values():
            for count in row_counts(high):
                if count >= low:
                    module(torch.zeros((count, module.in_features), dtype=module.dtype))
                    run += 1
        return run

    @torch.inference_mode()
    def hidden_states(
        self,
        step: StepInputs,
        cos_table,
        sin_table,
        cache: KVCache,
        capture: tuple[int, ...] = (),
        captured: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Final-norm hidden states [b, q, hidden] for the step's tokens; fills the cache.

        ``capture``: layer ids whose outputs (the residual stream after that layer, before the
        final norm: what an EAGLE-3 head reads) are appended to ``captured``, each [b, q, hidden].
        """
        x = self.model.embed_tokens(step.tokens)
        dtype = x.dtype
        cos = cos_table[step.positions].to(dtype).unsqueeze(1)  # [b, 1, q, head_dim]
        sin = sin_table[step.positions].to(dtype).unsqueeze(1)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, step, cache.k[i], cache.v[i])
            if i in capture and captured is not None:
                captured.append(x)
        return self.model.norm(x)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

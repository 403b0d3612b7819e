"""An EAGLE-3 head in PyTorch, and the engine that runs it next to a torch target.

The head is one Llama decoder layer whose attention reads [token embedding; state] (2 x hidden):
``state`` is the target's fused features (``fc`` over the outputs of a low, a middle and a high
target layer) at the first draft step and the head's own previous output after that. It shares
the target's token embeddings (no copy) and predicts over a reduced draft vocabulary that
``d2t`` maps back to target ids. Parameter names are those of the checkpoint
(engines/eagle3_checkpoint.py), so a head folder loads as it is.

The optional EAGLE-3.1 norms a head's config may set (eagle3_checkpoint.py): ``fuse`` applies
norm_before_fc / fc_norm to the features before ``fc``, MidLayer.finish takes the hidden-normed
state as its residual under norm_before_residual, and ``feed_back`` gives the next draft step
norm(output) under norm_output. A head that sets none runs exactly the plain EAGLE-3 layer.

HeadEngine keeps the head's own static KV cache per slot, indexed by position like the
target's: a rejected draft is undone by rewinding an integer. On a CPU it runs its own copy of
the head with its Linears on the kernel layout this machine runs fastest (engines/torch/kernels.py,
measured once per machine and head shape): a head step is c of the speed-up bound, and
PyTorch's dense kernel reads the head's ~40 MB of weights slower than oneDNN's layout does on
the CPU measured (lab/RECORDS.md#the-demos-co-designed-pair-quiet).
"""

from __future__ import annotations

import copy
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from trtspec.device import check_dtype, uses_cpu_kernels
from trtspec.engines.eagle3_checkpoint import HeadConfig, read_head_config
from trtspec.engines.manifest import read_manifest
from trtspec.engines.torch import kernels
from trtspec.engines.torch.engine import DTYPES, WEIGHTS, SlotPool, TorchEngine
from trtspec.engines.torch.model import MLP, TREE_ROWS, Attention, DecoderConfig, KVCache, RMSNorm, StepInputs, rope_tables
from trtspec.errors import EngineError


def decoder_config(cfg: HeadConfig) -> DecoderConfig:
    """The head's layer as a DecoderConfig (for the shared Attention, MLP and KV cache)."""
    return DecoderConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_layers=1,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=False,
        sliding_window=None,
    )


class MidLayer(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.norm_before_residual = cfg.norm_before_residual
        dc = decoder_config(cfg)
        h, d = cfg.hidden_size, cfg.head_dim
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = Attention(dc, bias=False, o_bias=False)
        # The attention input is [embeds; state]: twice the hidden size.
        self.self_attn.q_proj = nn.Linear(2 * h, cfg.num_heads * d, bias=False)
        self.self_attn.k_proj = nn.Linear(2 * h, cfg.num_kv_heads * d, bias=False)
        self.self_attn.v_proj = nn.Linear(2 * h, cfg.num_kv_heads * d, bias=False)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = MLP(dc, bias=False)

    def attention_input(self, state: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """[b, q, 2*hidden] from the state and token embeddings, each [b, q, hidden]."""
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(state)], dim=-1)

    def finish(self, attn_out: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """The layer's output (before the final norm) from the attention output."""
        # The residual is the state, not the embeddings (hidden-normed under norm_before_residual).
        h = attn_out + (self.hidden_norm(state) if self.norm_before_residual else state)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward(self, state, embeds, cos, sin, step: StepInputs, k_cache, v_cache):
        x = self.attention_input(state, embeds)
        return self.finish(self.self_attn(x, cos, sin, step, k_cache, v_cache), state)


class Eagle3Head(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.cfg = cfg
        width = cfg.n_features * cfg.target_hidden_size
        if cfg.norm_before_fc:  # created only when set: a plain head's state dict is unchanged
            self.input_norm = RMSNorm(width, cfg.rms_norm_eps)
        if cfg.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in range(cfg.n_features))
        self.fc = nn.Linear(width, cfg.hidden_size, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        # draft id -> target id offset; all zeros when the draft vocabulary is the target's.
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))

    @classmethod
    def from_state_dict(cls, cfg: HeadConfig, state: dict[str, torch.Tensor]) -> Eagle3Head:
        with torch.device("meta"):
            head = cls(cfg)
        state = dict(state)
        state["d2t"] = state["d2t"].long() if "d2t" in state else torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
        head.load_state_dict(state, strict=True, assign=True)
        return head.eval()

    def state_for_checkpoint(self) -> dict[str, torch.Tensor]:
        """Tensors under the loaders' names (d2t only when the vocabulary is reduced)."""
        state = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        if self.cfg.draft_vocab_size == self.cfg.vocab_size:
            state.pop("d2t")
        return state

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The first-step state [..., hidden] from target features [..., n_layers * target_hidden]."""
        if self.cfg.norm_before_fc:
            features = self.input_norm(features)
        if self.cfg.fc_norm:
            parts = features.chunk(self.cfg.n_features, dim=-1)
            features = torch.cat([norm(x) for norm, x in zip(self.fc_norm, parts)], dim=-1)
        return self.fc(features)

    def feed_back(self, out: torch.Tensor) -> torch.Tensor:
        """The next draft step's state from the layer output [..., hidden]: the output itself,
        or under norm_output the normed output the LM head reads."""
        return self.norm(out) if self.cfg.norm_output else out

    def draft_logits(self, out: torch.Tensor) -> torch.Tensor:
        """[..., draft_vocab] from the layer output [..., hidden]."""
        return self.lm_head(self.norm(out))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]


HEAD_STEP_SIZES = (1, 2)  # tokens of the head steps timed: a draft step; the step after a verify that kept a draft


def choose_head_kernels(
    head: Eagle3Head, embed: nn.Embedding, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype, cache_dir: Path | None = None
) -> kernels.KernelChoice:
    """Put ``head``'s Linears on this machine's fastest layout for a head of its shape
    (kernels.choose_layout). Its q/k/v stay apart: distill's scoring path reads them by name."""
    cfg = head.cfg
    shape = {
        "model": "eagle3-head",
        "shape": f"{cfg.hidden_size}x{cfg.intermediate_size}x{cfg.n_features}x{cfg.target_hidden_size}"
        f"x{cfg.draft_vocab_size}/{cfg.num_heads}/{cfg.num_kv_heads}/{cfg.head_dim}",
        "dtype": str(dtype),
        "sizes": ",".join(map(str, HEAD_STEP_SIZES)),
    }
    key = json.dumps(json.loads(kernels.machine_key()) | shape, sort_keys=True)
    return kernels.choose_layout(
        head,
        key,
        HEAD_STEP_SIZES,
        lambda: head_step_timer(head, embed, cos, sin, dtype, HEAD_STEP_SIZES),
        kernels.apply_layout,
        cache_dir,
    )


def head_step_timer(
    head: Eagle3Head, embed: nn.Embedding, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype, sizes: tuple[int, ...]
) -> Callable[[], list[float]]:
    """A function that times one head step of each of ``sizes`` tokens (seconds each): ``fc``
    over that many positions' target features, the layer at position kernels.PREFILL of a
    private one-slot cache, and the draft LM head over the last position, as a draft step runs."""
    start = max(0, min(kernels.PREFILL, cos.shape[0] - max(sizes)))
    cache = KVCache(decoder_config(head.cfg), 1, start + max(sizes) + 1, dtype)
    features = torch.zeros(max(sizes), head.cfg.n_features * head.cfg.target_hidden_size, dtype=dtype)
    steps = [kernels.timing_step(n, start, embed.num_embeddings) for n in sizes]

    @torch.inference_mode()
    def run(step: StepInputs) -> float:
        t = time.perf_counter()
        n = step.rows[0][2]
        state = head.fuse(features[:n]).unsqueeze(0)  # [1, n, hidden]
        embeds = embed(step.tokens).to(dtype)
        c, s = cos[step.positions].to(dtype).unsqueeze(1), sin[step.positions].to(dtype).unsqueeze(1)
        out = head.midlayer(state, embeds, c, s, step, cache.k[0], cache.v[0])
        int(torch.argmax(head.draft_logits(out[0, -1:]).float()))
        return time.perf_counter() - t

    return lambda: [run(step) for step in steps]


@dataclass
class HeadRow:
    """One sequence's positions start..start+n-1 for the head: state [n, hidden] and the
    tokens whose embeddings go with them (the token AFTER each position).

    A draft tree's nodes (speculative/eagle3_drafter.py) sit in cache rows start..start+n-1 but at
    positions by depth (``positions``), each seeing only some rows (``visible`` [n, start+n]:
    the context's and its own ancestors'); None for both: causal, positions = rows.
    """

    slot: int
    start: int
    state: torch.Tensor  # [n, hidden]
    tokens: list[int]
    positions: list[int] | None = None
    visible: torch.Tensor | None = None  # [n, start + n] bool


class HeadEngine:
    """A head next to its target: the target's token embeddings and RoPE tables (shared in
    process, loaded alone inside the Triton orchestrator), and the head's own KV cache
    (``slots`` x max_seq_len positions)."""

    def __init__(
        self,
        head: Eagle3Head,
        embed: nn.Embedding,
        cos: torch.Tensor,
        sin: torch.Tensor,
        max_seq_len: int,
        dtype: torch.dtype,
        slots: int,
    ):
        self.cfg = head.cfg
        self.dtype = dtype
        # The head's device is its weights' (in process: the target's, see load); inputs,
        # K/V and states are made there, draft ids come back as Python ints.
        self.device = head.fc.weight.device
        self.embed = embed
        self.cos, self.sin = cos, sin  # [max_seq_len, head_dim]
        self.kernels: kernels.KernelChoice | None = None  # how the head's Linears run (CPU only)
        if uses_cpu_kernels(self.device):
            head = copy.deepcopy(head)  # the caller's head (a trainer's, say) keeps its nn.Linear weights
            self.kernels = choose_head_kernels(head, embed, cos, sin, dtype)
        self.head = head
        self.max_seq_len = max_seq_len
        with self.device:
            self.cache = KVCache(decoder_config(self.cfg), slots, max_seq_len + TREE_ROWS, dtype)  # room for a tree's nodes
        self.pool = SlotPool(slots)  # per slot: the context whose positions 0..len-2 are valid
        self.lock = threading.Lock()

    @staticmethod
    def _head(folder: Path, target_layers: int, target_hidden: int, target_vocab: int) -> tuple[Eagle3Head, torch.dtype]:
        folder = Path(folder)
        manifest = read_manifest(folder)
        cfg = read_head_config(folder, target_layers)
        if cfg.target_hidden_size != target_hidden or cfg.vocab_size != target_vocab:
            raise EngineError(f"{folder}: this head was made for another target; rebuild the spec")
        return Eagle3Head.from_state_dict(cfg, load_file(str(folder / WEIGHTS))), DTYPES[manifest.dtype]

    @classmethod
    def load(cls, folder: Path, target: TorchEngine, slots: int | None = None) -> HeadEngine:
        """In process: share the loaded target's embeddings and RoPE tables, on its device."""
        c = target.config
        head, dtype = cls._head(folder, c.num_layers, c.hidden_size, target.vocab_size)
        check_dtype(target.device, read_manifest(Path(folder)).dtype, f"{folder} (EAGLE-3 head)")
        head = head.to(target.device)
        return cls(
            head,
            target.model.model.embed_tokens,
            target.cos,
            target.sin,
            target.max_seq_len,
            dtype,
            slots or target.max_batch_size,
        )

    @classmethod
    def load_beside(cls, folder: Path, target_folder: Path, slots: int) -> HeadEngine:
        """Without the target in this process: read only its embedding table and config."""
        from safetensors import safe_open
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(target_folder)
        target_manifest = read_manifest(Path(target_folder))
        head, dtype = cls._head(folder, hf.num_hidden_layers, hf.hidden_size, hf.vocab_size)
        with safe_open(str(Path(target_folder) / WEIGHTS), framework="pt") as st:
            table = st.get_tensor("model.embed_tokens.weight")
        embed = nn.Embedding.from_pretrained(table, freeze=True)
        max_seq = target_manifest.limits["max_seq_len"]
        cos, sin = rope_tables(hf, max_seq)
        return cls(head, embed, cos, sin, max_seq, dtype, slots)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The first-step state [n, hidden] from target features [n, n_layers * target_hidden]."""
        with torch.inference_mode():
            return self.head.fuse(features.to(self.device, self.dtype))

    @torch.inference_mode()
    def extend(self, rows: list[HeadRow]) -> list[torch.Tensor]:
        """Run the head over each row's positions (batched, ragged); the layer outputs
        [n, hidden] per row (a later step's state is ``head.feed_back`` of one). Writes the
        head's K/V at those positions."""
        b = len(rows)
        q = max(len(r.tokens) for r in rows)
        h = self.cfg.hidden_size
        state = torch.zeros((b, q, h), dtype=self.dtype, device=self.device)
        tokens = torch.zeros((b, q), dtype=torch.long)
        positions = torch.zeros((b, q), dtype=torch.long)
        for i, r in enumerate(rows):
            n = len(r.tokens)
            state[i, :n] = r.state.to(self.device, self.dtype)
            tokens[i, :n] = torch.tensor(r.tokens, dtype=torch.long)
            positions[i, :n] = torch.arange(r.start, r.start + n) if r.positions is None else torch.tensor(r.positions)
        tokens, positions = tokens.to(self.device), positions.to(self.device)  # filled on the CPU, copied once
        spans = [(r.slot, r.start, len(r.tokens)) for r in rows]
        span = max(s + n for _, s, n in spans)
        mask = None
        if b > 1 or q > 1 or any(r.visible is not None for r in rows):
            keys = torch.arange(span, device=self.device)
            allowed = keys.view(1, 1, span) <= positions.unsqueeze(-1)  # [b, q, S]
            for i, r in enumerate(rows):
                if r.visible is not None:  # a tree's nodes: the rows they may see, as given
                    n = len(r.tokens)
                    allowed[i, :n] = False
                    allowed[i, :n, : r.start + n] = r.visible.to(self.device)
            mask = allowed.unsqueeze(1)  # [b, 1, q, S]
        step = StepInputs(
            tokens=tokens,
            positions=positions,
            slots=torch.tensor([r.slot for r in rows], dtype=torch.long, device=self.device),
            mask=mask,
            rows=spans,
            span=span,
        )
        embeds = self.embed(tokens).to(self.dtype)  # [b, q, hidden]
        cos = self.cos[positions].to(self.dtype).unsqueeze(1)  # [b, 1, q, head_dim]
        sin = self.sin[positions].to(self.dtype).unsqueeze(1)
        out = self.head.midlayer(state, embeds, cos, sin, step, self.cache.k[0], self.cache.v[0])
        return [out[i, : len(r.tokens)] for i, r in enumerate(rows)]  # each [n, hidden]

    @torch.inference_mode()
    def next_ids(self, outs: torch.Tensor) -> list[int]:
        """Greedy target ids from layer outputs [b, hidden] (argmax over the draft vocabulary)."""
        draft = torch.argmax(self.head.draft_logits(outs).float(), dim=-1)  # [b]
        return self.head.to_target_ids(draft).tolist()

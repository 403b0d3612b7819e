"""The EAGLE-3 head checkpoint: the folder layout TensorRT-LLM, vLLM and SGLang load, and the
check that a head was made for the target it is paired with.

A head folder is a Hugging Face folder: ``config.json`` (Llama keys for ONE decoder layer, plus
``draft_vocab_size``, ``target_hidden_size`` and the target layers it reads) and safetensors
with these names (as the loaders read them; docs/codesign.md, "The head"):

    fc.weight                       [hidden, n_layers * target_hidden]   fuses the target's features
    midlayer.hidden_norm.weight     [hidden]                             norm of the fused/fed-back state
    midlayer.input_layernorm.weight [hidden]                             norm of the token embedding
    midlayer.self_attn.{q,k,v}_proj.weight  [heads*head_dim, 2*hidden]   attention reads [embeds; state]
    midlayer.self_attn.o_proj.weight        [hidden, heads*head_dim]
    midlayer.post_attention_layernorm.weight, midlayer.mlp.{gate,up,down}_proj.weight
    norm.weight                     [hidden]
    lm_head.weight                  [draft_vocab, hidden]                the reduced draft vocabulary
    d2t                             [draft_vocab] int64                  target id = draft id + d2t[id]
                                                                        (only when draft_vocab < vocab)

Optional norms (EAGLE-3.1, as speculators writes them and vLLM's llama_eagle3.py reads them:
config.json keys, all false unless set; trtspec's own heads set none):

    norm_before_fc        input_norm.weight [n_layers * target_hidden]: one RMSNorm over the
                          concatenated target features before fc
    fc_norm               fc_norm.{i}.weight [target_hidden] per feature layer: an RMSNorm of each
                          feature layer before the concatenation (excludes norm_before_fc)
    norm_before_residual  the layer's residual is the hidden-normed state, not the raw state
    norm_output           the state fed back to the next draft step is norm(output) (the same
                          normed output the LM head reads), not the raw layer output

Layer ids: trtspec counts a feature as the OUTPUT of target layer i (TensorRT-LLM's
``eagle3_layers_to_capture``, default {1, L//2-1, L-4}); vLLM's
``eagle_aux_hidden_state_layer_ids`` counts the INPUT of layer i, so the config records i + 1
there (vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py@0cfdd2e1).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from trtspec.errors import CheckpointError

HEAD_ARCHITECTURE = "LlamaForCausalLMEagle3"  # SGLang's EntryClass; the usual value in EAGLE-3 heads
HEAD_FORMAT = 1


def default_layer_ids(num_layers: int) -> tuple[int, ...]:
    """TensorRT-LLM's default capture layers {1, L//2-1, L-4}; every layer for tiny targets."""
    if num_layers >= 6:
        return (1, num_layers // 2 - 1, num_layers - 4)
    return tuple(range(min(num_layers, 3)))


def distill_layer_ids(num_layers: int) -> tuple[int, ...]:
    """The layers ``trtspec distill`` reads: {1, L//2-1, L-2}.

    The high feature is the output of layer L-2 (= the input of the last layer), not
    TensorRT-LLM's default L-4: a head that reads it can start as a copy of the target's last
    layer and predict exactly what the target does (distill/heads.py), instead of relearning
    layers L-3..L-1 from a few thousand sequences. L-1's own output is the latest layer, but
    vLLM names features by the INPUT of a layer (``eagle_aux_hidden_state_layer_ids`` = i + 1),
    and L-1's output is the input of the final norm, not of a layer: L-2 is the latest choice
    all three loaders can name. Tiny targets (< 6 layers) keep every layer.
    """
    if num_layers >= 6:
        return (1, num_layers // 2 - 1, num_layers - 2)
    return default_layer_ids(num_layers)


@dataclass(frozen=True)
class HeadConfig:
    """What the runtime needs from a head's config.json."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int  # the target's vocabulary (embedding rows)
    draft_vocab_size: int
    target_hidden_size: int
    layer_ids: tuple[int, ...]  # target layers whose outputs the head reads, ascending
    target_num_layers: int | None  # recorded by trtspec; None for third-party heads
    raw: dict  # the whole config.json
    norm_before_fc: bool = False  # the optional norms (module docstring)
    fc_norm: bool = False
    norm_before_residual: bool = False
    norm_output: bool = False

    @property
    def n_features(self) -> int:
        return len(self.layer_ids)

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor a head must hold, with its shape."""
        h, hd = self.hidden_size, self.head_dim
        shapes = {
            "fc.weight": (h, self.n_features * self.target_hidden_size),
            "midlayer.hidden_norm.weight": (h,),
            "midlayer.input_layernorm.weight": (h,),
            "midlayer.self_attn.q_proj.weight": (self.num_heads * hd, 2 * h),
            "midlayer.self_attn.k_proj.weight": (self.num_kv_heads * hd, 2 * h),
            "midlayer.self_attn.v_proj.weight": (self.num_kv_heads * hd, 2 * h),
            "midlayer.self_attn.o_proj.weight": (h, self.num_heads * hd),
            "midlayer.post_attention_layernorm.weight": (h,),
            "midlayer.mlp.gate_proj.weight": (self.intermediate_size, h),
            "midlayer.mlp.up_proj.weight": (self.intermediate_size, h),
            "midlayer.mlp.down_proj.weight": (h, self.intermediate_size),
            "norm.weight": (h,),
            "lm_head.weight": (self.draft_vocab_size, h),
        }
        if self.draft_vocab_size != self.vocab_size:
            shapes["d2t"] = (self.draft_vocab_size,)
        return shapes | self.norm_shapes()

    def norm_shapes(self) -> dict[str, tuple[int, ...]]:
        """The optional norms' tensors this config asks for, with their shapes."""
        return {k: v for k, (v, flag) in _norm_tensors(self).items() if getattr(self, flag)}


NORM_FLAGS = ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output")


def _norm_tensors(cfg: HeadConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every optional norm tensor a head of this shape can hold: its shape and the flag it needs."""
    out = {"input_norm.weight": ((cfg.n_features * cfg.target_hidden_size,), "norm_before_fc")}
    out |= {f"fc_norm.{i}.weight": ((cfg.target_hidden_size,), "fc_norm") for i in range(cfg.n_features)}
    return out


def head_config_dict(target_hf, layer_ids: tuple[int, ...], draft_vocab_size: int, extra: dict | None = None) -> dict:
    """config.json of a new head for ``target_hf`` (a transformers config of the target)."""
    heads = target_hf.num_attention_heads
    head_dim = getattr(target_hf, "head_dim", None) or target_hf.hidden_size // heads
    rope = getattr(target_hf, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0}
    ids = [int(i) for i in layer_ids]
    return {
        "architectures": [HEAD_ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": target_hf.hidden_size,
        "intermediate_size": target_hf.intermediate_size,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(target_hf, "num_key_value_heads", None) or heads,
        "head_dim": head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": target_hf.rms_norm_eps,
        "max_position_embeddings": getattr(target_hf, "max_position_embeddings", 2048),
        "rope_parameters": dict(rope),
        "rope_theta": rope.get("rope_theta", 10000.0),
        "vocab_size": target_hf.vocab_size,
        "draft_vocab_size": draft_vocab_size,
        "target_hidden_size": target_hf.hidden_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": getattr(target_hf, "bos_token_id", None),
        "eos_token_id": getattr(target_hf, "eos_token_id", None),
        # vLLM reads the INPUT of layer i: output of layer i-1.
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in ids],
        # SGLang reads its aux-layer ids from eagle_config (which convention: unverified here).
        "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": [i + 1 for i in ids]},
        "trtspec": {
            "format": HEAD_FORMAT,
            "target_layer_ids": ids,
            "target_num_layers": target_hf.num_hidden_layers,
            "target_model_type": target_hf.model_type,
            **(extra or {}),
        },
    }


def is_head_folder(folder: Path) -> bool:
    """Whether config.json names an EAGLE-3 head architecture."""
    try:
        cfg = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    archs = cfg.get("architectures") or []
    return any("eagle3" in str(a).lower() for a in archs)


def read_head_config(folder: Path, target_num_layers: int, role: str = "draft") -> HeadConfig:
    """Parse a head's config.json; CheckpointError names what is missing or malformed."""
    path = Path(folder) / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise CheckpointError(f"{role}: cannot read {path} ({e.strerror}); point draft at an EAGLE-3 head folder") from e
    except ValueError as e:
        raise CheckpointError(f"{role}: {path} is not valid JSON ({e}); re-export the head") from e
    if not is_head_folder(folder):
        raise CheckpointError(
            f"{role}: {folder} is not an EAGLE-3 head (config.json architectures "
            f"{raw.get('architectures')}; expected {HEAD_ARCHITECTURE}); method eagle3 needs a "
            "head folder (train one with `trtspec distill SPEC`)"
        )
    return head_config_from_dict(raw, target_num_layers, f"{role}: {path}")


def head_config_from_dict(raw: dict, target_num_layers: int, where: str = "head config") -> HeadConfig:
    try:
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        layers = int(raw.get("num_hidden_layers", 1))
        vocab = int(raw["vocab_size"])
        cfg = HeadConfig(
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            vocab_size=vocab,
            draft_vocab_size=int(raw.get("draft_vocab_size") or vocab),
            target_hidden_size=int(raw.get("target_hidden_size") or hidden),
            layer_ids=_layer_ids(raw, target_num_layers),
            target_num_layers=(raw.get("trtspec") or {}).get("target_num_layers"),
            raw=raw,
            **_norm_flags(raw, where),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{where} lacks or garbles key {e}; re-export the head") from e
    if layers != 1:
        raise CheckpointError(f"{where}: the head has num_hidden_layers {layers}; trtspec runs one-layer EAGLE-3 heads")
    return cfg


def _norm_flags(raw: dict, where: str) -> dict[str, bool]:
    flags = {}
    for key in NORM_FLAGS:
        value = raw.get(key, False)
        if value is None:
            value = False
        if not isinstance(value, bool):
            raise CheckpointError(f"{where}: {key} is {value!r}; set it to true or false")
        flags[key] = value
    if flags["norm_before_fc"] and flags["fc_norm"]:
        raise CheckpointError(
            f"{where}: norm_before_fc and fc_norm are both true; a head normalises its features once "
            "(one norm over all of them, or one per layer): set one of them to false"
        )
    return flags


def _layer_ids(raw: dict, target_num_layers: int) -> tuple[int, ...]:
    own = (raw.get("trtspec") or {}).get("target_layer_ids")
    if own:
        return tuple(int(i) for i in own)
    vllm = raw.get("eagle_aux_hidden_state_layer_ids") or (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if vllm:
        return tuple(int(i) - 1 for i in vllm)
    return default_layer_ids(target_num_layers)


def check_head_for_target(head: HeadConfig, target_hf, role: str = "draft") -> None:
    """Refuse a head made for another target, naming the mismatch and the fix."""
    fix = "train a head for this target with `trtspec distill SPEC`, or point draft at the head made for it"
    n_layers = target_hf.num_hidden_layers
    problems = []
    if head.target_hidden_size != target_hf.hidden_size:
        problems.append(f"it reads hidden size {head.target_hidden_size}, the target's is {target_hf.hidden_size}")
    if head.hidden_size != target_hf.hidden_size:
        problems.append(
            f"its hidden size {head.hidden_size} differs from the target's {target_hf.hidden_size} "
            "(it shares the target's token embeddings)"
        )
    if head.vocab_size != target_hf.vocab_size:
        problems.append(f"it maps into a vocabulary of {head.vocab_size}, the target's has {target_hf.vocab_size}")
    bad = [i for i in head.layer_ids if not 0 <= i < n_layers]
    if bad:
        problems.append(f"it reads layer id(s) {bad}, the target has layers 0..{n_layers - 1}")
    elif list(head.layer_ids) != sorted(set(head.layer_ids)) or not head.layer_ids:
        problems.append(f"its layer ids {list(head.layer_ids)} must be distinct and ascending")
    if head.target_num_layers is not None and head.target_num_layers != n_layers:
        problems.append(f"it was made for a target of {head.target_num_layers} layers, this one has {n_layers}")
    if not 1 <= head.draft_vocab_size <= head.vocab_size:
        problems.append(f"draft_vocab_size {head.draft_vocab_size} not in 1..{head.vocab_size}")
    if problems:
        raise CheckpointError(f"{role}: this EAGLE-3 head was made for another target: " + "; ".join(problems) + f"; {fix}")


def check_head_tensors(head: HeadConfig, shapes: dict[str, tuple[int, ...]], role: str = "draft") -> None:
    """Every tensor present with its shape (from the safetensors headers); a norm's weight
    present exactly when config.json sets its flag."""
    _check_norm_tensors(head, shapes, role)
    want = head.tensor_shapes()
    missing = [k for k in want if k not in shapes]
    if missing:
        raise CheckpointError(
            f"{role}: the head lacks tensor(s) {', '.join(missing[:4])}; an EAGLE-3 head needs {', '.join(want)}"
        )
    wrong = [f"{k} {tuple(shapes[k])} (expected {v})" for k, v in want.items() if tuple(shapes[k]) != v]
    if wrong:
        raise CheckpointError(
            f"{role}: head tensor shapes do not match its config: {'; '.join(wrong[:3])}; "
            "config.json and the weights must come from the same head"
        )


def _check_norm_tensors(head: HeadConfig, shapes: dict[str, tuple[int, ...]], role: str) -> None:
    for name, (shape, flag) in _norm_tensors(head).items():
        if getattr(head, flag) and name not in shapes:
            raise CheckpointError(
                f"{role}: config.json sets {flag}: true but the head lacks tensor {name} {shape}; "
                f"export the head with its {flag} weights, or set {flag}: false if it was trained without them"
            )
        if not getattr(head, flag) and name in shapes:
            raise CheckpointError(
                f"{role}: the head holds {name} but config.json does not set {flag}: true; "
                f"set {flag}: true in config.json (the head was trained with it), or re-export it"
            )
        if name in shapes and tuple(shapes[name]) != shape:
            raise CheckpointError(
                f"{role}: {name} has shape {tuple(shapes[name])}, {flag} over {head.n_features} feature layer(s) "
                f"of hidden size {head.target_hidden_size} needs {shape}; config.json and the weights must come "
                "from the same head"
            )


def check_d2t(head: HeadConfig, d2t, role: str = "draft") -> None:
    """Every draft id maps into the target vocabulary, no two onto the same target id."""
    import torch

    if d2t is None:
        return
    target_ids = torch.arange(head.draft_vocab_size) + d2t.long()
    if int(target_ids.min()) < 0 or int(target_ids.max()) >= head.vocab_size:
        raise CheckpointError(f"{role}: d2t maps draft ids outside the target vocabulary 0..{head.vocab_size - 1}")
    if len(set(target_ids.tolist())) != head.draft_vocab_size:
        raise CheckpointError(f"{role}: d2t maps two draft ids onto one target id; re-export the head")


def safetensors_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                shapes[name] = tuple(st.get_slice(name).get_shape())
    return shapes


def check_head_checkpoint(target, head, role: str = "draft") -> HeadConfig:
    """Config, tensors and id map of a resolved head checkpoint, against the resolved target
    (both trtspec.checkpoints.Checkpoint)."""
    target_hf = target.hf_config()
    cfg = read_head_config(head.folder, target_hf.num_hidden_layers, role)
    check_head_for_target(cfg, target_hf, role)
    if any(f.suffix != ".safetensors" for f in head.weight_files):
        state = head.load_state_dict()
        shapes = {k: tuple(v.shape) for k, v in state.items()}
        d2t = state.get("d2t")
    else:
        shapes = safetensors_shapes(head.weight_files)
        d2t = _read_tensor(head.weight_files, "d2t") if "d2t" in shapes else None
    check_head_tensors(cfg, shapes, role)
    check_d2t(cfg, d2t, role)
    return cfg


def _read_tensor(files: list[Path], name: str):
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), framework="pt") as st:
            if name in st.keys():
                return st.get_tensor(name)
    return None

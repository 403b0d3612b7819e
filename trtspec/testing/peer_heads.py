"""Peer trainers' EAGLE-3 heads written in trtspec's head layout (engines/eagle3_checkpoint.py):
speculators' checkpoint folder and the folder `specforge export --to sglang` writes. The
product keeps one head format and never reads these layouts; the lab's peer comparison
(lab/distill_peers.py) scores the peers' heads through them, and the product's tests build
EAGLE-3.1 heads with norms from a speculators-layout checkpoint (tests/test_eagle3_norms.py).
A folder that is not what it should be is a SystemExit naming it (the lab's commands' exit)."""

from __future__ import annotations

import json
from pathlib import Path

# speculators' tensors with no place in a trtspec head: the target's own embeddings (a head
# shares the target's), the target-to-draft mask (d2t carries the same map), the verifier's copies.
SPECULATORS_DROPPED = ("embed_tokens.weight", "t2d", "verifier_lm_head.weight", "verifier_norm.weight")
LAYER_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "max_position_embeddings",
    "rope_parameters",
    "rope_theta",
    "vocab_size",
    "bos_token_id",
    "eos_token_id",
)


def speculators_to_trtspec(src: Path, dst: Path) -> Path:
    """speculators' EAGLE-3 checkpoint folder ``src`` written as a trtspec head folder ``dst``
    (engines/eagle3_checkpoint.py's layout): ``layers.0.*`` -> ``midlayer.*``, the layer's
    config flattened to Llama keys, the same aux layer ids (both count a layer's input) and the
    norm flags and their tensors carried as they are. Returns ``dst``."""
    from safetensors.torch import load_file

    from trtspec.engines.eagle3_checkpoint import NORM_FLAGS

    try:
        cfg = json.loads((src / "config.json").read_text(encoding="utf-8"))
        layer = cfg["transformer_layer_config"]
        files = sorted(src.glob("*.safetensors"))
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"{src} is not a speculators checkpoint folder ({e})") from e
    if cfg.get("speculators_model_type") != "eagle3" or not files:
        raise SystemExit(f"{src} is not a speculators EAGLE-3 checkpoint (speculators_model_type eagle3, safetensors)")
    if int(layer.get("num_hidden_layers", 1)) != 1:
        raise SystemExit(f"{src}: {layer['num_hidden_layers']} draft layers; trtspec runs one-layer EAGLE-3 heads")
    state = {}
    for f in files:
        state |= load_file(str(f))
    state = {
        ("midlayer." + k[len("layers.0.") :] if k.startswith("layers.0.") else k): v
        for k, v in state.items()
        if k not in SPECULATORS_DROPPED
    }
    norms = {k: bool(cfg.get(k, False)) for k in NORM_FLAGS}
    # the window speculators trained under; trtspec's head attends to the whole context
    origin = {"speculators": {"source": str(src), "sliding_window": layer.get("sliding_window")}}
    return write_head(dst, state, layer, cfg, cfg["eagle_aux_hidden_state_layer_ids"], norms | origin)


def write_head(dst: Path, state: dict, layer: dict, cfg: dict, ids, extra: dict) -> Path:
    """A one-layer head in trtspec's layout: ``state`` as model.safetensors and a config of the
    Llama keys of ``layer``, ``cfg``'s draft vocabulary and target width, the aux layer ``ids``
    and ``extra`` (norm flags, where it came from). Returns ``dst``."""
    from safetensors.torch import save_file

    from trtspec.engines.eagle3_checkpoint import HEAD_ARCHITECTURE

    config = {
        "architectures": [HEAD_ARCHITECTURE],
        "model_type": "llama",
        **{k: layer[k] for k in LAYER_KEYS if k in layer},
        "num_hidden_layers": 1,
        "draft_vocab_size": cfg["draft_vocab_size"],
        "target_hidden_size": cfg.get("target_hidden_size") or layer["hidden_size"],
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "eagle_aux_hidden_state_layer_ids": [int(i) for i in ids],
        **extra,
    }
    dst.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return dst


def specforge_to_trtspec(src: Path, dst: Path) -> Path:
    """The folder ``specforge export --to sglang`` wrote (``src``) as a trtspec head folder ``dst``:
    the tensor names are already the ones trtspec reads (``midlayer.*``, ``fc``, ``norm``,
    ``lm_head``, ``d2t``; ``fc_norm.{i}`` where its config sets fc_norm); ``t2d`` (d2t carries
    the same map) and any embeddings are dropped, the config gets the keys trtspec checks.
    SpecForge's own ``norm_output`` (true by default) is the usual norm before the LM head, not
    the EAGLE-3.1 flag of that name; a head trained without it is refused. Returns ``dst``."""
    from safetensors.torch import load_file

    from trtspec.engines.eagle3_checkpoint import HEAD_ARCHITECTURE

    try:
        cfg = json.loads((src / "config.json").read_text(encoding="utf-8"))
        files = sorted(src.glob("*.safetensors"))
    except (OSError, ValueError) as e:
        raise SystemExit(f"{src} is not a SpecForge export folder ({e}); pass the folder `specforge export` wrote") from e
    if cfg.get("architectures") != [HEAD_ARCHITECTURE] or not files:
        raise SystemExit(f"{src} is not a SpecForge EAGLE-3 export ({HEAD_ARCHITECTURE} config and safetensors)")
    if int(cfg.get("num_hidden_layers", 1)) != 1:
        raise SystemExit(f"{src}: {cfg['num_hidden_layers']} draft layers; trtspec runs one-layer EAGLE-3 heads")
    if cfg.get("norm_output", True) is not True:
        raise SystemExit(f"{src}: trained with norm_output false (no norm before the LM head); trtspec's head always applies it")
    ids = cfg.get("eagle_aux_hidden_state_layer_ids") or (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        raise SystemExit(
            f"{src}/config.json names no eagle_aux_hidden_state_layer_ids; put the layers it was trained on in its draft config"
        )
    state = {}
    for f in files:
        state |= load_file(str(f))
    state = {k: v for k, v in state.items() if k != "t2d" and "embed" not in k}
    if "d2t" in state:
        state["d2t"] = state["d2t"].long()
    norms = {
        "norm_before_fc": False,
        "fc_norm": bool(cfg.get("fc_norm", False)),
        "norm_before_residual": False,
        "norm_output": False,
    }
    return write_head(dst, state, cfg, cfg, ids, norms | {"specforge": {"source": str(src)}})

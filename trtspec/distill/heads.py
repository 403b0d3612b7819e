"""Make a new EAGLE-3 head for a target, and write a head folder atomically.

An anchored head (the default) starts as the target's own next-token predictor: ``fc`` passes
the latest feature through unchanged (identity on its block, zeros on the others), the layer
is a copy of the target layer that follows that feature (its attention reading only the state
half of [embeds; state], the embedding half zero), and the output norm and LM-head rows are
the target's final norm and its LM head over the draft vocabulary. At step 0 such a head
reproduces the target's prediction at the fed position; training then only has to learn the
shift by one token (and the use of the next token's embedding), not the target's last layers,
from a few thousand sequences. ``anchor=False`` is the earlier recipe: seeded noise everywhere
but the LM-head rows.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch

from trtspec.engines.eagle3_checkpoint import HeadConfig, head_config_dict, head_config_from_dict
from trtspec.engines.torch.eagle3_head import Eagle3Head
from trtspec.errors import TrtspecError
from trtspec.files import swap_into_place, write_json_atomic

HEAD_WEIGHTS = "model.safetensors"
HEAD_MANIFEST = "trtspec-head.json"  # how the head was made (target hash, data, seed, metrics)


# EAGLE-3.1's norms as speculators trains them by default (engines/eagle3_checkpoint.py: NORM_FLAGS)
NORMS = {"norm_before_fc": True, "norm_before_residual": True, "norm_output": True}


def head_norms(opts) -> dict | None:
    """The head config's norm flags for a recipe (``opts.norms``), or None: a plain EAGLE-3 head."""
    return dict(NORMS) if opts.norms else None


def new_head(
    target_hf,
    target_folder: Path,
    layer_ids: tuple[int, ...],
    draft_ids: list[int],
    seed: int,
    extra: dict | None = None,
    scale: float = 0.02,
    anchor: bool = True,
    norms: dict | None = None,
) -> tuple[Eagle3Head, dict]:
    """A fresh head over ``draft_ids`` (ascending target ids) and its config.json dict;
    ``norms``: the EAGLE-3.1 norm flags it is made with (top-level config keys, as its loaders
    read them; their weights start at 1)."""
    raw = head_config_dict(target_hf, layer_ids, len(draft_ids), extra) | (norms or {})
    cfg: HeadConfig = head_config_from_dict(raw, target_hf.num_hidden_layers)
    gen = torch.Generator().manual_seed(seed)
    head = Eagle3Head(cfg)
    ids = torch.tensor(draft_ids, dtype=torch.long)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
        head.lm_head.weight.copy_(target_lm_head(target_folder).float()[ids])
        head.d2t.copy_(ids - torch.arange(len(draft_ids)))
        if anchor:
            _anchor(head, target_folder, layer_ids[-1] + 1, target_hf.num_hidden_layers)
    return head, raw


def _anchor(head: Eagle3Head, target_folder: Path, layer: int, num_layers: int) -> None:
    """Make ``head`` (freshly initialised) start as the target's own next-token predictor from
    the output of layer ``layer - 1`` (see the module docstring)."""
    cfg, h = head.cfg, head.cfg.hidden_size
    n = cfg.n_features
    fc = torch.zeros_like(head.fc.weight)  # [hidden, n * target_hidden]
    fc[:, (n - 1) * h : n * h] = torch.eye(h)
    head.fc.weight.copy_(fc)
    names = {"norm.weight": "model.norm.weight"}
    mid = head.midlayer
    if layer < num_layers:  # a copy of the target layer that reads the latest feature
        src = f"model.layers.{layer}."
        names.update(
            {
                "midlayer.hidden_norm.weight": src + "input_layernorm.weight",
                "midlayer.self_attn.o_proj.weight": src + "self_attn.o_proj.weight",
                "midlayer.post_attention_layernorm.weight": src + "post_attention_layernorm.weight",
                **{f"midlayer.mlp.{p}.weight": f"{src}mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")},
            }
        )
        got = target_tensors(target_folder, [src + f"self_attn.{p}_proj.weight" for p in "qkv"])
        for p, w in zip("qkv", got):
            proj = getattr(mid.self_attn, f"{p}_proj").weight  # [out, 2 * hidden]: [embeds | state]
            proj.zero_()
            proj[:, h:] = w.float()
    else:  # the feature is already the last layer's output: the layer starts as the identity
        mid.self_attn.o_proj.weight.zero_()
        mid.mlp.down_proj.weight.zero_()
    params = dict(head.named_parameters())
    for mine, w in zip(names, target_tensors(target_folder, list(names.values()))):
        params[mine].copy_(w.float())


def save_head(
    out: Path, head: Eagle3Head, config: dict, manifest: dict | None = None, extra_files: dict[str, Path] | None = None
) -> None:
    """Write config.json, safetensors, the manifest and extras into a temp folder beside
    ``out`` and rename it into place: an interrupted write leaves no head folder."""
    from safetensors.torch import save_file

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        state = head.state_for_checkpoint()
        state = {k: (v if k == "d2t" else v.float()).cpu() for k, v in state.items()}  # trained on any device
        save_file(state, str(tmp / HEAD_WEIGHTS), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        for name, src in (extra_files or {}).items():
            shutil.copy2(src, tmp / name)
        if manifest is not None:
            write_json_atomic(tmp / HEAD_MANIFEST, manifest)
        swap_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def refuse_existing(out: Path, force: bool) -> None:
    if Path(out).exists() and not force:
        raise TrtspecError(f"{out} already exists; pass --force to replace it, or choose another --output")


def target_lm_head(target_folder: Path) -> torch.Tensor:
    """The target's LM-head weight [vocab, hidden] as stored (the embeddings when tied)."""
    from safetensors import safe_open

    with safe_open(str(Path(target_folder) / HEAD_WEIGHTS), framework="pt") as st:
        name = "lm_head.weight" if "lm_head.weight" in st.keys() else "model.embed_tokens.weight"
        return st.get_tensor(name)


def target_tensors(target_folder: Path, names: list[str]) -> list[torch.Tensor]:
    """Tensors of a built target engine folder, by name, as stored."""
    from safetensors import safe_open

    with safe_open(str(Path(target_folder) / HEAD_WEIGHTS), framework="pt") as st:
        missing = [n for n in names if n not in st.keys()]
        if missing:
            raise TrtspecError(f"{target_folder}: the target engine lacks {', '.join(missing)}; rebuild it")
        return [st.get_tensor(n) for n in names]

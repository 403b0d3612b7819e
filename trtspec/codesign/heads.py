"""Make a new EAGLE-3 head for a target, and write a head folder atomically.

A new head copies the target's LM-head rows of its draft vocabulary (so it starts by predicting
like the target's last layer would) and initialises the rest with small seeded noise.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch

from trtspec.engines.eagle3 import HeadConfig, head_config_dict, head_config_from_dict
from trtspec.engines.torch.eagle3 import Eagle3Head
from trtspec.errors import TrtspecError
from trtspec.files import swap_into_place, write_json_atomic

HEAD_WEIGHTS = "model.safetensors"
HEAD_MANIFEST = "trtspec-head.json"  # how the head was made (target hash, data, seed, metrics)


def new_head(
    target_hf,
    target_lm_head: torch.Tensor,
    layer_ids: tuple[int, ...],
    draft_ids: list[int],
    seed: int,
    extra: dict | None = None,
    scale: float = 0.02,
) -> tuple[Eagle3Head, dict]:
    """A fresh head over ``draft_ids`` (ascending target ids) and its config.json dict."""
    raw = head_config_dict(target_hf, layer_ids, len(draft_ids), extra)
    cfg: HeadConfig = head_config_from_dict(raw, target_hf.num_hidden_layers)
    gen = torch.Generator().manual_seed(seed)
    head = Eagle3Head(cfg)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
        ids = torch.tensor(draft_ids, dtype=torch.long)
        head.lm_head.weight.copy_(target_lm_head.float()[ids])
        head.d2t.copy_(ids - torch.arange(len(draft_ids)))
    return head, raw


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
        state = {k: (v if k == "d2t" else v.float()) for k, v in state.items()}
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

"""Torch backend, method eagle3: the draft engine is the head itself, cast to the engine dtype
(config.json kept as the loaders read it, no tokenizer: the head uses the target's)."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from trtspec import console
from trtspec.checkpoints import Checkpoint
from trtspec.engines.build import finish_torch_engine
from trtspec.engines.torch.engine import DTYPES, WEIGHTS
from trtspec.spec import LoadedSpec


def build_head_engine(loaded: LoadedSpec, ckpt: Checkpoint, folder: Path) -> None:
    from safetensors.torch import save_file

    tmp = Path(tempfile.mkdtemp(prefix=".draft.tmp-", dir=folder.parent))
    try:
        with console.step(f"draft: EAGLE-3 head {ckpt.model.source_id} as {ckpt.model.dtype}"):
            dtype = DTYPES[ckpt.model.dtype]
            # d2t is an integer map: it keeps its dtype.
            state = {k: (v if k == "d2t" else v.to(dtype)).contiguous() for k, v in ckpt.load_state_dict().items() if k != "t2d"}
            save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt"})
            config = json.loads((ckpt.folder / "config.json").read_text(encoding="utf-8"))
            config["torch_dtype"] = ckpt.model.dtype
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
            # a head reads the target's token ids; it has no tokenizer
            finish_torch_engine(loaded, ckpt, "draft", tmp, folder, state, tokenizer_dir=None)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

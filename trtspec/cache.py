"""Where trtspec caches derived files (converted GGUF checkpoints, the Triton stub copy):
$TRTSPEC_CACHE, else $XDG_CACHE_HOME/trtspec, else ~/.cache/trtspec."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    if os.environ.get("TRTSPEC_CACHE"):
        return Path(os.environ["TRTSPEC_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "trtspec"

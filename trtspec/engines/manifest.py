"""manifest.json: what an engine folder holds and how it was made.

A folder is an engine only if its manifest parses, says it is complete, matches the spec it
is loaded for, and every file it lists is present at the recorded size. Builds write the
manifest last and rename the folder into place, so an interrupted build never qualifies.
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from trtspec.errors import EngineError
from trtspec.files import FileRecord, file_record, write_json_atomic  # noqa: F401  (re-exported for builders)

MANIFEST = "manifest.json"
FORMAT = 1
REBUILD = "run `trtspec build SPEC` (add --force to replace it)"  # what every manifest error says to do


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


B = TypeVar("B", bound=BuildRecord)


class Manifest(BuildRecord):
    role: str
    backend: str
    spec_hash: str
    dtype: str
    quantization: str = "none"  # the spec's value, as this engine's backend reads it
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
    # torch engines: the compiled step's choice per machine (engines/torch/compiled.py), keyed
    # by a digest of the machine, its threads and torch; made by `trtspec build` on that machine.
    programs: dict[str, dict[str, str | float]] = {}


def versions() -> dict[str, str]:
    import torch
    import transformers

    from trtspec import __version__

    return {"trtspec": __version__, "torch": torch.__version__, "transformers": transformers.__version__}


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def write_manifest(folder: Path, manifest: Manifest) -> None:
    write_json_atomic(folder / MANIFEST, manifest.model_dump(mode="json"))


def read_build(folder: Path, model: type[B], whole: str, stale: str) -> B:
    """``folder``'s manifest.json parsed as ``model``; EngineError, saying to rebuild, when it
    is missing, unreadable, unfinished or of another format than ``model`` writes. ``whole``
    and ``stale`` name what the folder should hold in those errors ("not a complete {whole}",
    "an incomplete or outdated {stale}")."""
    path = folder / MANIFEST
    if not path.is_file():
        raise EngineError(f"{folder} has no {MANIFEST}: not a complete {whole}; {REBUILD}")
    try:
        record = model.model_validate_json(path.read_text(encoding="utf-8"))
    except (ValidationError, ValueError) as e:
        raise EngineError(f"{path} is unreadable ({type(e).__name__}); {REBUILD}") from e
    if not record.complete or record.format != model.model_fields["format"].default:
        raise EngineError(f"{folder} holds an incomplete or outdated {stale}; {REBUILD}")
    return record


def check_files(folder: Path, files: dict[str, FileRecord], label: str = "") -> None:
    """EngineError, saying to rebuild, when a file a manifest lists (by path relative to
    ``folder``) is missing or not of its recorded size."""
    for rel, rec in files.items():
        f = folder / rel
        if not f.is_file() or f.stat().st_size != rec.bytes:
            raise EngineError(f"{folder}: {label}{rel} is missing or truncated; {REBUILD}")


def read_manifest(folder: Path) -> Manifest:
    """Parse a folder's manifest; EngineError says to (re)build when it is not an engine."""
    if not folder.is_dir():
        raise EngineError(f"engine folder {folder} does not exist; {REBUILD}")
    manifest = read_build(folder, Manifest, "engine", "engine")
    check_files(folder, manifest.files, "engine file ")
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

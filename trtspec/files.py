"""Files written so that nothing half-done is ever read: atomic writes, folder swaps, hashes.

Every file trtspec writes goes to a temp path beside its destination and is renamed into
place, so a reader never sees a half-written file and an interrupted write loses nothing.
Folders (engines, model repositories) are built under a hidden temp name and swapped in.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from trtspec.errors import SpecError, TrtspecError

# Hidden temp folders are named ".<name>.tmp-<suffix>"; anything matching is a leftover.
TEMP_GLOB = ".*.tmp-*"


def read_text_file(path: Path, what: str = "file") -> str:
    """The UTF-8 text of a file a user gave (spec, prompts): SpecError (exit 2) naming the file
    and the byte offset where it stops being UTF-8, instead of a UnicodeDecodeError traceback.
    Every spec and prompts file trtspec reads comes through here."""
    path = Path(path)
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(
            f"{what} {path}: not UTF-8 text (byte 0x{data[e.start]:02x} at byte offset {e.start}); save the file as UTF-8"
        ) from None


def write_text_atomic(path: Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; these are ordinary, shareable files
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_bytes_atomic(path: Path, data: bytes, *, durable: bool = False) -> None:
    """``data`` as ``path``, renamed into place. ``durable``: also on disk before this returns
    (the file and its folder fsynced before the rename, the folder again after), so a power
    loss leaves the old file or the new one whole, never an empty or torn one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        if durable:
            fsync_folder(path.parent)
        os.replace(tmp, path)
        if durable:
            fsync_folder(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def fsync_folder(folder: Path) -> None:
    """Flush a folder's entries (a rename into it, a new file) to disk."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def swap_into_place(tmp: Path, folder: Path) -> None:
    """Rename a finished temp folder over ``folder``; the old one is removed only after."""
    if folder.exists():
        old = folder.with_name(f".{folder.name}.tmp-old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(folder, old)
        os.replace(tmp, folder)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, folder)


def swap_unit_into_place(pairs: list[tuple[Path, Path]]) -> None:
    """Rename several finished temp folders over their destinations as one unit.

    First every old folder moves aside, then every new one moves in, then the old ones go.
    Interrupted anywhere, the destinations hold all new folders or some missing (which never
    load: rebuild), never a new folder beside an old one (e.g. a new trtllm target engine
    beside the control engine of earlier weights).
    """
    olds = []
    for _, folder in pairs:
        if folder.exists():
            old = folder.with_name(f".{folder.name}.tmp-old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(folder, old)
            olds.append(old)
    for tmp, folder in pairs:
        os.replace(tmp, folder)
    for old in olds:
        shutil.rmtree(old, ignore_errors=True)


def remove_stale_temps(folder: Path) -> None:
    """Delete temp folders an interrupted run left behind (never loadable: no manifest)."""
    for stale in Path(folder).glob(TEMP_GLOB):
        shutil.rmtree(stale, ignore_errors=True)


def ensure_writable(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise TrtspecError(
            f"output folder {folder} is not writable ({e.strerror}); pass --output DIR or fix its permissions"
        ) from e


@contextmanager
def writable_folder(folder: Path) -> Iterator[None]:
    """ensure_writable(folder) for the block; a folder this made is removed again when the block
    fails and leaves it empty, so a refused command leaves nothing behind."""
    existed = folder.exists()
    ensure_writable(folder)
    try:
        yield
    except BaseException:
        if not existed:
            with contextlib.suppress(OSError):
                folder.rmdir()  # only ever an empty one
        raise


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


class FileRecord(BaseModel):
    """A file's content hash and size, as manifests record sources and engine files."""

    model_config = ConfigDict(extra="forbid")
    sha256: str
    bytes: int


def file_record(path: Path) -> FileRecord:
    return FileRecord(sha256=sha256_file(path), bytes=path.stat().st_size)


@contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (POSIX flock, released when its process ends, however it
    ends); without one (no fcntl, an unwritable folder), no lock."""
    with file_lock(path):
        yield


@contextmanager
def file_lock(path: Path, *, shared: bool = False, wait: bool = True) -> Iterator[bool]:
    """A POSIX flock on ``path`` for the block (released too when its process ends, however it
    ends): exclusive, or ``shared`` (held by many processes at once, never beside an exclusive
    one). Yields whether it is held: False without one (no fcntl, an unwritable folder) or, not
    to ``wait``, where another process holds one that conflicts."""
    try:
        import fcntl

        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a")  # noqa: SIM115 (held across the yield)
    except (ImportError, OSError):
        yield False
        return
    with handle:
        held = True
        try:
            fcntl.flock(handle, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            held = False
        yield held

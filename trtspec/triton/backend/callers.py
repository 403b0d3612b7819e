"""Who may call the torch engine models: only the repository's own BLS models.

The engine models (`tensorrt_llm`, `tensorrt_llm_draft`, `tensorrt_llm_control`) keep the
speculative endpoints' KV-cache slots. A client that called one directly would take a slot
from a live sequence (its prefix is then recomputed), and its requests would take places in
the engine model's bounded queue that the endpoints' own steps need. So an engine model
answers only requests carrying this server's caller key in the request parameter
``trtspec_caller``: the text endpoints send it with every BLS request (models/pb.py); anything
else is refused by name before its inputs are read.

The key is made once per tritonserver process by whichever of its Python stubs asks first, as
a 0600 file in /dev/shm named after the server's pid (every stub of one server shares its
/dev/shm and its parent), under ``flock`` so all stubs read the same key; the files of servers
that are gone are removed when a new key is made. Clients reach the
server only through its gRPC/HTTP APIs, which never show a stub's files or environment; the
key is not in config.pbtxt (readable through the model-configuration API). Where no key can be
made (no writable /dev/shm), engine models answer every caller, as before, and say so in the
log once.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

CALLER_PARAMETER = "trtspec_caller"
SHM = Path("/dev/shm")


def key_path(server_pid: int, folder: Path = SHM) -> Path:
    return folder / f"trtspec-caller-{server_pid}"


def server_key(server_pid: int | None = None, folder: Path = SHM) -> str | None:
    """This tritonserver's caller key (made by the first stub that asks); None if none can be."""
    import fcntl

    path = key_path(os.getppid() if server_pid is None else server_pid, folder)
    try:
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        key = os.read(fd, 64).decode("ascii", "replace").strip()
        if not key:
            key = secrets.token_hex(16)
            os.write(fd, key.encode())
            _forget_dead(folder)
        return key
    except OSError:
        return None
    finally:
        os.close(fd)  # also releases the lock


def local_keys(folder: Path = SHM) -> list[str]:
    """The caller keys of the running servers on this machine whose key files this user can read
    (``trtspec bench --url`` times the engine models of a server it started itself)."""
    keys = []
    for path in sorted(folder.glob("trtspec-caller-*")):
        try:
            key = path.read_text(encoding="ascii").strip()
        except (OSError, UnicodeDecodeError):
            continue
        if key:
            keys.append(key)
    return keys


def _forget_dead(folder: Path) -> None:
    """Remove the key files of servers that are gone (a new server's first stub does this, so
    /dev/shm keeps one small file per running server, however the others ended)."""
    for path in folder.glob("trtspec-caller-*"):
        try:
            os.kill(int(path.name.rsplit("-", 1)[1]), 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
        except (ValueError, OSError):
            continue


def from_inside(parameters: str | None, key: str | None) -> bool:
    """A request's parameters (python_backend's JSON string) carry ``key``; True without a key."""
    if key is None:
        return True
    try:
        given = json.loads(parameters or "{}").get(CALLER_PARAMETER)
    except (ValueError, AttributeError):
        return False
    return isinstance(given, str) and secrets.compare_digest(given, key)


def outside_error(model: str) -> str:
    return (
        f"{model} is internal to this model repository: it keeps the speculative endpoints' KV-cache slots and "
        "answers only their requests; send requests to tensorrt_llm_bls, tensorrt_llm_bls_streaming, target_only "
        "or ensemble"
    )

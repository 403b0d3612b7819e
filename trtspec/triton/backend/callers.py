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
made or read (no writable /dev/shm), the gate fails closed: the engine models refuse every
request with ``no_key_error`` (the fix: give tritonserver a writable /dev/shm), and the text
endpoints trust no caller.

The text endpoints ask the same key of one caller: the OpenAI front (`trtspec openai`), which
reads it from the server's key file (``key_for_port``) and sends it with every request. Only
a request carrying it may name its suffix cache scope (the front's tenants); a request that
carries a wrong key is refused (``caller_of``), so a front that lost its server's key fails
loudly instead of putting every tenant in one scope.
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


INSIDE, ANYONE, WRONG_KEY = "inside", "anyone", "wrong key"  # what caller_of finds


def caller_of(parameters: str | None, key: str | None) -> str:
    """Who sent a request, from its parameters (python_backend's JSON string): INSIDE when
    they carry ``key``, ANYONE when they carry no caller key, WRONG_KEY when they carry another
    (or any, where this server has no key: nothing is trusted then)."""
    try:
        given = json.loads(parameters or "{}").get(CALLER_PARAMETER)
    except (ValueError, AttributeError):
        return WRONG_KEY
    if given is None:
        return ANYONE
    if key is None or not isinstance(given, str):
        return WRONG_KEY
    return INSIDE if secrets.compare_digest(given.encode(), key.encode()) else WRONG_KEY


def from_inside(parameters: str | None, key: str | None) -> bool:
    """A request's parameters carry ``key``; False where this server has no key (fail closed)."""
    return caller_of(parameters, key) == INSIDE


def no_key_error(model: str) -> str:
    return (
        f"{model} refuses every request: this tritonserver could not make or read its caller key in {SHM} "
        "(callers.py), so it cannot tell its own endpoints from other callers; give tritonserver a writable "
        "/dev/shm (docker --shm-size, a Kubernetes emptyDir with medium Memory) and restart it"
    )


def wrong_key_error() -> str:
    return (
        f"the request's {CALLER_PARAMETER} key is not this server's; restart `trtspec openai` against this "
        "server (it reads the key of the server it was started for), or send no key"
    )


def key_for_port(port: int, folder: Path = SHM) -> str | None:
    """The caller key of the tritonserver on this machine listening on ``port``, where this
    user can read it (None: no such server here, or not ours)."""
    for pid in _listening_pids(port):
        try:
            key = key_path(pid, folder).read_text(encoding="ascii").strip()
        except (OSError, UnicodeDecodeError):
            continue
        if key:
            return key
    return None


def listening_sockets(port: int) -> list[tuple[str, str]]:
    """Each TCP socket LISTENing on ``port`` (Linux /proc/net/tcp and tcp6): its local address
    as /proc writes it (little-endian hex, 0100007F is 127.0.0.1) and its inode."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A":  # 0A = LISTEN
                address, hex_port = fields[1].rsplit(":", 1)
                if int(hex_port, 16) == port:
                    found.append((address, fields[9]))
    return found


def _listening_pids(port: int) -> list[int]:
    """The processes of this user listening on TCP ``port`` (Linux /proc)."""
    inodes = {f"socket:[{inode}]" for _, inode in listening_sockets(port)}
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                pids.append(int(proc.name))
        except OSError:  # another user's process, or gone
            continue
    return pids


def outside_error(model: str) -> str:
    return (
        f"{model} is internal to this model repository: it keeps the speculative endpoints' KV-cache slots and "
        "answers only their requests; send requests to tensorrt_llm_bls, tensorrt_llm_bls_streaming, target_only "
        "or ensemble"
    )

"""Detached servers: a JSON pid file that `trtspec stop` reads to end the server it names.

The file records the pid and the process's start time (field 22 of /proc/<pid>/stat, clock
ticks since boot): a pid the kernel has since given to another process has another start
time, so `stop` never signals it. The file is created exclusively (a second `serve --detach`
on the same file fails instead of overwriting the first server's record)."""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from trtspec.errors import ServerError, TrtspecError
from trtspec.triton.server.procgroup import (
    alive,
    cmdline,
    descendants,
    end_group,
    end_pids,
    proc_stat,
    signal_group,
    signal_pid,
    start_time,
)


@dataclass(frozen=True)
class DetachedServer:
    """What a pid file records about a detached server."""

    pid: int
    http_endpoint: str
    grpc_endpoint: str
    metrics_url: str
    log_path: str
    model_repository: str
    argv: list[str] = field(default_factory=list)
    start_time: int | None = None  # /proc/<pid>/stat starttime; None in files of older trtspec


def write_pid_file(path: Path, server) -> None:
    """Record a started TritonServer so that another process can stop it. The file appears
    whole and only if none exists (ServerError otherwise): written beside, then hard-linked."""
    path = Path(path)
    info = DetachedServer(
        pid=server.pid or 0,
        http_endpoint=server.http_endpoint,
        grpc_endpoint=server.grpc_endpoint,
        metrics_url=server.metrics_url,
        log_path=str(server.log_path),
        model_repository=str(server.command.model_repository),
        argv=server.shown_argv(),  # never the admin key
        start_time=start_time(server.pid) if server.pid else None,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(info.__dict__, indent=2, sort_keys=True) + "\n")
        os.link(tmp, path)  # fails if the file exists: never two servers in one pid file
    except FileExistsError:
        raise ServerError(
            f"{path} exists: a server may be running; `trtspec stop --pid-file {path}` first, or pick another --pid-file"
        ) from None
    except PermissionError as err:
        raise TrtspecError(f"cannot write the pid file {path} ({err.strerror}); pick a writable --pid-file") from None
    finally:
        tmp.unlink(missing_ok=True)


def read_pid_file(pid_file: str | os.PathLike[str]) -> DetachedServer:
    try:
        return DetachedServer(**json.loads(Path(pid_file).read_text()))
    except FileNotFoundError:
        raise ServerError(f"no pid file at {pid_file}: is a server running?") from None
    except PermissionError as err:
        raise TrtspecError(
            f"cannot read the pid file {pid_file} ({err.strerror}); run `trtspec stop` as the user who started the server"
        ) from None
    except (ValueError, TypeError) as err:
        raise ServerError(f"{pid_file} is not a trtspec server pid file ({err}); remove it") from err


def stop_detached(pid_file: str | os.PathLike[str], timeout: float = 30.0) -> bool:
    """Stop the server recorded in ``pid_file``, with its whole process tree; remove the file.

    Returns False when that server was already gone. The pid is only signalled while it is
    the process that was launched: same start time (files that record one) and still running
    what was launched (tritonserver, or the launcher the pid file records, e.g. mpirun), so a
    pid reused by an unrelated process is left alone. The descendants are collected before
    any signal: MPI ranks and their daemons may sit outside the server's process group and
    would otherwise outlive the launcher. Not being allowed to signal it (another user's
    server) is a ServerError (exit 3) that says so.
    """
    info = read_pid_file(pid_file)
    pid = info.pid
    launched = {"tritonserver"} | ({Path(info.argv[0]).name} if info.argv else set())
    same = info.start_time is None or start_time(pid) == info.start_time
    running = same and proc_stat(pid) is not None and Path(cmdline(pid)[0] or "-").name in launched
    try:
        if running:
            tree = descendants(pid)
            signal_group(pid, signal.SIGINT)
            for child in tree:
                signal_pid(child, signal.SIGINT)
            deadline = time.monotonic() + timeout
            while alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            end_group(pid, grace=0.0 if alive(pid) else 10.0)
            end_pids(tree, grace=min(timeout, 10.0))
        Path(pid_file).unlink(missing_ok=True)
    except PermissionError as err:
        what = f"signal the server (pid {pid})" if running else f"remove {pid_file}"
        raise ServerError(
            f"not permitted to {what}: {err.strerror}; run `trtspec stop` as the user who started the server"
        ) from None
    return running

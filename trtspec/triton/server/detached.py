"""Detached servers: a JSON pid file that `trtspec stop` reads to end the server it names."""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from trtspec.errors import ServerError
from trtspec.files import write_json_atomic
from trtspec.triton.server.procgroup import (
    alive,
    cmdline,
    descendants,
    end_group,
    end_pids,
    proc_stat,
    signal_group,
    signal_pid,
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


def write_pid_file(path: Path, server) -> None:
    """Record a started TritonServer so that another process can stop it."""
    info = DetachedServer(
        pid=server.pid or 0,
        http_endpoint=server.http_endpoint,
        grpc_endpoint=server.grpc_endpoint,
        metrics_url=server.metrics_url,
        log_path=str(server.log_path),
        model_repository=str(server.command.model_repository),
        argv=server.argv(),
    )
    write_json_atomic(path, info.__dict__)


def read_pid_file(pid_file: str | os.PathLike[str]) -> DetachedServer:
    try:
        return DetachedServer(**json.loads(Path(pid_file).read_text()))
    except FileNotFoundError:
        raise ServerError(f"no pid file at {pid_file}: is a server running?") from None
    except (ValueError, TypeError) as err:
        raise ServerError(f"{pid_file} is not a trtspec server pid file ({err}); remove it") from err


def stop_detached(pid_file: str | os.PathLike[str], timeout: float = 30.0) -> bool:
    """Stop the server recorded in ``pid_file``, with its whole process tree; remove the file.

    Returns False when that server was already gone. The pid is only signalled while it still
    runs what was launched (tritonserver, or the launcher the pid file records, e.g. mpirun),
    so a pid reused by an unrelated process is left alone. The descendants are collected
    before any signal: MPI ranks and their daemons may sit outside the server's process group
    and would otherwise outlive the launcher.
    """
    info = read_pid_file(pid_file)
    pid = info.pid
    launched = {"tritonserver"} | ({Path(info.argv[0]).name} if info.argv else set())
    running = proc_stat(pid) is not None and Path(cmdline(pid)[0] or "-").name in launched
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
    return running

"""Process groups read from /proc (no psutil): who is still alive, and ending them all.

A tritonserver runs in its own session (process group == its pid); the Python backend's stub
processes are its children in the same group, so stopping signals the whole group and then
checks /proc until no member is left.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from trtspec.errors import ServerError


def stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat from the third (state) on, or None when ``pid`` is gone:
    field n of proc(5) is index n - 3."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and ')': split after the last ')'.
    return raw[raw.rindex(")") + 2 :].split()


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, process group) of ``pid``, or None when it is gone."""
    fields = stat_fields(pid)
    return None if fields is None else (fields[0], int(fields[2]))


def start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot), or None when it is gone."""
    fields = stat_fields(pid)
    return None if fields is None else int(fields[19])


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group ``pgid``."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = proc_stat(int(entry.name))
            # Zombies are dead; orphans are reaped by init, which may lag (or never, in
            # some containers), so they must not count as survivors.
            if stat is not None and stat[1] == pgid and stat[0] != "Z":
                members.append(int(entry.name))
    return members


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def end_group(pgid: int, grace: float) -> None:
    """Wait ``grace`` s for the group to empty, then SIGKILL it; raise if anything survives."""
    deadline = time.monotonic() + grace
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if not group_members(pgid):
        return
    signal_group(pgid, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while (left := group_members(pgid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    if left:
        raise ServerError(f"processes {left} of tritonserver group {pgid} survived SIGKILL")


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def alive(pid: int) -> bool:
    try:  # reap it if it is our own child (detached from this same process)
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    stat = proc_stat(pid)
    return stat is not None and stat[0] != "Z"


def descendants(root: int) -> list[int]:
    """Every live process below ``root`` (children, grandchildren, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            ppid = _ppid(int(entry.name))
            if ppid is not None:
                children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _ppid(pid: int) -> int | None:
    fields = stat_fields(pid)
    return None if fields is None else int(fields[1])


def signal_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def end_pids(pids: list[int], grace: float) -> None:
    """Wait ``grace`` s for ``pids`` to exit, then SIGKILL the rest; raise if any survive."""
    deadline = time.monotonic() + grace
    while [p for p in pids if alive(p)] and time.monotonic() < deadline:
        time.sleep(0.05)
    for p in pids:
        if alive(p):
            signal_pid(p, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    if left:
        raise ServerError(f"processes {left} of the server's process tree survived SIGKILL")

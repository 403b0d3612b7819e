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


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, process group) of ``pid``, or None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and ')': split after the last ')'.
    fields = raw[raw.rindex(")") + 2 :].split()
    return fields[0], int(fields[2])


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

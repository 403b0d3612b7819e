"""What a server's process tree holds, process by process, from the kernel's own accounting:
what the product's memory-bound tests (tests/test_repository_bounds.py) and the lab's soak
and memory benches (lab/server_memory.py) read.

Summed VmRSS counts a shared page once per process that maps it (the Python backend's /dev/shm
pool is mapped by tritonserver and by every stub), so it cannot tell a leak from pool growth.
The fields kept here can (KiB; shm_maps a count):

  held       Pss_Anon + Pss_Shmem (/proc/<pid>/smaps_rollup): what the process holds that the
             kernel cannot drop, each shared page divided among the processes that map it, so
             a tree's held memory adds up; the measure growth is judged by
  pss        proportional set size, file-backed pages included: mapped weights are page cache,
             evicted under memory pressure and read back, so on a loaded machine a model
             process's Pss swings by 100+ MiB while it holds no more
  rss_anon   private heap and stacks (RssAnon, /proc/<pid>/status): where a leak shows
  rss_shmem  shared-memory pages the process touched (RssShmem): the Python backend's pool
  shm_maps   mappings of /dev/shm files (/proc/<pid>/maps): the pool's regions; a pool that
             grows adds one
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from trtspec.triton.server.procgroup import cmdline, descendants

MEMORY_FIELDS = ("held", "pss", "rss_anon", "rss_shmem", "shm_maps")
STUB_NAME = "triton_python_backend_stub"

T = TypeVar("T")
Memory = dict[str, int]  # MEMORY_FIELDS -> KiB (shm_maps: a count)


def _kib(text: str, key: str) -> int:
    m = re.search(rf"^{key}:\s+(\d+) kB", text, re.M)
    return int(m.group(1)) if m else 0


def process_memory(pid: int) -> Memory | None:
    """MEMORY_FIELDS of one process; None once it is gone."""
    proc = Path("/proc") / str(pid)
    try:
        status = (proc / "status").read_text()
        rollup = (proc / "smaps_rollup").read_text()
        maps = (proc / "maps").read_text()
    except OSError:
        return None
    return {
        "held": _kib(rollup, "Pss_Anon") + _kib(rollup, "Pss_Shmem"),
        "pss": _kib(rollup, "Pss"),
        "rss_anon": _kib(status, "RssAnon"),
        "rss_shmem": _kib(status, "RssShmem"),
        "shm_maps": sum(1 for line in maps.splitlines() if " /dev/shm/" in line),
    }


def label(pid: int) -> str:
    """ "tritonserver [pid]", or for a Python-backend stub the model it serves (the stub's first
    argument is the model's file, <model>/<version>/model.py): "stub <model> [pid]"."""
    argv = cmdline(pid)
    name = Path(argv[0]).name if argv else "?"
    if name == STUB_NAME and len(argv) > 1:
        model = Path(argv[1])
        name = f"stub {model.parent.parent.name if model.suffix == '.py' else model.name}"
    return f"{name} [{pid}]"


def over_tree(root: int, read: Callable[[int], T | None]) -> dict[str, T]:
    """``read`` of ``root`` and every process under it, by :func:`label` (a process gone: left out)."""
    out = {}
    for pid in [root, *descendants(root)]:
        value = read(pid)
        if value is not None:
            out[label(pid)] = value
    return out


def tree_memory(root: int) -> dict[str, Memory]:
    """MEMORY_FIELDS of ``root`` and every process under it, by :func:`label`."""
    return over_tree(root, process_memory)

"""What the lab's soak and memory benches report of a server's process tree: growth between
samples, the worst grower, a compact sample, and where a process's private pages lie. The
samples themselves (each process's held, Pss, RssAnon, RssShmem and shm_maps) are
trtspec/testing/process_memory.py's, shared with the product's tests."""

from __future__ import annotations

import re
from pathlib import Path

from trtspec.testing.process_memory import MEMORY_FIELDS, Memory, over_tree


def total(memory: dict[str, Memory], field: str = "held") -> int:
    return sum(m[field] for m in memory.values())


def growth(start: dict[str, Memory], end: dict[str, Memory]) -> dict[str, dict]:
    """Per process alive at both ends: each field's start, end and growth (KiB, and percent of
    its start). A process that ended or began in between is reported as such, never hidden."""
    out: dict[str, dict] = {}
    for name in sorted(start.keys() | end.keys()):
        if name not in end:
            out[name] = {"ended": True}
        elif name not in start:
            out[name] = {"began": True, "end_kib": end[name]}
        else:
            a, b = start[name], end[name]
            out[name] = {
                "start_kib": a,
                "end_kib": b,
                "growth_kib": {f: b[f] - a[f] for f in MEMORY_FIELDS},
                "growth_pct": {f: round(100.0 * (b[f] - a[f]) / a[f], 2) if a[f] else None for f in MEMORY_FIELDS[:-1]},
            }
    return out


def worst_growth(per_process: dict[str, dict], field: str = "held") -> tuple[str | None, float]:
    """The process whose ``field`` grew most, in percent; a process that began or ended in the
    span counts as unbounded growth (inf)."""
    worst, pct = None, float("-inf")
    for name, g in per_process.items():
        p = g["growth_pct"][field] if "growth_pct" in g else float("inf")
        if p is not None and p > pct:
            worst, pct = name, p
    return worst, pct


def compact(memory: dict[str, Memory]) -> dict[str, list]:
    """One sample for a report: per process [held, Pss, RssAnon, RssShmem] in MiB and shm_maps."""
    return {k: [round(m[f] / 1024, 1) for f in MEMORY_FIELDS[:-1]] + [m["shm_maps"]] for k, m in memory.items()}


# Where a process's private pages lie, to name what grew (/proc/<pid>/smaps, one block per mapping).
LAYOUT_KINDS = ("heap", "thread stacks", "file copies", "stack", "other")
GUARD_MAX = 64 << 10  # a thread's guard is a page or a few (glibc's guardsize); an allocator's reserve is MiBs
_MAPPING = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S{4}) \S+ \S+ \S+\s*(.*)$")


def anon_layout(pid: int) -> dict | None:
    """A process's threads and its anonymous KiB and mappings by kind; None once it is gone:

    heap           the brk heap and every other anonymous mapping (the allocator's extents)
    thread stacks  anonymous read-write mappings right above a no-access guard of at most
                   GUARD_MAX, which is how glibc lays out a thread's stack: a thread started
                   adds one (a glibc malloc arena's reserve below a mapping is no guard)
    file copies    private copies of a mapped file's pages (a library's data, relocations)
    stack          the main thread's stack
    other          the rest ([vvar], [vsyscall], ...)
    """
    proc = Path("/proc") / str(pid)
    try:
        smaps = (proc / "smaps").read_text()
        status = (proc / "status").read_text()
    except OSError:
        return None
    kib = dict.fromkeys(LAYOUT_KINDS, 0)
    mappings = dict.fromkeys(LAYOUT_KINDS, 0)
    kind, prev_end, prev_guard = "other", None, False
    for line in smaps.splitlines():
        m = _MAPPING.match(line)
        if m:
            start, end, perms, path = int(m.group(1), 16), int(m.group(2), 16), m.group(3), m.group(4)
            if path == "[stack]":
                kind = "stack"
            elif path.startswith("["):
                kind = "heap" if path == "[heap]" else "other"
            elif path:
                kind = "file copies"
            else:
                kind = "thread stacks" if perms.startswith("rw") and prev_guard and prev_end == start else "heap"
            mappings[kind] += 1
            prev_end, prev_guard = end, perms == "---p" and not path and end - start <= GUARD_MAX
        elif line.startswith("Anonymous:"):
            kib[kind] += int(line.split()[1])
    threads = re.search(r"^Threads:\s+(\d+)", status, re.M)
    return {"threads": int(threads.group(1)) if threads else 0, "kib": kib, "mappings": mappings}


def tree_layout(root: int) -> dict[str, dict]:
    """:func:`anon_layout` of ``root`` and every process under it, by :func:`label`."""
    return over_tree(root, anon_layout)


def layout_growth(start: dict[str, dict], end: dict[str, dict]) -> dict[str, dict]:
    """Per process alive at both ends, what changed: threads and each kind's anonymous KiB and
    mappings as [start, end]; a process where nothing changed is left out."""
    out: dict[str, dict] = {}
    for name in sorted(start.keys() & end.keys()):
        a, b = start[name], end[name]
        changed: dict = {}
        if a["threads"] != b["threads"]:
            changed["threads"] = [a["threads"], b["threads"]]
        for field in ("kib", "mappings"):
            moved = {k: [a[field][k], b[field][k]] for k in LAYOUT_KINDS if a[field][k] != b[field][k]}
            if moved:
                changed[field] = moved
        if changed:
            out[name] = changed
    return out

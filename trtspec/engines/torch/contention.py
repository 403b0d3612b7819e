"""How busy the machine was while a choice was measured, and whether a cached choice stands.

Why: the kernel choice (kernels.py) and the compiled-or-eager choice (compiled.py) are measured
once per machine and cached. Measured while other processes kept the cores busy, the timings
are noise: a demo's int4 self-draft once cached PyTorch's kernel (one-row step 29 ms against
the panel kernel's 41 ms, beside two busy jobs) where the panel kernel wins clearly on the
quiet machine (4.35 against 5.19 ms), and every later quiet run paid for it (draft step ~10 ->
19-33 ms). So each measurement samples what OTHER processes used of the cores this process may
run on over the same window (``Watch``): /proc/stat's busy jiffies of those cores (steal
included: another VM's work) minus this process's own CPU time (os.times, waited-for children
included: the C++ compiler), over those cores' total jiffies. It is stored in the cached record
as ``others_busy``.

A record whose ``others_busy`` is above ``BUSY`` is provisional. A later load first probes the
same figure for ``PROBE_SECONDS``: still busy, it uses the provisional choice and measures
nothing (a busy machine never pays for measuring again and again); quiet, it measures again,
and the new record replaces the old one only when that measurement was itself uncontended.
Records without the figure (written before it was kept) and machines without /proc/stat (not
Linux: unknown) are final, as every record was before. ``TRTSPEC_REMEASURE=1`` measures every
choice again at this load and writes the new records, whatever the machine's state.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from trtspec.files import write_json_atomic

# Others' share of this process's cores above which a measurement is provisional. Background
# daemons stay below a few hundredths; one busy neighbour thread on the 2-core machines trtspec
# is measured on is 0.5, and there a spinning thread pool runs up to 15x slower (threads.py).
# A quarter is well above the first and well below the second.
BUSY = 0.25
PROBE_SECONDS = 0.2  # how long a later load samples the machine before measuring a provisional choice again
REMEASURE_ENV = "TRTSPEC_REMEASURE"
PROC_STAT = Path("/proc/stat")


@dataclass(frozen=True)
class CpuSnapshot:
    busy: int  # jiffies the cores this process may run on have spent busy (anyone's work)
    total: int  # ... in all (idle and iowait included)
    own: float  # this process's CPU seconds so far, waited-for children included


def snapshot() -> CpuSnapshot | None:
    """The cores' jiffies and this process's CPU time now; None where /proc/stat cannot be read."""
    try:
        text = PROC_STAT.read_text()
    except OSError:
        return None
    cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    busy = total = 0
    for line in text.splitlines():
        name, *fields = line.split()
        if not name.startswith("cpu") or not name[3:].isdigit() or (cores is not None and int(name[3:]) not in cores):
            continue
        # user nice system idle iowait irq softirq steal (guest time is already inside user)
        ticks = [int(f) for f in fields[:8]]
        total += sum(ticks)
        busy += sum(ticks) - sum(ticks[3:5])
    if total == 0:
        return None
    t = os.times()
    return CpuSnapshot(busy, total, t.user + t.system + t.children_user + t.children_system)


def others_busy(before: CpuSnapshot | None, after: CpuSnapshot | None) -> float | None:
    """Other processes' share of this process's cores between two snapshots (0 .. 1), or None."""
    if before is None or after is None or after.total <= before.total:
        return None
    own = (after.own - before.own) * os.sysconf("SC_CLK_TCK")
    share = (after.busy - before.busy - own) / (after.total - before.total)
    return round(min(1.0, max(0.0, share)), 2)


class Watch:
    """``others``: other processes' share of this process's cores while the block ran (None: unknown)."""

    others: float | None = None

    def __enter__(self) -> Watch:
        self._start = snapshot()
        return self

    def __exit__(self, *exc: object) -> None:
        self.others = others_busy(self._start, snapshot())


def probe(seconds: float = PROBE_SECONDS) -> float | None:
    """Other processes' share of this process's cores over the next ``seconds`` (this one sleeps)."""
    start = snapshot()
    time.sleep(seconds)
    return others_busy(start, snapshot())


def contended(others: float | None) -> bool:
    return others is not None and others > BUSY


def remeasure_forced() -> bool:
    return os.environ.get(REMEASURE_ENV, "").strip().lower() in ("1", "true", "yes")


def describe(key: str) -> str:
    """A cached choice's key as a reader names it: the model's kind, shape, dtype, quantization, layout."""
    try:
        parts = json.loads(key)
    except ValueError:
        return key
    names = [str(parts[k]) for k in ("model", "shape", "dtype", "quantization", "layout") if k in parts]
    return " ".join(names) or key


def stands(record: object, what: str) -> bool:
    """Whether a cached ``record`` of ``what`` (a kernels.json or programs.json entry) is used as
    it is: yes when it was measured on a quiet machine or how busy is unknown; for a provisional
    one, yes while the machine is still busy now, no (measure again) once it is quiet; never
    under TRTSPEC_REMEASURE=1."""
    if remeasure_forced():
        return False
    others = record.get("others_busy") if isinstance(record, dict) else None
    if not contended(others):
        return True
    now = probe()
    if now is None or contended(now):
        _say(f"{what} was measured on a busy machine (others {others:.2f} of the CPUs) and is still busy; using it as it is")
        return True
    _say(f"{what} was measured on a busy machine (others {others:.2f} of the CPUs); measuring again now that it is quiet")
    return False


def replaces(previous: object, others: float | None, what: str) -> bool:
    """Whether a choice just measured with ``others`` busy is cached over ``previous`` (the
    record it was measured again for, or None): a provisional record gives way only to an
    uncontended measurement (or to TRTSPEC_REMEASURE=1). Says so when the new one is contended."""
    if not contended(others):
        return True
    was_provisional = isinstance(previous, dict) and contended(previous.get("others_busy"))
    if was_provisional and not remeasure_forced():
        _say(f"{what} was measured again on a busy machine (others {others:.2f} of the CPUs); the earlier choice stays cached")
        return False
    _say(f"{what} was measured on a busy machine (others {others:.2f} of the CPUs): provisional, measured again at a quiet load")
    return True


def records(path: Path) -> dict:
    """The cached records in ``path`` (kernels.json, programs.json); a missing or damaged file
    has none: its choices are measured again and the file rewritten."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def store(path: Path, key: str, record: dict, others: float | None) -> None:
    """Cache ``record`` under ``key`` in ``path``, stamped with when it was measured and how busy
    other processes kept the cores meanwhile (``others``). A read-only cache keeps nothing:
    the choice is measured again next time."""
    entries = records(path)
    entries[key] = record | {"measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "others_busy": others}
    with contextlib.suppress(OSError):
        write_json_atomic(path, entries)


def _say(message: str) -> None:
    print(f"trtspec: {message}", file=sys.stderr)

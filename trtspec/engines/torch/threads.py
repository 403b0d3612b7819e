"""How many threads torch's CPU kernels use: the cores this process can have, and fewer while a
neighbour takes one.

Why: torch's CPU kernels run on an OpenMP pool (libgomp in torch's wheels) whose threads spin
while they wait for each other, and a decode step is a few hundred short parallel regions. When
another process holds one of the cores, every region waits for the thread that shares that core
with it. Measured on a 2-core Xeon (SmolLM2-135M float32 decode step, median of 40): quiet, 2
threads 38.8 ms, 1 thread 58.9 ms; beside one busy single-threaded process, 2 threads
589 ms (15x), 2 threads with ``OMP_WAIT_POLICY=PASSIVE`` 68 ms (but 54 ms quiet: 1.4x slower
when nobody is there), 1 thread 62.6 ms. So the pool keeps spinning (fastest when quiet) and
shrinks while a neighbour is there:

1. At start the pool gets the cores the process may run on: the affinity mask and the tightest
   cgroup CPU quota over its own cgroup and their ancestors (a pod limited to 1.5 CPUs gets 1
   thread), never more than torch's own default (``OMP_NUM_THREADS`` when set); the governor
   never tries more.
2. ``Governor`` times each forward under a shape key (the engine, its rows and new tokens)
   per thread count and runs each forward with the count whose recent forwards of that shape
   were fastest (the current count wins ties within ``HYSTERESIS``). Every ``PROBE_MIN``
   seconds, doubling to ``PROBE_MAX`` while the choice holds, one forward runs with another
   candidate count, so a neighbour's arrival and departure are both noticed. A shape never
   seen at a candidate count is tried there once first.

``TRTSPEC_THREADS=N`` fixes N threads (the governor keeps its hands off); ``auto``, the default,
does the above. Process-wide: one pool, so one governor for every engine in the process.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Collection, Hashable, Iterator
from pathlib import Path

import torch

from trtspec.errors import SpecError
from trtspec.machine import THREADS_ENV as ENV

PROBE_MIN = 1.0  # seconds between probes of another thread count, after a change
PROBE_MAX = 16.0  # ... doubling up to this while the choice holds
HYSTERESIS = 0.9  # another count must be this much faster than the current one to take over
RECENT = 3  # forwards per (count, shape) whose median stands for it


CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")  # which cgroup this process is in, per hierarchy


def _cgroup_dirs(root: Path, proc_cgroup: Path) -> list[Path]:
    """This process's cgroup folders and every ancestor up to the mount: v2's unified one
    (``0::/path``) and v1's cpu controller (``N:cpu,cpuacct:/path``), plus the mounts themselves
    (a container sees its own cgroup there while /proc still names the host's path)."""
    places = [(root, "/"), (root / "cpu", "/")]
    with contextlib.suppress(OSError):
        for line in proc_cgroup.read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if not controllers:
                places.append((root, path))
            elif "cpu" in controllers.split(","):
                places += [(root / "cpu", path), (root / controllers, path)]
    dirs: list[Path] = []
    for base, path in places:
        here = base / path.strip("/")
        while True:
            dirs.append(here)
            if here == base:
                break
            here = here.parent
    return list(dict.fromkeys(dirs))


def _folder_quota(folder: Path) -> float | None:
    with contextlib.suppress(OSError, ValueError):
        quota, period = (folder / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    with contextlib.suppress(OSError, ValueError):
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 else quota / period
    return None


def quota_cores(root: Path | None = None, proc_cgroup: Path | None = None) -> float | None:
    """The tightest cgroup CPU quota over this process's cgroup and its ancestors, in cores
    (v2 ``cpu.max``, or v1 ``cpu.cfs_quota_us``); None if none is limited. A pod's limit sits
    on its own cgroup, below the mount, so the mount's root alone would miss it."""
    dirs = _cgroup_dirs(CGROUP_ROOT if root is None else root, PROC_CGROUP if proc_cgroup is None else proc_cgroup)
    quotas = [q for q in map(_folder_quota, dirs) if q is not None]
    return min(quotas, default=None)


def usable_cores(quota: float | None = None, affinity: int | None = None) -> int:
    """Cores this process may run on: its affinity mask, capped by the cgroup quota (at least 1)."""
    if affinity is None:
        affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = quota_cores() if quota is None else quota
    cores = affinity if quota is None else min(affinity, math.floor(quota))
    return max(1, cores)


def fixed_threads(value: str | None = None) -> int | None:
    """``TRTSPEC_THREADS`` as a fixed count, None for ``auto`` (or unset); SpecError when malformed."""
    value = os.environ.get(ENV, "auto") if value is None else value
    if value.strip().lower() in ("", "auto"):
        return None
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise SpecError(f"{ENV}={value!r}: give a thread count >= 1, or 'auto' to let trtspec choose")
    return n


def candidates(most: int) -> list[int]:
    """The counts the governor compares: all of them, then one fewer, half and one (descending)."""
    return sorted({most, max(1, most - 1), max(1, most // 2), 1}, reverse=True)


class Governor:
    """Chooses the thread count for each forward from measured forward times (see the module doc).

    ``clock`` and ``set_threads`` are injectable so the policy is testable without a neighbour.
    """

    def __init__(
        self,
        most: int,
        *,
        clock: Callable[[], float] = time.perf_counter,
        set_threads: Callable[[int], None] = torch.set_num_threads,
    ):
        self.counts = candidates(most)
        self.current = self.counts[0]
        self.clock = clock
        self.set_threads = set_threads
        self.times: dict[tuple[int, Hashable], deque[float]] = defaultdict(lambda: deque(maxlen=RECENT))
        self.tried: dict[tuple[int, Hashable], float] = {}  # when each (count, shape) last ran
        self.backoff = PROBE_MIN
        self.next_probe = clock() + PROBE_MIN
        self.applied: int | None = None
        self.switches = 0  # how often the chosen count changed (reported by bench)
        self.holds = 0  # open held() blocks: every forward at the full count, untimed
        self.forced: int | None = None  # inside in_turn(): every forward at this count, untimed
        self._lock = threading.Lock()

    def _time(self, n: int, key: Hashable) -> float | None:
        """What a forward of ``key`` costs with ``n`` threads now: the median of the recent ones
        at the current count, the latest probe at any other (older ones may predate a change)."""
        seen = self.times.get((n, key))
        if not seen:
            return None
        return statistics.median(seen) if n == self.current else seen[-1]

    def pick(self, key: Hashable, allowed: Collection[int] | None = None) -> int:
        """The thread count this forward of shape ``key`` runs with: one of ``allowed`` (None:
        any) where it can be, the counts a compiled program exists for (compiled.py)."""
        if len(self.counts) == 1:
            return self.current
        with self._lock:
            if self.forced is not None:
                return self.forced
            if self.holds:
                return self.counts[0]
            counts = [n for n in self.counts if allowed is None or n in allowed] or [self.current]
            if self.current not in counts:
                return counts[0]
            untried = [n for n in counts if (n, key) not in self.times]
            if self.current in untried:
                return self.current
            if untried:  # a shape seen only at some counts: try it at the next once
                return untried[0]
            now = self.clock()
            others = [n for n in counts if n != self.current]
            if others and now >= self.next_probe:  # a probe: the other count this shape ran longest ago
                self.next_probe = now + self.backoff
                self.backoff = min(self.backoff * 2, PROBE_MAX)
                return min(others, key=lambda n: self.tried.get((n, key), 0.0))
            return self.current

    def record(self, n: int, key: Hashable, seconds: float) -> None:
        """A forward of shape ``key`` took ``seconds`` with ``n`` threads; maybe change the count."""
        with self._lock:
            if self.holds or self.forced is not None:  # no measurement of the count the governor runs
                return
            self.times[(n, key)].append(seconds)
            self.tried[(n, key)] = self.clock()
            mine = self._time(self.current, key)
            if mine is None:
                return
            best, best_time = self.current, HYSTERESIS * mine
            for m in self.counts:
                t = self._time(m, key)
                if m != self.current and t is not None and t < best_time:
                    best, best_time = m, t
            if best != self.current:
                self.current = best
                self.switches += 1
                self.backoff = PROBE_MIN
                self.next_probe = self.clock() + PROBE_MIN

    @contextlib.contextmanager
    def forward(
        self, key: Hashable, compiles: Callable[[], int] | None = None, allowed: Collection[int] | None = None
    ) -> Iterator[int]:
        """Run one forward of shape ``key`` under the chosen count (one of ``allowed``, see pick);
        its time is recorded, unless ``compiles`` (a count of compiles so far) moved while it ran:
        a forward that compiled a program is no measure of the count (one such time would keep a
        count off for minutes)."""
        n = self.pick(key, allowed)
        if n != self.applied:
            self.set_threads(n)
            self.applied = n
        before = compiles() if compiles else 0
        start = self.clock()
        yield n
        if not compiles or compiles() == before:
            self.record(n, key, self.clock() - start)

    def in_turn(self) -> Iterator[int]:
        """Set each count the governor compares in turn, for untimed work that must meet every
        one of them (the engines' matmul shapes and compiled programs at load): forwards inside
        run at that count and are not recorded."""
        try:
            for n in self.counts:
                with self._lock:
                    self.set_threads(n)
                    self.applied = n
                    self.forced = n
                yield n
        finally:  # back to the count the governor runs
            with self._lock:
                self.forced = None
                self.set_threads(self.current)
                self.applied = self.current

    @contextlib.contextmanager
    def held(self) -> Iterator[int]:
        """Every forward inside runs at the full count, neither probing nor recorded: work
        whose outputs must not depend on timing (distill's data: a forward's features differ in
        the last bits between 1 and 2 threads, so a probe would make the same command's data,
        or a capture made again, differ from run to run)."""
        with self._lock:
            self.holds += 1
        try:
            with self.pinned() as n:
                yield n
        finally:
            with self._lock:
                self.holds -= 1

    @contextlib.contextmanager
    def pinned(self) -> Iterator[int]:
        """Run untimed work at the full count, whatever the governor chose: work whose numbers
        must not depend on timing. CPU kernels split their reductions by thread count (a
        training step's weight gradients differ in the last bits between 1 and 2 threads), so
        a probe in the middle of training would make a run differ from the same run resumed."""
        n = self.counts[0]
        with self._lock:
            if n != self.applied:
                self.set_threads(n)
                self.applied = n
        yield n


class _Fixed:
    """A fixed count (``TRTSPEC_THREADS=N``): set once, never changed."""

    switches = 0

    def __init__(self, n: int):
        self.current = n
        self.counts = [n]
        torch.set_num_threads(n)

    @contextlib.contextmanager
    def forward(
        self, key: Hashable, compiles: Callable[[], int] | None = None, allowed: Collection[int] | None = None
    ) -> Iterator[int]:
        yield self.current

    @contextlib.contextmanager
    def pinned(self) -> Iterator[int]:
        yield self.current

    held = pinned

    def in_turn(self) -> Iterator[int]:
        yield self.current


_governor: Governor | _Fixed | None = None
_made = threading.Lock()


def governor() -> Governor | _Fixed:
    """The process's one governor, made on first use (after torch set up its pool)."""
    global _governor
    with _made:
        if _governor is None:
            fixed = fixed_threads()
            if fixed is not None:
                _governor = _Fixed(fixed)
            else:
                _governor = Governor(max(1, min(torch.get_num_threads(), usable_cores())))
        return _governor

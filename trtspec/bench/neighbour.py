"""A synthetic busy neighbour for `trtspec bench --neighbour N`: N processes that each keep one
core busy for as long as the measurement runs, as another tenant's job on a shared CI runner
or laptop would. The engines' thread governor (engines/torch/threads.py) is what they test."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator

# A pure-Python busy loop: one core, no memory traffic, ends when its parent closes its stdin.
_BUSY = "import sys, threading\nthreading.Thread(target=sys.stdin.read, daemon=True).start()\nwhile threading.active_count() > 1: pass\n"


@contextlib.contextmanager
def busy_neighbours(n: int) -> Iterator[list[subprocess.Popen]]:
    """Start ``n`` busy processes; stop them (and wait for them) however the block ends."""
    procs: list[subprocess.Popen] = []
    try:
        for _ in range(n):
            procs.append(subprocess.Popen([sys.executable, "-c", _BUSY], stdin=subprocess.PIPE))
        yield procs
    finally:
        for p in procs:
            with contextlib.suppress(OSError):
                p.stdin.close()
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

"""What machine a measurement ran on: one description for every report that names it
(`trtspec bench`, bench peers, verify's HTML page, the benchmark scripts).

torch is imported only when the description is made, so importing this costs nothing.
"""

from __future__ import annotations

import contextlib
import os
import platform
from pathlib import Path

# The thread count torch's CPU kernels use: N fixes it, "auto" (the default) lets
# engines/torch/threads.py choose; deploy/k8s.py sets it from a pod's CPU limit.
THREADS_ENV = "TRTSPEC_THREADS"


def cpu_name() -> str:
    """The CPU model as the OS names it (/proc/cpuinfo's first model name), else platform's name."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                return value.strip()
    return platform.processor() or platform.machine()


def description() -> str:
    """One line: architecture and cores, torch and its threads (what bench's tables have always
    begun with), then the CPU model and the OS."""
    import torch

    return (
        f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads), "
        f"{cpu_name()}, {platform.system()} {platform.release()}"
    )

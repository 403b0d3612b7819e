"""What the scripts in lab/ share: the repository root, a tritonserver for a spec, the command
line that ran, and the result files the figures of README.md, docs/performance.md and lab/RECORDS.md are
generated from (lab/figures.py).

A result file, lab/results/NAME.json:

    {"command": "python -m lab.ttft ...",         what ran (one string; several lines for several commands)
     "machine": "x86_64 2 cores, torch ...",      trtspec.machine.description() where it ran, or as recorded
     "time": "2026-12-01T21:47Z",                 when (ISO 8601, UTC)
     "values": {...},                             the measured values, as the run wrote them
     "stale": "why"}                              only where a change since makes the figures out of date

The scripts run from the repository root as `python -m lab.NAME`: the lab is a package beside
trtspec, never installed with it and never imported by it (an import-linter contract); tests
import it as `lab.NAME` (pytest puts the repository root on its path, pyproject.toml).
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "lab" / "results"


def command_line(script: str, argv: list[str] | None = None) -> str:
    """`python -m lab.NAME ARGS` as it ran, for SCRIPT NAME.py (argv: sys.argv[1:] unless given)."""
    args = sys.argv[1:] if argv is None else argv
    return shlex.join(["python", "-m", f"lab.{Path(script).stem}", *args])


@dataclass(frozen=True)
class Result:
    """One result file: how its figures were made and the figures themselves."""

    command: str
    machine: str
    time: str
    values: dict
    stale: str | None = None

    @classmethod
    def read(cls, path: Path) -> Result:
        data = json.loads(path.read_text(encoding="utf-8"))
        missing = [k for k in ("command", "machine", "time", "values") if k not in data]
        if missing:
            raise ValueError(f"{path}: no {', '.join(missing)}; a result file holds command, machine, time and values")
        return cls(data["command"], data["machine"], data["time"], data["values"], data.get("stale"))

    def to_dict(self) -> dict:
        out = {"command": self.command, "machine": self.machine, "time": self.time, "values": self.values}
        return out | ({"stale": self.stale} if self.stale else {})


def start_server(loaded, env: dict[str, str] | None = None, **options):
    """tritonserver on a fresh temporary model repository of ``loaded``'s built engines, on free
    loopback ports, ready; the caller stops it. ``env`` is added to the server's environment;
    ``options`` go to TritonServer.for_repository (allocator, extra_args)."""
    import tempfile

    from trtspec.triton.repository.writer import write_repository
    from trtspec.triton.server.process import TritonServer

    repo = write_repository(loaded, loaded.output_dir(), Path(tempfile.mkdtemp(prefix="trtspec-bench-")) / "repo")
    server = TritonServer.for_repository(repo, **options)
    if env:
        server.env = (server.env or {}) | env
    server.start()
    try:
        seconds = server.wait_ready(600)
    except BaseException:
        server.stop()
        raise
    allocator = (server.env or {}).get("LD_PRELOAD") or "glibc malloc"
    print(f"server ready in {seconds:.1f}s ({allocator})", flush=True)
    return server


def totals_mib(field: str = "held", **snapshots) -> dict[str, float]:
    """Each named snapshot of the server tree's memory (server_memory.tree_memory)
    as its total ``field`` in MiB, one decimal."""
    from lab.server_memory import total

    return {name: round(total(snapshot, field) / 1024, 1) for name, snapshot in snapshots.items()}


def served_or_given(loaded, url: str | None):
    """(the server started here, its gRPC address), or (None, ``url``) where one is given."""
    if url is not None:
        return None, url
    server = start_server(loaded)
    return server, server.grpc_endpoint


def write_result(path: Path, command: str, values: dict, machine: str | None = None) -> Path:
    """Write a result file now (machine: this machine's description unless given)."""
    from trtspec.files import write_json_atomic
    from trtspec.machine import description

    stamp = time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime())
    write_json_atomic(path, Result(command, machine or description(), stamp, values).to_dict())
    return path

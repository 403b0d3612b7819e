"""The choices this machine has measured and cached: listed (`trtspec choices`), and cleared so
that the next load measures them again (`trtspec choices --clear`).

Two files under $TRTSPEC_CACHE: kernels.json (which kernel layout runs each model shape's
Linears, kernels.py) and programs.json (eager or compiled, per kind of step, compiled.py). Each
record says when it was measured and how busy other processes kept the cores meanwhile
(contention.py); a provisional one is measured again at a quiet load.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from trtspec.cache import cache_root
from trtspec.engines.torch import compiled, contention, kernels
from trtspec.errors import RuntimeFailure
from trtspec.files import exclusive_lock

FILES = {"kernels": kernels.CACHE_FILE, "programs": compiled.CACHE_FILE}


@dataclass
class CachedChoice:
    kind: str  # kernels | programs
    what: str  # the model's kind, shape, dtype, quantization (and layout, for programs)
    threads: str
    choice: str  # the kernel layout, or each kind of step's path
    measured_at: str
    others_busy: float | None  # other processes' share of the cores while measured; None: unknown
    provisional: bool  # measured on a busy machine: measured again at a quiet load


@dataclass
class ChoicesReport:
    folder: Path
    choices: list[CachedChoice] = field(default_factory=list)
    cleared: bool = False

    def to_dict(self) -> dict:
        return {"folder": str(self.folder), "cleared": self.cleared, "choices": [asdict(c) for c in self.choices]}

    def render(self, out) -> None:
        from rich.table import Table

        verb = "cleared" if self.cleared else "cached"
        table = Table(title=f"measured choices {verb} in {self.folder}")
        for col in ("file", "model", "threads", "choice", "measured", "others busy"):
            table.add_column(col)
        for c in self.choices:
            busy = "unknown" if c.others_busy is None else f"{c.others_busy:.2f}" + (" (provisional)" if c.provisional else "")
            table.add_row(FILES[c.kind], c.what, c.threads, c.choice, c.measured_at, busy)
        out.print(table if self.choices else f"no measured choices {verb} in {self.folder}")


def _entry(kind: str, key: str, record: dict) -> CachedChoice:
    parts = json.loads(key) if key.startswith("{") else {}
    choice = str(record.get("layout")) if kind == "kernels" else f"one row {record.get('one')}, more rows {record.get('many')}"
    others = record.get("others_busy")
    others = others if isinstance(others, int | float) else None
    return CachedChoice(
        kind,
        contention.describe(key),
        str(parts.get("threads", "")),
        choice,
        str(record.get("measured_at", "")),
        others,
        contention.contended(others),
    )


def cached_choices(folder: Path | None = None) -> ChoicesReport:
    """Every record of both files (a missing or damaged file has none)."""
    folder = folder or cache_root()
    report = ChoicesReport(folder)
    for kind, name in FILES.items():
        for key, record in contention.records(folder / name).items():
            if isinstance(record, dict):
                report.choices.append(_entry(kind, key, record))
    return report


def clear_choices(folder: Path | None = None) -> ChoicesReport:
    """Remove both files (kernels.json under the lock its measurements hold): every choice is
    measured again at its next load. Returns what they held."""
    report = cached_choices(folder)
    for name in FILES.values():
        path = report.folder / name
        try:
            with exclusive_lock(path.with_suffix(".lock")), contextlib.suppress(FileNotFoundError):
                path.unlink()
        except OSError as err:
            raise RuntimeFailure(
                f"cannot remove {path} ({err.strerror}): remove it by hand, or fix its folder's permissions"
            ) from err
    report.cleared = True
    return report

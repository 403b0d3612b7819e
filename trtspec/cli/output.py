"""The one way every command prints its result: a human view, or JSON.

Data goes to stdout and diagnostics to stderr. ``--json`` prints the report as JSON to stdout
instead of the human view; ``--json-file F`` also writes it to F (atomically).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from trtspec import console
from trtspec.files import write_json_atomic


class Report(Protocol):
    def to_dict(self) -> dict: ...


def emit(report: Report, human: Callable[[object], None], *, as_json: bool = False, json_file: Path | None = None) -> None:
    """``human(console.out)`` or the report's JSON on stdout; the JSON file when asked."""
    data = report.to_dict()
    if as_json:
        console.out.print_json(json.dumps(data))
    else:
        human(console.out)
    if json_file is not None:
        write_json_atomic(json_file, data)
        console.info(f"wrote {json_file}")

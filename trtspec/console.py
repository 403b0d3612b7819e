"""Output helpers: data goes to stdout, diagnostics and progress to stderr."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console

# Piped output (CI logs) gets a wide table instead of rich's 80-column default.
_width = None if sys.stdout.isatty() else int(os.environ.get("COLUMNS", "160"))
out = Console(soft_wrap=True, highlight=False, width=_width)
err = Console(stderr=True, soft_wrap=True, highlight=False)


@contextmanager
def step(description: str) -> Iterator[None]:
    """Show a spinner while a long step runs, then one line with its duration."""
    start = time.perf_counter()
    with err.status(description + " ..."):
        yield
    err.print(f"[green]done[/green] {description} ({time.perf_counter() - start:.1f}s)")


def info(message: str) -> None:
    err.print(message)

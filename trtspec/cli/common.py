"""What every command shares: option aliases and one way to report errors."""

from __future__ import annotations

import functools
import os
import traceback
from pathlib import Path
from typing import Annotated

import typer

from trtspec import console
from trtspec.errors import EXIT_INTERRUPTED, TrtspecError

SpecArg = Annotated[Path, typer.Argument(help="Engine spec YAML (engine_specs/*.yaml).", show_default=False)]
OutputOpt = Annotated[
    Path | None,
    typer.Option("--output", "-o", help="Engine folder (default: the spec's output_dir, else engines/<name>)."),
]
AllowPickleOpt = Annotated[
    bool,
    typer.Option("--allow-pickle", help="Also load pickle weights (.bin/.pt). Pickle can run code: only for trusted sources."),
]
EnginesOpt = Annotated[
    Path | None,
    typer.Option("--engines", help="Engine folder (default: the spec's output_dir, else engines/<name>)."),
]
JsonOpt = Annotated[Path | None, typer.Option("--json", help="Also write the report as JSON to this file.")]


def handle_errors(fn):
    """Turn TrtspecError into `Error: <message>` on stderr and its exit code.

    TRTSPEC_DEBUG=1 prints the traceback as well.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except TrtspecError as e:
            if os.environ.get("TRTSPEC_DEBUG"):
                traceback.print_exc()
            console.err.print(f"[red]Error:[/red] {e}", markup=True)
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt:
            console.err.print("Interrupted.")
            raise typer.Exit(EXIT_INTERRUPTED) from None

    return wrapper

"""`trtspec choices`: the kernel and compiled-step choices this machine measured and cached."""

from __future__ import annotations

from typing import Annotated

import typer

from trtspec.cli.common import JsonFileOpt, JsonOpt, handle_errors
from trtspec.cli.output import emit
from trtspec.engines.torch.choices import cached_choices, clear_choices

ClearOpt = Annotated[bool, typer.Option("--clear", help="Remove every cached choice: the next load measures again.")]


@handle_errors
def choices(clear: ClearOpt = False, as_json: JsonOpt = False, json_file: JsonFileOpt = None) -> None:
    """List the kernel and compiled-step choices this machine measured and cached.

    The choices live under $TRTSPEC_CACHE: each model shape's kernel layout (kernels.json) and
    eager or compiled per kind of step (programs.json), with when each was measured and how busy
    other processes kept the CPUs meanwhile. A choice measured on a busy machine (others above
    0.25 of the CPUs) is provisional: a load that finds the machine quiet measures it again. With
    --clear, remove them all (what they held is listed); TRTSPEC_REMEASURE=1 measures again at
    one load without removing anything.

    Examples:
      trtspec choices
      trtspec choices --json
      trtspec choices --clear
    """
    report = clear_choices() if clear else cached_choices()
    emit(report, report.render, as_json=as_json, json_file=json_file)

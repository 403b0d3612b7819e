"""`trtspec stop`: stop a server started with `trtspec serve --detach`."""

from __future__ import annotations

from typing import Annotated

import typer

from trtspec import console
from trtspec.cli.common import PidFileOpt, handle_errors
from trtspec.triton.server.detached import stop_detached
from trtspec.triton.server.launch import DEFAULT_PID_FILE

TimeoutOpt = Annotated[float, typer.Option("--timeout", min=1, help="Seconds before SIGKILL.")]


@handle_errors
def stop(
    pid_file: PidFileOpt = DEFAULT_PID_FILE,
    timeout: TimeoutOpt = 30.0,
) -> None:
    """Stop a detached server and every stub process; remove its pid file.

    Examples:
      trtspec stop
      trtspec stop --pid-file ci/server.json
    """
    if stop_detached(pid_file, timeout):
        console.out.print(f"stopped the server of {pid_file}")
    else:
        console.out.print(f"the server of {pid_file} had already exited; removed the pid file")

"""One MPI rank's tritonserver, started with the admin key off every command line.

mpirun starts each rank with the words it was given, so a tritonserver rank given its admin
rules (--http-restricted-api / --grpc-restricted-protocol) would show the key to every local
user (/proc/PID/cmdline), and tritonserver takes the key in no other form. So each rank runs
``python -m trtspec.triton.server.rank TRITONSERVER ARGS...``, whose arguments carry REDACTED
where the key goes; mpirun exports the key by name (``-x TRTSPEC_ADMIN_KEY``, its value in
mpirun's environment, which only its own user can read), and this process starts tritonserver
through hidden_args: the server parses the key, its command line shows REDACTED. It stays the
server's parent: the signals mpirun sends are passed on, and it exits as the server does.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence

from trtspec.errors import EXIT_BAD_INPUT, ServerError, TrtspecError
from trtspec.triton.server import hidden_args
from trtspec.triton.server.process import ADMIN_KEY_ENV, REDACTED, die_with_parent

MODULE = "trtspec.triton.server.rank"
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def rank_argv(python: str, server_argv: Sequence[str], key: str) -> list[str]:
    """The words one rank runs: this module under ``python``, and ``server_argv`` with ``key``
    replaced by REDACTED (the rank reads it from ADMIN_KEY_ENV)."""
    return [python, "-m", MODULE, *(a.replace(key, REDACTED) if key else a for a in server_argv)]


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    key = os.environ.pop(ADMIN_KEY_ENV, "")
    hidden = {i: a.replace(REDACTED, key) for i, a in enumerate(args) if REDACTED in a}
    try:
        if not args:
            raise TrtspecError(f"usage: python -m {MODULE} TRITONSERVER [ARGS...]", EXIT_BAD_INPUT)
        if hidden and not key:
            raise ServerError(
                f"the rank's command line holds {REDACTED} but {ADMIN_KEY_ENV} is unset; mpirun must export it (-x)"
            )
        proc = hidden_args.spawn(args, hidden, dict(os.environ), die_with_parent)
    except TrtspecError as err:
        print(f"Error: {err}", file=sys.stderr, flush=True)
        return err.exit_code
    for sig in _FORWARDED:
        signal.signal(sig, lambda signum, _frame: proc.send_signal(signum))
    code = proc.wait()
    return 128 - code if code < 0 else code  # killed by a signal: as a shell reports it


if __name__ == "__main__":
    sys.exit(main())

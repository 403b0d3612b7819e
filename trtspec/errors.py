"""One error hierarchy for user-facing failures.

Every error carries a message that names the problem and the fix, and an exit code.
The CLI prints ``Error: <message>`` (no traceback unless TRTSPEC_DEBUG=1) and exits with it.

Exit codes (documented in README):
    0  success
    1  verify found a divergence (outputs not token-identical)
    2  bad input: spec, checkpoint, flag, request, output folder
    3  runtime or environment failure: server did not start, engine failed to load
  130  interrupted (Ctrl-C)
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_DIVERGED = 1
EXIT_BAD_INPUT = 2
EXIT_RUNTIME = 3
EXIT_INTERRUPTED = 130


class TrtspecError(Exception):
    """A failure the user can act on; ``str(err)`` is the whole message."""

    exit_code = EXIT_BAD_INPUT

    def __init__(self, message: str, exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class SpecError(TrtspecError):
    """The engine spec YAML is malformed or inconsistent."""


class CheckpointError(TrtspecError):
    """A checkpoint is missing, unsafe to load, or incompatible with its partner."""


class EngineError(TrtspecError):
    """An engine folder is missing, incomplete or stale: rebuild it."""


class RequestError(TrtspecError):
    """A generation request is invalid (prompt too long, bad max_tokens, ...)."""


class RuntimeFailure(TrtspecError):
    """Something outside the user's input failed (server start, subprocess)."""

    exit_code = EXIT_RUNTIME


class ServerError(RuntimeFailure):
    """tritonserver could not be found, started or stopped (exit code 3)."""

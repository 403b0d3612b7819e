"""The backend's one logger: Triton's own (``pb_utils.Logger``, lines in tritonserver's log)
inside the Python stub, Python's ``logging`` (logger ``trtspec.triton.backend``) where
``triton_python_backend_utils`` is absent (tests, tools).

Every error the backend swallows to keep serving (a sender that refused an answer, an observer
that raised, an engine request abandoned at its timeout) goes through here, with the request id
when there is one, so that an operator can find what happened to a request. Logging never
raises: a failing logger must not fail the request it reports on.
"""

from __future__ import annotations

import logging
import sys

FALLBACK = logging.getLogger("trtspec.triton.backend")


def _triton_logger():
    """pb_utils.Logger when the stub (or a test's stand-in) has loaded pb_utils, else None."""
    return getattr(sys.modules.get("triton_python_backend_utils"), "Logger", None)


def _text(message: str, request_id: str | None) -> str:
    return f"trtspec: {message}" + (f" [request id {request_id!r}]" if request_id else "")


def info(message: str, request_id: str | None = None) -> None:
    _log("log_info", logging.INFO, _text(message, request_id))


def error(message: str, request_id: str | None = None) -> None:
    _log("log_error", logging.ERROR, _text(message, request_id))


def warn(message: str, request_id: str | None = None) -> None:
    _log("log_warn", logging.WARNING, _text(message, request_id))


def _log(method: str, level: int, text: str) -> None:
    logger = _triton_logger()
    try:
        if logger is not None:
            getattr(logger, method)(text)
            return
    except Exception:  # noqa: S110 - fall back to Python's logging below
        pass
    try:
        FALLBACK.log(level, text)
    except Exception:  # noqa: S110 - logging must never fail the request it reports on
        pass


def request_id(reply) -> str | None:
    """The request id of a scheduler Reply (models/pb.Reply) or a pb_utils request, None when
    it has none."""
    try:
        rid = getattr(reply, "request_id", None)
        rid = rid() if callable(rid) else rid
    except Exception:
        return None
    return str(rid) if rid else None

"""A stand-in for ``triton_python_backend_utils``, for running the Triton model classes
(trtspec/triton/backend/models/) without a server. It keeps the semantics trtspec relies on,
as python_backend's sources state them (src/response_sender.cc, src/infer_request.cc,
src/pb_stub.cc):

- one response sender per request (``get_response_sender`` returns the same one);
- a send with the FINAL flag marks the sender closed BEFORE the response is written, so a
  final whose write raises still closes it, and every later send raises "Unable to send
  response. Response sender has been closed.";
- ``Logger.log_error`` / ``log_warn`` / ``log_info`` / ``log_verbose`` write to Triton's log.

``install(monkeypatch)`` puts it in ``sys.modules`` and forgets the model modules imported
against it when the test ends.
"""

from __future__ import annotations

import sys
import types
from functools import partialmethod

import numpy as np

FINAL = 1
CLOSED = "Unable to send response. Response sender has been closed."
NAMES = ["triton_python_backend_utils", "trtspec.triton.backend.models", "trtspec.triton.backend.models.pb"]
MODELS = [
    "trtspec.triton.backend.models.orchestrator",
    "trtspec.triton.backend.models.llmapi_model",
    "trtspec.triton.backend.models.engine_model",
]


class Tensor:
    def __init__(self, name: str, array):
        self._name, self._array = name, np.asarray(array)

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array


class TritonError:
    INVALID_ARG, INTERNAL, UNAVAILABLE, CANCELLED = "INVALID_ARG", "INTERNAL", "UNAVAILABLE", "CANCELLED"

    def __init__(self, message: str, code: str = "INTERNAL"):
        self._message, self.code = message, code

    def message(self) -> str:
        return self._message


class InferenceResponse:
    def __init__(self, output_tensors=(), error=None):
        self.output_tensors, self._error = list(output_tensors), error

    def has_error(self) -> bool:
        return self._error is not None

    def error(self):
        return self._error


class ResponseSender:
    """``write_raises``: the n-th send's write raises (1-based; "final": the final one's)."""

    def __init__(self, write_raises=None):
        self.responses: list[tuple[InferenceResponse | None, int]] = []
        self.closed = False
        self.refused = 0  # sends after the final
        self.sends = 0
        self.write_raises = write_raises

    def send(self, response=None, flags=0):
        if self.closed:
            self.refused += 1
            raise RuntimeError(CLOSED)
        if flags == FINAL:
            self.closed = True  # before the write, as the stub does
        self.sends += 1
        if self.write_raises == self.sends or (self.write_raises == "final" and flags == FINAL):
            raise RuntimeError("Failed to increase the shared memory pool size")
        self.responses.append((response, flags))

    @property
    def finals(self) -> int:
        return sum(1 for _, flags in self.responses if flags == FINAL)

    @property
    def errors(self) -> list[str]:
        return [r.error().message() for r, _ in self.responses if r is not None and r.has_error()]


class Request:
    """An InferenceRequest as a model's execute() gets it; ``unreadable``: inputs() raises."""

    def __init__(
        self,
        inputs: dict,
        request_id: str = "",
        unreadable: bool = False,
        sender: ResponseSender | None = None,
        parameters: str = "{}",
    ):
        self._inputs, self._id, self.unreadable, self._parameters = inputs, request_id, unreadable, parameters
        self.sender = sender or ResponseSender()
        self.cancelled = False

    def inputs(self):
        if self.unreadable:
            raise RuntimeError("Failed to load the input tensors from shared memory")
        return [Tensor(k, v) for k, v in self._inputs.items()]

    def get_response_sender(self) -> ResponseSender:
        return self.sender

    def timeout(self) -> int:
        return 0

    def is_cancelled(self) -> bool:
        return self.cancelled

    def request_id(self) -> str:
        return self._id

    def parameters(self) -> str:
        """The request's parameters as python_backend gives them: a JSON string."""
        return self._parameters


class InferenceRequest:
    """A BLS request as a model builds it; ``made`` keeps every one (the test reads them)."""

    made: list[InferenceRequest] = []

    def __init__(self, model_name, requested_output_names, inputs, timeout=0, parameters=None):
        self.model_name, self.inputs, self.parameters = model_name, inputs, parameters
        InferenceRequest.made.append(self)


class Logger:
    lines: list[tuple[str, str]] = []  # (level, message), one per call

    @classmethod
    def _log(cls, level: str, message) -> None:
        cls.lines.append((level, message))

    log_error = partialmethod(_log, "error")
    log_warn = partialmethod(_log, "warn")
    log_info = partialmethod(_log, "info")
    log_verbose = partialmethod(_log, "verbose")


def module() -> types.ModuleType:
    pb = types.ModuleType("triton_python_backend_utils")
    pb.Tensor, pb.TritonError, pb.InferenceResponse, pb.Logger = Tensor, TritonError, InferenceResponse, Logger
    pb.InferenceRequest = InferenceRequest
    pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL
    return pb


def install(monkeypatch) -> types.ModuleType:
    """The stand-in in sys.modules (the model modules are imported against it afresh)."""
    for name in NAMES + MODELS:
        monkeypatch.delitem(sys.modules, name, raising=False)
    pb = module()
    Logger.lines = []
    InferenceRequest.made = []
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", pb)
    monkeypatch.setenv("GOMP_SPINCOUNT", "10000")  # models/__init__ would set it for the stub
    return pb


def forget() -> None:
    """Drop the model modules imported against the stand-in."""
    for name in NAMES[1:] + MODELS:
        sys.modules.pop(name, None)

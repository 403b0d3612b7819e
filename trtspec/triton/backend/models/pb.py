"""Conversions between pb_utils objects and the dicts of numpy arrays the cores use."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping

import numpy as np
import triton_python_backend_utils as pb_utils

from trtspec.errors import RequestError
from trtspec.triton.backend import callers, log
from trtspec.triton.backend.callers import CALLER_PARAMETER


def parameters(args: Mapping[str, str]) -> dict[str, str]:
    """The model's config parameters as plain strings."""
    config = json.loads(args["model_config"])
    return {k: v["string_value"] for k, v in config.get("parameters", {}).items()}


def model_config(args: Mapping[str, str]) -> dict:
    return json.loads(args["model_config"])


def inputs_of(request) -> dict[str, np.ndarray]:
    return {t.name(): t.as_numpy() for t in request.inputs()}


def response(tensors: Mapping[str, np.ndarray]):
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, v) for k, v in tensors.items()])


def error_response(err: Exception):
    """A TritonError response; INVALID_ARG for the client's mistakes, the error's own
    ``triton_code`` (UNAVAILABLE, CANCELLED) where it names one, INTERNAL otherwise."""
    code_name = "INVALID_ARG" if isinstance(err, RequestError) else getattr(err, "triton_code", "INTERNAL")
    code = getattr(pb_utils.TritonError, code_name, None)
    error = pb_utils.TritonError(str(err), code) if code is not None else pb_utils.TritonError(str(err))
    return pb_utils.InferenceResponse(output_tensors=[], error=error)


class Reply:
    """A scheduler Reply over a request's response sender: answers from any thread, after
    execute() returned (decoupled models, and non-decoupled ones with exactly one final
    response, which tritonserver 2.51's Python backend accepts)."""

    def __init__(self, request):
        self.request = request
        self.sender = request.get_response_sender()

    def send(self, tensors: Mapping[str, np.ndarray], final: bool) -> None:
        self.sender.send(response(tensors), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)

    def fail(self, err: Exception) -> None:
        self.sender.send(error_response(err), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def cancelled(self) -> bool:
        """The client cancelled, disconnected or let its deadline pass."""
        return self.request.is_cancelled()

    def request_id(self) -> str:
        """The client's request id ('' when it sent none), for the log."""
        return self.request.request_id()

    def close(self) -> None:
        """End the request without a response (its client left), so Triton releases it."""
        self.sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


def guarded(request, take: Callable[[], None]) -> None:
    """Run ``take``, which answers ``request`` itself (now, or later from the scheduler). If it
    raises, the request alone is answered with the error and execute() goes on: a raising
    execute() makes Triton answer every request of the batch, the ones already handed over
    too, which would then be answered twice. A sender that refuses (already closed) is logged."""
    try:
        take()
    except Exception as err:
        rid = log.request_id(request)
        log.error(f"could not take the request: {type(err).__name__}: {err}", rid)
        try:
            answer = error_response(RuntimeError(f"could not take the request: {type(err).__name__}: {err}"))
            request.get_response_sender().send(answer, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as refused:
            log.error(f"its error answer could not be sent either: {type(refused).__name__}: {refused}", rid)


def _request(model: str, inputs: Mapping[str, np.ndarray], output_names, timeout_us: int = 0, key: str | None = None):
    # timeout: microseconds (python_backend's InferenceRequest; 0 = none); Triton answers a
    # request still queued at the engine model past it with an error. key: this server's
    # caller key, which torch engine models ask of every request (callers.py).
    extra = {} if key is None else {"parameters": {CALLER_PARAMETER: key}}
    return pb_utils.InferenceRequest(
        model_name=model,
        requested_output_names=list(output_names),
        inputs=[pb_utils.Tensor(k, np.ascontiguousarray(v)) for k, v in inputs.items()],
        timeout=int(timeout_us),
        **extra,
    )


def caller_of(request, key: str | None) -> str:
    """Who sent the request: callers.INSIDE, ANYONE or WRONG_KEY (callers.caller_of)."""
    try:
        parameters = request.parameters()
    except Exception:
        return callers.WRONG_KEY
    return callers.caller_of(parameters, key)


def from_inside(request, key: str | None) -> bool:
    """The request came from this repository's own BLS models (callers.py); False where this
    server has no key (fail closed)."""
    return caller_of(request, key) == callers.INSIDE


def _outputs(model: str, reply, output_names) -> dict[str, np.ndarray]:
    """The named output arrays of a BLS reply; RuntimeError on an error reply or a missing one."""
    if reply.has_error():
        raise RuntimeError(f"{model}: {reply.error().message()}")
    out = {}
    for name in output_names:
        tensor = pb_utils.get_output_tensor_by_name(reply, name)
        if tensor is None:
            raise RuntimeError(f"{model} returned no {name}")
        out[name] = tensor.as_numpy()
    return out


def bls_call(
    model: str, inputs: Mapping[str, np.ndarray], output_names, timeout_us: int = 0, key: str | None = None
) -> dict[str, np.ndarray]:
    """One synchronous BLS request to another model of this server."""
    return _outputs(model, _request(model, inputs, output_names, timeout_us, key).exec(), output_names)


def bls_call_many(model: str, requests, output_names, timeout_us: int = 0) -> list[dict[str, np.ndarray]]:
    """Several single-row BLS requests to ``model``, all in flight at once (async_exec), so
    a non-decoupled TensorRT-LLM model batches them in flight instead of refusing a batch."""
    import asyncio

    async def all_replies():
        return await asyncio.gather(*[_request(model, inputs, output_names, timeout_us).async_exec() for inputs in requests])

    return [_outputs(model, reply, output_names) for reply in asyncio.run(all_replies())]

"""The OpenAI front's one way to the deployment: Triton's gRPC API (asyncio client).

A completion is one request to the text endpoints of a trtspec repository:
`tensorrt_llm_bls` (unary) or `tensorrt_llm_bls_streaming` (streamed steps) for the
speculative model, `target_only` for the control. Token counts, finish reason and the whole
generation's speculative metrics come back as tensors (triton/backend/contract.py).

Every call has a deadline (``timeout``), and every failure becomes one ``DeploymentError``
carrying the HTTP status it means (``STATUS_OF``): the deployment's INVALID_ARG is the client's
mistake (400), UNAVAILABLE (queue full, unloading, unreachable) is 503, a deadline 504, the
rest 500. Streams are opened with Triton's ``triton_grpc_error`` header, so a streamed error
keeps its gRPC status code (without it a stream error carries its message only).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from trtspec.errors import RequestError
from trtspec.layout import BLS_MODEL, BLS_STREAMING_MODEL, CONTROL_MODEL
from trtspec.triton.backend.callers import CALLER_PARAMETER
from trtspec.triton.request import infer_inputs

# gRPC status (as tritonclient and grpc name it) -> HTTP status of the OpenAI front.
STATUS_OF = {
    "INVALID_ARGUMENT": 400,
    "INVALID_ARG": 400,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
    "CANCELLED": 499,  # the client went away; nobody reads the answer
}
STREAM_STATUS_HEADERS = {"triton_grpc_error": "true"}  # Triton >= 24.08: stream errors keep their code


class DeploymentError(Exception):
    """A request the deployment refused or failed, with the HTTP status that says why."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


WANTED = [
    "text_output",
    "finish_reason",
    "num_input_tokens",
    "num_output_tokens",
    "acceptance_rate",
    "total_accepted_draft_tokens",
    "total_draft_tokens",
]


LOG_PROB_OUTPUTS = ["output_ids", "sequence_length", "output_log_probs"]


@dataclass
class Piece:
    """One response: new text; on the last one, counts and the finish reason."""

    text: str
    final: bool
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    acceptance_rate: float = 0.0
    token_ids: list[int] | None = None  # with log probs: the generated tokens ...
    log_probs: list[float] | None = None  # ... and the target's log prob of each


@dataclass(frozen=True)
class Generation:
    text: str  # already templated when chat
    max_tokens: int
    stop: tuple[str, ...] = ()
    apply_chat_template: bool = False
    num_draft_tokens: int | None = None
    control: bool = False  # target-only path
    sampling: tuple[float, float, int] | None = None  # (temperature, top_p, seed); None: greedy
    processing: tuple[tuple[str, float], ...] = ()  # upstream input name -> value (penalties, min_tokens)
    log_probs: bool = False
    ignore_eos: bool = False  # generate exactly max_tokens: no end token (upstream's end_id -1)
    suffix_cache_scope: str | None = None  # the suffix cache scope (None: the shared one)
    suffix_cache: bool = True  # False: neither read nor feed the suffix cache
    capture: bool = True  # False: serve.capture never keeps it


class TritonText:
    """Completions from a running trtspec deployment at ``url`` (HOST:PORT, gRPC); every call
    waits at most ``timeout`` seconds. ``caller_key``: the server's caller key
    (triton/backend/callers.py), sent with every request so the endpoints take this front's
    suffix cache scopes (its tenants'); None: none is sent, and the endpoints put every request
    in their shared scope."""

    def __init__(self, url: str, timeout: float = 600.0, caller_key: str | None = None):
        self.url = url
        self.timeout = timeout
        self.parameters = None if caller_key is None else {CALLER_PARAMETER: caller_key}
        self._client = None

    @property
    def client(self):
        # Made on first use, inside the server's event loop (a gRPC aio channel is bound to it).
        if self._client is None:
            import tritonclient.grpc.aio as grpcaio

            self._client = grpcaio.InferenceServerClient(self.url)
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()

    async def ready(self) -> list[str]:
        """Names of the text endpoints that are ready."""
        names = []
        for m in (BLS_MODEL, BLS_STREAMING_MODEL, CONTROL_MODEL):
            try:
                if await self.client.is_model_ready(m, client_timeout=5):
                    names.append(m)
            except Exception:  # a missing model is "not ready", not a failure
                pass
        return names

    @staticmethod
    def _inputs(g: Generation, stream: bool) -> list:
        values: dict = {
            "text_input": g.text,
            "max_tokens": g.max_tokens,
            "exclude_input_in_output": True,
            "apply_chat_template": g.apply_chat_template,
            "return_perf_metrics": True,
            "return_num_input_tokens": True,
            "return_num_output_tokens": True,
        }
        if stream:
            values["stream"] = True
        if g.stop:
            values["stop_words"] = list(g.stop)
        if g.num_draft_tokens is not None:
            values["num_draft_tokens"] = g.num_draft_tokens
        if g.ignore_eos:  # as TensorRT-LLM's executor carries ignore_eos: end_id -1, no end token
            values["end_id"] = -1
        if g.sampling is not None:  # upstream BLS names: top_k 0 (all) with top_p samples
            temperature, top_p, seed = g.sampling
            values |= {"temperature": temperature, "top_k": 0, "top_p": top_p, "seed": seed}
        values |= dict(g.processing)  # each under its contract type (min_tokens INT32, the rest FP32)
        if g.log_probs:
            values["return_log_probs"] = True
        if g.suffix_cache_scope is not None:
            values["suffix_cache_scope"] = g.suffix_cache_scope
        if not g.suffix_cache:
            values["suffix_cache"] = False
        if not g.capture:
            values["capture"] = False
        return infer_inputs(values)

    @staticmethod
    def _wanted(g: Generation) -> list:
        import tritonclient.grpc as grpcclient

        return [grpcclient.InferRequestedOutput(n) for n in WANTED + (LOG_PROB_OUTPUTS if g.log_probs else [])]

    async def complete(self, g: Generation) -> Piece:
        outputs = self._wanted(g)
        model = CONTROL_MODEL if g.control else BLS_MODEL
        try:
            result = await self.client.infer(
                model, self._inputs(g, False), outputs=outputs, client_timeout=self.timeout, parameters=self.parameters
            )
        except Exception as err:
            raise self._error(err) from None
        return _piece(result, final=True)

    async def stream(self, g: Generation) -> AsyncIterator[Piece]:
        """Pieces as the deployment streams them. The control endpoint does not stream: its
        whole answer comes as one piece."""
        if g.control:
            yield await self.complete(g)
            return

        request = {
            "model_name": BLS_STREAMING_MODEL,
            "inputs": self._inputs(g, True),
            "outputs": self._wanted(g),
            "request_id": uuid.uuid4().hex,
            "enable_empty_final_response": True,
            "parameters": self.parameters,
        }

        async def requests():
            yield request

        responses = None
        try:
            responses = self.client.stream_infer(requests(), stream_timeout=self.timeout, headers=STREAM_STATUS_HEADERS)
            async for result, error in responses:
                if error is not None:
                    raise self._error(error)
                final = result.get_response().parameters["triton_final_response"].bool_param
                yield _piece(result, final)
                if final:
                    return
        except DeploymentError:
            raise
        except Exception as err:
            raise self._error(err) from None
        finally:
            if responses is not None:
                responses.cancel()  # a client gone mid-stream cancels the request (a no-op once done)

    def _error(self, err: Exception) -> DeploymentError:
        return as_error(err, self.url, self.timeout)


def as_error(err: Exception, url: str, timeout: float) -> DeploymentError:
    """Any failure of a call to the deployment as the DeploymentError it means."""
    import grpc
    from tritonclient.utils import InferenceServerException

    if isinstance(err, RequestError):
        return DeploymentError(400, str(err))
    if isinstance(err, grpc.RpcError) and hasattr(err, "code"):
        code, text = err.code().name, err.details() or ""
    elif isinstance(err, InferenceServerException):
        code, text = (err.status() or "").removeprefix("StatusCode."), err.message() or ""
    else:  # not an RPC failure: a bug or a broken channel, never a plain-text 500
        return DeploymentError(500, f"the call to the Triton deployment failed: {type(err).__name__}: {err}")
    status = STATUS_OF.get(code, 500)
    if status == 504:
        text = f"the Triton deployment did not answer within {timeout:g} s"
    elif status == 503 and ("failed to connect" in text.lower() or "connection refused" in text.lower()):
        text = f"the Triton deployment at {url} is unreachable ({text.splitlines()[0] if text else code})"
    return DeploymentError(status, text if status == 400 else f"{text} ({code or 'no status'})")


def _scalar(result, name, default=0):
    x = result.as_numpy(name)
    return default if x is None or x.size == 0 else x.reshape(-1)[0]


def _piece(result, final: bool) -> Piece:
    text = result.as_numpy("text_output")
    text = b"" if text is None or text.size == 0 else text.reshape(-1)[0]
    piece = Piece(text.decode("utf-8", "replace") if isinstance(text, bytes) else str(text), final)
    if result.as_numpy("num_output_tokens") is not None:  # counts so far: every streamed response has them
        piece.prompt_tokens = int(_scalar(result, "num_input_tokens"))
        piece.completion_tokens = int(_scalar(result, "num_output_tokens"))
    if final and result.as_numpy("num_output_tokens") is not None:
        reason = _scalar(result, "finish_reason", b"")
        piece.finish_reason = reason.decode() if isinstance(reason, bytes) else str(reason)
        piece.prompt_tokens = int(_scalar(result, "num_input_tokens"))
        piece.completion_tokens = int(_scalar(result, "num_output_tokens"))
        piece.draft_tokens = int(_scalar(result, "total_draft_tokens"))
        piece.accepted_draft_tokens = int(_scalar(result, "total_accepted_draft_tokens"))
        piece.acceptance_rate = float(_scalar(result, "acceptance_rate", 0.0))
    lp = result.as_numpy("output_log_probs")
    if final and lp is not None:
        n = int(_scalar(result, "sequence_length"))
        piece.token_ids = [int(t) for t in result.as_numpy("output_ids").reshape(-1)[:n]]
        piece.log_probs = [float(x) for x in lp.reshape(-1)[:n]]
    return piece

"""The OpenAI front's one way to the deployment: Triton's gRPC API (asyncio client).

A completion is one request to the text endpoints of a trtspec repository:
`tensorrt_llm_bls` (unary) or `tensorrt_llm_bls_streaming` (streamed steps) for the
speculative model, `target_only` for the control. Token counts, finish reason and the whole
generation's speculative metrics come back as tensors (triton/backend/contract.py).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np

from trtspec.errors import RequestError
from trtspec.layout import BLS_MODEL, BLS_STREAMING_MODEL, CONTROL_MODEL

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


class TritonText:
    """Completions from a running trtspec deployment at ``url`` (HOST:PORT, gRPC)."""

    def __init__(self, url: str):
        self.url = url
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
                if await self.client.is_model_ready(m):
                    names.append(m)
            except Exception:  # a missing model is "not ready", not a failure
                pass
        return names

    def _inputs(self, g: Generation, stream: bool) -> list:
        import tritonclient.grpc as grpcclient

        def tensor(name, arr):
            t = grpcclient.InferInput(name, list(arr.shape), _triton_type(arr))
            t.set_data_from_numpy(arr)
            return t

        arrays = {
            "text_input": np.array([[g.text.encode()]], dtype=np.object_),
            "max_tokens": np.array([[g.max_tokens]], dtype=np.int32),
            "exclude_input_in_output": np.array([[True]]),
            "apply_chat_template": np.array([[g.apply_chat_template]]),
            "return_perf_metrics": np.array([[True]]),
            "return_num_input_tokens": np.array([[True]]),
            "return_num_output_tokens": np.array([[True]]),
        }
        if stream:
            arrays["stream"] = np.array([[True]])
        if g.stop:
            arrays["stop_words"] = np.array([[s.encode() for s in g.stop]], dtype=np.object_)
        if g.num_draft_tokens is not None:
            arrays["num_draft_tokens"] = np.array([[g.num_draft_tokens]], dtype=np.int32)
        if g.sampling is not None:  # upstream BLS names: top_k 0 (all) with top_p samples
            temperature, top_p, seed = g.sampling
            arrays["temperature"] = np.array([[temperature]], dtype=np.float32)
            arrays["top_k"] = np.array([[0]], dtype=np.int32)
            arrays["top_p"] = np.array([[top_p]], dtype=np.float32)
            arrays["seed"] = np.array([[seed]], dtype=np.uint64)
        for name, value in g.processing:
            dtype = np.int32 if name == "min_tokens" else np.float32
            arrays[name] = np.array([[value]], dtype=dtype)
        if g.log_probs:
            arrays["return_log_probs"] = np.array([[True]])
        return [tensor(k, v) for k, v in arrays.items()]

    @staticmethod
    def _wanted(g: Generation) -> list:
        import tritonclient.grpc as grpcclient

        return [grpcclient.InferRequestedOutput(n) for n in WANTED + (LOG_PROB_OUTPUTS if g.log_probs else [])]

    async def complete(self, g: Generation) -> Piece:
        from tritonclient.utils import InferenceServerException

        outputs = self._wanted(g)
        try:
            result = await self.client.infer(CONTROL_MODEL if g.control else BLS_MODEL, self._inputs(g, False), outputs=outputs)
        except InferenceServerException as err:
            raise _as_error(err) from None
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
        }

        async def requests():
            yield request

        async for result, error in self.client.stream_infer(requests()):
            if error is not None:
                raise _as_error(error)
            final = result.get_response().parameters["triton_final_response"].bool_param
            yield _piece(result, final)
            if final:
                return


def _triton_type(arr: np.ndarray) -> str:
    from tritonclient.utils import np_to_triton_dtype

    return np_to_triton_dtype(arr.dtype)


def _as_error(err) -> Exception:
    """INVALID_ARG from the deployment is the client's fault (HTTP 400); the rest is ours."""
    text = err.message() if hasattr(err, "message") else str(err)
    status = (err.status() or "") if hasattr(err, "status") else ""
    if "INVALID_ARG" in status:
        return RequestError(text)
    return RuntimeError(f"the Triton deployment failed: {text}")


def _scalar(result, name, default=0):
    x = result.as_numpy(name)
    return default if x is None or x.size == 0 else x.reshape(-1)[0]


def _piece(result, final: bool) -> Piece:
    text = result.as_numpy("text_output")
    text = b"" if text is None or text.size == 0 else text.reshape(-1)[0]
    piece = Piece(text.decode("utf-8", "replace") if isinstance(text, bytes) else str(text), final)
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

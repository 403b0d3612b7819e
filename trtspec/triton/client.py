"""GrpcBackend: the VerifyBackend of `trtspec verify --url`, over Triton's gRPC API.

The speculative path calls `tensorrt_llm_bls` (or, with stream=True, streams from
`tensorrt_llm_bls_streaming` and concatenates the steps); the control path calls
`target_only`. Both ask for token ids (exclude_input_in_output), the target's margins and the
whole generation's SpecMetrics, so the report is the same as in process.
"""

from __future__ import annotations

import queue
import time

import numpy as np

from trtspec.errors import RequestError, RuntimeFailure
from trtspec.layout import BLS_MODEL, BLS_STREAMING_MODEL, CONTROL_MODEL
from trtspec.speculative.loop import PathRun
from trtspec.speculative.metrics import metrics_from_json
from trtspec.triton.request import infer_inputs

URL_HELP = "A running `trtspec serve` at HOST:PORT (its gRPC port, e.g. 127.0.0.1:8001) instead of in process."


def parse_url(url: str | None) -> str | None:
    """Check --url: HOST:PORT of a gRPC endpoint, no scheme; RequestError names the fix."""
    if url is None:
        return None
    host, sep, port = url.rpartition(":")
    if (
        url.startswith(("http://", "https://", "grpc://"))
        or not sep
        or not host
        or not port.isdigit()
        or not 0 < int(port) < 65536
    ):
        raise RequestError(f"--url takes HOST:PORT (the gRPC port, e.g. 127.0.0.1:8001), not {url!r}")
    return url


class GrpcBackend:
    def __init__(
        self,
        url: str,
        tokenizer=None,
        chat_template: bool = True,
        num_draft_tokens: int | None = None,
        stream: bool = False,
        timeout: float = 600.0,
    ):
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException

        self.url = url
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.num_draft_tokens = num_draft_tokens
        self.stream = stream
        self.timeout = timeout
        self._error = InferenceServerException
        try:
            self.client = grpcclient.InferenceServerClient(url)
            live = self.client.is_server_live(client_timeout=10)
        except (InferenceServerException, ValueError) as err:
            raise RequestError(
                f"cannot reach a Triton server at {url} ({_first_line(err)}); start one with "
                "`trtspec serve SPEC` or fix --url HOST:PORT (the gRPC port, 8001 by default)"
            ) from None
        if not live:
            raise RequestError(f"the Triton server at {url} is not live yet; wait for `trtspec serve` to say ready")
        needed = [BLS_MODEL, CONTROL_MODEL] + ([BLS_STREAMING_MODEL] if stream else [])
        missing = [m for m in needed if not self._ready(m)]
        if missing:
            raise RequestError(
                f"the server at {url} has no ready model(s) {', '.join(missing)}; serve a trtspec "
                "repository (`trtspec serve SPEC`)" + (" with serve.streaming: true" if BLS_STREAMING_MODEL in missing else "")
            )

    def _ready(self, model: str) -> bool:
        try:
            return self.client.is_model_ready(model, client_timeout=10)
        except self._error:
            return False

    def _values(self, prompt: str, max_tokens: int, stream: bool) -> dict:
        values = {
            "text_input": prompt,
            "max_tokens": max_tokens,
            "apply_chat_template": self.chat_template,
            "exclude_input_in_output": True,
            "return_perf_metrics": True,
            "return_margins": not stream,
        }
        if self.num_draft_tokens is not None:
            values["num_draft_tokens"] = self.num_draft_tokens
        if stream:
            values["stream"] = True
        return values

    def run(self, prompt: str, max_tokens: int, speculative: bool) -> PathRun:
        start = time.perf_counter()
        ids, margins, metrics = self.generate(prompt, max_tokens, speculative)
        return PathRun(ids, margins, metrics if speculative else None, time.perf_counter() - start)

    def generate(self, prompt: str, max_tokens: int, speculative: bool, on_tokens=None):
        """(output ids, margins, SpecMetrics) of one request; ``on_tokens()`` is called when
        a streamed response brings tokens."""
        stream = speculative and self.stream
        inputs = infer_inputs(self._values(prompt, max_tokens, stream))
        try:
            if stream:
                return self._run_stream(inputs, on_tokens)
            return self._run_unary(BLS_MODEL if speculative else CONTROL_MODEL, inputs)
        except self._error as err:
            raise RequestError(f"the server refused the request: {_first_line(err)}") from None

    def _run_unary(self, model: str, inputs: list):
        result = self.client.infer(model, inputs, client_timeout=self.timeout)
        n = int(result.as_numpy("sequence_length")[0, 0])
        ids = result.as_numpy("output_ids")[0, :n].tolist()
        raw = result.as_numpy("output_margins")
        margins = [None if np.isnan(x) else float(x) for x in raw[0, :n]] if raw is not None else [None] * n
        return ids, margins, metrics_from_json(result.as_numpy("perf_metrics_json")[0, 0].decode())

    def sample(self, prompt: str, max_tokens: int, sampling, end_id: int):
        """One sampled generation from the speculative endpoint: (output ids, finish reason,
        SpecMetrics). Sampling inputs under upstream's BLS names (top_k 0: all tokens)."""
        values = self._values(prompt, max_tokens, False)
        del values["return_margins"]  # sampled tokens have no margins
        values |= {
            "temperature": sampling.temperature,
            "top_k": sampling.top_k,
            "top_p": sampling.top_p,
            "seed": sampling.seed,
            "end_id": end_id,
        }
        inputs = infer_inputs(values)
        try:
            result = self.client.infer(BLS_MODEL, inputs, client_timeout=self.timeout)
        except self._error as err:
            raise RequestError(f"the server refused the request: {_first_line(err)}") from None
        n = int(result.as_numpy("sequence_length")[0, 0])
        reason = result.as_numpy("finish_reason")[0, 0].decode()
        metrics = metrics_from_json(result.as_numpy("perf_metrics_json")[0, 0].decode())
        return result.as_numpy("output_ids")[0, :n].tolist(), reason, metrics

    def _run_stream(self, inputs: list, on_tokens=None):
        responses: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: responses.put((result, error)))
        ids: list[int] = []
        metrics = None
        try:
            self.client.async_stream_infer(BLS_STREAMING_MODEL, inputs, enable_empty_final_response=True)
            while True:
                try:
                    result, error = responses.get(timeout=self.timeout)
                except queue.Empty:
                    raise RuntimeFailure(f"no streamed response from {self.url} within {self.timeout:.0f}s") from None
                if error is not None:
                    raise error
                out = result.as_numpy("output_ids")
                if out is not None and out.size:
                    ids += out[0].tolist()
                    if on_tokens is not None:
                        on_tokens()
                blob = result.as_numpy("perf_metrics_json")
                if blob is not None:
                    metrics = metrics_from_json(blob[0, 0].decode())
                if result.get_response().parameters["triton_final_response"].bool_param:
                    break
        finally:
            self.client.stop_stream()
        return ids, [None] * len(ids), metrics

    def token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"<id {token_id}>"
        return self.tokenizer.decode([token_id])

    def decided_draft_tokens(self) -> int:
        """The num_draft_tokens the served speculative endpoint decides for these requests: the
        one they send (it refuses one beyond its bound), else its own default_draft_tokens, a
        parameter of its model config."""
        if self.num_draft_tokens is not None:
            return self.num_draft_tokens
        try:
            params = self.client.get_model_config(BLS_MODEL, client_timeout=10).config.parameters
        except self._error as err:
            raise RequestError(f"the server at {self.url} did not give {BLS_MODEL}'s config ({_first_line(err)})") from None
        if "default_draft_tokens" not in params or not params["default_draft_tokens"].string_value.isdigit():
            raise RequestError(
                f"{BLS_MODEL} at {self.url} names no default_draft_tokens in its config; serve a repository "
                "written by this trtspec (`trtspec serve SPEC`) or pass -k K"
            )
        return int(params["default_draft_tokens"].string_value)


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__

"""The text endpoints for trtllm.runtime llmapi, without the Triton plumbing.

Same contract as the torch/engine endpoints (orchestrator_core: text_input, max_tokens, ...
-> text_output, output_ids, sequence_length, and with return_perf_metrics the whole-request
acceptance_rate / total_accepted_draft_tokens / total_draft_tokens), so clients and
`trtspec verify --url` work unchanged. Requests are parsed and answered by the Orchestrator's
own parse() and pack(); generation is one LLM.generate call for every valid row of the
batch, which the LLM API batches in flight. Beyond upstream's llmapi model: output_ids (token
identity can be checked) and batching.

stop_words go to SamplingParams.stop with include_stop_str_in_output=True: the LLM API turns
each string into tokens (tokenizer.encode, no special tokens) and stops when the output ends
with them, as our other endpoints do, and keeps them in the output as those endpoints do
(upstream would cut them otherwise: executor/result.py@005bc848).

Streaming (the decoupled model, `tensorrt_llm_bls_streaming`): one LLM.generate_async(...,
streaming=True) per request, one response per step with that step's tokens and text delta
(the same incremental decoder as the orchestrator's streams), the last flagged final with the
whole request's metrics; a request Triton reports cancelled is aborted at the next step.
Each stream runs on its own thread, at most max_batch_size generating plus ``max_queue``
waiting (serve.max_queue, as the scheduler's endpoints); beyond that a request is answered
UNAVAILABLE at once. However a stream ends (finished, cancelled, failed, its sender broken),
its generation is aborted unless it finished, it gets one final answer or error, and its
place is given back (``serve_stream``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import numpy as np

from trtspec.errors import RequestError
from trtspec.speculative.llmapi import acceptance, greedy_params
from trtspec.speculative.loop import GenerationResult
from trtspec.speculative.metrics import SpecMetrics
from trtspec.triton.backend import log
from trtspec.triton.backend.orchestrator_core import Orchestrator, OrchestratorSettings, stop_words
from trtspec.triton.backend.responses import Row, TextStream, row_tensors
from trtspec.triton.backend.scheduler import Unavailable, deliver

# send(tensors, final) for one streamed request; cancelled() asks Triton whether it was.
StreamSend = Callable[[dict[str, np.ndarray], bool], None]


class StreamReply(Protocol):
    """Where one streamed request's answers go (models/pb.Reply, or a test's recorder)."""

    def send(self, tensors: dict[str, np.ndarray], final: bool) -> None: ...

    def fail(self, err: Exception) -> None: ...  # one error response; ends the request

    def cancelled(self) -> bool: ...

    def close(self) -> None: ...  # a bare final flag: ends a request whose client left


class LlmapiEndpoint:
    def __init__(self, settings: OrchestratorSettings, tokenizer, end_ids: frozenset[int], llm, api, max_queue: int = 64):
        self.orch = Orchestrator(settings, call=None, tokenizer=tokenizer, end_ids=end_ids)
        self.default_end_ids = end_ids
        self.llm = llm
        self.api = api
        self.speculative = settings.mode == "speculative"
        # streams in flight (one thread each): the LLM's batch plus max_queue waiting in it
        self.max_streams = settings.limits.max_batch_size + max_queue
        self._streams = threading.BoundedSemaphore(self.max_streams)
        self._parse_lock = threading.Lock()  # stream threads parse at once; one tokenizer

    def parse(self, inputs: Mapping[str, np.ndarray]) -> list[Row]:
        if inputs.get("draft_tree") is not None:
            raise RequestError(
                "draft_tree is not supported by the LLM API endpoints: TensorRT-LLM drafts the tree (or chain) "
                "its speculative_config names for every request; leave it out"
            )
        for name in ("suffix_cache_scope", "suffix_cache"):
            if inputs.get(name) is not None:
                raise RequestError(
                    f"{name} is not supported by the LLM API endpoints: TensorRT-LLM's suffix automaton keeps one "
                    "pool for all requests (enable_global_pool in its speculative_config); leave it out, or serve "
                    "each tenant its own deployment"
                )
        with self._parse_lock:
            rows = self.orch.parse(inputs)
        if any(row.sequences > 1 for row in rows):
            raise RequestError(
                f"num_return_sequences={rows[0].sequences} is not supported by the LLM API endpoints "
                "(they generate greedily, one sequence per prompt); send 1"
            )
        return rows

    def run(self, requests: Sequence[Mapping[str, np.ndarray]]) -> list[dict | Exception]:
        answers: list[dict | Exception | None] = [None] * len(requests)
        parsed = {}
        words: dict[int, list[list[str]]] = {}
        for i, inputs in enumerate(requests):
            try:
                parsed[i] = self.parse(inputs)
                words[i] = [stop_words(inputs.get("stop_words"), r, len(parsed[i])) for r in range(len(parsed[i]))]
            except RequestError as err:
                answers[i] = err.with_traceback(None)  # its frames would pin the request's arrays
        owners = [(i, r) for i in parsed for r in range(len(parsed[i]))]
        rows = [parsed[i][r] for i, r in owners]
        if not rows:
            return answers
        params = [self._params(row, words[i][r]) for (i, r), row in zip(owners, rows)]
        try:
            outs = self.llm.generate([row.request.prompt_ids for row in rows], params)
        except ValueError as err:  # the LLM API's refusal of a request
            for i in parsed:
                answers[i] = RequestError(str(err))
            return answers
        except Exception as err:
            for i in parsed:
                answers[i] = RuntimeError(f"generation failed: {err}")
            return answers
        results = [self._result(o.outputs[0]) for o in outs]
        for i in parsed:
            mine = [j for j, (owner, _) in enumerate(owners) if owner == i]
            answers[i] = self.orch.pack([rows[j] for j in mine], [results[j] for j in mine])
        return answers

    def _params(self, row: Row, stops: list[str]):
        ends = row.request.end_ids
        # the request's own end_id; none at all (end_id -1, the OpenAI front's ignore_eos): the
        # LLM API's ignore_eos; else its default (the tokenizer's EOS)
        end = next(iter(ends)) if ends != self.default_end_ids and len(ends) == 1 else None
        return greedy_params(self.api, row.request.max_tokens, self.speculative, end, stops, ignore_eos=not ends)

    def stream(self, inputs: Mapping[str, np.ndarray], send: StreamSend, cancelled: Callable[[], bool]) -> bool:
        """Answer one request of the decoupled model through ``send``; True once the final
        response went out, False when the client cancelled (the generation is aborted). Errors
        are raised, for the caller to send as the final response."""
        rows = self.parse(inputs)
        if len(rows) != 1:
            raise RequestError("the streaming model takes one prompt per request; send the prompts as separate requests")
        (row,) = rows
        row.times["first_scheduled_time_ns"] = time.time_ns()
        params = self._params(row, stop_words(inputs.get("stop_words"), 0, 1))
        try:
            result = self.llm.generate_async(row.request.prompt_ids, params, streaming=row.stream)
        except ValueError as err:  # the LLM API's refusal of a request
            raise RequestError(str(err)) from None
        text = TextStream(self.orch.tokenizer)
        ended = False  # the LLM finished the request: nothing left to abort
        try:
            for step in result:
                if cancelled():
                    return False  # aborted below: frees its KV cache; Triton drops what we would send
                ended = step.finished
                if self._answer_step(step, rows, text, send):
                    return True
            raise RuntimeError("the LLM API ended the request without a final output")
        finally:
            if not ended:  # cancelled, failed or a send raised: the generation must not run on
                try:
                    result.abort()
                except Exception as err:  # the stream ends anyway; the LLM may run it to its end
                    log.warn(f"aborting an ended stream's generation raised {type(err).__name__}: {err}")

    def _answer_step(self, step, rows: list[Row], text: TextStream, send: StreamSend) -> bool:
        """Send one streamed step; True once the final response went out."""
        (row,) = rows
        out = step.outputs[0]
        if out.token_ids_diff or step.finished:
            now = time.time_ns()
            row.times.setdefault("first_token_time_ns", now)
            row.times["last_token_time_ns"] = now
        if not step.finished:
            if out.token_ids_diff and row.stream:
                tensors = text.step(list(out.token_ids_diff), False)
                if row.want_metrics:  # upstream's streamed responses carry the perf outputs so far
                    tensors |= row_tensors(rows, [self._result(out)])
                send(tensors, False)
            return False
        final = self._result(out)
        if not row.stream:
            send(self.orch.pack(rows, [final]), True)
            return True
        send(text.step(list(out.token_ids_diff), True) | row_tensors(rows, [final]), True)
        return True

    def submit_stream(self, inputs: Mapping[str, np.ndarray], reply: StreamReply) -> threading.Thread | None:
        """Start one request of the decoupled model on its own thread (returned), or answer
        it UNAVAILABLE at once when max_streams are in flight (None)."""
        if not self._streams.acquire(blocking=False):
            full = f"the queue is full ({self.max_streams} streams in flight); retry later, or raise serve.max_queue in the spec"
            deliver(reply, Unavailable(full))
            return None
        thread = threading.Thread(target=self.serve_stream, args=(inputs, reply), name="trtspec-llmapi-stream", daemon=True)
        try:
            thread.start()
        except Exception as err:  # no thread to be had: this request fails, its place is free
            self._streams.release()
            deliver(reply, Unavailable(f"could not start the stream ({err}); retry later"))
            return None
        return thread

    def serve_stream(self, inputs: Mapping[str, np.ndarray], reply: StreamReply) -> None:
        """One admitted request of the decoupled model, on its own thread. Never raises: the
        final response, or one error, or (cancelled) a bare final flag ends it; the error
        send is guarded; its place is given back."""
        try:
            # Never ask cancelled() after the final response: Triton has released the request
            # then (tritonserver 2.51 segfaults in TRITONBACKEND_ResponseFactoryIsCancelled).
            if not self.stream(inputs, reply.send, reply.cancelled):
                reply.close()  # aborted: close the stream so Triton releases the request
        except Exception as err:  # this request fails, the server carries on
            deliver(reply, err)
        finally:
            self._streams.release()

    @staticmethod
    def _result(output) -> GenerationResult:
        ids = [int(t) for t in output.token_ids]
        res = GenerationResult(output_ids=ids, margins=[None] * len(ids))
        counts = acceptance(output)
        # whole-request totals only: the LLM API reports no per-step counts
        res.metrics = SpecMetrics(drafted=counts[1], accepted=counts[0]) if counts else SpecMetrics()
        return res

"""`tensorrt_llm_bls`, `tensorrt_llm_bls_streaming` and `target_only`: the text endpoints.

The speculative endpoints batch continuously: execute() parses and queues each request and
returns None at once; a worker thread runs the one loop (trtspec.speculative.loop.Batch)
step by step through scheduler.Scheduler, with a drafter and verifier that call the engine
models over BLS. Requests join between steps and each is answered through its response
sender the moment it ends (the unary endpoint too: one final response per request). The
target-only control answers inside execute(), each greedy prompt in one engine request (what
verify certifies). Errors become TritonError responses for the request at fault; the server
and the other requests carry on.
"""

from __future__ import annotations

import functools
import threading
from pathlib import Path

import triton_python_backend_utils as pb_utils

from trtspec.errors import RequestError
from trtspec.speculative.requests import end_token_ids
from trtspec.triton.backend import callers, log
from trtspec.triton.backend.bls import ENGINE_TIMEOUT_S, split_rows, with_timeout
from trtspec.triton.backend.head_swap import HeadSwap, announce, control_file
from trtspec.triton.backend.metrics import EndpointMetrics, TritonSink
from trtspec.triton.backend.models import pb
from trtspec.triton.backend.orchestrator_core import Orchestrator, caller_scopes
from trtspec.triton.backend.params import EngineEndpointParams
from trtspec.triton.backend.scheduler import Scheduler, Unavailable

# How long unload waits for the scheduler's worker once its engine calls are closed.
UNLOAD_WAIT_S = 10.0


class TritonPythonModel:
    def initialize(self, args):
        from transformers import AutoTokenizer

        config = pb.model_config(args)
        self.decoupled = bool(config.get("model_transaction_policy", {}).get("decoupled", False))
        params = EngineEndpointParams.from_params(pb.parameters(args))
        tokenizer_dir = Path(params.tokenizer_dir)
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        settings = params.settings(self.decoupled, int(config["max_batch_size"]))
        # The speculative endpoints' engine requests are bounded (bls.with_timeout), so a hung
        # engine model fails the step instead of stalling the scheduler; the control answers
        # inside execute() (one request per answer) and keeps Triton's own unbounded wait.
        timeout_s = 0.0
        if settings.mode == "speculative":
            timeout_s = ENGINE_TIMEOUT_S if params.engine_timeout_s is None else params.engine_timeout_s
        us = int(timeout_s * 1e6)
        # trtspec's torch engine models answer only this repository's BLS models, and only the
        # OpenAI front (the same key) names suffix cache scopes here (callers.py)
        self.key = callers.server_key()
        self.client_scopes = params.suffix is not None and params.suffix.client_scopes
        call = functools.partial(pb.bls_call, timeout_us=us, key=self.key if params.engine_margins else None)
        if params.engine_requests == "per_row":
            call = split_rows(functools.partial(pb.bls_call_many, timeout_us=us))
        self.calls = None
        if timeout_s > 0:  # on a bounded set of threads; readiness follows the engines' answers
            call = self.calls = with_timeout(call, timeout_s)
        # Prometheus metrics on Triton's metrics port (README: Monitoring).
        self.sink = TritonSink(pb_utils)
        metrics = EndpointMetrics(
            self.sink, args["model_name"], settings.mode, args["model_instance_name"], settings.limits.max_draft_len
        )
        self.core = Orchestrator(settings, call, tokenizer, end_token_ids(tokenizer, tokenizer_dir), metrics)
        self.scheduler = None
        swap = self._head_swap(args, settings, metrics)
        if settings.mode == "speculative":
            # Each instance holds up to max_batch_size live sequences: the engines have that
            # many KV slots per calling instance (triton/repository/writer.py).
            self.scheduler = Scheduler(
                self.core,
                settings.limits.max_batch_size,
                params.max_queue,
                observe=self.core.observe_step,
                answered=self.core.keep if settings.capture is not None else None,
                renewal=swap,
            )
            self.worker = threading.Thread(target=self.scheduler.serve, name="trtspec-scheduler", daemon=True)
            self.worker.start()
            if swap is not None:
                swap.wake = self.scheduler.wake
                swap.start()

    def _head_swap(self, args, settings, metrics) -> HeadSwap | None:
        """A speculative EAGLE-3 endpoint's head, which `trtspec refresh` can replace through the
        repository's control file (head_swap.py) without reloading this model."""
        if settings.mode != "speculative" or settings.eagle3_head_dir is None:
            return None
        control = control_file(Path(args["model_repository"]).parent)
        swap = HeadSwap(control, self.core.load_head, settings.eagle3_head_dir, lambda r: announce(metrics, r))
        metrics.head(1, None, None)
        self.core.head_swap = swap
        return swap

    def is_ready(self) -> bool:
        """Triton's readiness of this instance (python_backend calls it where it supports
        user readiness, 2026 releases on): False once the scheduler's worker has died, and
        while the engine models keep timing out (bls.UNREADY_AFTER_TIMEOUTS in a row; True
        again when one answers)."""
        if self.scheduler is None:
            return True
        engines = self.calls is None or self.calls.healthy
        return self.scheduler.ready and self.worker.is_alive() and engines

    def execute(self, requests):
        if self.scheduler is not None:
            # Each request on its own: one that cannot be read is answered alone, and execute()
            # never raises (Triton would answer the whole batch, queued requests included, twice).
            for r in requests:
                pb.guarded(r, lambda r=r: self._submit(r))
            return None
        inputs = [self._inputs(r) for r in requests]
        readable = [i for i, x in enumerate(inputs) if not isinstance(x, Exception)]
        if not self.decoupled:
            answers = inputs[:]
            for i, a in zip(readable, self.core.run([inputs[i] for i in readable])):
                answers[i] = a
            return [pb.error_response(a) if isinstance(a, Exception) else pb.response(a) for a in answers]
        senders = [r.get_response_sender() for r in requests]
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL

        def send(j, tensors, last):
            senders[readable[j]].send(pb.response(tensors), flags=final if last else 0)

        errors = [x if isinstance(x, Exception) else None for x in inputs]
        for j, err in enumerate(self.core.run([inputs[i] for i in readable], send)):
            errors[readable[j]] = err
        for i, err in enumerate(errors):
            if err is not None:
                pb.guarded(requests[i], lambda i=i, err=err: senders[i].send(pb.error_response(err), flags=final))
        return None

    def _inputs(self, request):
        """The request's inputs as its caller may send them (orchestrator_core.caller_scopes),
        or the RequestError that refuses it."""
        try:
            return caller_scopes(pb.inputs_of(request), pb.caller_of(request, self.key), self.client_scopes)
        except RequestError as err:
            return err

    def _submit(self, request) -> None:
        inputs, reply = self._inputs(request), pb.Reply(request)
        if isinstance(inputs, Exception):
            reply.fail(inputs)
            return
        self.scheduler.submit(inputs, reply, timeout_us=int(request.timeout()))

    def finalize(self):
        """Unload: every request held is answered before this returns. The worker stops after
        its step; a step waiting on an engine model ends at once (its requests are answered
        UNAVAILABLE, "unloading") instead of at the engine timeout, so the wait below is for
        the worker's own bookkeeping; should it not end within UNLOAD_WAIT_S, whatever it still
        holds is answered from here (a second final is refused by the sender, and logged)."""
        if self.scheduler is not None:
            self.scheduler.stop()  # the worker answers what is left with UNAVAILABLE
            if self.calls is not None:
                self.calls.close()
            self.worker.join(timeout=UNLOAD_WAIT_S)
            if self.worker.is_alive():
                log.error(f"the scheduler did not stop within {UNLOAD_WAIT_S:g} s; answering what it holds")
                self.scheduler.fail_all(Unavailable("the model is unloading; retry on another instance or later"))
        if self.core.head_swap is not None:
            self.core.head_swap.stop()
        self.core.close()  # serve.capture's thread: what it has not sent yet is dropped
        self.core.metrics = None
        self.sink.close()

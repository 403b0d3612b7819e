"""Benchmarks against a served repository over gRPC: concurrent clients with streamed TTFT,
and step costs measured through the served engine models."""

from __future__ import annotations

import queue
import time

import numpy as np

from trtspec.bench.measure import Costs, RequestTiming
from trtspec.layout import BLS_STREAMING_MODEL, DRAFT_MODEL, TARGET_MODEL
from trtspec.triton.client import GrpcBackend


class GrpcBench:
    """BenchBackend over a served repository: ``concurrency`` client threads, each with its own
    gRPC connection. The speculative path streams (so time to first token is real when the
    streaming endpoint is served); the target-only control is unary, so its TTFT is not
    observable and is left out."""

    def __init__(self, url: str, chat_template: bool = True):
        self.url = url
        self.chat_template = chat_template
        probe = GrpcBackend(url, chat_template=chat_template)
        self.streaming = probe._ready(BLS_STREAMING_MODEL)

    def run_batch(self, prompts, max_tokens, speculative, k, concurrency):
        from concurrent.futures import ThreadPoolExecutor

        work: queue.Queue = queue.Queue()
        for p in prompts:
            work.put(p)

        def worker() -> list[RequestTiming]:
            backend = GrpcBackend(
                self.url, chat_template=self.chat_template, num_draft_tokens=k, stream=speculative and self.streaming
            )
            out = []
            while True:
                try:
                    prompt = work.get_nowait()
                except queue.Empty:
                    return out
                out.append(self._one(backend, prompt, max_tokens, speculative))

        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            futures = [pool.submit(worker) for _ in range(concurrency)]
            timings = [t for f in futures for t in f.result()]
        return timings, time.perf_counter() - start

    def _one(self, backend: GrpcBackend, prompt: str, max_tokens: int, speculative: bool):
        start = time.perf_counter()
        first: list[float] = []
        ids, _, metrics = backend.generate(
            prompt, max_tokens, speculative, on_tokens=lambda: first or first.append(time.perf_counter() - start)
        )
        return RequestTiming(len(ids), first[0] if first else None, time.perf_counter() - start, metrics if speculative else None)


def measure_grpc_costs(url: str, k: int, repeats: int = 7, context: int = 64) -> Costs | None:
    """Step costs measured through the served engine models (gRPC overhead included):
    a target decode step, a draft decode step, and a target forward verifying k drafts.

    The engine models answer only the repository's own models (triton/backend/callers.py), so
    this works against a server on this machine whose caller key this user can read (one it
    started); for any other server it says so and returns None (the rest of the bench runs)."""
    import statistics

    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    from trtspec import console
    from trtspec.triton.backend.callers import CALLER_PARAMETER, local_keys

    client = grpcclient.InferenceServerClient(url)
    parameters: dict[str, str] | None = None

    def call(model: str, ids: list[int], out_len: int, draft: list[int] | None = None) -> float:
        def t(name, arr):
            x = grpcclient.InferInput(name, list(arr.shape), "INT32")
            x.set_data_from_numpy(arr.astype(np.int32))
            return x

        inputs = [
            t("input_ids", np.array([ids])),
            t("input_lengths", np.array([[len(ids)]])),
            t("request_output_len", np.array([[out_len]])),
        ]
        if draft:
            inputs.append(t("draft_input_ids", np.array([draft])))
        start = time.perf_counter()
        client.infer(model, inputs, parameters=parameters)
        return time.perf_counter() - start

    for key in [None, *local_keys()]:  # which key (if any) this server takes
        parameters = {CALLER_PARAMETER: key} if key else None
        try:
            call(TARGET_MODEL, [10, 11], 1)
            break
        except InferenceServerException as err:
            if "internal to this model repository" not in str(err):
                raise
    else:
        console.info(
            f"step costs not measured: the engine models of {url} answer only its own endpoints, and no caller key "
            "of a server on this machine is readable here (run the bench as the user who started the server, on its "
            "machine); tokens/s, latency and acceptance are measured as usual"
        )
        return None

    def timed(model: str, n_new: int) -> float:
        times = []
        for r in range(repeats):
            base = [(7 * r + j) % 200 + 10 for j in range(context)]
            call(model, base, 1)  # the context is cached now
            tail = [(11 * r + j) % 200 + 10 for j in range(n_new)]
            times.append(call(model, base + tail[:1], n_new, tail[1:] if n_new > 1 else None))
        return statistics.median(times)

    target = timed(TARGET_MODEL, 1)
    verify = timed(TARGET_MODEL, k + 1)
    draft = timed(DRAFT_MODEL, 1) if client.is_model_ready(DRAFT_MODEL) else None
    return Costs(target, draft, verify, k)

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
        self.probe = GrpcBackend(url, chat_template=chat_template)
        self.streaming = self.probe._ready(BLS_STREAMING_MODEL)

    def decided_draft_tokens(self, num_draft_tokens: int | None) -> int:
        """The k the served speculative endpoint drafts for requests sending ``num_draft_tokens``
        (None: its own default_draft_tokens; GrpcBackend.decided_draft_tokens)."""
        self.probe.num_draft_tokens = num_draft_tokens
        return self.probe.decided_draft_tokens()

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


class _EngineModels:
    """Timed calls to the served engine models, with this machine's caller key when it has one
    the server takes (the engine models answer only the repository's own models:
    triton/backend/callers.py)."""

    def __init__(self, url: str):
        import tritonclient.grpc as grpcclient

        self.grpc = grpcclient
        self.client = grpcclient.InferenceServerClient(url)
        self.parameters: dict[str, str] | None = None

    def call(self, model: str, ids: list[int], out_len: int, draft: list[int] | None = None) -> float:
        """Seconds one engine request took."""
        arrays = {"input_ids": [ids], "input_lengths": [[len(ids)]], "request_output_len": [[out_len]]}
        if draft:
            arrays["draft_input_ids"] = [draft]
        inputs = []
        for name, value in arrays.items():
            x = self.grpc.InferInput(name, list(np.array(value).shape), "INT32")
            x.set_data_from_numpy(np.array(value, dtype=np.int32))
            inputs.append(x)
        start = time.perf_counter()
        self.client.infer(model, inputs, parameters=self.parameters)
        return time.perf_counter() - start

    def find_key(self) -> bool:
        """Whether a caller key (or none) this server takes is readable here; keeps it."""
        from tritonclient.utils import InferenceServerException

        from trtspec.triton.backend.callers import CALLER_PARAMETER, local_keys

        for key in [None, *local_keys()]:
            self.parameters = {CALLER_PARAMETER: key} if key else None
            try:
                self.call(TARGET_MODEL, [10, 11], 1)
                return True
            except InferenceServerException as err:
                if "internal to this model repository" not in str(err):
                    raise
        return False

    def timed(self, model: str, n_new: int, repeats: int, context: int) -> float:
        """Median seconds of a forward of ``n_new`` tokens after a cached ``context``."""
        import statistics

        times = []
        for r in range(repeats):
            base = [(7 * r + j) % 200 + 10 for j in range(context)]
            self.call(model, base, 1)  # the context is cached now
            tail = [(11 * r + j) % 200 + 10 for j in range(n_new)]
            times.append(self.call(model, base + tail[:1], n_new, tail[1:] if n_new > 1 else None))
        return statistics.median(times)


def measure_grpc_costs(url: str, k: int, repeats: int = 7, context: int = 64) -> Costs | None:
    """Step costs measured through the served engine models (gRPC overhead included):
    a target decode step, a draft decode step, and a target forward verifying k drafts.

    This works against a server on this machine whose caller key this user can read (one it
    started); for any other server it says so and returns None (the rest of the bench runs)."""
    from trtspec import console

    engines = _EngineModels(url)
    if not engines.find_key():
        console.info(
            f"step costs not measured: the engine models of {url} answer only its own endpoints, and no caller key "
            "of a server on this machine is readable here (run the bench as the user who started the server, on its "
            "machine); tokens/s, latency and acceptance are measured as usual"
        )
        return None
    target = engines.timed(TARGET_MODEL, 1, repeats, context)
    verify = engines.timed(TARGET_MODEL, k + 1, repeats, context)
    draft = engines.timed(DRAFT_MODEL, 1, repeats, context) if engines.client.is_model_ready(DRAFT_MODEL) else None
    return Costs(target, draft, verify, k)

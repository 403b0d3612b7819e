"""`trtspec bench` on a trtllm.runtime llmapi spec, in process through the LLM API (the real
tensorrt_llm on a GPU, or trtspec's CPU conformance double, named in the report's mode).

Each request is one LLM.generate_async(..., streaming=True), so the first token's time is
observed; a concurrency level submits that many requests at once from threads, which the LLM
API batches in flight. The speculative configuration's draft length is fixed when the LLM is
built (speculative_config.max_draft_len), so there is no draft-length sweep here and no
engine step costs: the LLM API exposes neither. Acceptance is the whole request's (the LLM
API's perf metrics: accepted and drafted totals; no per-position counts).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from trtspec.bench.measure import RequestTiming
from trtspec.errors import RequestError
from trtspec.speculative.llmapi import acceptance, greedy_params
from trtspec.speculative.metrics import SpecMetrics
from trtspec.speculative.requests import encode_prompt


class LlmapiBench:
    """BenchBackend over a runtime.LlmapiDeployment."""

    def __init__(self, dep, chat_template: bool | None = None):
        self.dep = dep
        self.chat_template = dep.spec.verify.chat_template if chat_template is None else chat_template
        self.k = dep.spec.speculative.max_draft_len  # what speculative_config was built with

    def run_batch(self, prompts: Sequence[str], max_tokens: int, speculative: bool, k: int, concurrency: int):
        if speculative and k != self.k:
            raise RequestError(
                f"draft length {k}: this llmapi build drafts {self.k} (speculative_config.max_draft_len); "
                "rebuild with another speculative.max_draft_len to measure it"
            )
        llm = self.dep.speculative if speculative else self.dep.control
        timings: list[RequestTiming] = []
        start_all = time.perf_counter()
        for lo in range(0, len(prompts), concurrency):
            group = prompts[lo : lo + concurrency]
            slots: list[RequestTiming | BaseException | None] = [None] * len(group)
            threads = [
                threading.Thread(target=self._one, args=(llm, p, max_tokens, speculative, slots, i)) for i, p in enumerate(group)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for s in slots:
                if isinstance(s, BaseException):
                    raise s
                timings.append(s)
        return timings, time.perf_counter() - start_all

    def _one(self, llm, prompt: str, max_tokens: int, speculative: bool, slots: list, i: int) -> None:
        try:
            ids = encode_prompt(self.dep.tokenizer, prompt, self.chat_template)
            params = greedy_params(self.dep.api, max_tokens, speculative)
            start = time.perf_counter()
            first = None
            try:
                result = llm.generate_async(ids, params, streaming=True)
            except ValueError as e:  # the LLM API's refusal of a request
                raise RequestError(str(e)) from e
            out = None
            for step in result:
                out = step.outputs[0]
                if first is None and out.token_ids_diff:
                    first = time.perf_counter() - start
            latency = time.perf_counter() - start
            counts = acceptance(out) if speculative and out is not None else None
            metrics = SpecMetrics(drafted=counts[1], accepted=counts[0]) if counts else None
            n = len(out.token_ids) if out is not None else 0
            slots[i] = RequestTiming(tokens=n, ttft=first if first is not None else latency, latency=latency, metrics=metrics)
        except BaseException as err:  # re-raised in the caller's thread
            slots[i] = err

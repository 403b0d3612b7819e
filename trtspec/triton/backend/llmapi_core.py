"""The text endpoints for trtllm.runtime llmapi, without the Triton plumbing.

Same contract as the torch/engine endpoints (orchestrator_core: text_input, max_tokens, ...
-> text_output, output_ids, sequence_length, and with return_perf_metrics the whole-request
acceptance_rate / total_accepted_draft_tokens / total_draft_tokens), so clients and
`trtspec verify --url` work unchanged. Requests are parsed and answered by the Orchestrator's
own parse() and pack(); generation is one LLM.generate call for every valid row of the
batch, which the LLM API batches in flight. Beyond upstream's llmapi model: output_ids (token
identity can be checked) and batching.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from trtspec.errors import RequestError
from trtspec.speculative.llmapi import acceptance, greedy_params
from trtspec.speculative.loop import GenerationResult
from trtspec.speculative.metrics import SpecMetrics
from trtspec.triton.backend.orchestrator_core import Orchestrator, OrchestratorSettings


class LlmapiEndpoint:
    def __init__(self, settings: OrchestratorSettings, tokenizer, end_ids: frozenset[int], llm, api):
        if settings.decoupled:
            raise ValueError("llmapi endpoints are unary; streaming is not provided yet")
        self.orch = Orchestrator(settings, call=None, tokenizer=tokenizer, end_ids=end_ids)
        self.default_end_ids = end_ids
        self.llm = llm
        self.api = api
        self.speculative = settings.mode == "speculative"

    def run(self, requests: Sequence[Mapping[str, np.ndarray]]) -> list[dict | Exception]:
        answers: list[dict | Exception | None] = [None] * len(requests)
        parsed = {}
        for i, inputs in enumerate(requests):
            try:
                if inputs.get("stop_words") is not None and np.asarray(inputs["stop_words"]).size:
                    raise RequestError("stop_words is not supported by the llmapi endpoints; drop it")
                parsed[i] = self.orch.parse(inputs)
            except RequestError as err:
                answers[i] = err
        owners = [(i, r) for i in parsed for r in range(len(parsed[i]))]
        rows = [parsed[i][r] for i, r in owners]
        if not rows:
            return answers
        params = []
        for row in rows:
            ends = row.request.end_ids
            # the request's own end_id; else the LLM API's default (the tokenizer's EOS)
            end = next(iter(ends)) if ends != self.default_end_ids and len(ends) == 1 else None
            params.append(greedy_params(self.api, row.request.max_tokens, self.speculative, end))
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

    @staticmethod
    def _result(output) -> GenerationResult:
        ids = [int(t) for t in output.token_ids]
        res = GenerationResult(output_ids=ids, margins=[None] * len(ids))
        counts = acceptance(output)
        # whole-request totals only: the LLM API reports no per-step counts
        res.metrics = SpecMetrics(drafted=counts[1], accepted=counts[0]) if counts else SpecMetrics()
        return res

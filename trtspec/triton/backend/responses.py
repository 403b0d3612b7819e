"""The response tensors of the text endpoints (`tensorrt_llm_bls` contract, see
orchestrator_core): a request's parsed rows, the unary answer, the per-row perf tensors and
the streamed text deltas. Shared by the orchestrator and its scheduler."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from trtspec.speculative.loop import GenerationRequest, GenerationResult
from trtspec.speculative.metrics import metrics_json


@dataclass
class Row:
    request: GenerationRequest
    exclude_input: bool
    want_metrics: bool
    want_margins: bool
    stream: bool
    pad_id: int
    want_counts: tuple[bool, bool] = (False, False)  # return_num_input_tokens, return_num_output_tokens
    batch_index: int = 0
    times: dict[str, int] = field(default_factory=dict)  # *_time_ns events, time.time_ns()
    sequence_index: int = 0  # which of the prompt's num_return_sequences this row is
    sequences: int = 1  # num_return_sequences: > 1 answers one response per sequence
    separate: bool = False  # one response per row (decoupled model, several prompts or sequences)
    capture: bool = True  # the request's capture input (false: serve.capture never keeps it)

    @property
    def want_log_probs(self) -> bool:
        return self.request.log_probs

    @property
    def want_logits(self) -> bool:
        return self.request.generation_logits


def pack(tokenizer, rows: Sequence[Row], results: Sequence[GenerationResult]) -> dict[str, np.ndarray]:
    """One response for a request's rows: the whole outputs, padded, and the per-row tensors."""
    seqs = [res.output_ids if row.exclude_input else row.request.prompt_ids + res.output_ids for row, res in zip(rows, results)]
    width = max(1, max(len(s) for s in seqs))
    ids = np.full((len(seqs), width), rows[0].pad_id, dtype=np.int32)  # [b, T]
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = s
    texts = [tokenizer.decode(s, skip_special_tokens=True).encode() for s in seqs]
    tensors = {
        # [b], not [b, 1]: upstream's text_output is flat, its clients read output[0].decode().
        "text_output": np.array(texts, dtype=np.object_).reshape(len(seqs)),
        "output_ids": ids,
        "sequence_length": np.array([[len(s)] for s in seqs], dtype=np.int32),
    }
    if any(r.want_margins for r in rows):
        m = np.full((len(seqs), width), np.nan, dtype=np.float32)  # [b, T]
        for r, (row, res) in enumerate(zip(rows, results)):
            off = 0 if row.exclude_input else len(row.request.prompt_ids)
            vals = [np.nan if x is None else x for x in res.margins]
            m[r, off : off + len(vals)] = vals
        tensors["output_margins"] = m
    return tensors | log_prob_tensors(rows, results) | logits_tensors(rows, results) | row_tensors(rows, results)


def logits_tensors(rows: Sequence[Row], results: Sequence[GenerationResult], start: Sequence[int] | None = None) -> dict:
    """With return_generation_logits: generation_logits FP32 [b, beam 1, G, vocab], the
    target's own (unprocessed) logits at each generated token, padded with 0; streamed
    responses carry those of the step's new tokens (``start``: the first one's index)."""
    if not any(r.want_logits for r in rows):
        return {}
    parts = [res.generation_logits[(start[r] if start else 0) :] for r, res in enumerate(results)]
    width = max(1, max(len(p) for p in parts))
    vocab = max((int(t.shape[-1]) for p in parts for t in p), default=1)
    out = np.zeros((len(rows), 1, width, vocab), dtype=np.float32)
    for r, part in enumerate(parts):
        for t, row in enumerate(part):
            out[r, 0, t, : row.shape[-1]] = row.numpy()
    return {"generation_logits": out}


def log_prob_tensors(rows: Sequence[Row], results: Sequence[GenerationResult]) -> dict[str, np.ndarray]:
    """With return_log_probs: output_log_probs FP32 [b, beam 1, G] — the target's log
    probability of each generated token under the distribution it was decided from (after
    the request's processing and temperature; upstream's normalize_log_probs=false meaning),
    padded with 0 — and cum_log_probs FP32 [b, 1], their sum. Streamed responses carry all
    tokens so far, as upstream's do."""
    if not any(r.want_log_probs for r in rows):
        return {}
    width = max(1, max(len(res.log_probs) for res in results))
    lp = np.zeros((len(rows), 1, width), dtype=np.float32)
    for r, res in enumerate(results):
        lp[r, 0, : len(res.log_probs)] = res.log_probs
    cum = np.array([[float(np.sum(np.asarray(res.log_probs, dtype=np.float64)))] for res in results], dtype=np.float32)
    return {"output_log_probs": lp, "cum_log_probs": cum}


# KV-cache block counts of a request's context phase come from the target engine model
# (engine_core.kv_blocks); where it reported none they are -1 ("not measured"), never made up.
NOT_MEASURED = -1


def row_tensors(rows: Sequence[Row], results: Sequence[GenerationResult]) -> dict[str, np.ndarray]:
    """Per-row outputs of upstream's contract: indices, token counts, perf metrics."""

    def col(values, dtype):
        return np.array([[v] for v in values], dtype=dtype)  # [b, 1]

    tensors = {
        "batch_index": col([r.batch_index for r in rows], np.int32),
        "sequence_index": col([r.sequence_index for r in rows], np.int32),
        "finish_reason": col([(res.finish_reason or "").encode() for res in results], np.object_),
    }
    if any(r.want_counts[0] for r in rows):
        tensors["num_input_tokens"] = col([len(r.request.prompt_ids) for r in rows], np.int32)
    if any(r.want_counts[1] for r in rows):
        tensors["num_output_tokens"] = col([len(res.output_ids) for res in results], np.int32)
    if not any(r.want_metrics for r in rows):
        return tensors
    ms = [res.metrics for res in results]
    tensors |= {
        "acceptance_rate": col([m.acceptance_rate for m in ms], np.float32),
        "total_accepted_draft_tokens": col([m.accepted for m in ms], np.int32),
        "total_draft_tokens": col([m.drafted for m in ms], np.int32),
        "perf_metrics_json": col([metrics_json(m).encode() for m in ms], np.object_),
    }
    for name in ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns"):
        # Only max_tokens 0 produces no token event; its token times are then the schedule time.
        tensors[name] = col([r.times.get(name, r.times.get("first_scheduled_time_ns", 0)) for r in rows], np.int64)
    names = ("kv_cache_alloc_new_blocks", "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks")
    for k, name in enumerate(names):
        tensors[name] = col([NOT_MEASURED if res.kv_blocks is None else res.kv_blocks[k] for res in results], np.int32)
    return tensors


class TextStream:
    """Per-stream text deltas, decoded incrementally as inference servers do (vLLM, TGI).

    Each step decodes from ``prefix`` (a few tokens of context before the unsent ones, so
    word boundaries and spaces come out as in a full decode) and sends only what lies past
    the text of ``ids[prefix:read]``. Text once sent is never sent again, even where decoding
    more tokens rewrites earlier characters; a character split across tokens (U+FFFD until it
    completes) is held back until it is whole.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read]: already sent, decoded again as context
        self.read = 0  # ids[read:]: not sent yet

    def step(self, emitted: list[int], done: bool) -> dict[str, np.ndarray]:
        self.ids += emitted
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        sent = decode(self.ids[self.prefix : self.read])
        text = decode(self.ids[self.prefix :])
        delta = ""
        if len(text) > len(sent) and (done or not text.endswith("\ufffd")):
            delta = text[len(sent) :]
            self.prefix, self.read = self.read, len(self.ids)
        return {
            "text_output": np.array([delta.encode()], dtype=np.object_),  # [1], as upstream
            "output_ids": np.array([emitted], dtype=np.int32).reshape(1, len(emitted)),
            "sequence_length": np.array([[len(emitted)]], dtype=np.int32),
        }

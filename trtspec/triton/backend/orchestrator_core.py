"""The text-in/text-out endpoints (`tensorrt_llm_bls` contract) without the Triton plumbing.

A request (dict of input arrays, batch dim first) is validated with speculative.requests,
every valid row of every request in the batch goes through ONE call of the shared loop
(trtspec.speculative.loop.generate) with a drafter and verifier that call the engine models,
and each request gets its output tensors or its own error. Target-only control = the same
loop with NoDrafter.

Contract: upstream's `tensorrt_llm_bls` (every tensor in triton/backend/contract.py; the
features trtspec does not implement are refused there by name). Implemented, batch dim first:
  text_input BYTES [b, 1]; max_tokens INT32 [b, 1]; optional num_draft_tokens, end_id, pad_id
  INT32, stop_words BYTES [b, n], stream, exclude_input_in_output, return_perf_metrics,
  return_num_input_tokens, return_num_output_tokens, apply_chat_template (trtspec),
  return_margins (trtspec) BOOL; greedy settings of top_k / top_p / temperature / beam_width.
  -> text_output BYTES [b] (flat, as upstream), output_ids INT32 [b, T] (padded with pad_id), sequence_length
  INT32 [b, 1], batch_index / sequence_index INT32 [b, 1], finish_reason BYTES [b, 1]
  (trtspec: length / eos / stop); num_input_tokens /
  num_output_tokens when asked; with return_perf_metrics: acceptance_rate FP32,
  total_accepted_draft_tokens, total_draft_tokens INT32 [b, 1] for the WHOLE generation,
  arrival / first_scheduled / first_token / last_token _time_ns INT64 [b, 1] (time.time_ns()
  at this model's events), kv_cache_* INT32 [b, 1] = -1 (not reported by the engines) and
  perf_metrics_json BYTES [b, 1] (all SpecMetrics counts); with return_margins:
  output_margins FP32 [b, T].
Streaming (decoupled model): one response per loop step with that step's new tokens and text,
the last one flagged final and carrying the metrics.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from trtspec.errors import RequestError
from trtspec.speculative.drafters import make_drafter
from trtspec.speculative.loop import GenerationRequest, GenerationResult, NoDrafter, generate
from trtspec.speculative.metrics import metrics_json
from trtspec.speculative.requests import Limits, encode_prompt, make_request
from trtspec.tokens import check_token_ids
from trtspec.triton.backend.bls import BlsDecoder, BlsDrafter, BlsVerifier, EngineCall
from trtspec.triton.backend.contract import check_supported
from trtspec.triton.backend.engine_core import per_row
from trtspec.triton.backend.metrics import EndpointMetrics, MeteredVerifier


@dataclass(frozen=True)
class OrchestratorSettings:
    """What the model's config parameters say (see triton/repository/writer.py)."""

    mode: str  # "speculative" or "target_only"
    decoupled: bool
    target_model: str
    draft_model: str | None  # None: method ngram
    method: str
    default_draft_tokens: int
    max_ngram: int
    min_ngram: int
    limits: Limits  # max_batch_size bounds the prompts of one request
    draft_vocab_limit: int | None = None
    chat_template_default: bool = False
    margins_supported: bool = True  # the target engine answers return_margins (torch engines)
    eagle3_head_dir: str | None = None  # method eagle3: the head engine folder ...
    eagle3_target_dir: str | None = None  # ... and the target's (its embeddings and RoPE)
    # TensorRT-LLM targets keep decoding to request_output_len after a rejected draft; the
    # verifier then keeps those tokens (bls.BlsVerifier).
    target_continues: bool = False


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


# Sends tensors for request i; final=True ends that request's stream.
Sender = Callable[[int, dict[str, np.ndarray], bool], None]


def _optional(inputs: Mapping[str, np.ndarray], name: str, rows: int) -> np.ndarray | None:
    return per_row(inputs, name, rows, unit="prompt")


def _text(value) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as err:
            raise RequestError(f"text is not valid UTF-8 ({err.reason} at byte {err.start}); send UTF-8 text") from None
    text = str(value)
    try:  # a str can still hold lone surrogates (undecodable bytes smuggled through JSON)
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise RequestError(f"text is not valid UTF-8 ({err.reason} at character {err.start}); send UTF-8 text") from None
    return text


def stop_words(stops, row: int, rows: int) -> list[str]:
    """The non-empty stop_words strings of one batch row (BYTES [b, n], or [n] for every row)."""
    if stops is None:
        return []
    words = np.asarray(stops)
    words = words.reshape(rows, -1)[row] if words.size and words.size % rows == 0 else words.reshape(-1)
    return [w for w in (_text(x) for x in words) if w]


class Orchestrator:
    def __init__(
        self,
        settings: OrchestratorSettings,
        call: EngineCall,
        tokenizer,
        end_ids: frozenset[int],
        metrics: EndpointMetrics | None = None,
    ):
        self.s = settings
        self.call = call
        self.tokenizer = tokenizer
        self.end_ids = end_ids
        self.metrics = metrics  # Prometheus (triton/backend/metrics.py); None: not reported

    # -- parsing -------------------------------------------------------------------------

    def parse(self, inputs: Mapping[str, np.ndarray]) -> list[Row]:
        """Validate one request into rows; RequestError names the input and the fix."""
        arrival = time.time_ns()
        check_supported(inputs)
        text = inputs.get("text_input")
        max_tokens = inputs.get("max_tokens")
        if text is None or max_tokens is None:
            raise RequestError("text_input and max_tokens are required")
        text = np.asarray(text)
        rows = text.shape[0] if text.ndim else 1
        if text.size != rows:
            raise RequestError(f"text_input must hold one prompt per batch row; got shape {list(text.shape)}")
        self.s.limits.check_batch(rows, "prompts")
        max_tokens = _optional(inputs, "max_tokens", rows)
        k = _optional(inputs, "num_draft_tokens", rows)
        end_id = _optional(inputs, "end_id", rows)
        pad_id = _optional(inputs, "pad_id", rows)
        stream = _optional(inputs, "stream", rows)
        exclude = _optional(inputs, "exclude_input_in_output", rows)
        metrics = _optional(inputs, "return_perf_metrics", rows)
        margins = _optional(inputs, "return_margins", rows)
        chat = _optional(inputs, "apply_chat_template", rows)
        n_in = _optional(inputs, "return_num_input_tokens", rows)
        n_out = _optional(inputs, "return_num_output_tokens", rows)
        stops = inputs.get("stop_words")
        wants_stream = stream is not None and bool(stream.any())
        if wants_stream and not self.s.decoupled:
            raise RequestError(
                "stream=true needs the decoupled model tensorrt_llm_bls_streaming (gRPC "
                "streaming); this model answers once per request"
            )
        if wants_stream and rows > 1:
            raise RequestError("streaming takes one prompt per request; send the prompts as separate requests")
        vocab = self.s.limits.vocab_size
        out = []
        for r in range(rows):
            prompt = _text(text.reshape(rows)[r])
            if not prompt.strip():
                raise RequestError("text_input is empty; send the prompt text")
            use_chat = self.s.chat_template_default if chat is None else bool(chat[r])
            ids = encode_prompt(self.tokenizer, prompt, use_chat)
            n_draft = self.s.default_draft_tokens if k is None else int(k[r])
            ends = self.end_ids
            if end_id is not None:
                e = int(end_id[r])
                check_token_ids([e], vocab, "end_id")
                ends = frozenset({e})
            pad = 0 if pad_id is None else int(pad_id[r])
            check_token_ids([pad], vocab, "pad_id")
            req = make_request(ids, int(max_tokens[r]), n_draft, self.s.limits, ends, self._stop_sequences(stops, r, rows))
            if self.s.mode == "target_only":
                req.num_draft_tokens = 0
            out.append(
                Row(
                    request=req,
                    exclude_input=False if exclude is None else bool(exclude[r]),
                    want_metrics=False if metrics is None else bool(metrics[r]),
                    want_margins=False if margins is None else bool(margins[r]),
                    stream=wants_stream,
                    pad_id=pad,
                    want_counts=(n_in is not None and bool(n_in[r]), n_out is not None and bool(n_out[r])),
                    batch_index=r,
                    times={"arrival_time_ns": arrival},
                )
            )
        return out

    def _stop_sequences(self, stops, row: int, rows: int) -> tuple[tuple[int, ...], ...]:
        seqs = [tuple(self.tokenizer(word, add_special_tokens=False)["input_ids"]) for word in stop_words(stops, row, rows)]
        return tuple(s for s in seqs if s)

    # -- running -------------------------------------------------------------------------

    def drafter(self):
        if self.s.mode == "target_only":
            return NoDrafter()
        model = None
        if self.s.draft_model is not None:
            model = BlsDrafter(self.call, self.s.draft_model, self.s.draft_vocab_limit)
        elif self.s.method == "eagle3":
            model = self._eagle3_drafter()
        return make_drafter(self.s.method, max_ngram=self.s.max_ngram, min_ngram=self.s.min_ngram, draft_model=model)

    def _eagle3_drafter(self):
        """The head runs here, beside the loop; the target's features come from the target
        engine model (BlsFeatures), so the target is loaded once, in its own model."""
        from trtspec.engines.torch.eagle3 import HeadEngine
        from trtspec.speculative.eagle3 import Eagle3Drafter
        from trtspec.triton.backend.bls import BlsFeatures

        if getattr(self, "_head", None) is None:
            self._head = HeadEngine.load_beside(self.s.eagle3_head_dir, self.s.eagle3_target_dir, self.s.limits.max_batch_size)
        return Eagle3Drafter(self._head, BlsFeatures(self.call, self.s.target_model))

    def run(self, requests: Sequence[Mapping[str, np.ndarray]], send: Sender | None = None) -> list[dict | Exception | None]:
        """Answer every request. Unary: returns the tensors (or error) per request. With
        ``send`` (decoupled): streams through it and returns only errors (None = sent)."""
        answers: list[dict | Exception | None] = [None] * len(requests)
        parsed: dict[int, list[Row]] = {}
        for i, inputs in enumerate(requests):
            try:
                parsed[i] = self.parse(inputs)
            except RequestError as err:
                answers[i] = err
            except Exception as err:  # a tokenizer or chat-template failure: this request only
                answers[i] = RuntimeError(f"could not prepare the request: {type(err).__name__}: {err}")
        owners = [(i, r) for i in parsed for r in range(len(parsed[i]))]
        rows = [parsed[i][r] for i, r in owners]
        if not rows:
            return answers
        streams = {j: _Stream(self.tokenizer) for j, row in enumerate(rows) if row.stream and send}
        last: dict[int, dict[str, np.ndarray]] = {}

        def on_step(j: int, emitted: list[int], done: bool) -> None:
            if emitted or done:  # done without tokens: EOS came (the engine did produce it)
                now = time.time_ns()
                rows[j].times.setdefault("first_token_time_ns", now)
                rows[j].times["last_token_time_ns"] = now
            if j not in streams or not (emitted or done):
                return
            tensors = streams[j].step(emitted, done)
            if done:  # sent below with the whole generation's metrics, flagged final
                last[j] = tensors
            else:
                send(owners[j][0], tensors, False)

        margins = self.s.margins_supported and any(r.want_margins for r in rows)
        if self.metrics is not None:
            self.metrics.load(active=len(rows), queued=0)  # every row starts now, none waits here
        try:
            scheduled = time.time_ns()
            for row in rows:
                row.times["first_scheduled_time_ns"] = scheduled
            if self.s.mode == "target_only" and not streams and all(r.request.sampling is None for r in rows):
                # The control answers each greedy prompt in one engine request, as a user's
                # request would: what verify certifies and what bench's baseline measures.
                decoder = BlsDecoder(self.call, self.s.target_model, self.tokenizer.eos_token_id, margins)
                results = decoder.decode([r.request for r in rows])
                done = time.time_ns()  # one request: every token arrives with the answer
                for row, res in zip(rows, results):
                    if res.output_ids or res.finish_reason == "eos":
                        row.times.setdefault("first_token_time_ns", done)
                        row.times["last_token_time_ns"] = done
            else:
                verifier = BlsVerifier(self.call, self.s.target_model, margins, continued=self.s.target_continues)
                if self.metrics is not None:
                    verifier = MeteredVerifier(verifier, self.metrics, max(r.request.num_draft_tokens for r in rows))
                results = generate([r.request for r in rows], self.drafter(), verifier, on_step)
        except Exception as err:  # an engine failure fails these requests, not the server
            self._report_finished([None] * len(rows))
            for i in parsed:
                answers[i] = err if isinstance(err, RequestError) else RuntimeError(f"generation failed: {err}")
            return answers
        self._report_finished(results)
        for j in streams:
            send(owners[j][0], last[j] | _row_tensors([rows[j]], [results[j]]), True)
        for i in parsed:
            mine = [j for j, (owner, _) in enumerate(owners) if owner == i]
            if send is not None and rows[mine[0]].stream:
                continue  # already streamed
            tensors = self.pack([rows[j] for j in mine], [results[j] for j in mine])
            if send is not None:
                send(i, tensors, True)
            else:
                answers[i] = tensors
        return answers

    def _report_finished(self, results: Sequence[GenerationResult | None]) -> None:
        """Every row has ended (None: failed): count them by reason; nothing is active now."""
        if self.metrics is None:
            return
        for res in results:
            self.metrics.finished(None if res is None else res.finish_reason, 0 if res is None else len(res.output_ids))
        self.metrics.load(active=0, queued=0)

    def pack(self, rows: Sequence[Row], results: Sequence[GenerationResult]) -> dict[str, np.ndarray]:
        seqs = [
            res.output_ids if row.exclude_input else row.request.prompt_ids + res.output_ids for row, res in zip(rows, results)
        ]
        width = max(1, max(len(s) for s in seqs))
        ids = np.full((len(seqs), width), rows[0].pad_id, dtype=np.int32)  # [b, T]
        for r, s in enumerate(seqs):
            ids[r, : len(s)] = s
        texts = [self.tokenizer.decode(s, skip_special_tokens=True).encode() for s in seqs]
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
        return tensors | _row_tensors(rows, results)


# Upstream reports paged KV-cache block counts; the engines trtspec drives do not report them
# to the orchestrator, so they are -1 ("not measured"), never a made-up count.
NOT_MEASURED = -1


def _row_tensors(rows: Sequence[Row], results: Sequence[GenerationResult]) -> dict[str, np.ndarray]:
    """Per-row outputs of upstream's contract: indices, token counts, perf metrics."""

    def col(values, dtype):
        return np.array([[v] for v in values], dtype=dtype)  # [b, 1]

    tensors = {
        "batch_index": col([r.batch_index for r in rows], np.int32),
        "sequence_index": col([0] * len(rows), np.int32),
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
    for name in ("kv_cache_alloc_new_blocks", "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks"):
        tensors[name] = col([NOT_MEASURED] * len(rows), np.int32)
    return tensors


class _Stream:
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

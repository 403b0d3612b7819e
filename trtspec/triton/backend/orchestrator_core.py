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
  return_margins (trtspec) BOOL; top_k / top_p / temperature / seed (sampling); the
  penalties, min_tokens, bad_words and embedding bias (logits processing); return_log_probs;
  num_return_sequences (decoupled model: one response per sequence).
  -> text_output BYTES [b] (flat, as upstream), output_ids INT32 [b, T] (padded with pad_id), sequence_length
  INT32 [b, 1], batch_index / sequence_index INT32 [b, 1], finish_reason BYTES [b, 1]
  (trtspec: length / eos / stop); num_input_tokens /
  num_output_tokens when asked; with return_perf_metrics: acceptance_rate FP32,
  total_accepted_draft_tokens, total_draft_tokens INT32 [b, 1] for the WHOLE generation,
  arrival / first_scheduled / first_token / last_token _time_ns INT64 [b, 1] (time.time_ns()
  at this model's events), kv_cache_* INT32 [b, 1] (the target engine
  model's context-phase blocks; -1 where it reports none) and perf_metrics_json BYTES [b, 1]
  (all SpecMetrics counts); with return_margins: output_margins FP32 [b, T]; with
  return_log_probs: output_log_probs FP32 [b, 1, G], cum_log_probs FP32 [b, 1]; with
  return_generation_logits: generation_logits FP32 [b, 1, G, vocab].
Streaming (decoupled model): one response per loop step with that step's new tokens and text
(a step that drafts nothing may decode a chunk of several tokens: up to loop.DECODE_CHUNK, or
loop.SATURATED_CHUNK while the batch is full and requests wait, all in that one response), the
last one flagged final; with return_perf_metrics every response carries the counts so far.
Several prompts or num_return_sequences on a decoupled model: one response stream per row,
tagged batch_index / sequence_index, as upstream's.
"""

from __future__ import annotations

import copy
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np

from trtspec.errors import RequestError
from trtspec.spec import CaptureSpec, SuffixSpec, SwitchOffSpec
from trtspec.speculative.adaptive import AdaptivePolicy
from trtspec.speculative.capture import wanted
from trtspec.speculative.drafters import make_drafter, response_cache
from trtspec.speculative.loop import (
    DECODE_CHUNK,
    SATURATED_CHUNK,
    SHARED_SCOPE,
    Batch,
    GenerationRequest,
    GenerationResult,
    NoDrafter,
)
from trtspec.speculative.menus import adaptive_policy, make_menu
from trtspec.speculative.metrics import SourceCounts
from trtspec.speculative.processing import Processing
from trtspec.speculative.requests import MAX_SCOPE_BYTES, Limits, check_scope, encode_prompt, make_request
from trtspec.speculative.sampling import SamplingParams
from trtspec.speculative.schedule import LoadPolicy
from trtspec.tokens import check_token_ids
from trtspec.triton.backend import callers, log
from trtspec.triton.backend.bls import BlsDecoder, BlsDrafter, BlsKeeper, BlsVerifier, EngineCall
from trtspec.triton.backend.contract import (
    DEFAULT_MAX_RESPONSE_MB,
    check_response_size,
    check_supported,
    check_text_sizes,
    processing_of,
    sampling_of,
    text_byte_limit,
)
from trtspec.triton.backend.engine_core import per_row
from trtspec.triton.backend.metrics import EndpointMetrics
from trtspec.triton.backend.responses import Row, pack
from trtspec.triton.backend.scheduler import Scheduler, StepStats


@dataclass(frozen=True)
class OrchestratorSettings:
    """What the model's config parameters say (see triton/repository/writer.py)."""

    mode: str  # "speculative" or "target_only"
    decoupled: bool
    target_model: str
    draft_model: str | None  # None: method ngram
    method: str
    max_ngram: int
    min_ngram: int
    limits: Limits  # max_batch_size bounds the prompts of one request; default_draft_tokens: k when asked none
    draft_vocab_limit: int | None = None
    chat_template_default: bool = False
    margins_supported: bool = True  # the target engine answers return_margins (torch engines)
    eagle3_head_dir: str | None = None  # method eagle3: the head engine folder ...
    eagle3_target_dir: str | None = None  # ... and the target's (its embeddings and RoPE)
    # TensorRT-LLM targets keep decoding to request_output_len after a rejected draft; the
    # verifier then keeps those tokens (bls.BlsVerifier).
    target_continues: bool = False
    # The target engine model returns generation_logits (torch engines), so requests may sample.
    sampling_supported: bool = False
    # The target engine model answers return_perf_metrics with its kv_cache_* block counts
    # (torch engine models); others are not asked, and those outputs stay -1.
    kv_blocks_supported: bool = False
    # Load-aware speculation (spec speculative.schedule / switch_off): {active sequences: k}
    # and the spec's SwitchOffSpec (either threshold); the active sequences are this instance's batch.
    schedule: tuple[tuple[int, int], ...] | None = None
    switch_off: SwitchOffSpec | None = None
    # The most one response may hold (contract.check_response_size; serve.max_response_mb).
    max_response_mb: int = DEFAULT_MAX_RESPONSE_MB
    # Suffix drafting: method suffix's settings, or layered on the model draft (None: none).
    suffix: SuffixSpec | None = None
    # Adaptive speculation (method auto, or adaptive k): the methods the policy chooses among.
    adaptive_methods: tuple[str, ...] | None = None
    probe_every: int = 16
    # serve.capture: which answered requests the target engine model keeps (None: none).
    capture: CaptureSpec | None = None

    def load_policy(self) -> LoadPolicy | None:
        if self.mode != "speculative":
            return None
        return LoadPolicy.from_switch_off(dict(self.schedule) if self.schedule else None, self.switch_off)

    def adaptive_policy(self) -> AdaptivePolicy | None:
        if self.mode != "speculative" or not self.adaptive_methods:
            return None
        return adaptive_policy(self.adaptive_methods, self.limits.max_draft_len, self.probe_every)


@dataclass(frozen=True)
class RequestInputs:
    """One request's inputs as the orchestrator reads them: per batch row, batch dim first;
    an optional input is None when the request left it out."""

    arrival: int  # time.time_ns() when parsing began
    prompts: np.ndarray  # [rows] text_input
    max_tokens: np.ndarray  # [rows]
    n_seqs: list[int]  # num_return_sequences per row
    sampling: list[SamplingParams | None]
    processing: list[Processing | None]
    log_probs: np.ndarray | None
    generation_logits: np.ndarray | None
    num_draft_tokens: np.ndarray | None
    end_id: np.ndarray | None
    pad_id: np.ndarray | None
    stream: np.ndarray | None
    exclude_input_in_output: np.ndarray | None
    return_perf_metrics: np.ndarray | None
    return_margins: np.ndarray | None
    apply_chat_template: np.ndarray | None
    return_num_input_tokens: np.ndarray | None
    return_num_output_tokens: np.ndarray | None
    draft_tree: np.ndarray | None
    suffix_cache_scope: np.ndarray | None
    suffix_cache: np.ndarray | None
    capture: np.ndarray | None
    stop_words: np.ndarray | None  # BYTES [rows, n] or [n] (stop_words reads a row's)

    # The optional per-row inputs stored under their contract names, in reading order.
    OPTIONAL: ClassVar[tuple[str, ...]] = (
        "num_draft_tokens",
        "end_id",
        "pad_id",
        "stream",
        "exclude_input_in_output",
        "return_perf_metrics",
        "return_margins",
        "apply_chat_template",
        "return_num_input_tokens",
        "return_num_output_tokens",
        "draft_tree",
        "suffix_cache_scope",
        "suffix_cache",
        "capture",
    )

    @property
    def wants_stream(self) -> bool:
        """Any row asks to stream (a request streams as a whole)."""
        return self.stream is not None and bool(self.stream.any())

    def flag(self, field: str, row: int) -> bool:
        """A boolean input of one row; False when the request left it out."""
        value = getattr(self, field)
        return value is not None and bool(value[row])


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


def _scope_of(request: RequestInputs, r: int) -> str | None:
    """Row r's suffix cache scope: suffix_cache_scope (absent: the shared one), None where
    suffix_cache is false; both at once is refused. The request rules check the text."""
    scope = None if request.suffix_cache_scope is None else request.suffix_cache_scope[r]
    if request.suffix_cache is not None and not bool(request.suffix_cache[r]):
        if scope is not None:
            raise RequestError("suffix_cache false keeps the request out of every scope; send it or suffix_cache_scope, not both")
        return None
    return SHARED_SCOPE if scope is None else check_scope(scope, "suffix_cache_scope")


def caller_scopes(inputs: Mapping[str, np.ndarray], caller: str, client_scopes: bool) -> Mapping[str, np.ndarray]:
    """The inputs as ``caller`` (callers.caller_of) may send them. The OpenAI front (INSIDE: it
    carries the server's caller key) names its tenants' scopes (tenant/user). Anyone else's
    suffix_cache_scope is dropped, so every direct caller is in the shared scope; where the
    spec allows client scopes (suffix.client_scopes) it is kept under the direct callers'
    tenant ("/" + scope), so no direct caller ever reaches a front tenant's responses. A wrong
    caller key is refused: a front that lost its server's key must not share its tenants' scopes."""
    if caller == callers.WRONG_KEY:
        raise RequestError(callers.wrong_key_error())
    raw = inputs.get("suffix_cache_scope")
    if caller == callers.INSIDE or raw is None:
        return inputs
    out = dict(inputs)
    if not client_scopes:
        del out["suffix_cache_scope"]
        return out
    raw = np.asarray(raw)
    limit = MAX_SCOPE_BYTES - 1  # room for the "/" of the direct callers' tenant
    scoped = [check_scope(x, "suffix_cache_scope", limit) for x in raw.reshape(-1)]
    out["suffix_cache_scope"] = np.array([f"/{x}".encode() if x else b"" for x in scoped], dtype=np.object_).reshape(raw.shape)
    return out


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
        self.tokenizer = tokenizer  # decodes answers (the scheduler's worker)
        # Requests are encoded with a tokenizer of their own (execute's thread), so one
        # request's tokenization never waits for, or holds up, the decoding of the others'.
        self.input_tokenizer = copy.deepcopy(tokenizer)
        lim = settings.limits
        self.max_input_len = lim.max_input_len if lim.max_input_len is not None else lim.max_seq_len
        self.max_text_bytes = text_byte_limit(tokenizer, self.max_input_len)
        self.end_ids = end_ids
        self.metrics = metrics  # Prometheus (triton/backend/metrics.py); None: not reported
        self.policy = settings.load_policy()  # one per instance: its window spans batches
        self.adaptive = settings.adaptive_policy()  # one per instance: its measured costs span batches
        # Suffix drafting's earlier responses and its per-source counts: one per instance
        # (each instance runs its own loop), kept across batches; the cache is bounded.
        self.suffix_cache = response_cache(settings.suffix) if settings.mode == "speculative" else None
        self.sources = SourceCounts()
        self._capture_thread: ThreadPoolExecutor | None = None  # serve.capture's (keep), made when first used
        self.head_swap = None  # method eagle3 in a Triton model: head_swap.HeadSwap (`trtspec refresh`)

    # -- parsing -------------------------------------------------------------------------

    def parse(self, inputs: Mapping[str, np.ndarray]) -> list[Row]:
        """Validate one request into rows; RequestError names the input and the fix."""
        request = self._read(inputs)
        return [row for r in range(len(request.prompts)) for row in self._prompt_rows(request, r)]

    def _read(self, inputs: Mapping[str, np.ndarray]) -> RequestInputs:
        """The request's inputs, per row, with every check that needs the whole request made
        before any prompt is tokenized."""
        arrival = time.time_ns()
        prompts = self._prompts(inputs)
        rows = len(prompts)
        sampling = sampling_of(inputs, rows)
        processing = processing_of(inputs, rows, self.input_tokenizer, self.s.limits.vocab_size)
        log_probs = _optional(inputs, "return_log_probs", rows)
        gen_logits = _optional(inputs, "return_generation_logits", rows)
        wants_log_probs = log_probs is not None and bool(log_probs.any())
        wants_logits = gen_logits is not None and bool(gen_logits.any())
        if not self.s.sampling_supported:
            self._refuse_logits_features(any(sampling), any(processing), wants_log_probs, wants_logits)
        n_seqs = _optional(inputs, "num_return_sequences", rows)
        n_seqs = [1] * rows if n_seqs is None else [int(n) for n in n_seqs]
        # every sequence is a row of the batch: they must fit in it together
        self.s.limits.check_batch(sum(n_seqs), "sequences (prompts x num_return_sequences)")
        max_tokens = _optional(inputs, "max_tokens", rows)
        if wants_logits:  # what the request would hold and send, refused before it runs
            asking = [r for r in range(rows) if gen_logits is not None and bool(gen_logits[r])]
            most = max(int(max_tokens[r]) for r in asking)
            check_response_size(sum(n_seqs[r] for r in asking), most, self.s.limits.vocab_size, True, self.s.max_response_mb)
        request = RequestInputs(
            arrival,
            prompts,
            max_tokens,
            n_seqs,
            sampling,
            processing,
            log_probs,
            gen_logits,
            **{name: _optional(inputs, name, rows) for name in RequestInputs.OPTIONAL},
            stop_words=inputs.get("stop_words"),
        )
        self._check_decoupled(request.wants_stream, max(n_seqs))
        return request

    def _prompts(self, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
        """The request's prompts, one per batch row [rows], within the batch and text limits."""
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
        check_text_sizes(inputs, self.max_text_bytes, self.max_input_len)  # before any tokenizing
        return text.reshape(rows)

    def _check_decoupled(self, wants_stream: bool, n_seq: int) -> None:
        """Streams and several sequences per prompt need the decoupled model."""
        if wants_stream and not self.s.decoupled:
            raise RequestError(
                "stream=true needs the decoupled model tensorrt_llm_bls_streaming (gRPC "
                "streaming); this model answers once per request"
            )
        if n_seq > 1 and not self.s.decoupled:
            raise RequestError(
                f"num_return_sequences={n_seq} answers with one response per sequence, which needs a "
                "decoupled model (as upstream): send it to tensorrt_llm_bls_streaming, or repeat the "
                "request with other seeds"
            )

    def _prompt_rows(self, request: RequestInputs, r: int) -> list[Row]:
        """Batch row r's prompt, tokenized, as one Row per sequence it asks for."""
        rows, vocab = len(request.prompts), self.s.limits.vocab_size
        prompt = _text(request.prompts[r])
        if not prompt.strip():
            raise RequestError("text_input is empty; send the prompt text")
        chat = request.apply_chat_template
        use_chat = self.s.chat_template_default if chat is None else bool(chat[r])
        ids = encode_prompt(self.input_tokenizer, prompt, use_chat)
        column = request.num_draft_tokens
        num_draft_tokens = None if column is None else int(column[r])  # None: the request rules fill in the default
        ends = self._ends_of(request, r)
        tree = self._tree_of(request, r)
        scope = _scope_of(request, r)
        pad = 0 if request.pad_id is None else int(request.pad_id[r])
        check_token_ids([pad], vocab, "pad_id")
        sampling, n_seqs = request.sampling[r], request.n_seqs
        out = []
        for seq in range(n_seqs[r]):
            # Sequence i samples with seed + i, as upstream's child requests do.
            params = sampling if seq == 0 or sampling is None else replace(sampling, seed=(sampling.seed + seq) % 2**63)
            req = make_request(
                ids,
                int(request.max_tokens[r]),
                num_draft_tokens,
                self.s.limits,
                ends,
                self._stop_sequences(request.stop_words, r, rows),
                params,
                request.processing[r],
                request.flag("log_probs", r),
                request.flag("generation_logits", r),
                tree=tree,
                suffix_scope=scope,
            )
            out.append(
                Row(
                    request=req,
                    exclude_input=request.flag("exclude_input_in_output", r),
                    want_metrics=request.flag("return_perf_metrics", r),
                    want_margins=request.flag("return_margins", r),
                    stream=request.wants_stream,
                    pad_id=pad,
                    want_counts=(request.flag("return_num_input_tokens", r), request.flag("return_num_output_tokens", r)),
                    batch_index=r,
                    times={"arrival_time_ns": request.arrival},
                    sequence_index=seq,
                    sequences=n_seqs[r],
                    # a decoupled model answers each prompt and sequence on its own, as upstream
                    separate=self.s.decoupled and sum(n_seqs) > 1,
                    capture=request.capture is None or bool(request.capture[r]),
                )
            )
        return out

    def _ends_of(self, request: RequestInputs, r: int) -> frozenset[int]:
        """Row r's end tokens: its end_id, none for -1 (TensorRT-LLM's ignore_eos: generate
        max_tokens), the tokenizer's without one."""
        if request.end_id is None:
            return self.end_ids
        e = int(request.end_id[r])
        if e == -1:
            return frozenset()
        check_token_ids([e], self.s.limits.vocab_size, "end_id")
        return frozenset({e})

    def _tree_of(self, request: RequestInputs, r: int) -> str | None:
        """draft_tree false: "chain"; true or absent: None, the deployment's own (a tree, if it
        has one); true where it drafts chains is refused by name."""
        if request.draft_tree is None:
            return None
        if not bool(request.draft_tree[r]):
            return "chain"
        if self.s.mode == "speculative" and self.s.limits.default_tree is None:
            raise RequestError("draft_tree true: this endpoint drafts chains (its spec has no speculative.tree); leave it out")
        return None

    def _refuse_logits_features(self, sampling: bool, processing: bool, log_probs: bool, logits: bool) -> None:
        """This endpoint's target engine returns no generation logits (TensorRT-LLM engines):
        the features decided from the target's logits are refused, each by name."""
        for asked, feature, fix in (
            (sampling, "sampling (top_k/top_p with temperature > 0)", "send top_k 1 for greedy decoding"),
            (
                processing,
                "logits processing (repetition/presence/frequency penalty, min_tokens, bad_words, embedding bias)",
                "leave those inputs out or at their neutral values",
            ),
            (log_probs, "log probs (return_log_probs)", "send return_log_probs false"),
            (logits, "generation logits (return_generation_logits)", "send return_generation_logits false"),
        ):
            if asked:
                raise RequestError(
                    f"{feature} is not supported by this endpoint: its target engine returns no generation "
                    f"logits (trtspec decides these from the logits of its torch engines); {fix}"
                )

    def _stop_sequences(self, stops, row: int, rows: int) -> tuple[tuple[int, ...], ...]:
        seqs = [tuple(self.input_tokenizer(word, add_special_tokens=False)["input_ids"]) for word in stop_words(stops, row, rows)]
        return tuple(s for s in seqs if s)

    # -- running -------------------------------------------------------------------------

    def drafter(self):
        if self.s.mode == "target_only":
            return NoDrafter()
        model = None
        if self.s.draft_model is not None:
            model = BlsDrafter(self.call, self.s.draft_model, self.s.draft_vocab_limit)
        elif self.s.eagle3_head_dir is not None:  # method eagle3, or auto listing it
            model = self._eagle3_drafter()
        kw = dict(min_ngram=self.s.min_ngram, draft_model=model, suffix=self.s.suffix, cache=self.suffix_cache)
        if self.adaptive is not None:
            return make_menu(self.s.method, self.adaptive, max_ngram=self.s.max_ngram, sources=self.sources, **kw)
        return make_drafter(self.s.method, max_ngram=self.s.max_ngram, sources=self.sources, **kw)

    def _eagle3_drafter(self):
        """The head runs here, beside the loop; the target's features come from the target
        engine model (BlsFeatures), so the target is loaded once, in its own model."""
        from trtspec.speculative.eagle3_drafter import Eagle3Drafter
        from trtspec.triton.backend.bls import BlsFeatures

        if self.head_swap is not None:  # `trtspec refresh` may have put in another head
            return Eagle3Drafter(self.head_swap.head, BlsFeatures(self.call, self.s.target_model))
        if getattr(self, "_head", None) is None:
            self._head = self.load_head(self.s.eagle3_head_dir)
        return Eagle3Drafter(self._head, BlsFeatures(self.call, self.s.target_model))

    def load_head(self, folder: str):
        """The EAGLE-3 head engine in ``folder``, beside this endpoint's target (its embeddings and RoPE)."""
        from trtspec.engines.torch.eagle3_head import HeadEngine

        return HeadEngine.load_beside(folder, self.s.eagle3_target_dir, self.s.limits.max_batch_size)

    def verifier(self, margins: bool) -> BlsVerifier:
        return BlsVerifier(
            self.call,
            self.s.target_model,
            margins,
            continued=self.s.target_continues,
            kv_blocks=self.s.kv_blocks_supported,
            eos_id=self.tokenizer.eos_token_id,
        )

    def new_batch(self) -> Batch:
        """A loop Batch for this endpoint. Margins come back whenever the engine gives them
        (requests that want them join a batch already running). A speculative endpoint's steps
        that draft nothing decode up to DECODE_CHUNK tokens per engine request, SATURATED_CHUNK
        while the scheduler finds the batch saturated (loop.Batch); the target-only control's
        scheduled requests (streaming, sampling) keep one per step."""
        chunk, saturated = (DECODE_CHUNK, SATURATED_CHUNK) if self.s.mode == "speculative" else (1, 1)
        return Batch(
            self.drafter(),
            self.verifier(self.s.margins_supported),
            policy=self.policy,
            decode_chunk=chunk,
            saturated_chunk=saturated,
        )

    def run(self, requests: Sequence[Mapping[str, np.ndarray]], send: Sender | None = None) -> list[dict | Exception | None]:
        """Answer every request, here and now (the control endpoint; tests). Unary: returns
        the tensors (or error) per request. With ``send`` (decoupled): streams through it and
        returns only errors (None = sent). The speculative endpoints serve through a
        scheduler.Scheduler on a worker thread instead; this runs the same one to the end."""
        answers: list[dict | Exception | None] = [None] * len(requests)
        parsed: dict[int, list[Row]] = {}
        for i, inputs in enumerate(requests):
            try:
                parsed[i] = self.parse(inputs)
            except RequestError as err:
                answers[i] = err.with_traceback(None)  # its frames would pin the request's arrays
            except Exception as err:  # a tokenizer or chat-template failure: this request only
                answers[i] = RuntimeError(f"could not prepare the request: {type(err).__name__}: {err}")
        rows = [row for i in parsed for row in parsed[i]]
        greedy = all(not r.request.needs_logits and not r.stream and r.sequences == 1 for r in rows)
        if rows and self.s.mode == "target_only" and greedy:
            self._decode_in_one_request(parsed, answers)
            return answers
        try:
            scheduler = Scheduler(self, max_active=max(1, len(rows)), max_queue=max(1, len(parsed)), observe=self.observe_step)
        except Exception as err:  # no drafter (engine failure): these requests, not the server
            for i in parsed:
                answers[i] = RuntimeError(f"generation failed: {err}")
            return answers
        for i, own in parsed.items():
            scheduler.enqueue(own, _Collect(i, answers, send))
        while scheduler.busy:
            scheduler.step()
        return answers

    def _decode_in_one_request(self, parsed: dict[int, list[Row]], answers: list) -> None:
        """The control answers each greedy prompt in one engine request, as a user's request
        would: what verify certifies and what bench's baseline measures."""
        rows = [row for i in parsed for row in parsed[i]]
        margins = self.s.margins_supported and any(r.want_margins for r in rows)
        scheduled = time.time_ns()
        for row in rows:
            row.times["first_scheduled_time_ns"] = scheduled
        try:
            decoder = BlsDecoder(
                self.call, self.s.target_model, self.tokenizer.eos_token_id, margins, kv_blocks=self.s.kv_blocks_supported
            )
            results = decoder.decode([r.request for r in rows])
        except Exception as err:  # an engine failure fails these requests, not the server
            self._report_finished([None] * len(rows))
            for i in parsed:
                answers[i] = (
                    err.with_traceback(None) if isinstance(err, RequestError) else RuntimeError(f"generation failed: {err}")
                )
            return
        self._report_finished(results)
        done = time.time_ns()  # one request: every token arrives with the answer
        for row, res in zip(rows, results):
            if res.output_ids or res.finish_reason == "eos":
                row.times.setdefault("first_token_time_ns", done)
                row.times["last_token_time_ns"] = done
        at = 0
        for i, own in parsed.items():
            answers[i] = self.pack(own, results[at : at + len(own)])
            at += len(own)

    def observe_step(self, stats: StepStats) -> None:
        """A scheduler step, for monitoring: the loop's counts, the load, who ended and why."""
        if self.metrics is None:
            return
        if stats.sequences:
            self.metrics.step(stats)  # StepStats carries StepCounts' fields
            # the gauge shows the k the requests ask for, not the loop's per-step cap near
            # max_tokens (or the prefill step, which drafts nothing)
            self.metrics.draft_len.set(stats.num_draft_tokens)
        self.metrics.load(active=stats.held, queued=stats.queued)
        self.metrics.sources(self.sources)
        if self.suffix_cache is not None:
            self.metrics.suffix_cache(self.suffix_cache.held_tokens)
        for reason, tokens in stats.ended:
            self.metrics.finished(reason, tokens)  # None (failed) counts as error
        if stats.unsent:
            self.metrics.unsent.increment(stats.unsent)

    def _report_finished(self, results: Sequence[GenerationResult | None]) -> None:
        """Every row has ended (None: failed): count them by reason; nothing is active now."""
        if self.metrics is None:
            return
        for res in results:
            self.metrics.finished(None if res is None else res.finish_reason, 0 if res is None else len(res.output_ids))
        self.metrics.load(active=0, queued=0)

    def pack(self, rows: Sequence[Row], results: Sequence[GenerationResult]) -> dict[str, np.ndarray]:
        return pack(self.tokenizer, rows, results)

    def keep(self, rows: Sequence[Row], results: Sequence[GenerationResult], request_id: str) -> None:
        """A request was answered: the rows serve.capture wants go to the target engine model,
        which keeps them (speculative/capture.py), on a thread of their own so the loop never
        waits. A row's id is the request's (with its row and sequence where it has several);
        a request sent without an id gets a random one."""
        spec = self.s.capture
        if spec is None:
            return
        rid = request_id or uuid.uuid4().hex
        for row, res in zip(rows, results):
            key = rid if len(rows) == 1 else f"{rid}/{row.batch_index}/{row.sequence_index}"
            if res.output_ids and wanted(spec, key, row.request.suffix_scope, row.capture):
                self._keeper().submit(self._keep_one, key, row.request, list(res.output_ids))

    def close(self) -> None:
        """Unload: serve.capture's thread stops; requests it has not sent to the target are not kept."""
        if self._capture_thread is not None:
            self._capture_thread.shutdown(wait=False, cancel_futures=True)

    def _keeper(self) -> ThreadPoolExecutor:
        if self._capture_thread is None:
            self._capture_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trtspec-capture")
        return self._capture_thread

    def _keep_one(self, key: str, request: GenerationRequest, output_ids: list[int]) -> None:
        try:
            BlsKeeper(self.call, self.s.target_model)(key, request.prompt_ids, output_ids, request.suffix_scope)
        except Exception as err:  # the answer is out; a capture that fails loses only itself
            log.error(f"serve.capture could not keep the request: {type(err).__name__}: {err}", key)


class _Collect:
    """A scheduler Reply that keeps a request's answer in ``answers[i]`` (unary) or streams
    it through ``send`` (decoupled; errors still land in ``answers``)."""

    def __init__(self, i: int, answers: list, send: Sender | None):
        self.i, self.answers, self.sender = i, answers, send

    def send(self, tensors: dict[str, np.ndarray], final: bool) -> None:
        if self.sender is not None:
            self.sender(self.i, tensors, final)
        elif final:
            self.answers[self.i] = tensors

    def fail(self, err: Exception) -> None:
        self.answers[self.i] = err.with_traceback(None)  # its frames would pin the request's arrays

    def cancelled(self) -> bool:
        return False

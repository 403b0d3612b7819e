"""Drafter and verifier that call engine models through a request function (BLS in Triton).

They plug into the one speculative loop (trtspec.speculative.loop.generate) exactly as
ModelDrafter and LogitsVerifier do in process; only the transport differs. Requests follow
TensorRT-LLM's `tensorrt_llm` contract, so the same classes drive a TensorRT-LLM target:

  draft   input_ids + request_output_len = k            -> k greedy draft tokens
  verify  input_ids + draft_input_ids, request_output_len = len(draft) + 1
                                                         -> accepted prefix + the target's next token
  tree    input_ids + draft_input_ids + draft_tree_parents, request_output_len = len(tree) + 1
                                                         -> the target's token after every node
  grow    the same with return_top_k = w                 -> w candidates after every node

``call(model, inputs, output_names)`` sends one request (batch = several sequences) and
returns its output arrays, raising on an error response. Within one call every row has the
same draft length (draft_input_ids has no per-row length), so rows are grouped by it (and
trees apart from chains).
TensorRT-LLM's tensorrtllm backend refuses a batch > 1 in a non-decoupled model, so for it the
call is wrapped by :func:`split_rows`: one request per row, all in flight at once, which the
in-flight batcher merges. Target-only control decodes a whole answer in one request
(:class:`BlsDecoder`), as a user's own request would.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from trtspec.speculative.capabilities import Capabilities, Drafter
from trtspec.speculative.loop import (
    DecodeChunk,
    GenerationRequest,
    GenerationResult,
    TokenRows,
    Verdict,
    VerifyAsks,
    finish,
)
from trtspec.speculative.processing import RowRules
from trtspec.speculative.tree import Candidates, DraftTree, TreeGrowth, TreeShape
from trtspec.triton.backend import log

if TYPE_CHECKING:
    from typing_extensions import Unpack

EngineCall = Callable[[str, Mapping[str, np.ndarray], Sequence[str]], Mapping[str, np.ndarray]]
# Sends several single-row requests to one model at once; answers in order.
EngineCallMany = Callable[[str, Sequence[Mapping[str, np.ndarray]], Sequence[str]], list[Mapping[str, np.ndarray]]]


# How long the speculative endpoints wait for one engine request (a loop step's draft or
# verify) before failing the step: a hung engine model must not stall the scheduler forever.
# Model parameter engine_timeout_s overrides it.
ENGINE_TIMEOUT_S = 120.0


class EngineTimeout(RuntimeError):
    """An engine model did not answer in time; the step's requests fail with this, retryable."""

    triton_code = "UNAVAILABLE"


class EngineCallsClosed(RuntimeError):
    """The endpoint is unloading: an engine call still waiting was given up."""

    triton_code = "UNAVAILABLE"


# Threads that run one endpoint instance's engine requests. Its scheduler makes one request at
# a time, so one thread serves it while the engines answer; the others run requests that were
# abandoned at their timeout, until the engine answers them. When all are held by such
# requests, new ones wait in line and time out in turn: a hung engine costs these threads,
# never more.
ENGINE_CALL_THREADS = 4
# Consecutive engine timeouts after which the instance reports itself not ready (Triton's
# readiness, where python_backend asks is_ready()); any engine answer makes it ready again.
UNREADY_AFTER_TIMEOUTS = 3


@dataclass(eq=False)
class _Pending:
    model: str
    inputs: Mapping[str, np.ndarray]
    names: Sequence[str]
    done: threading.Event
    outcome: tuple[str, object] | None = None  # ("out", outputs) | ("err", error) | ("closed", None)
    abandoned: bool = False  # timed out while still in line: never run


class EngineCalls:
    """An EngineCall bounded in time and in threads: each request runs on one of at most
    ``threads`` daemon threads, and the caller stops waiting after ``seconds`` (Triton's own
    request timeout, passed along by models/pb.py, only ends a request still queued at the
    engine model, not one it is running). A request abandoned that way keeps its thread until
    the engine answers; one still in line is dropped. ``healthy`` turns False after
    ``unready_after`` timeouts in a row and True again when an engine answers (readiness);
    ``close()`` (unload) ends every wait at once with EngineCallsClosed."""

    def __init__(
        self,
        call: EngineCall,
        seconds: float,
        threads: int = ENGINE_CALL_THREADS,
        unready_after: int = UNREADY_AFTER_TIMEOUTS,
    ):
        self.call, self.seconds, self.threads, self.unready_after = call, seconds, threads, unready_after
        self.timeouts = 0  # in a row
        self._lock = threading.Lock()
        self._line: deque[_Pending] = deque()
        self._waiting: set[_Pending] = set()  # callers still waiting, ended by close()
        self._workers = 0
        self._idle = 0
        self._more = threading.Condition(self._lock)
        self._closed = False

    @property
    def healthy(self) -> bool:
        with self._lock:
            return self.timeouts < self.unready_after

    @property
    def workers(self) -> int:
        with self._lock:
            return self._workers

    def __call__(self, model: str, inputs: Mapping[str, np.ndarray], names: Sequence[str]) -> Mapping[str, np.ndarray]:
        job = _Pending(model, inputs, names, threading.Event())
        with self._lock:
            if self._closed:
                raise EngineCallsClosed("the model is unloading; retry on another instance or later")
            self._line.append(job)
            self._waiting.add(job)
            if self._idle == 0 and self._workers < self.threads:
                self._workers += 1
                threading.Thread(target=self._work, name=f"trtspec-engine-calls-{self._workers}", daemon=True).start()
            else:
                self._more.notify()
        job.done.wait(self.seconds)
        with self._lock:
            self._waiting.discard(job)
            outcome = job.outcome
            if outcome is None:  # no answer in time: drop it if it has not started
                job.abandoned = True
                self.timeouts += 1
                timeouts = self.timeouts
        if outcome is None:
            log.error(
                f"engine model {model} did not answer within {self.seconds:g} s ({timeouts} timeout(s) in a row; "
                f"not ready from {self.unready_after})"
            )
            raise EngineTimeout(
                f"generation failed: engine model {model} did not answer within {self.seconds:g} s (engine timeout); "
                "retry the request; if it keeps happening, look at that model's log"
            )
        kind, value = outcome
        if kind == "out":
            return value  # type: ignore[return-value]
        if kind == "closed":
            raise EngineCallsClosed("the model is unloading; retry on another instance or later")
        raise value  # type: ignore[misc]

    def close(self) -> None:
        """Unload: no new requests; every caller still waiting gets EngineCallsClosed now."""
        with self._lock:
            self._closed = True
            for job in self._waiting:
                if job.outcome is None:
                    job.outcome = ("closed", None)
                    job.done.set()
            self._line.clear()
            self._more.notify_all()

    def _work(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
                while not self._line and not self._closed:
                    self._more.wait()
                self._idle -= 1
                if not self._line:  # closed
                    self._workers -= 1
                    return
                job = self._line.popleft()
                if job.abandoned:
                    continue
            try:
                outcome = ("out", self.call(job.model, job.inputs, job.names))
            except BaseException as err:  # handed to the caller; its frames would pin the arrays
                outcome = ("err", err.with_traceback(None))
            with self._lock:
                self.timeouts = 0  # the engine answered: it is not hung
                if job.outcome is None:
                    job.outcome = outcome
                    job.done.set()
            del job, outcome  # an abandoned request's arrays are not kept until the next one


def with_timeout(call: EngineCall, seconds: float) -> EngineCalls:
    """``call`` bounded by ``seconds`` on a bounded set of threads (EngineCalls)."""
    return EngineCalls(call, seconds)


def sequence_inputs(contexts: Sequence[list[int]], pad_id: int = 0) -> dict[str, np.ndarray]:
    """input_ids [b, L] padded with pad_id, input_lengths [b, 1]."""
    width = max(len(c) for c in contexts)
    ids = np.full((len(contexts), width), pad_id, dtype=np.int32)
    for row, c in enumerate(contexts):
        ids[row, : len(c)] = c
    lengths = np.array([[len(c)] for c in contexts], dtype=np.int32)
    return {"input_ids": ids, "input_lengths": lengths}


def _column(values: Sequence[int | bool], dtype) -> np.ndarray:
    return np.array([[v] for v in values], dtype=dtype)  # [b, 1]


def generated(outputs: Mapping[str, np.ndarray], rows: int) -> list[list[int]]:
    """Tokens per row from output_ids [b, beam, T] and sequence_length [b, beam] (beam 0)."""
    ids = np.asarray(outputs["output_ids"]).reshape(rows, -1, np.asarray(outputs["output_ids"]).shape[-1])
    lengths = np.asarray(outputs["sequence_length"]).reshape(rows, -1)
    return [ids[r, 0, : int(lengths[r, 0])].tolist() for r in range(rows)]


class BlsDrafter(Drafter):
    """Greedy drafts from a draft engine model, one batched request per loop step; the
    requests' logits processing goes along in upstream's `tensorrt_llm` inputs."""

    capabilities = Capabilities(mirrors_processing=True, trees=True)

    def __init__(self, call: EngineCall, model: str, vocab_limit: int | None = None, pad_id: int = 0):
        self.call = call
        self.model = model
        self.vocab_limit = vocab_limit
        self.pad_id = pad_id

    def propose(
        self, contexts: Sequence[list[int]], draft_lens: Sequence[int], rules: Sequence[RowRules | None] | None = None
    ) -> list[list[int]]:
        inputs = sequence_inputs(contexts, self.pad_id)
        inputs["request_output_len"] = _column(draft_lens, np.int32)
        inputs["exclude_input_in_output"] = _column([True] * len(draft_lens), np.bool_)
        if rules and any(r is not None for r in rules):
            inputs |= processing_inputs(rules)
        out = self.call(self.model, inputs, ["output_ids", "sequence_length"])
        drafts = generated(out, len(contexts))
        if self.vocab_limit is not None:  # an id the target cannot score ends the draft
            drafts = [_until_outside(d, self.vocab_limit) for d in drafts]
        return drafts

    def propose_tree(self, contexts: Sequence[list[int]], shapes: Sequence[TreeShape]) -> list[DraftTree]:
        """Draft trees a depth at a time (speculative/tree.py TreeGrowth), as ModelDrafter does
        in process: each round, one request per tree size scores every sequence's nodes so far
        under its tree mask and returns the candidates after each; the frontier's are grown."""
        growths = [TreeGrowth(s) for s in shapes]
        while live := [i for i, g in enumerate(growths) if not g.done]:
            scored = {i: growths[i].scored() for i in live}
            by_size: dict[int, list[int]] = {}
            for i in live:
                by_size.setdefault(len(scored[i][0]), []).append(i)
            for size, rows in by_size.items():
                width = max(growths[i].width for i in rows)
                inputs = sequence_inputs([contexts[i] for i in rows], self.pad_id)
                inputs["request_output_len"] = _column([size + 1] * len(rows), np.int32)
                inputs["exclude_input_in_output"] = _column([True] * len(rows), np.bool_)
                inputs["return_top_k"] = _column([width] * len(rows), np.int32)
                if size:
                    inputs["draft_input_ids"] = np.array([scored[i][0] for i in rows], dtype=np.int32)
                    inputs["draft_tree_parents"] = np.array([scored[i][1] for i in rows], dtype=np.int32)
                out = self.call(self.model, inputs, ["top_k_ids", "top_k_log_probs"])
                ids = np.asarray(out["top_k_ids"]).reshape(len(rows), size + 1, -1)
                lps = np.asarray(out["top_k_log_probs"]).reshape(len(rows), size + 1, -1)
                for r, i in enumerate(rows):
                    # the frontier: ROOT (row 0) in the first round, then the nodes scored last
                    at = [0] if not size else [j + 1 for j in scored[i][2]]
                    growths[i].grow([self._candidates(ids[r, a], lps[r, a]) for a in at])
        return [g.tree() for g in growths]

    def _candidates(self, ids: np.ndarray, log_probs: np.ndarray) -> Candidates:
        """One position's candidates, most likely first; ids the target cannot score are dropped."""
        out = []
        for t, lp in zip(ids.tolist(), log_probs.tolist()):
            if t < 0 or (self.vocab_limit is not None and t >= self.vocab_limit):
                continue
            out.append((int(t), float(lp)))
        return out


def processing_inputs(rules: Sequence[RowRules | None]) -> dict[str, np.ndarray]:
    """Upstream's `tensorrt_llm` logits-processing inputs for a batch of drafts: the values of
    each row's rules (neutral for rows without), min_tokens counted from the draft request's
    input (the tokens generated so far are in it), the first end id banned before it (the
    engine model has one end_id per request), bad_words_list [b, 2, n] and embedding_bias
    [b, vocab] (present only when some row uses them)."""
    procs = [None if r is None else r.processing for r in rules]
    f = lambda get, neutral: _column([neutral if p is None else get(p) for p in procs], np.float32)  # noqa: E731
    tensors = {
        "repetition_penalty": f(lambda p: p.repetition_penalty, 1.0),
        "presence_penalty": f(lambda p: p.presence_penalty, 0.0),
        "frequency_penalty": f(lambda p: p.frequency_penalty, 0.0),
        "temperature": f(lambda p: p.temperature, 1.0),
        "min_tokens": _column([0 if r is None else max(0, r.processing.min_tokens - r.generated) for r in rules], np.int32),
    }
    ends = [min(r.end_ids | r.processing.end_ids) if r is not None and (r.end_ids | r.processing.end_ids) else -1 for r in rules]
    if any(e >= 0 for e in ends):
        tensors["end_id"] = _column(ends, np.int32)
    words = [() if p is None else p.bad_words for p in procs]
    if any(words):
        width = max(1, max(sum(len(w) for w in ws) for ws in words))
        lists = np.zeros((len(rules), 2, width), dtype=np.int32)
        lists[:, 1, :] = -1
        for r, ws in enumerate(words):
            flat = [t for w in ws for t in w]
            lists[r, 0, : len(flat)] = flat
            lists[r, 1, : len(ws)] = np.cumsum([len(w) for w in ws]) if ws else []
        tensors["bad_words_list"] = lists
    biases = [() if p is None else p.bias for p in procs]
    if any(biases):
        vocab = 1 + max(t for b in biases for t, _ in b)
        bias = np.zeros((len(rules), vocab), dtype=np.float32)
        for r, b in enumerate(biases):
            for t, w in b:
                bias[r, t] += w
        tensors["embedding_bias"] = bias
    return tensors


def _until_outside(draft: list[int], limit: int) -> list[int]:
    for i, t in enumerate(draft):
        if not 0 <= t < limit:
            return draft[:i]
    return draft


@dataclass(eq=False)
class BlsVerifier:
    """One target request per distinct draft length (normally one per loop step)."""

    call: EngineCall
    model: str
    want_margins: bool = False
    pad_id: int = 0
    # TensorRT-LLM keeps decoding to request_output_len after a rejected draft; those
    # tokens are the target's own greedy ones and are kept (as upstream's BLS does).
    continued: bool = False
    kv_blocks: bool = False  # ask return_perf_metrics for the kv_cache_* block counts
    eos_id: int | None = None  # the end id a decode chunk's request names, when the row has it

    def verify(self, contexts: TokenRows, drafts: TokenRows, **asks: Unpack[VerifyAsks]) -> list[Verdict]:
        """``want_logits``: rows that sample; their request asks the engine model for
        return_generation_logits (the target's logits at the len(draft) + 1 positions).
        ``context_phase``: rows on their first step; only those ask for the kv_cache_* counts
        (the loop keeps a sequence's first ones), so later steps pay nothing for them.
        ``trees``: per row the parents of its draft tree (None: a chain); a tree's rows go in
        a request of their own (draft_tree_parents), answered with the target's token after
        every node. ``decode_chunks``: no row drafts; ONE decode request (BlsDecoder, the
        target-only endpoint's) answers every row with up to its chunk's tokens."""
        want_logits, context_phase = asks.get("want_logits"), asks.get("context_phase")
        chunks = asks.get("decode_chunks")
        if chunks is not None:
            return self._decode(contexts, chunks, context_phase)
        verdicts: list[Verdict | None] = [None] * len(contexts)
        trees = asks.get("trees") or [None] * len(drafts)
        by_len: dict[tuple[int, bool], list[int]] = {}
        for i, d in enumerate(drafts):
            by_len.setdefault((len(d), trees[i] is not None), []).append(i)
        for (d_len, is_tree), rows in by_len.items():
            if is_tree and self.continued:
                raise RuntimeError("this target keeps decoding past a rejected draft and scores chains only, not draft trees")
            inputs = sequence_inputs([contexts[i] for i in rows], self.pad_id)
            inputs["request_output_len"] = _column([d_len + 1] * len(rows), np.int32)
            inputs["exclude_input_in_output"] = _column([True] * len(rows), np.bool_)
            if d_len > 0:
                inputs["draft_input_ids"] = np.array([drafts[i] for i in rows], dtype=np.int32)
            if is_tree:
                inputs["draft_tree_parents"] = np.array([trees[i] for i in rows], dtype=np.int32)
            perf_rows = [bool(context_phase[i]) for i in rows] if self.kv_blocks and context_phase is not None else []
            names = _outputs(inputs, len(rows), perf_rows, self.want_margins)
            logits_rows = [bool(want_logits[i]) for i in rows] if want_logits is not None else []
            if any(logits_rows):
                inputs["return_generation_logits"] = _column(logits_rows, np.bool_)
                names.append("generation_logits")
            out = self.call(self.model, inputs, names)
            ids = generated(out, len(rows))
            margins = _margins_of(out, ids) if self.want_margins else None
            logits = _generation_logits(out, len(rows), d_len + 1) if any(logits_rows) else [None] * len(rows)
            blocks = kv_blocks_of(out, len(rows))
            for r, i in enumerate(rows):
                verdicts[i] = Verdict(
                    ids[r], margins[r] if margins else None, logits[r], continued=self.continued, kv_blocks=blocks[r]
                )
        return verdicts  # type: ignore[return-value]

    def _decode(self, contexts: TokenRows, chunks: Sequence[DecodeChunk], context_phase) -> list[Verdict]:
        """Each row's greedy continuation as a verdict the loop keeps whole (``continued``)."""
        decoder = BlsDecoder(self.call, self.model, self.eos_id, self.want_margins, self.pad_id)
        perf = [self.kv_blocks and context_phase is not None and bool(context_phase[r]) for r in range(len(contexts))]
        decoded = decoder.tokens(contexts, [c.tokens for c in chunks], [c.end_ids for c in chunks], perf)
        return [Verdict(d.ids, d.margins, continued=True, kv_blocks=d.kv_blocks) for d in decoded]


KV_BLOCK_OUTPUTS = ["kv_cache_alloc_new_blocks", "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks"]


def _outputs(inputs: dict[str, np.ndarray], rows: int, perf: Sequence[bool], margins: bool) -> list[str]:
    """The outputs a target request reads, its asks added to ``inputs``: the tokens, the
    kv_cache_* counts of the rows in ``perf`` (return_perf_metrics), the margins when asked."""
    names = ["output_ids", "sequence_length"]
    if any(perf):
        inputs["return_perf_metrics"] = _column(perf, np.bool_)
        names += KV_BLOCK_OUTPUTS
    if margins:
        inputs["return_margins"] = _column([True] * rows, np.bool_)
        names.append("output_margins")
    return names


def _margins_of(out: Mapping[str, np.ndarray], ids: list[list[int]]) -> list[list[float]]:
    """output_margins [b, 1, G] -> per row the margins of its tokens."""
    m = np.asarray(out["output_margins"]).reshape(len(ids), -1)
    return [m[r, : len(ids[r])].tolist() for r in range(len(ids))]


def kv_blocks_of(out: Mapping[str, np.ndarray], rows: int) -> list[tuple[int, int, int] | None]:
    """Per row (new, reused, total) KV-cache blocks of the request's context phase, as the
    engine model reports them with return_perf_metrics; None where it reports none (-1)."""
    cols = []
    for name in KV_BLOCK_OUTPUTS:
        x = out.get(name)
        if x is None:
            return [None] * rows
        cols.append(np.asarray(x).reshape(rows, -1)[:, 0])
    return [None if any(int(c[r]) < 0 for c in cols) else tuple(int(c[r]) for c in cols) for r in range(rows)]  # type: ignore[misc]


def _generation_logits(out, rows: int, n: int) -> list:
    """generation_logits [b, beam 1, n, vocab] -> per row a torch tensor [n, vocab]."""
    import torch

    raw = out.get("generation_logits")
    if raw is None:
        raise RuntimeError("the target engine model returned no generation_logits; it cannot serve sampling")
    arr = np.asarray(raw, dtype=np.float32).reshape(rows, n, -1)
    return [torch.from_numpy(np.ascontiguousarray(arr[r])) for r in range(rows)]


class BlsFeatures:
    """EAGLE-3's FeaturesFn over BLS: one request to the target engine model per loop step
    asks for the features it captured (hidden_states_from; nothing is recomputed)."""

    def __init__(self, call: EngineCall, model: str, pad_id: int = 0):
        self.call = call
        self.model = model
        self.pad_id = pad_id

    def __call__(self, wants):
        import torch

        inputs = sequence_inputs([list(tokens[:stop]) for tokens, _, stop in wants], self.pad_id)
        inputs["hidden_states_from"] = _column([start for _, start, _ in wants], np.int32)
        inputs["request_output_len"] = _column([1] * len(wants), np.int32)
        out = self.call(self.model, inputs, ["hidden_states", "hidden_states_length"])
        feats = np.asarray(out["hidden_states"])  # [b, N, n_layers * hidden]
        got = np.asarray(out["hidden_states_length"]).reshape(len(wants))
        return [None if got[r] < 0 else torch.from_numpy(np.ascontiguousarray(feats[r, : got[r]])) for r in range(len(wants))]


class BlsKeeper:
    """serve.capture over BLS: one answered request, prompt + response, sent to the target
    engine model, which scores it and keeps it (speculative/capture.py) where its features are."""

    def __init__(self, call: EngineCall, model: str):
        self.call = call
        self.model = model

    def __call__(self, request_id: str, prompt_ids: list[int], output_ids: list[int], scope: str | None) -> bool:
        """Whether the target model kept it."""
        inputs = sequence_inputs([list(prompt_ids) + list(output_ids)])
        inputs["request_output_len"] = _column([1], np.int32)
        inputs["capture_request_id"] = np.array([[request_id.encode()]], dtype=np.object_)
        inputs["capture_scope"] = np.array([[(scope or "").encode()]], dtype=np.object_)
        inputs["capture_prompt_length"] = _column([len(prompt_ids)], np.int32)
        out = self.call(self.model, inputs, ["capture_kept"])
        return bool(np.asarray(out["capture_kept"]).reshape(-1)[0])


@dataclass
class Decoded:
    """One row of a decode request: the target's greedy tokens after its context (its end id
    last when it stopped there), their margins when asked, its context phase's KV blocks."""

    ids: list[int]
    margins: list[float] | None
    kv_blocks: tuple[int, int, int] | None


@dataclass(eq=False)
class BlsDecoder:
    """Greedy decoding of several tokens per row in ONE engine request (no drafts,
    request_output_len = the tokens wanted): the target-only endpoint's answers (a whole
    answer per prompt) and the speculative endpoints' decode chunks (BlsVerifier)."""

    call: EngineCall
    model: str
    eos_id: int | None
    want_margins: bool = False
    pad_id: int = 0
    kv_blocks: bool = False

    def decode(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Target-only: one request for every prompt's whole answer (request_output_len = max_tokens)."""
        results: list[GenerationResult | None] = [None] * len(requests)
        live = [i for i, r in enumerate(requests) if r.max_tokens > 0]
        for i in set(range(len(requests))) - set(live):
            results[i] = finish(requests[i], [])
        if live:
            rows = [requests[i] for i in live]
            decoded = self.tokens(
                [r.prompt_ids for r in rows],
                [r.max_tokens for r in rows],
                [r.end_ids for r in rows],
                [self.kv_blocks] * len(rows),
            )
            for i, d in zip(live, decoded):
                results[i] = finish(requests[i], d.ids, d.margins)
                results[i].kv_blocks = d.kv_blocks
        return results  # type: ignore[return-value]

    def tokens(
        self, contexts: TokenRows, lengths: Sequence[int], end_ids: Sequence[frozenset[int]], perf: Sequence[bool]
    ) -> list[Decoded]:
        """Up to lengths[r] greedy tokens after each context, in one request; ``perf``: rows
        whose context phase's KV blocks are asked for (return_perf_metrics)."""
        inputs = sequence_inputs(contexts, self.pad_id)
        inputs["request_output_len"] = _column(lengths, np.int32)
        inputs["exclude_input_in_output"] = _column([True] * len(contexts), np.bool_)
        # The engine stops at one end_id; the row's other end ids and its stop sequences end
        # it in the loop's rules (finish, or the loop's accept step) over the returned tokens.
        inputs["end_id"] = _column([self._end_id(e) for e in end_ids], np.int32)
        out = self.call(self.model, inputs, _outputs(inputs, len(contexts), perf, self.want_margins))
        ids = generated(out, len(contexts))
        blocks = kv_blocks_of(out, len(contexts))
        margins: list[list[float]] | list[None] = _margins_of(out, ids) if self.want_margins else [None] * len(contexts)
        return [Decoded(i, m, b) for i, m, b in zip(ids, margins, blocks)]

    def _end_id(self, end_ids: frozenset[int]) -> int:
        if self.eos_id is not None and self.eos_id in end_ids:
            return self.eos_id
        return min(end_ids) if end_ids else -1


def split_rows(call_many: EngineCallMany) -> EngineCall:
    """An EngineCall that sends each row as its own request, all at once, and merges the
    answers: output_ids [b, 1, T] (padded with 0), sequence_length [b, 1], margins [b, 1, G]."""

    def call(model: str, inputs: Mapping[str, np.ndarray], names: Sequence[str]) -> dict[str, np.ndarray]:
        rows = int(np.asarray(inputs["input_ids"]).shape[0])
        lengths = np.asarray(inputs["input_lengths"]).reshape(rows)
        singles = []
        for r in range(rows):
            one = {k: np.asarray(v)[r : r + 1] for k, v in inputs.items()}
            one["input_ids"] = one["input_ids"][:, : int(lengths[r])]  # no padding per request
            singles.append(one)
        answers = call_many(model, singles, names)
        merged: dict[str, np.ndarray] = {}
        for name in names:
            parts = [np.asarray(a[name]) for a in answers]
            if name == "sequence_length":
                merged[name] = np.concatenate([p.reshape(1, -1) for p in parts])
                continue
            width = max(p.shape[-1] for p in parts)
            fill = np.nan if name == "output_margins" else 0
            rows_out = [
                np.pad(
                    p.reshape(1, 1, -1).astype(np.float32 if fill is np.nan else p.dtype),
                    ((0, 0), (0, 0), (0, width - p.shape[-1])),
                    constant_values=fill,
                )
                for p in parts
            ]
            merged[name] = np.concatenate(rows_out)
        return merged

    return call

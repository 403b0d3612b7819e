"""The token-level engine behind the `tensorrt_llm` / `tensorrt_llm_draft` Python models.

It speaks TensorRT-LLM's `tensorrt_llm` tensor contract so the orchestrator talks to a torch
engine exactly as it will to a TensorRT-LLM one:

  inputs   input_ids [b, L] INT32 (padded), input_lengths [b, 1], request_output_len [b, 1],
           draft_input_ids [b, D] (optional), end_id / pad_id [b, 1] (optional),
           streaming [b, 1] BOOL (optional, must be false: this model is not decoupled),
           exclude_input_in_output [b, 1] BOOL (optional, default from the model parameter),
           return_margins [b, 1] BOOL (optional, trtspec extension),
           return_generation_logits [b, 1] BOOL (optional; scoring requests only)
           draft_tree_parents [b, D] INT32 (optional, trtspec extension: the drafts are a
           draft tree, node i's parent draft_tree_parents[i], -1 for the input's last token),
           return_top_k [b, 1] INT32 (optional, trtspec extension; scoring requests only)
  outputs  output_ids [b, 1, T] INT32 (beam width 1, padded with pad_id),
           sequence_length [b, 1] INT32, output_margins [b, 1, G] FP32 (when asked),
           generation_logits [b, 1, D + 1, vocab] FP32 (when asked: the target's logits at
           every scored position, drafts rejected or not; what speculative sampling needs),
           top_k_ids / top_k_log_probs [b, 1, D + 1, K] INT32 / FP32 (when asked: the K most
           likely tokens and their log probabilities at every scored position; a drafter
           grows a draft tree from them)

Semantics, as TensorRT-LLM's draft_tokens_external mode: with draft tokens the engine scores
input + drafts in ONE forward and returns the accepted prefix of the drafts plus the target's
own next token; without, it decodes request_output_len tokens greedily (stopping after end_id).
A draft tree (draft_tree_parents) is scored in the same ONE forward under a tree attention mask
(speculative/tree.py) and answered with the target's greedy token after the input and after
every node (D + 1 tokens, output_ids): the caller's loop finds the accepted path.
Everything here is plain numpy/torch so it is tested without a server; the Triton model only
converts pb_utils tensors to and from the dicts used here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from trtspec.engines.torch.engine import RunFn
from trtspec.engines.torch.model import tree_layout
from trtspec.errors import RequestError
from trtspec.spec import MAX_TREE_TOP_K
from trtspec.speculative.loop import GenerationRequest, NoDrafter, Verdict, accepted_prefix, generate
from trtspec.speculative.processing import Processing, processed
from trtspec.speculative.requests import Limits
from trtspec.speculative.tree import top_candidates
from trtspec.speculative.verifier import LogitsVerifier, greedy_with_margins
from trtspec.tokens import check_token_ids


@dataclass
class EngineJob:
    """One sequence of one request: what to run and how to answer."""

    tokens: list[int]  # input_ids[:input_length]
    max_new: int  # request_output_len
    draft: list[int] = field(default_factory=list)
    end_id: int | None = None
    want_logits: bool = False  # return_generation_logits (a scoring job)
    processing: Processing | None = None  # penalties, min_tokens, bad words, bias (upstream's inputs)
    want_perf: bool = False  # return_perf_metrics: the kv_cache_* block counts
    tree: tuple[int, ...] | None = None  # draft_tree_parents: the draft is a tree (speculative/tree.py)
    top_k: int = 0  # return_top_k: candidates wanted at every scored position


@dataclass
class JobResult:
    ids: list[int] = field(default_factory=list)  # generated tokens (input excluded)
    margins: list[float] = field(default_factory=list)  # top-1 minus top-2 logit per token
    logits: np.ndarray | None = None  # [len(draft) + 1, vocab] when the job asked for them
    kv_blocks: tuple[int, int, int] | None = None  # (new, reused, total) of the job's context phase
    top: list[list[tuple[int, float]]] | None = None  # per scored position: (token, log prob), most likely first


# TensorRT-LLM's default KV-cache block size (PluginConfig tokens_per_block): the unit of the
# kv_cache_* perf outputs. The torch engine caches per slot; counted in these blocks, its
# prefix reuse reads as upstream's block reuse.
TOKENS_PER_BLOCK = 32


def kv_blocks(input_len: int, reused: int, held: int, block: int = TOKENS_PER_BLOCK) -> tuple[int, int, int]:
    """(kv_cache_alloc_new_blocks, kv_cache_reused_blocks, kv_cache_alloc_total_blocks) of a
    context phase, as TensorRT-LLM counts them (kvCacheManager addSequence): of the
    ceil(input_len / block) blocks the input needs, the full blocks of its first
    input_len - 1 tokens found in the cache are reused; the rest are allocated, and an
    allocated block is "new" unless it overwrites cached content (the slot held ``held``
    tokens before)."""
    needed = -(-input_len // block)
    reused_blocks = min(reused, input_len - 1) // block
    allocated = range(reused_blocks, needed)
    new = sum(1 for b in allocated if b * block >= held)
    return new, reused_blocks, len(allocated)


def _recording(run: RunFn, cache_use, seen: dict[tuple, tuple[int, int]]) -> RunFn:
    """``run`` that keeps, for each sequence's FIRST forward in this call of run_jobs (its
    context phase), the engine's cache use (reused tokens, tokens held before)."""

    def wrapped(items):
        out = run(items)
        uses = cache_use() if cache_use is not None else []
        for it, use in zip(items, uses):
            seen.setdefault(tuple(it.tokens[: len(it.tokens)]), use)
        return out

    return wrapped


def run_jobs(run: RunFn, jobs: Sequence[EngineJob], vocab_limit: int | None = None, cache_use=None) -> list[JobResult]:
    """Run every job with the same verifier and loop as in-process generation.

    Verify jobs (with drafts, or asking for one token) are answered by ONE batched forward of
    LogitsVerifier: the accepted prefix of the draft plus the target's next token. Decode jobs
    (several tokens, no draft) are target-only generation: the one loop with NoDrafter, all
    jobs batched per step. ``vocab_limit`` keeps argmax within the first rows (a draft never
    proposes an id the target's vocabulary lacks).
    """
    results = [JobResult() for _ in jobs]
    first: dict[tuple, tuple[int, int]] = {}  # input tokens -> cache use of their first forward
    if cache_use is not None:
        run = _recording(run, cache_use, first)
    verifier = LogitsVerifier(run, vocab_limit)
    verify = [i for i, j in enumerate(jobs) if j.max_new > 0 and (j.draft or j.max_new == 1)]
    decode = [i for i, j in enumerate(jobs) if j.max_new > 1 and not j.draft]
    if verify:
        trees = [jobs[i].tree for i in verify]
        verdicts = verifier.verify(
            [jobs[i].tokens for i in verify], [jobs[i].draft for i in verify], trees=trees if any(trees) else None
        )
        for i, verdict in zip(verify, verdicts):
            job = jobs[i]
            if job.top_k:
                results[i].top = top_candidates(verdict.logits, job.top_k)
            if job.want_logits:
                results[i].logits = verdict.logits.float().numpy()
            if job.tree is not None:  # tree scoring: the target's token after every node
                results[i].ids, results[i].margins = list(verdict.target_ids), list(verdict.margins)
                continue
            if job.processing is not None:  # the processed target decides, as in the loop
                ends = frozenset() if job.end_id is None else frozenset({job.end_id})
                logits = processed(verdict.logits, job.processing, job.tokens, 0, job.draft, ends)
                ids, margins = greedy_with_margins(logits)
                verdict = Verdict(ids, margins, verdict.logits)
            n = accepted_prefix(jobs[i].draft, verdict)
            _answer(jobs[i], results[i], verdict.target_ids[: n + 1], verdict.margins[: n + 1])
    if decode:
        # The end id is emitted (as TensorRT-LLM's engines do), so it is a stop sequence here.
        requests = [
            GenerationRequest(
                jobs[i].tokens,
                jobs[i].max_new,
                # the end id is emitted, so it ends as a stop; min_tokens still bans it (_with_end)
                stop_sequences=() if jobs[i].end_id is None else ((jobs[i].end_id,),),
                processing=_with_end(jobs[i]),
            )
            for i in decode
        ]
        for i, res in zip(decode, generate(requests, NoDrafter(), verifier)):
            _answer(jobs[i], results[i], res.output_ids, res.margins)
    if cache_use is not None:
        for job, res in zip(jobs, results):
            # the job's context phase: the forward over its input (and draft, when it scores one)
            use = first.get(tuple(job.tokens + job.draft))
            if use is not None:
                res.kv_blocks = kv_blocks(len(job.tokens), *use)
    return results


def _with_end(job: EngineJob) -> Processing | None:
    """The job's processing, with its end id banned before min_tokens (upstream's rule)."""
    if job.processing is None or job.end_id is None:
        return job.processing
    return replace(job.processing, end_ids=frozenset({job.end_id}))


def _answer(job: EngineJob, res: JobResult, ids: list[int], margins) -> None:
    """Up to max_new tokens, ending after end_id."""
    for tok, margin in zip(ids, margins):
        if len(res.ids) >= job.max_new:
            break
        res.ids.append(tok)
        res.margins.append(margin)
        if tok == job.end_id:
            break


# ----------------------------------------------------------------------------- tensors


def per_row(inputs: Mapping[str, np.ndarray], name: str, rows: int, unit: str = "sequence") -> np.ndarray | None:
    """An optional per-row scalar input [b, 1] (or [b] after a reshape) as a [b] array."""
    x = inputs.get(name)
    if x is None:
        return None
    x = np.asarray(x)
    if x.size != rows:
        raise RequestError(f"{name} must hold one value per {unit} ({rows}); got shape {list(x.shape)}")
    return x.reshape(rows)


def parse_engine_request(
    inputs: Mapping[str, np.ndarray], limits: Limits, exclude_default: bool
) -> tuple[list[EngineJob], list[bool], list[bool], int]:
    """Validate one request; return its jobs, exclude_input_in_output and return_margins per
    row, and the pad id. RequestError messages name the tensor and the fix."""
    # Every size is checked on the arrays before any row becomes a Python list: a request
    # this engine cannot hold costs no more than reading its shape.
    ids = _input_ids(inputs, limits)
    rows, width = ids.shape
    lengths = per_row(inputs, "input_lengths", rows)
    out_len = per_row(inputs, "request_output_len", rows)
    if lengths is None or out_len is None:
        raise RequestError("input_lengths and request_output_len are required")
    streaming = per_row(inputs, "streaming", rows)
    if streaming is not None and streaming.any():
        raise RequestError(
            "streaming=true needs a decoupled model; this engine model answers once per request "
            "(stream through tensorrt_llm_bls_streaming)"
        )
    optional = (
        "end_id",
        "pad_id",
        "exclude_input_in_output",
        "return_margins",
        "return_generation_logits",
        "return_perf_metrics",
        "return_top_k",
    )
    end_ids, pad_ids, exclude, margins, gen_logits, perf, top_k = (per_row(inputs, name, rows) for name in optional)
    drafts = _draft_ids(inputs, rows, limits)
    processing = engine_processing(inputs, rows, limits.vocab_size)
    trees = _tree_parents(inputs, drafts, rows)
    if trees is not None and any(p is not None for p in processing):
        raise RequestError(
            "logits processing (penalties, min_tokens, bad words, bias) applies to chains: a draft "
            "tree's nodes continue different paths; send draft_tree_parents without those inputs"
        )
    _check_ranges(end_ids, pad_ids, top_k, limits.vocab_size)
    jobs = []
    d_len = 0 if drafts is None else int(drafts.shape[1])
    for r in range(rows):
        n, k, tree = int(lengths[r]), int(out_len[r]), None if trees is None else trees[r]
        _check_row_lengths(r, n, k, width, d_len, tree, limits)
        row = ids[r, :n] if drafts is None else np.concatenate([ids[r, :n], drafts[r]])
        outside = (row < 0) | (row >= limits.vocab_size)
        if outside.any():
            check_token_ids([int(row[int(outside.argmax())])], limits.vocab_size)
        tokens, draft = row[:n].tolist(), row[n:].tolist()
        end = None if end_ids is None else int(end_ids[r])
        wants = gen_logits is not None and bool(gen_logits[r])
        top = 0 if top_k is None else int(top_k[r])
        _check_row_asks(wants, top, bool(draft), k, d_len, tree)
        job = EngineJob(tokens, k, draft, end, wants, processing[r], perf is not None and bool(perf[r]), tree, top)
        jobs.append(job)
    pad = 0 if pad_ids is None else int(pad_ids[0])
    excl = [exclude_default if exclude is None else bool(exclude[r]) for r in range(rows)]
    want = [False if margins is None else bool(margins[r]) for r in range(rows)]
    return jobs, excl, want, pad


def _check_ranges(end_ids, pad_ids, top_k, vocab_size: int) -> None:
    """end_id a token id or -1 (no end token), pad_id a token id, return_top_k within the
    children one tree node may have (a drafter grows trees from them; more would only cost)."""
    if end_ids is not None and ((end_ids < -1) | (end_ids >= vocab_size)).any():
        raise RequestError(f"end_id must be a token id (0..{vocab_size - 1}) or -1 (no end token)")
    if pad_ids is not None and ((pad_ids < 0) | (pad_ids >= vocab_size)).any():
        raise RequestError(f"pad_id must be a token id (0..{vocab_size - 1})")
    if top_k is not None and ((top_k < 0) | (top_k > MAX_TREE_TOP_K)).any():
        raise RequestError(f"return_top_k must be in 0..{MAX_TREE_TOP_K} (the most children a draft tree node may have)")


def _input_ids(inputs: Mapping[str, np.ndarray], limits: Limits) -> np.ndarray:
    """input_ids [b, width], its batch and width within the engine's limits."""
    ids = inputs.get("input_ids")
    if ids is None or np.asarray(ids).ndim != 2:
        raise RequestError("input_ids must be an INT32 tensor of shape [batch, tokens]")
    ids = np.asarray(ids)
    rows, width = ids.shape
    limits.check_batch(rows)
    if width > limits.max_seq_len:
        raise RequestError(
            f"input_ids is {width} tokens wide; this engine holds at most {limits.max_seq_len} tokens "
            "per sequence (max_seq_len): send shorter inputs"
        )
    return ids


def _draft_ids(inputs: Mapping[str, np.ndarray], rows: int, limits: Limits) -> np.ndarray | None:
    """draft_input_ids [b, D] within max_draft_len (None: no drafts)."""
    drafts = inputs.get("draft_input_ids")
    if drafts is None:
        return None
    drafts = np.asarray(drafts)
    if drafts.ndim != 2 or drafts.shape[0] != rows:
        raise RequestError(f"draft_input_ids must have shape [{rows}, draft_len]; got {list(drafts.shape)}")
    if drafts.shape[1] > 0 and limits.max_draft_len == 0:
        raise RequestError("draft_input_ids given to an engine built without speculative decoding (max_draft_len 0)")
    if drafts.shape[1] > limits.max_draft_len:
        raise RequestError(f"{drafts.shape[1]} draft tokens exceed max_draft_len {limits.max_draft_len}; send fewer")
    return drafts


def _check_row_lengths(r: int, n: int, k: int, width: int, d_len: int, tree: tuple[int, ...] | None, limits: Limits) -> None:
    """Row ``r``'s input length ``n`` and request_output_len ``k`` (with ``d_len`` drafts or
    a draft tree) within the input width and max_seq_len."""
    if not 1 <= n <= width:
        raise RequestError(f"input_lengths[{r}] is {n}; it must be in 1..{width} (the input_ids width)")
    if k < 1:
        raise RequestError(f"request_output_len must be at least 1 (got {k})")
    if d_len and k < d_len + 1:
        raise RequestError(f"request_output_len {k} must be at least len(draft_input_ids) + 1 = {d_len + 1}")
    if tree is not None:  # the nodes sit at their depths after the input (the engine keeps them aside)
        depth = max(tree_layout(tree)[0])
        if n + depth > limits.max_seq_len:
            raise RequestError(f"input ({n} tokens) + a draft tree {depth} deep exceeds max_seq_len {limits.max_seq_len}")
    elif n + max(k, d_len + 1 if d_len else 0) > limits.max_seq_len:
        raise RequestError(f"input ({n} tokens) + request_output_len ({k}) exceeds max_seq_len {limits.max_seq_len}")


def _check_row_asks(wants_logits: bool, top_k: int, drafted: bool, k: int, d_len: int, tree: tuple[int, ...] | None) -> None:
    """Generation logits and top-k candidates come with scoring requests; a draft tree's
    request asks for one token after the input and after each node."""
    for asked, name in ((wants_logits, "return_generation_logits"), (top_k, "return_top_k")):
        if asked and not (drafted or k == 1):
            raise RequestError(
                f"{name} is answered for scoring requests (draft_input_ids, or request_output_len 1); send it with those"
            )
    if tree is not None and k != d_len + 1:
        raise RequestError(
            f"a draft tree is answered with the target's token after the input and after each of its "
            f"{d_len} nodes: send request_output_len {d_len + 1}"
        )


def _tree_parents(inputs: Mapping[str, np.ndarray], drafts: np.ndarray | None, rows: int) -> list[tuple[int, ...]] | None:
    """draft_tree_parents [b, D], one parent per draft token, checked (None: chains)."""
    raw = inputs.get("draft_tree_parents")
    if raw is None:
        return None
    parents = np.asarray(raw)
    if drafts is None or parents.shape != drafts.shape or drafts.shape[1] == 0:
        raise RequestError(
            f"draft_tree_parents must have the shape of draft_input_ids (one parent per draft token); "
            f"got {list(parents.shape)} for {None if drafts is None else list(drafts.shape)}"
        )
    out = []
    for r in range(rows):
        row = tuple(int(p) for p in parents[r])
        try:
            tree_layout(row)
        except ValueError as e:
            raise RequestError(f"draft_tree_parents[{r}]: {e}") from None
        out.append(row)
    return out


def _word_list(x: np.ndarray, r: int, rows: int) -> tuple[tuple[int, ...], ...]:
    """Upstream's bad_words_list row [2, n]: flat ids, then cumulative end offsets (padded -1)."""
    lists = np.asarray(x)
    if lists.ndim == 2:
        lists = lists[None]
    if lists.ndim != 3 or lists.shape[1] != 2 or lists.shape[0] not in (1, rows):
        raise RequestError(f"bad_words_list must have shape [{rows}, 2, n]; got {list(np.asarray(x).shape)}")
    ids, offsets = lists[min(r, lists.shape[0] - 1)]
    words, start = [], 0
    for end in offsets:
        end = int(end)
        if end < 0:
            break
        if not start <= end <= len(ids):
            raise RequestError(f"bad_words_list offsets must grow within the {len(ids)} ids; got {end} after {start}")
        if end > start:
            words.append(tuple(int(t) for t in ids[start:end]))
        start = end
    return tuple(words)


def engine_processing(inputs: Mapping[str, np.ndarray], rows: int, vocab_size: int) -> list[Processing | None]:
    """Per row: the logits processing of upstream's `tensorrt_llm` inputs (repetition /
    presence / frequency penalty, min_tokens, temperature, bad_words_list, embedding_bias
    [b, vocab]); None when a row asks for none (what the orchestrator's drafts mirror)."""

    def col(name, default):
        v = per_row(inputs, name, rows)
        return [default] * rows if v is None else [float(x) for x in v]

    rep, pres, freq = col("repetition_penalty", 1.0), col("presence_penalty", 0.0), col("frequency_penalty", 0.0)
    min_tokens, temperature = col("min_tokens", 1), col("temperature", 1.0)
    if any(not np.isfinite(t) or t < 0 for t in temperature):
        raise RequestError("temperature must be a finite number >= 0 (0: greedy)")
    bad = inputs.get("bad_words_list")
    bias = inputs.get("embedding_bias")
    if bias is not None:
        bias = np.asarray(bias, dtype=np.float32)
        bias = bias.reshape(rows, -1) if bias.size else None
    out: list[Processing | None] = []
    for r in range(rows):
        b: tuple[tuple[int, float], ...] = ()
        if bias is not None:
            nz = np.nonzero(bias[r])[0]
            b = tuple((int(t), float(bias[r, t])) for t in nz)
        proc = Processing(
            repetition_penalty=rep[r],
            presence_penalty=pres[r],
            frequency_penalty=freq[r],
            min_tokens=max(0, int(min_tokens[r])),
            bad_words=() if bad is None else _word_list(bad, r, rows),
            bias=b,
            temperature=temperature[r] if temperature[r] > 0 else 1.0,
        )
        proc.check_ids(vocab_size)
        out.append(proc if proc.active else None)
    return out


def pack_engine_response(
    jobs: Sequence[EngineJob],
    results: Sequence[JobResult],
    exclude: Sequence[bool],
    want_margins: Sequence[bool],
    pad: int,
) -> dict[str, np.ndarray]:
    seqs = [r.ids if ex else j.tokens + r.ids for j, r, ex in zip(jobs, results, exclude)]
    width = max(1, max(len(s) for s in seqs))
    out = np.full((len(seqs), 1, width), pad, dtype=np.int32)  # [b, beam, T]
    for row, s in enumerate(seqs):
        out[row, 0, : len(s)] = s
    tensors = {
        "output_ids": out,
        "sequence_length": np.array([[len(s)] for s in seqs], dtype=np.int32),  # [b, beam]
    }
    if any(want_margins):
        g = max(1, max(len(r.margins) for r in results))
        m = np.zeros((len(seqs), 1, g), dtype=np.float32)  # [b, beam, G]
        for row, r in enumerate(results):
            m[row, 0, : len(r.margins)] = r.margins
        tensors["output_margins"] = m
    if any(j.want_perf for j in jobs):
        # upstream's tensorrt_llm perf outputs [b, 1]; -1 where the engine reported no cache use
        for k, name in enumerate(("kv_cache_alloc_new_blocks", "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks")):
            tensors[name] = np.array([[-1 if r.kv_blocks is None else r.kv_blocks[k]] for r in results], dtype=np.int32)
    if any(j.top_k for j in jobs):
        n = max(len(r.top) for r in results if r.top is not None)
        w = max(j.top_k for j in jobs)
        ids = np.full((len(seqs), 1, n, w), -1, dtype=np.int32)  # [b, beam, positions, K]
        lps = np.full((len(seqs), 1, n, w), -np.inf, dtype=np.float32)
        for row, r in enumerate(results):
            for pos, cands in enumerate(r.top or []):
                for c, (tok, lp) in enumerate(cands):
                    ids[row, 0, pos, c], lps[row, 0, pos, c] = tok, lp
        tensors["top_k_ids"], tensors["top_k_log_probs"] = ids, lps
    if any(j.want_logits for j in jobs):
        n = max(r.logits.shape[0] for r in results if r.logits is not None)
        vocab = max(r.logits.shape[1] for r in results if r.logits is not None)
        lg = np.zeros((len(seqs), 1, n, vocab), dtype=np.float32)  # [b, beam, positions, vocab]
        for row, r in enumerate(results):
            if r.logits is not None:
                lg[row, 0, : r.logits.shape[0], : r.logits.shape[1]] = r.logits
        tensors["generation_logits"] = lg
    return tensors


def answer_features(inputs: Mapping[str, np.ndarray], features_of, limits: Limits) -> dict[str, np.ndarray]:
    """EAGLE-3 (trtspec extension): the captured target features of positions
    hidden_states_from..input_length-1 of each row, computing nothing.

    outputs  hidden_states [b, N, n_layers * hidden] FP32 (padded with 0),
             hidden_states_length [b, 1] INT32: N_r, or -1 when no cached prefix covers the row
             (the drafter then proposes nothing for it; the target's next forward fills it in).
    """
    if features_of is None:
        raise RequestError("hidden_states_from: this engine model does not capture features (method eagle3 only)")
    ids = inputs.get("input_ids")
    if ids is None or np.asarray(ids).ndim != 2:
        raise RequestError("input_ids must be an INT32 tensor of shape [batch, tokens]")
    ids = np.asarray(ids)
    rows = ids.shape[0]
    limits.check_batch(rows)
    lengths = per_row(inputs, "input_lengths", rows)
    starts = per_row(inputs, "hidden_states_from", rows)
    if lengths is None:
        raise RequestError("input_lengths is required")
    feats = []
    for r in range(rows):
        n, a = int(lengths[r]), int(starts[r])
        if not 0 <= a <= n <= ids.shape[1]:
            raise RequestError(f"hidden_states_from[{r}] is {a}; it must be in 0..input_lengths ({n})")
        feats.append(features_of([int(t) for t in ids[r, :n]], a, n))
    width = max((f.shape[-1] for f in feats if f is not None), default=1)
    longest = max([f.shape[0] for f in feats if f is not None] + [1])
    out = np.zeros((rows, longest, width), dtype=np.float32)
    got = np.full((rows, 1), -1, dtype=np.int32)
    for r, f in enumerate(feats):
        if f is not None:
            out[r, : f.shape[0]] = f.float().numpy()
            got[r, 0] = f.shape[0]
    return {"hidden_states": out, "hidden_states_length": got}


def answer_capture(inputs: Mapping[str, np.ndarray], capture) -> dict[str, np.ndarray]:
    """serve.capture (trtspec extension): keep one answered request, from the features and
    labels this engine kept while it served its steps (speculative/capture.py's
    CaptureWriter.record: no forward; capture_kept 0 once its slot holds another sequence, or
    while the writer's queue is full).

    inputs   input_ids [1, T] (prompt + response), input_lengths [1, 1],
             capture_prompt_length [1, 1], capture_request_id and capture_scope BYTES [1, 1]
    outputs  capture_kept [1, 1] INT32: 1 when its part was queued for the writer thread
    """
    if capture is None:
        raise RequestError("capture_request_id: this engine model keeps no requests (serve.capture is off)")
    ids = np.asarray(inputs.get("input_ids"))
    lengths, plen = per_row(inputs, "input_lengths", 1), per_row(inputs, "capture_prompt_length", 1)
    if ids.ndim != 2 or ids.shape[0] != 1 or lengths is None or plen is None:
        raise RequestError("a capture request is one row: input_ids [1, T], input_lengths and capture_prompt_length")
    n, p = int(lengths[0]), int(plen[0])
    if not 0 < p < n <= ids.shape[1]:
        raise RequestError(f"capture_prompt_length {p} must be in 1..input_lengths - 1 ({n - 1})")
    tokens = [int(t) for t in ids[0, :n]]
    rid, scope = (_bytes_text(np.asarray(inputs[name]).reshape(-1)[0]) for name in ("capture_request_id", "capture_scope"))
    kept = capture.record(rid, tokens[:p], tokens[p:], scope or None)
    return {"capture_kept": np.array([[int(kept is not None)]], dtype=np.int32)}


def _bytes_text(value) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


class EngineCore:
    """Serve a list of requests (each a dict of input arrays) with one batched engine run."""

    def __init__(
        self,
        run: RunFn,
        limits: Limits,
        vocab_limit: int | None = None,
        exclude_default: bool = False,
        features_of=None,
        cache_use=None,
        capture=None,
    ):
        self.run = run
        self.capture = capture  # serve.capture's CaptureWriter (target model only); None: off
        self.cache_use = cache_use  # () -> the engine's last_use (TorchEngine), for kv_cache_* outputs
        self.limits = limits
        self.vocab_limit = vocab_limit
        self.exclude_default = exclude_default
        self.features_of = features_of  # TorchEngine.features_of when it captures (eagle3)

    def infer(self, requests: Sequence[Mapping[str, np.ndarray]]) -> list[dict[str, np.ndarray] | Exception]:
        """One answer per request: output tensors, or the error for that request alone."""
        answers: list[dict[str, np.ndarray] | Exception] = [RequestError("not run")] * len(requests)
        parsed = {}
        for i, inputs in enumerate(requests):
            try:
                if inputs.get("hidden_states_from") is not None:  # a lookup, no forward
                    answers[i] = answer_features(inputs, self.features_of, self.limits)
                    continue
                if inputs.get("capture_request_id") is not None:  # an answered request to keep
                    answers[i] = answer_capture(inputs, self.capture)
                    continue
                parsed[i] = parse_engine_request(inputs, self.limits, self.exclude_default)
            except RequestError as err:
                # kept as the answer without its traceback: the traceback's frames hold the
                # request's arrays, in a cycle with this list, until the garbage collector runs
                answers[i] = err.with_traceback(None)
        jobs = [job for i in parsed for job in parsed[i][0]]
        try:
            results = []
            # Dynamic batching never exceeds max_batch_size rows; this only guards odd clients.
            for s in range(0, len(jobs), self.limits.max_batch_size):
                results += run_jobs(self.run, jobs[s : s + self.limits.max_batch_size], self.vocab_limit, self.cache_use)
        except Exception as err:  # an engine failure fails this batch, not the server
            for i in parsed:
                answers[i] = err.with_traceback(None)
            return answers
        start = 0
        for i, (req_jobs, excl, want, pad) in parsed.items():
            mine = results[start : start + len(req_jobs)]
            start += len(req_jobs)
            answers[i] = pack_engine_response(req_jobs, mine, excl, want, pad)
        return answers

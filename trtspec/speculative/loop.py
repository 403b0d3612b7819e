"""The one speculative decoding loop, shared by every runtime.

Each step: the drafter proposes up to k tokens per sequence; the verifier runs the target once
over [context + drafts] and returns the target's greedy tokens; the longest prefix of the
drafts that agrees with them is accepted, plus the target's own next token (the bonus after a
fully accepted draft, or the correction at the first disagreement). Target-only decoding is
the same loop with a drafter that proposes nothing (k = 0), so both paths share every rule
for EOS, stop sequences and max_tokens.

Drafter and verifier are plain interfaces: in process they call torch engines; inside the
Triton orchestrator they call the engine models over BLS. The loop never drafts or scores.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from trtspec.speculative.metrics import SpecMetrics

FinishReason = Literal["length", "eos", "stop"]


class Drafter(Protocol):
    def propose(self, contexts: Sequence[list[int]], ks: Sequence[int]) -> list[list[int]]:
        """Up to ks[i] draft tokens continuing contexts[i] (fewer is allowed)."""
        ...


@dataclass
class Verdict:
    """The target's greedy tokens after context + draft[:i] for i = 0, 1, ...

    At least up to the first disagreement with the draft, or len(draft) + 1 tokens when the
    whole draft agrees. ``margins`` (optional) are the target's top-1 minus top-2 logits at
    the same positions.
    """

    target_ids: list[int]
    margins: list[float] | None = None
    # True when target_ids past the first disagreement are the target's own greedy
    # continuation (TensorRT-LLM's draft_tokens_external keeps decoding to
    # request_output_len after a rejection): those tokens are kept, not discarded.
    continued: bool = False


class Verifier(Protocol):
    def verify(self, contexts: Sequence[list[int]], drafts: Sequence[list[int]]) -> list[Verdict]:
        ...


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int
    num_draft_tokens: int = 0
    end_ids: frozenset[int] = frozenset()  # EOS-like ids: end generation, not emitted
    stop_sequences: tuple[tuple[int, ...], ...] = ()  # end generation once emitted


@dataclass
class GenerationResult:
    output_ids: list[int] = field(default_factory=list)
    margins: list[float | None] = field(default_factory=list)  # per output token
    finish_reason: FinishReason | None = None
    metrics: SpecMetrics = field(default_factory=SpecMetrics)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclass
class PathRun:
    """One timed generation on one path (target-only or speculative), in process or served:
    tokens, optional per-token target margins, metrics, wall time."""

    output_ids: list[int]
    margins: list[float | None]
    metrics: SpecMetrics | None
    seconds: float


# on_step(request index, tokens emitted this step, finished?) — streaming hook.
StepCallback = Callable[[int, list[int], bool], None]


class NoDrafter:
    """Target-only decoding: propose nothing."""

    def propose(self, contexts, ks):
        return [[] for _ in contexts]


def accepted_prefix(draft: list[int], verdict: Verdict) -> int:
    """Number of draft tokens the target agreed with; validates the verdict's shape."""
    target = verdict.target_ids
    n = 0
    while n < len(draft) and n < len(target) and draft[n] == target[n]:
        n += 1
    if n >= len(target):
        raise ValueError(
            f"verifier returned {len(target)} token(s) for a draft of {len(draft)}: "
            "it must include the target's next token after the accepted prefix"
        )
    return n


def generate(
    requests: Sequence[GenerationRequest],
    drafter: Drafter,
    verifier: Verifier,
    on_step: StepCallback | None = None,
) -> list[GenerationResult]:
    """Greedy generation for a batch of requests; identical tokens whatever the drafter."""
    results = [GenerationResult() for _ in requests]
    for i, req in enumerate(requests):
        if req.max_tokens <= 0:
            results[i].finish_reason = "length"
            if on_step:
                on_step(i, [], True)
    while active := [i for i, r in enumerate(results) if not r.done]:
        contexts = [requests[i].prompt_ids + results[i].output_ids for i in active]
        # Never draft past the token budget: n accepted + 1 target token <= tokens left.
        ks = [
            max(0, min(requests[i].num_draft_tokens, requests[i].max_tokens - len(results[i].output_ids) - 1))
            for i in active
        ]
        drafts: list[list[int]] = [[] for _ in active]
        wants = [j for j, k in enumerate(ks) if k > 0]
        if wants:
            proposed = drafter.propose([contexts[j] for j in wants], [ks[j] for j in wants])
            for j, d in zip(wants, proposed):
                drafts[j] = list(d[: ks[j]])
        verdicts = verifier.verify(contexts, drafts)
        for j, i in enumerate(active):
            n = accepted_prefix(drafts[j], verdicts[j])
            results[i].metrics.record_step(len(drafts[j]), n)
            margins = verdicts[j].margins
            keep = len(verdicts[j].target_ids) if verdicts[j].continued else n + 1
            for _ in range(keep - (n + 1)):  # each further token cost the target one decode step
                results[i].metrics.record_step(0, 0)
            new = verdicts[j].target_ids[:keep]
            emitted = _emit(requests[i], results[i], new, margins[:keep] if margins else None)
            if on_step:
                on_step(i, emitted, results[i].done)
    return results


def finish(req: GenerationRequest, tokens: list[int], margins: list[float] | None = None) -> GenerationResult:
    """The result of target-only decoding done in one engine request: the same EOS, stop
    and max_tokens rules as the loop, applied to the tokens the engine returned."""
    res = GenerationResult()
    if req.max_tokens <= 0:
        res.finish_reason = "length"
        return res
    emitted = _emit(req, res, list(tokens), margins)
    for _ in emitted:  # one target decode step per token
        res.metrics.record_step(0, 0)
    if res.finish_reason is None:  # the engine stopped first (its end_id): an EOS end
        res.finish_reason = "eos"
    return res


def _emit(req: GenerationRequest, res: GenerationResult, new: list[int], margins) -> list[int]:
    """Append tokens one by one, stopping exactly where token-by-token decoding would."""
    emitted = []
    for pos, tok in enumerate(new):
        if tok in req.end_ids:
            res.finish_reason = "eos"
            break
        res.output_ids.append(tok)
        res.margins.append(margins[pos] if margins else None)
        emitted.append(tok)
        if any(_ends_with(res.output_ids, s) for s in req.stop_sequences):
            res.finish_reason = "stop"
            break
        if len(res.output_ids) >= req.max_tokens:
            res.finish_reason = "length"
            break
    return emitted


def _ends_with(seq: list[int], suffix: tuple[int, ...]) -> bool:
    return len(suffix) > 0 and len(seq) >= len(suffix) and tuple(seq[-len(suffix):]) == suffix

"""Several drafting methods over ONE target, same prompts, one run: target-only, eagle3,
draft_target and ngram, each through the one loop with the same verifier.

Definitions (per method, summed over prompts and rounds):
  tokens/s          output tokens / wall seconds of generate() (prefill included, prefix cache
                    emptied before every run so no run reuses another's prefill)
  speedup           tokens/s / target-only tokens/s
  acceptance rate   accepted drafts / drafted tokens
  mean acceptance length   output tokens / target forwards (the bonus token included)
  draft cost c      seconds inside drafter.propose per drafted token / target-only seconds per
                    token (what one draft step costs in target steps)
Every method's output ids are compared with target-only's: a difference is reported, never
averaged away.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from trtspec.speculative.loop import Drafter, GenerationRequest, NoDrafter, generate
from trtspec.speculative.metrics import SpecMetrics


class TimedDrafter:
    """Counts the seconds a drafter spends proposing."""

    def __init__(self, inner: Drafter):
        self.inner = inner
        self.seconds = 0.0

    def propose(self, contexts, ks):
        t0 = time.perf_counter()
        try:
            return self.inner.propose(contexts, ks)
        finally:
            self.seconds += time.perf_counter() - t0


@dataclass
class MethodStats:
    name: str
    tokens: int = 0
    seconds: float = 0.0
    draft_seconds: float = 0.0
    metrics: SpecMetrics = field(default_factory=SpecMetrics)
    identical: bool = True
    mismatches: list[int] = field(default_factory=list)  # prompt indices

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def to_dict(self, base: MethodStats | None) -> dict:
        m = self.metrics
        d = {
            "method": self.name,
            "tokens": self.tokens,
            "seconds": round(self.seconds, 3),
            "tokens_per_s": round(self.tokens_per_s, 2),
            "identical_to_target_only": self.identical,
            "mismatched_prompts": self.mismatches,
        }
        if base is not None and base.tokens_per_s:
            d["speedup"] = round(self.tokens_per_s / base.tokens_per_s, 3)
        if m.drafted:
            d |= {
                "acceptance_rate": round(m.acceptance_rate, 4),
                "mean_acceptance_length": round(m.mean_acceptance_length, 3),
                "per_position_acceptance": [round(x, 3) for x in m.per_position_rate],
                "drafted": m.drafted,
                "accepted": m.accepted,
            }
            if base is not None and base.tokens:
                per_target_token = base.seconds / base.tokens
                d["draft_cost_c"] = round(self.draft_seconds / m.drafted / per_target_token, 4)
        return d


def compare_methods(
    verifier,
    drafters: dict[str, tuple[Callable[[], Drafter], int]],
    requests: Sequence[GenerationRequest],
    forget: Callable[[], None],
    rounds: int = 1,
    progress: Callable[[str], None] = lambda s: None,
) -> list[MethodStats]:
    """Run target-only and every drafter (a fresh one per run, with its k) on each request, in a
    rotating order per prompt."""
    names = ["target-only", *drafters]
    stats = {n: MethodStats(n) for n in names}
    for r in range(rounds):
        for i, req in enumerate(requests):
            outputs: dict[str, list[int]] = {}
            order = names[(i + r) % len(names) :] + names[: (i + r) % len(names)]
            for name in order:
                progress(f"round {r + 1}/{rounds} prompt {i + 1}/{len(requests)}: {name}")
                factory, k = (NoDrafter, 0) if name == "target-only" else drafters[name]
                drafter = TimedDrafter(factory())
                one = GenerationRequest(req.prompt_ids, req.max_tokens, k, req.end_ids, req.stop_sequences)
                forget()
                t0 = time.perf_counter()
                (res,) = generate([one], drafter, verifier)
                s = stats[name]
                s.seconds += time.perf_counter() - t0
                s.draft_seconds += drafter.seconds
                s.tokens += len(res.output_ids)
                s.metrics = s.metrics.merge(res.metrics)
                outputs[name] = res.output_ids
            for name in drafters:
                if outputs[name] != outputs["target-only"]:
                    stats[name].identical = False
                    stats[name].mismatches.append(i)
    return [stats[n] for n in names]

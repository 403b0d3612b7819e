"""Identity: are greedy speculative outputs token-identical to target-only?

Per prompt, both paths run greedily and are compared by token id. At the first divergence
the report gives its index, both tokens (id and text) and the target's top-1 minus top-2
logit margin there, so a numerical near-tie is told apart from a bug. Runs are interleaved
per prompt (alternating which path goes first) after a warm-up, so noise hits both alike;
in process, engine prefix caches are emptied before every timed run (verify/backends.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Protocol

from trtspec.speculative.loop import PathRun
from trtspec.speculative.metrics import SpecMetrics
from trtspec.verify.acceptance import identity
from trtspec.verify.verdicts import DivergenceVerdict


class VerifyBackend(Protocol):
    """Runs one prompt on one path; in process or over gRPC."""

    def run(self, prompt: str, max_tokens: int, speculative: bool) -> PathRun: ...

    def token_text(self, token_id: int) -> str: ...

    def decided_draft_tokens(self) -> int | None:
        """The num_draft_tokens the deployment decided for the speculative path's requests (the
        request rules' decide_num_draft_tokens, in this process or in the served endpoint);
        None until it is known (in process: until a request was made)."""
        ...

    # Optional: classify(target, spec, div) -> DivergenceVerdict (verify/verdicts.py). A backend
    # without it (gRPC: the served endpoints return neither step boundaries nor logits)
    # leaves divergences unclassified, which fail under every --fail-on.


@dataclass
class Divergence:
    index: int
    target_id: int | None  # None: the path had already ended
    target_text: str
    spec_id: int | None
    spec_text: str
    target_margin: float | None  # target-only run's top-1 minus top-2 logit at index
    spec_margin: float | None
    verdict: DivergenceVerdict | None = None

    @property
    def verdict_class(self) -> str:
        return self.verdict.verdict if self.verdict else "unclassified"

    def describe(self) -> str:
        margin = "n/a" if self.target_margin is None else f"{self.target_margin:.4g}"
        text = (
            f"token {self.index}: target {self.target_id} {self.target_text!r} vs speculative "
            f"{self.spec_id} {self.spec_text!r} (target top-2 margin {margin})"
        )
        if self.verdict:
            text += f"; {self.verdict.verdict}: {self.verdict.reason}"
        return text


@dataclass
class PromptResult:
    index: int
    prompt: str
    identical: bool
    target_tokens: int
    spec_tokens: int
    target_seconds: float
    spec_seconds: float
    divergence: Divergence | None
    metrics: SpecMetrics | None
    target_ids: list[int] = field(repr=False, default_factory=list)
    spec_ids: list[int] = field(repr=False, default_factory=list)
    # (first output index, drafts) per speculative step; empty where the backend does not say (--url)
    spec_steps: list[tuple[int, int]] = field(repr=False, default_factory=list)


@dataclass
class VerifyReport:
    spec_name: str
    mode: str  # "in-process" or "grpc://host:port"
    max_tokens: int
    results: list[PromptResult]
    prompt_set: str = "prompts"  # where the prompts came from, for gate messages
    num_draft_tokens: int | None = None  # k the speculative path drafted, as its deployment decided it

    @property
    def identical(self) -> bool:
        return all(r.identical for r in self.results)

    def count(self, verdict: str) -> int:
        return sum(r.divergence is not None and r.divergence.verdict_class == verdict for r in self.results)

    def passes(self, fail_on: str = "any") -> bool:
        """``any``: every prompt identical. ``algorithmic``: numerical divergences (near-ties
        flipped by the forward's shape) are tolerated; algorithmic and unclassified are not."""
        if fail_on == "any":
            return self.identical
        return all(r.divergence is None or r.divergence.verdict_class == "numerical" for r in self.results)

    @property
    def metrics(self) -> SpecMetrics:
        total = SpecMetrics()
        for r in self.results:
            if r.metrics is not None:
                total = total.merge(r.metrics)
        return total

    def tokens_per_second(self, path: str) -> float:
        toks = sum(r.target_tokens if path == "target" else r.spec_tokens for r in self.results)
        secs = sum(r.target_seconds if path == "target" else r.spec_seconds for r in self.results)
        return toks / secs if secs > 0 else 0.0

    @property
    def speedup(self) -> float:
        base = self.tokens_per_second("target")
        return self.tokens_per_second("speculative") / base if base > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            **identity(self.spec_name, [r.prompt for r in self.results], self.prompt_set, self.num_draft_tokens, self.max_tokens),
            "mode": self.mode,
            "identical": self.identical,
            "diverged": sum(not r.identical for r in self.results),
            "verdicts": {v: self.count(v) for v in ("numerical", "algorithmic", "unclassified")},
            "target_tokens_per_s": self.tokens_per_second("target"),
            "speculative_tokens_per_s": self.tokens_per_second("speculative"),
            "speedup": self.speedup,
            "metrics": self.metrics.to_dict(),
            "results": [
                {
                    "index": r.index,
                    "prompt": r.prompt,
                    "identical": r.identical,
                    "target_tokens": r.target_tokens,
                    "spec_tokens": r.spec_tokens,
                    "target_seconds": r.target_seconds,
                    "spec_seconds": r.spec_seconds,
                    "divergence": asdict(r.divergence) if r.divergence else None,
                    "metrics": r.metrics.to_dict() if r.metrics else None,
                    "target_ids": r.target_ids,
                    "spec_ids": r.spec_ids,
                    "spec_steps": [list(step) for step in r.spec_steps],
                }
                for r in self.results
            ],
        }


def first_divergence(target: PathRun, spec: PathRun, text) -> Divergence | None:
    a, b = target.output_ids, spec.output_ids
    for i in range(max(len(a), len(b))):
        ta = a[i] if i < len(a) else None
        tb = b[i] if i < len(b) else None
        if ta != tb:
            return Divergence(
                index=i,
                target_id=ta,
                target_text=text(ta) if ta is not None else "<end>",
                spec_id=tb,
                spec_text=text(tb) if tb is not None else "<end>",
                target_margin=target.margins[i] if i < len(target.margins) else None,
                spec_margin=spec.margins[i] if i < len(spec.margins) else None,
            )
    return None


def _classify(backend, target: PathRun, spec: PathRun, div: Divergence) -> DivergenceVerdict:
    if hasattr(backend, "classify"):
        return backend.classify(target, spec, div)
    return DivergenceVerdict(
        "unclassified",
        "over --url the target cannot be replayed; run `trtspec verify SPEC` in process to class it",
        None,
    )


def run_verify(
    backend: VerifyBackend,
    prompts: list[str],
    max_tokens: int,
    spec_name: str,
    mode: str = "in-process",
    progress=None,
    prompt_set: str = "prompts",
) -> VerifyReport:
    """Compare both paths on every prompt; ``progress(i, n)`` is called after each. The
    report's num_draft_tokens is the one the backend's deployment decided."""
    # Warm-up (untimed): first calls pay allocation and lazy-initialisation costs.
    backend.run(prompts[0], min(max_tokens, 4), speculative=False)
    backend.run(prompts[0], min(max_tokens, 4), speculative=True)
    results = []
    for i, prompt in enumerate(prompts):
        # Alternate which path goes first: a server's prefix cache (which trtspec cannot empty
        # over gRPC) then favours neither path.
        if i % 2 == 0:
            target = backend.run(prompt, max_tokens, speculative=False)
            spec = backend.run(prompt, max_tokens, speculative=True)
        else:
            spec = backend.run(prompt, max_tokens, speculative=True)
            target = backend.run(prompt, max_tokens, speculative=False)
        div = first_divergence(target, spec, backend.token_text)
        if div is not None:
            div.verdict = _classify(backend, target, spec, div)
        results.append(
            PromptResult(
                index=i,
                prompt=prompt,
                identical=div is None,
                target_tokens=len(target.output_ids),
                spec_tokens=len(spec.output_ids),
                target_seconds=target.seconds,
                spec_seconds=spec.seconds,
                divergence=div,
                metrics=spec.metrics,
                target_ids=target.output_ids,
                spec_ids=spec.output_ids,
                spec_steps=list(spec.steps or []),
            )
        )
        if progress:
            progress(i + 1, len(prompts))
    return VerifyReport(spec_name, mode, max_tokens, results, prompt_set, backend.decided_draft_tokens())

"""Several drafting methods over ONE target, same prompts, one run: target-only, eagle3,
draft_target, ngram, suffix, and suffix layered on a model draft (eagle3+suffix,
draft_target+suffix), each through the one loop with the same verifier. Suffix drafting
runs with requests kept apart (no cache of earlier responses): a run never drafts from its
own prompt's output in another run or round, so its figures are a lower bound.

Definitions (per method, summed over prompts and rounds):
  tokens/s          output tokens / wall seconds of generate() (prefill included, prefix cache
                    emptied before every run so no run reuses another's prefill)
  speedup           tokens/s / target-only tokens/s
  acceptance rate   accepted drafts / drafted tokens
  mean acceptance length   output tokens / target forwards (the bonus token included)
  draft cost c      seconds inside drafter.propose per drafted token / target-only seconds per
                    token (what one draft step costs in target steps)
  by source         layered and suffix drafters: drafted and accepted tokens per draft source
                    (suffix | model), counted by the drafter (speculative/metrics.SourceCounts)
  choices           method auto: per request (prompt, round) the steps the adaptive policy
                    drafted with each drafter and k ("ngram:5": 12, "off:0": 3), and their sum
Method auto chooses among the spec's auto.methods, or else this spec's model draft, suffix and
ngram; one policy serves all of a run's prompts, as one deployment's does.
Every method's output ids are compared with target-only's: a difference is reported, never
averaged away.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from trtspec.speculative.capabilities import Capabilities, Drafter
from trtspec.speculative.loop import GenerationRequest, Menu, NoDrafter, generate
from trtspec.speculative.metrics import SourceCounts, SpecMetrics


class TimedDrafter(Drafter):
    """Counts the seconds a drafter spends proposing (and passes ``release`` on)."""

    capabilities = Capabilities(releases=True)

    def __init__(self, inner: Drafter):
        self.inner = inner
        self.seconds = 0.0

    def propose(self, contexts, draft_lens):
        t0 = time.perf_counter()
        try:
            return self.inner.propose(contexts, draft_lens)
        finally:
            self.seconds += time.perf_counter() - t0

    def release(self, prompt_ids, output_ids) -> None:
        if self.inner.capabilities.releases:
            t0 = time.perf_counter()
            self.inner.release(prompt_ids, output_ids)
            self.seconds += time.perf_counter() - t0


@dataclass
class MethodStats:
    name: str
    tokens: int = 0
    seconds: float = 0.0
    draft_seconds: float = 0.0
    metrics: SpecMetrics = field(default_factory=SpecMetrics)
    sources: SourceCounts = field(default_factory=SourceCounts)
    identical: bool = True
    mismatches: list[int] = field(default_factory=list)  # prompt indices
    choices: list[dict[str, int]] = field(default_factory=list)  # method auto: per request run

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
        if self.sources.drafted:
            d["by_source"] = self.sources.to_dict()
        if self.metrics.choices:
            d["choices"] = dict(sorted(self.metrics.choices.items()))
            d["choices_per_request"] = self.choices
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
    rotating order per prompt, after each has run the first request once untimed."""
    names = ["target-only", *drafters]
    stats = {n: MethodStats(n) for n in names}
    _warm_methods(verifier, drafters, requests[:1], forget, progress)
    for r in range(rounds):
        for i, req in enumerate(requests):
            outputs: dict[str, list[int]] = {}
            order = names[(i + r) % len(names) :] + names[: (i + r) % len(names)]
            for name in order:
                progress(f"round {r + 1}/{rounds} prompt {i + 1}/{len(requests)}: {name}")
                factory, k = (NoDrafter, 0) if name == "target-only" else drafters[name]
                made = factory()
                drafter = made if isinstance(made, Menu) else TimedDrafter(made)
                one = GenerationRequest(req.prompt_ids, req.max_tokens, k, req.end_ids, req.stop_sequences)
                forget()
                t0 = time.perf_counter()
                (res,) = generate([one], drafter, verifier)
                s = stats[name]
                s.seconds += time.perf_counter() - t0
                s.draft_seconds += drafter.seconds if isinstance(drafter, TimedDrafter) else 0.0
                if res.metrics.choices:
                    s.choices.append(dict(sorted(res.metrics.choices.items())))
                s.tokens += len(res.output_ids)
                s.metrics = s.metrics.merge(res.metrics)
                for source, n in getattr(getattr(drafter, "inner", None), "sources", SourceCounts()).drafted.items():
                    s.sources.record(source, n, drafter.inner.sources.accepted.get(source, 0))
                outputs[name] = res.output_ids
            for name in drafters:
                if outputs[name] != outputs["target-only"]:
                    stats[name].identical = False
                    stats[name].mismatches.append(i)
    return [stats[n] for n in names]


def _warm_methods(verifier, drafters, requests: Sequence[GenerationRequest], forget, progress) -> None:
    """Every method once on ``requests``, untimed: a draft engine of its own (draft_target's
    --draft-from, an EAGLE-3 head) first meets its kinds of step here, and compiling or loading
    their programs (tens of seconds where none is saved) would otherwise land in the timed runs
    of the first prompt; one such run measured draft_target at 0.06x target-only."""
    for name in ["target-only", *drafters]:
        progress(f"warm-up: {name}")
        factory, k = (NoDrafter, 0) if name == "target-only" else drafters[name]
        for req in requests:
            forget()
            generate([GenerationRequest(req.prompt_ids, req.max_tokens, k, req.end_ids, req.stop_sequences)], factory(), verifier)
    forget()


# ---------------------------------------------------------------- the drafters of `bench --methods`

METHODS = ("eagle3", "draft_target", "ngram", "suffix", "eagle3+suffix", "draft_target+suffix", "auto")


@dataclass
class MethodSet:
    """Drafters for ``compare_methods`` over one deployment's target, and how to empty every
    cache they own (each timed run starts cold)."""

    drafters: dict[str, tuple[Callable[[], Drafter], int]]
    forget: Callable[[], None]


def method_set(dep, methods: Sequence[str], k: int, other=None) -> MethodSet:
    """The drafters for ``methods`` over ``dep``'s target (the verifier of every method).

    A method is the spec's own draft alone (its draft engine or EAGLE-3 head), ``ngram``
    (prompt lookup with the spec's n-gram sizes), ``suffix`` (the spec's suffix settings or
    the defaults), the method of ``other`` (a LoadedSpec with the same target weights, e.g.
    the draft_target demo beside the eagle3 one: only its draft engine or head is loaded, next
    to ``dep``'s target, drafting its spec's default_draft_tokens), or one of those model drafts with suffix drafting layered on
    (``eagle3+suffix``). RequestError names a method that has no source.
    """
    from trtspec.errors import RequestError
    from trtspec.spec import SuffixSpec
    from trtspec.speculative.drafters import make_drafter

    s = dep.spec.speculative
    sx = s.suffix_drafting or SuffixSpec()  # the spec's suffix settings, else the defaults
    drafters: dict[str, tuple[Callable[[], Drafter], int]] = {}
    forgets: list[Callable[[], None]] = [dep.forget_prefixes]
    extra = None
    if other is not None:
        extra, forget_other = other_drafter(dep, other)
        forgets.append(forget_other)
    for name in methods:
        if name not in METHODS:
            raise RequestError(f"--methods: unknown method '{name}'; choose from {', '.join(METHODS)}")
        base, _, layer = name.partition("+")
        layered = sx if layer else None
        if name == "auto":
            drafters[f"auto k<={k}"] = (auto_drafter(dep, sx, k), k)
        elif base in (s.method, s.model_draft) and base != "suffix":  # auto's model draft too
            drafters[f"{name} k={k}"] = ((lambda b=base, x=layered: dep.drafter(b, x)), k)
        elif name == "ngram":
            drafters[f"ngram k={k}"] = (lambda: make_drafter("ngram", max_ngram=s.max_ngram, min_ngram=s.min_ngram), k)
        elif name == "suffix":
            drafters[f"suffix k={k}"] = (lambda: make_drafter("suffix", suffix=sx), k)
        elif other is not None and base == other.spec.speculative.method:
            kk = other.spec.speculative.default_draft_tokens  # held within its max_draft_len by the spec
            drafters[f"{name} k={kk}"] = (
                (lambda b=base, x=layered: make_drafter(b, draft_model=extra(), suffix=x)) if layer else extra,
                kk,
            )
        else:
            raise RequestError(
                f"--methods: {name} needs a {name} draft for this target; this spec's method is {s.method}: "
                f"pass --draft-from SPEC of a built {name} spec with the same target weights"
            )

    def forget() -> None:
        for f in forgets:
            f()

    return MethodSet(drafters, forget)


def auto_drafter(dep, suffix, k: int) -> Callable[[], Drafter]:
    """Method auto over ``dep``: the spec's auto.methods, or its model draft (if any), suffix and
    ngram, with k <= ``k``; one policy for every run, its costs measured as it goes."""
    from trtspec.speculative.menus import adaptive_policy

    s = dep.spec.speculative
    if s.method == "auto":
        methods = s.methods
    else:
        methods = tuple(m for m in (s.model_draft, "suffix", "ngram") if m is not None)
    policy = adaptive_policy(methods, k)
    return lambda: dep.drafter("auto", suffix, policy=policy)


def other_drafter(dep, other) -> tuple[Callable[[], Drafter], Callable[[], None]]:
    """The draft of another built spec, loaded beside ``dep``'s target."""
    from trtspec.engines.manifest import check_manifest
    from trtspec.errors import RequestError
    from trtspec.layout import engine_folder

    method = other.spec.speculative.method
    if other.spec.backend != "torch" or method not in ("draft_target", "eagle3"):
        raise RequestError(
            f"--draft-from {other.path}: needs a torch spec with method draft_target or eagle3 (got "
            f"{other.spec.backend}/{method})"
        )
    if method == dep.spec.speculative.method:
        raise RequestError(f"--draft-from {other.path}: its method {method} is this spec's own; pass a spec of another method")
    out = other.output_dir()
    target_manifest = check_manifest(engine_folder(out, "target"), "target", other.spec.build_hash("target"))
    if target_manifest.source.weights != dep.target.manifest.source.weights:
        raise RequestError(
            f"--draft-from {other.path}: its target weights differ from {dep.loaded.path}'s; methods are "
            "compared on ONE target, so pass a spec built from the same target checkpoint"
        )
    folder = engine_folder(out, "draft")
    check_manifest(folder, "draft", other.spec.build_hash("draft"))
    if method == "draft_target":
        from trtspec.engines.torch.engine import TorchEngine
        from trtspec.speculative.drafters import ModelDrafter

        engine = TorchEngine.load(folder, dep.target.max_batch_size, device=dep.device)  # beside the target
        vocab = min(engine.vocab_size, dep.target.vocab_size)
        return (lambda: ModelDrafter(engine.run, vocab)), engine.forget_prefixes
    from trtspec.engines.torch.eagle3_head import HeadEngine
    from trtspec.speculative.eagle3_drafter import Eagle3Drafter, engine_features

    head = HeadEngine.load(folder, dep.target, dep.target.max_batch_size)
    dep.target.capture_features(head.cfg.layer_ids)  # every method then pays the same capture
    return (lambda: Eagle3Drafter(head, engine_features(dep.target))), head.pool.forget


def methods_table(stats: Sequence[MethodStats]) -> list[dict]:
    """Report rows, target-only first (the base of every speedup and cost ratio)."""
    base = stats[0]
    return [s.to_dict(base) for s in stats]

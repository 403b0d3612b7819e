"""Prometheus metrics of the text endpoints, served on Triton's metrics port (default 8002).

They go through the Python backend's custom-metrics API (``pb_utils.MetricFamily``), so
Triton's own /metrics page carries them next to its nv_* metrics; nothing opens another port.
Every metric has the labels ``model`` (the Triton model: tensorrt_llm_bls, ..., target_only),
``mode`` (speculative | target_only) and ``instance`` (the model instance: each instance runs
its own loop, so gauges are per instance; sum them by model for the endpoint).

Definitions (one "step" = one target forward of one sequence, as in speculative/metrics.py):
  trtspec_draft_tokens_total            counter: draft tokens proposed to the target
  trtspec_accepted_draft_tokens_total   counter: of those, the ones the target agreed with
  trtspec_acceptance_length             histogram: tokens one step yielded = accepted drafts + 1
                                        (the target's own token); a step without drafts yields 1
  trtspec_output_tokens_total           counter: tokens answered to clients (after EOS / stop /
                                        max_tokens truncation)
  trtspec_requests_finished_total       counter, label ``reason``: sequences that ended, by why
                                        (length | eos | stop | cancelled | error)
  trtspec_responses_unsent_total        counter: requests whose final response raised as it was sent;
                                        the sender closes before writing it, so those clients got no
                                        answer (each is in Triton's log with its request id)
  trtspec_active_sequences              gauge: sequences in the loop (in the last step)
  trtspec_queue_depth                   gauge: requests this instance holds but has not started
  trtspec_draft_length                  gauge: the draft length k the last step's requests ask for (num_draft_tokens)
  trtspec_source_draft_tokens_total     counter, label ``source``: draft tokens by where they came from
                                        (suffix decoding: suffix; layered on a model draft: suffix | model)
  trtspec_source_accepted_tokens_total  counter, label ``source``: of those, the ones the target accepted
                                        (counted when the request's next step or its end shows them)
  trtspec_suffix_cache_tokens           gauge: tokens the instance's cache of earlier responses holds
                                        (live + evicted not yet compacted; <= 2 x suffix.cache_tokens)
  trtspec_chosen_drafter_total          counter, label ``drafter``: adaptive speculation (method auto,
                                        adaptive): sequence-steps the policy drafted with that drafter
                                        (draft_target | suffix | ngram | ...; off: it chose k = 0)
  trtspec_chosen_draft_length           histogram: the draft length k the policy chose per sequence-step
                                        (0: off); a first step, or one with no room to draft, is no choice
  trtspec_eagle3_head_version           gauge: the EAGLE-3 head version new requests draft with (1: the
                                        repository's own; `trtspec refresh` numbers the later ones)
  trtspec_eagle3_head_acceptance        gauge, label ``head``: acceptance at k=1 on held-out captured
                                        requests that `trtspec refresh` measured when it deployed the head:
                                        ``serving`` (this head) and ``replaced`` (the head before it);
                                        absent for version 1
  trtspec_eagle3_head_swaps_total       counter: heads this instance swapped in

acceptance rate = rate(accepted) / rate(drafted) (per source: the source_* pair); mean acceptance length =
rate(acceptance_length_sum) / rate(acceptance_length_count).

``EndpointMetrics`` is the plain-Python core (tests run it against ``MemorySink``); inside
tritonserver it writes to ``TritonSink`` over ``triton_python_backend_utils``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

PREFIX = "trtspec_"
FINISH_REASONS = ("length", "eos", "stop", "cancelled", "error")


@dataclass
class StepCounts:
    """What one loop step did, over all its sequences (the fields monitoring reads)."""

    sequences: int  # sequences in the step: one target forward each
    drafted: int  # draft tokens proposed, all sequences
    accepted: int  # of those, accepted by the target
    accepted_each: list[int] = field(default_factory=list)  # per sequence that drafted
    draft_len: int = 0  # the largest draft length a sequence got this step (0: nobody drafted)
    # Further forwards of a target that kept decoding past a rejection, or the further tokens
    # of a decode chunk (Verdict.continued): each yielded one token, as SpecMetrics counts them.
    extra_forwards: int = 0


class Counter(Protocol):
    def increment(self, value: float) -> None: ...


class Gauge(Protocol):
    def set(self, value: float) -> None: ...


class Histogram(Protocol):
    def observe(self, value: float) -> None: ...


class Sink(Protocol):
    """Where metrics live: Triton's registry (TritonSink) or memory (MemorySink, tests)."""

    def counter(self, name: str, description: str, labels: Mapping[str, str]) -> Counter: ...

    def gauge(self, name: str, description: str, labels: Mapping[str, str]) -> Gauge: ...

    def histogram(self, name: str, description: str, labels: Mapping[str, str], buckets: Sequence[float]) -> Histogram: ...


def acceptance_buckets(max_draft_len: int) -> list[float]:
    """Upper bounds 1, 2, ..., max_draft_len + 1: one bucket per possible step length."""
    return [float(n) for n in range(1, max_draft_len + 2)]


class EndpointMetrics:
    """The metrics of one endpoint instance. Call ``step`` after every loop step,
    ``finished`` for every sequence that ends, ``load`` when the number of active or queued
    sequences changes outside a step (admission, the end of a batch)."""

    def __init__(self, sink: Sink, model: str, mode: str, instance: str, max_draft_len: int):
        labels = {"model": model, "mode": mode, "instance": instance}
        self.drafted = sink.counter(PREFIX + "draft_tokens_total", "Draft tokens proposed to the target.", labels)
        self.accepted = sink.counter(
            PREFIX + "accepted_draft_tokens_total", "Draft tokens the target accepted (longest agreeing prefix).", labels
        )
        self.lengths = sink.histogram(
            PREFIX + "acceptance_length",
            "Tokens per target forward of one sequence: accepted drafts + 1.",
            labels,
            acceptance_buckets(max_draft_len),
        )
        self.output_tokens = sink.counter(PREFIX + "output_tokens_total", "Tokens answered to clients.", labels)
        self.reasons = {
            reason: sink.counter(
                PREFIX + "requests_finished_total", "Sequences that ended, by finish reason.", labels | {"reason": reason}
            )
            for reason in FINISH_REASONS
        }
        self.unsent = sink.counter(
            PREFIX + "responses_unsent_total", "Requests whose final response could not be sent (see the log).", labels
        )
        self.active = sink.gauge(PREFIX + "active_sequences", "Sequences in the decoding loop.", labels)
        self.queued = sink.gauge(PREFIX + "queue_depth", "Requests held by this instance, not started yet.", labels)
        self.draft_len = sink.gauge(PREFIX + "draft_length", "Draft length k the last step asked for.", labels)
        self._sink, self._labels = sink, labels
        self._by_source: dict[str, tuple[Counter, Counter]] = {}
        self._seen: dict[str, tuple[int, int]] = {}  # source -> (drafted, accepted) already counted
        self._cache_tokens: Gauge | None = None  # made on first use: only suffix endpoints have a cache
        self._max_draft_len = max_draft_len
        self._chosen: dict[str, Counter] = {}  # drafter -> counter, made on first use (adaptive only)
        self._chosen_k: Histogram | None = None

    def step(self, counts: StepCounts) -> None:
        """One loop step. ``counts`` may be any object with StepCounts' fields."""
        if counts.drafted:
            self.drafted.increment(counts.drafted)
        if counts.accepted:
            self.accepted.increment(counts.accepted)
        for n in counts.accepted_each:
            self.lengths.observe(n + 1)
        singles = counts.sequences - len(counts.accepted_each) + getattr(counts, "extra_forwards", 0)
        for _ in range(singles):
            self.lengths.observe(1)  # a forward without drafts yields the target's token only
        self.active.set(counts.sequences)
        self.draft_len.set(counts.draft_len)
        for key in getattr(counts, "chosen", ()):
            self.chose(key)

    def chose(self, key: str) -> None:
        """The adaptive policy chose ``key`` ("drafter:k", speculative.adaptive.choice_key) for one sequence-step."""
        drafter, _, k = key.rpartition(":")
        if drafter not in self._chosen:
            labels = self._labels | {"drafter": drafter}
            self._chosen[drafter] = self._sink.counter(
                PREFIX + "chosen_drafter_total", "Sequence-steps the adaptive policy drafted with each drafter.", labels
            )
        if self._chosen_k is None:
            buckets = [float(n) for n in range(self._max_draft_len + 1)]
            self._chosen_k = self._sink.histogram(
                PREFIX + "chosen_draft_length", "Draft length the adaptive policy chose per sequence-step.", self._labels, buckets
            )
        self._chosen[drafter].increment(1)
        self._chosen_k.observe(int(k))

    def finished(self, reason: str | None, tokens: int) -> None:
        """One sequence ended with ``tokens`` output tokens; ``reason`` None counts as error."""
        self.reasons[reason if reason in self.reasons else "error"].increment(1)
        if tokens:
            self.output_tokens.increment(tokens)

    def load(self, active: int, queued: int) -> None:
        self.active.set(active)
        self.queued.set(queued)

    def suffix_cache(self, tokens: int) -> None:
        """The instance's suffix cache holds ``tokens`` tokens (its stream, evicted ones included)."""
        if self._cache_tokens is None:
            self._cache_tokens = self._sink.gauge(
                PREFIX + "suffix_cache_tokens", "Tokens held by the cache of earlier responses.", self._labels
            )
        self._cache_tokens.set(tokens)

    def head(self, version: int, live: float | None, new: float | None) -> None:
        """The EAGLE-3 head version new requests draft with, and refresh's figures for it and the
        head it replaced (None: not measured, left unset); a version after the first is a swap."""
        if not hasattr(self, "_head_version"):
            self._head_version = self._sink.gauge(
                PREFIX + "eagle3_head_version", "EAGLE-3 head version new requests draft with.", self._labels
            )
            self._head_swaps = self._sink.counter(PREFIX + "eagle3_head_swaps_total", "EAGLE-3 heads swapped in.", self._labels)
            self._head_figures = {
                which: self._sink.gauge(
                    PREFIX + "eagle3_head_acceptance",
                    "Acceptance at k=1 on held-out captured requests, measured by trtspec refresh.",
                    self._labels | {"head": which},
                )
                for which in ("serving", "replaced")
            }
        elif version > 1:
            self._head_swaps.increment(1)
        self._head_version.set(version)
        for which, value in (("serving", new), ("replaced", live)):
            if value is not None:
                self._head_figures[which].set(value)

    def sources(self, counts) -> None:
        """Bring the per-source counters up to ``counts`` (a speculative.metrics.SourceCounts
        that only grows: the instance's drafters count into it)."""
        for source, drafted in counts.drafted.items():
            accepted = counts.accepted.get(source, 0)
            if source not in self._by_source:
                labels = self._labels | {"source": source}
                self._by_source[source] = (
                    self._sink.counter(PREFIX + "source_draft_tokens_total", "Draft tokens by source.", labels),
                    self._sink.counter(
                        PREFIX + "source_accepted_tokens_total", "Draft tokens the target accepted, by source.", labels
                    ),
                )
            seen_d, seen_a = self._seen.get(source, (0, 0))
            c_d, c_a = self._by_source[source]
            if drafted > seen_d:
                c_d.increment(drafted - seen_d)
            if accepted > seen_a:
                c_a.increment(accepted - seen_a)
            self._seen[source] = (drafted, accepted)


# -- sinks ------------------------------------------------------------------------------------


class TritonSink:
    """Metrics in Triton's registry, through ``pb_utils`` (the module is passed in, so this
    file imports without tritonserver). Families are created once per name; Triton merges
    families of the same name across models, and labels tell the models apart."""

    def __init__(self, pb_utils):
        self.pb = pb_utils
        self.families: dict[str, object] = {}
        self.metrics: list[object] = []

    def _family(self, name: str, description: str, kind):
        if name not in self.families:
            self.families[name] = self.pb.MetricFamily(name=name, description=description, kind=kind)
        return self.families[name]

    def _metric(self, family, **kwargs):
        metric = family.Metric(**kwargs)
        self.metrics.append(metric)
        return metric

    def counter(self, name, description, labels):
        return self._metric(self._family(name, description, self.pb.MetricFamily.COUNTER), labels=dict(labels))

    def gauge(self, name, description, labels):
        return self._metric(self._family(name, description, self.pb.MetricFamily.GAUGE), labels=dict(labels))

    def histogram(self, name, description, labels, buckets):
        family = self._family(name, description, self.pb.MetricFamily.HISTOGRAM)
        return self._metric(family, labels=dict(labels), buckets=list(buckets))

    def close(self) -> None:
        """Metrics go before their families (the stub refuses the other order)."""
        self.metrics.clear()
        self.families.clear()


class MemorySink:
    """Metrics in memory, keyed by (name, sorted labels): what the tests read."""

    def __init__(self):
        self.values: dict[tuple[str, tuple[tuple[str, str], ...]], _Value] = {}

    def _get(self, name: str, labels: Mapping[str, str], buckets: Sequence[float] = ()) -> _Value:
        key = (name, tuple(sorted(labels.items())))
        if key in self.values:
            raise ValueError(f"metric {name} with labels {dict(labels)} created twice")
        self.values[key] = _Value(list(buckets))
        return self.values[key]

    def counter(self, name, description, labels):
        return self._get(name, labels)

    def gauge(self, name, description, labels):
        return self._get(name, labels)

    def histogram(self, name, description, labels, buckets):
        return self._get(name, labels, buckets)

    def value(self, name: str, **labels: str) -> _Value:
        return self.values[(name, tuple(sorted(labels.items())))]


@dataclass
class _Value:
    buckets: list[float]
    value: float = 0.0
    observations: list[float] = field(default_factory=list)

    def increment(self, value: float) -> None:
        if value < 0:
            raise ValueError("a counter only goes up")
        self.value += value

    def set(self, value: float) -> None:
        self.value = value

    def observe(self, value: float) -> None:
        self.observations.append(value)

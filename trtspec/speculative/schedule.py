"""Load-aware speculation: how many tokens to draft as the number of active sequences grows,
and an optional switch-off when acceptance falls.

Speculation trades spare compute for fewer target forwards. With one sequence the target
step is memory-bound and a verify of k+1 tokens costs little more than one token; with many
sequences the batch already fills the machine, each drafted token costs about as much as a
target token, and speculation stops paying. A schedule maps the number of active sequences
to a draft length (0: speculation off at that load); the one loop caps every sequence's k by
it before each step.

"Active sequences" are the sequences one step runs: the unfinished sequences of the loop's
batch (every prompt x num_return_sequences is one). In process that is every sequence of the
call; served, each endpoint instance keeps one batch of at most build.max_batch_size sequences
(its engines' KV-cache places), and requests beyond it wait in the scheduler's queue without
counting: waiting changes no step's cost, so a full batch with a queue behind it is the same
load as a full batch alone. TensorRT-LLM counts the same way (its executor's active requests,
at most its max batch size), and vLLM keys on the batch size. A threshold above
max_batch_size therefore never fires served (`trtspec check` warns of it), and ``recommend``
leaves out concurrencies above it: a grid point there measured a batch no served instance runs.

``DraftSchedule`` is the spec's `speculative.schedule` ({min active sequences: k}, thresholds
as TensorRT-LLM's ``draft_len_schedule``); ``AcceptanceSwitch`` is `speculative.switch_off`
(rolling mean acceptance length over the last N finished requests, or rolling mean acceptance
rate over the last N drafting steps, below a threshold: speculation off from then on, as
TensorRT-LLM 1.2's acceptance window and 1.3+'s acceptance rate window do); ``LoadPolicy`` joins
them for the loop. ``recommend`` turns a measured k x concurrency grid into a schedule; ``vllm_shape`` writes
it as vLLM takes it (TensorRT-LLM's keys: engines/trtllm/llmapi.py, schedule_keys).
"""

from __future__ import annotations

import threading
from bisect import bisect_right
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from trtspec.engines.exports import vllm_schedule


@dataclass(frozen=True)
class DraftSchedule:
    """Sorted (min active sequences, k) thresholds; the first threshold is 1."""

    points: tuple[tuple[int, int], ...]

    @classmethod
    def from_mapping(cls, mapping: Mapping[int, int]) -> DraftSchedule:
        points = tuple(sorted((int(n), int(k)) for n, k in mapping.items()))
        if not points or points[0][0] != 1:
            raise ValueError("a draft-length schedule must start at 1 active sequence, e.g. {1: 4, 4: 2, 8: 0}")
        if any(n < 1 or k < 0 for n, k in points):
            raise ValueError("schedule keys are active-sequence counts >= 1 and values draft lengths >= 0")
        return cls(points)

    def k_for(self, active: int) -> int:
        """The draft length at ``active`` sequences: the value of the largest threshold <= active."""
        i = bisect_right([n for n, _ in self.points], max(active, 1)) - 1
        return self.points[i][1]

    def to_mapping(self) -> dict[int, int]:
        return dict(self.points)

    def compact(self) -> DraftSchedule:
        """The same schedule without thresholds that repeat the previous value."""
        out: list[tuple[int, int]] = []
        for n, k in self.points:
            if not out or out[-1][1] != k:
                out.append((n, k))
        return DraftSchedule(tuple(out))


@dataclass
class AcceptanceSwitch:
    """Speculation off for good once the mean of the last ``window`` samples falls below
    ``threshold``. A sample is a finished request's acceptance length, tokens per target
    forward (switch_off.min_acceptance_length; TensorRT-LLM 1.2), or with ``per_step`` a
    drafting step's accepted / drafted tokens over the batch (switch_off.min_acceptance_rate;
    TensorRT-LLM 1.3+'s "rolling average over the last N speculation-enabled iterations")."""

    window: int
    threshold: float
    per_step: bool = False
    off: bool = False

    def __post_init__(self) -> None:
        self.recent: deque[float] = deque(maxlen=self.window)

    def record(self, sample: float) -> None:
        if self.off:
            return
        self.recent.append(sample)
        if len(self.recent) == self.window and sum(self.recent) / self.window < self.threshold:
            self.off = True


class LoadPolicy:
    """What the loop asks before each step (the draft-length cap for this many active
    sequences) and tells after a request ends (its acceptance length). Thread-safe: one
    policy may serve every batch of an engine instance."""

    def __init__(self, schedule: DraftSchedule | None = None, switch: AcceptanceSwitch | None = None):
        self.schedule = schedule
        self.switch = switch
        self._lock = threading.Lock()

    @classmethod
    def of(
        cls,
        schedule: Mapping[int, int] | None,
        switch_off: tuple[int, float] | None,
        rate_switch_off: tuple[int, float] | None = None,
    ) -> LoadPolicy | None:
        """From a {active sequences: k} mapping and a (window, min acceptance length) or a
        (window, min acceptance rate) pair; None when none is set. The spec, the Triton
        parameters and the LLM API double all come through here."""
        if not schedule and switch_off is None and rate_switch_off is None:
            return None
        switch = None
        if switch_off is not None:
            switch = AcceptanceSwitch(*switch_off)
        elif rate_switch_off is not None:
            switch = AcceptanceSwitch(*rate_switch_off, per_step=True)
        return cls(DraftSchedule.from_mapping(schedule) if schedule else None, switch)

    @classmethod
    def from_spec(cls, speculative) -> LoadPolicy | None:
        """From a SpeculativeSpec."""
        return cls.from_switch_off(speculative.schedule, speculative.switch_off)

    @classmethod
    def from_switch_off(cls, schedule: Mapping[int, int] | None, switch_off) -> LoadPolicy | None:
        """From a {active sequences: k} mapping and a SwitchOffSpec (None: no switch-off), by
        whichever threshold it gives: the in-process runtime and the Triton endpoints."""
        s = switch_off
        if s is not None and s.min_acceptance_rate is not None:
            return cls.of(schedule, None, (s.window, s.min_acceptance_rate))
        return cls.of(schedule, (s.window, s.min_acceptance_length) if s is not None else None)

    def cap(self, active: int) -> int | None:
        """The largest k any sequence may draft this step (None: no cap)."""
        with self._lock:
            if self.switch is not None and self.switch.off:
                return 0
        return self.schedule.k_for(active) if self.schedule is not None else None

    def finished(self, drafted: int, acceptance_length: float) -> None:
        """A request ended, having drafted ``drafted`` tokens in all."""
        if self.switch is None or self.switch.per_step or drafted == 0:
            return
        with self._lock:
            self.switch.record(acceptance_length)

    def stepped(self, drafted: int, accepted: int) -> None:
        """A decoding step scored ``drafted`` draft tokens over its batch, ``accepted`` kept."""
        if self.switch is None or not self.switch.per_step or drafted == 0:
            return
        with self._lock:
            self.switch.record(accepted / drafted)


# ---------------------------------------------------------------- recommending a schedule


@dataclass(frozen=True)
class GridPoint:
    concurrency: int
    k: int  # 0: target-only
    tokens_per_s: float
    mean_acceptance_length: float  # 1.0 for k = 0


def recommend(grid: list[GridPoint], max_batch_size: int | None = None) -> DraftSchedule:
    """Per measured concurrency the k with the highest tokens/s (0 when target-only wins);
    the thresholds are the measured concurrencies, so the schedule says nothing beyond them.
    With ``max_batch_size``, concurrencies above it are left out: in process they ran as one
    batch, which no served instance runs (it runs max_batch_size, the rest wait)."""
    best: dict[int, GridPoint] = {}
    for p in grid:
        if max_batch_size is not None and p.concurrency > max_batch_size:
            continue
        if p.concurrency not in best or p.tokens_per_s > best[p.concurrency].tokens_per_s:
            best[p.concurrency] = p
    if not best:
        raise ValueError(
            "no grid points measured"
            if not grid
            else f"no grid point at a concurrency <= max_batch_size ({max_batch_size}); measure -c 1,2,...,{max_batch_size}"
        )
    ks = {c: best[c].k for c in sorted(best)}
    first = min(ks)
    if first != 1:
        ks = {1: ks[first], **{c: k for c, k in ks.items() if c != first}}
    return DraftSchedule.from_mapping(ks).compact()


def break_even_length(grid: list[GridPoint], concurrency: int, k: int) -> float | None:
    """The acceptance length at which drafting k at this concurrency would just match
    target-only: the measured cost of a speculative step in target steps,
    L_measured * (target-only tok/s) / (speculative tok/s)."""
    base = next((p for p in grid if p.concurrency == concurrency and p.k == 0), None)
    spec = next((p for p in grid if p.concurrency == concurrency and p.k == k), None)
    if base is None or spec is None or not spec.tokens_per_s:
        return None
    return spec.mean_acceptance_length * base.tokens_per_s / spec.tokens_per_s


def vllm_shape(schedule: DraftSchedule, max_batch_size: int) -> dict:
    """``speculative_config`` keys for vLLM: num_speculative_tokens (the largest k) and
    num_speculative_tokens_per_batch_size, inclusive (first, last, k) batch-size ranges
    (written by engines/exports.py, as `trtspec check` writes a spec's schedule)."""
    return vllm_schedule(schedule.to_mapping(), max_batch_size)

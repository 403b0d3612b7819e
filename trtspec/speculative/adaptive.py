"""Speculation that tunes itself: per request and per step, which drafter and how many tokens.

The loop asks ``AdaptivePolicy.choose`` before each step for every sequence that may draft,
and tells it afterwards what the target accepted (``observe``) and what the step cost
(``CostModel.verified`` / ``drafted``, seconds from the loop's own clock around the target's
forward and the drafter's call). Nothing here drafts or verifies: the accept step stays the
loop's, so every choice is lossless.

The choice maximises expected tokens per second of this sequence's share of the step:

  E(a, k)      = (1 - a^(k+1)) / (1 - a)        tokens per target forward for a per-token
                                                  acceptance a and k drafts (k + 1 when a = 1)
  cost(d, k)   = k * c_d + verify(k)            seconds: k draft steps of drafter d, then its
                                                  share of the target's forward
  verify(k)    = base / active + per_token * (k + 1)
                                                  the target's forward, fitted online as
                                                  seconds = base + per_token * tokens scored
                                                  over the last ``cost_window`` steps
  target-only  = 1 / verify(0)                   the rate every choice must beat (k = 0)

``a`` is the request's own recent acceptance of that drafter: decayed counts (``decay`` per
observation) of accepted drafts over tried positions (a chain stops being tried at its first
rejection), started from the deployment's running acceptance of the drafter. ``c_d`` is 0 for
drafters that cost nothing (n-gram, suffix: they offer a draft of what they found, and are used
where it pays); the model draft's is a running mean of measured seconds per draft step per row.

Measured without being sent: a free drafter's offer that the step did not send is checked
against the step's tokens (the accepted drafts and the target's own are the target's greedy
continuation), as far as they reach (``shadow``), on every step of a greedy request, off ones
included. Coming back: a request whose choice is "off" (k = 0) re-probes every
``probe_every`` steps with one draft token from its most promising drafter that nothing
measured since, and any drafter left untried and unmeasured that long is tried once (the
model draft; free drafters of sampled requests), so acceptance is measured, never assumed
from stale counts. The load enters
only through ``active`` at each choice and the fitted costs, never through stored state, so
when the load falls the next choice is the low-load one.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

OFF = "off"  # the name of the choice that drafts nothing (k = 0)
DRAFT_CALLS = 15  # recent model-draft calls whose median per-step time is the draft cost


@dataclass(frozen=True)
class AdaptiveSettings:
    """``methods``: the drafters, in order of preference on equal rates; ``free``: those that
    cost nothing per draft step (they offer a draft, the model is asked for one)."""

    methods: tuple[str, ...]
    free: frozenset[str] = frozenset()
    max_draft_len: int = 4
    probe_every: int = 16  # steps between re-probes when off, or of a drafter left untried
    decay: float = 0.8  # per observation: a short window of a request's recent acceptance
    cost_window: int = 64  # target forwards the verify cost is fitted over
    prior_weight: float = 2.0  # pseudo-trials of the deployment's acceptance a new request starts with


@dataclass(frozen=True)
class Choice:
    drafter: str  # OFF when k == 0
    k: int
    probe: bool = False  # a re-probe, not the best expected rate


def expected_tokens(a: float, k: int) -> float:
    """Tokens per target forward for a per-token acceptance ``a`` and ``k`` drafts."""
    if a >= 1.0:
        return float(k + 1)
    return (1 - a ** (k + 1)) / (1 - a)


@dataclass
class Acceptance:
    """Decayed counts of accepted drafts and tried positions; ``rate`` = accepted / tried."""

    accepted: float = 0.0
    tried: float = 0.0

    def add(self, drafted: int, accepted: int, decay: float) -> None:
        """One step that drafted ``drafted`` and had ``accepted`` of them accepted: every accepted
        position was tried, and one more if the chain met a rejection."""
        self.accepted = self.accepted * decay + accepted
        self.tried = self.tried * decay + accepted + (1 if accepted < drafted else 0)

    def rate(self, prior: float, weight: float) -> float:
        return (self.accepted + prior * weight) / (self.tried + weight)


class CostModel:
    """The engine's measured costs, learned online. ``clock`` is injectable so tests are
    deterministic; the loop times its own calls with it."""

    def __init__(self, free: frozenset[str], window: int = 64, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.free = free
        self.samples: deque[tuple[int, float]] = deque(maxlen=window)  # (tokens scored, seconds)
        # drafter -> seconds per draft step per row of its recent calls; the cost is their median,
        # so a call that also caught the draft up on a prompt (tens of positions in one forward,
        # once a request) does not read as every step's cost
        self.draft_steps: dict[str, deque[float]] = {}

    def verified(self, tokens: int, seconds: float) -> None:
        """One target forward that scored ``tokens`` positions (rows + drafts) in ``seconds``."""
        if tokens > 0 and seconds >= 0:
            self.samples.append((tokens, seconds))

    def drafted(self, drafter: str, steps: int, rows: int, seconds: float) -> None:
        """The drafter's call: ``steps`` draft steps over ``rows`` sequences in ``seconds``."""
        if drafter in self.free or steps <= 0 or rows <= 0:
            return
        self.draft_steps.setdefault(drafter, deque(maxlen=DRAFT_CALLS)).append(seconds / steps / rows)

    def fit(self) -> tuple[float, float]:
        """(base seconds, seconds per token) of a forward, by least squares; a per-token cost
        that no spread of token counts has measured yet is 0 (speculation looks free until a
        step measures it)."""
        if not self.samples:
            return 0.0, 0.0
        n = len(self.samples)
        mx = sum(t for t, _ in self.samples) / n
        my = sum(s for _, s in self.samples) / n
        sxx = sum((t - mx) ** 2 for t, _ in self.samples)
        if sxx <= 0:
            return my, 0.0
        slope = max(0.0, sum((t - mx) * (s - my) for t, s in self.samples) / sxx)
        base = max(0.0, my - slope * mx)
        return base, slope

    def draft_cost(self, drafter: str) -> float:
        recent = self.draft_steps.get(drafter)
        return 0.0 if drafter in self.free or not recent else statistics.median(recent)


@dataclass
class RequestState:
    """One request's recent acceptance per drafter and how long since each was tried."""

    acceptance: dict[str, Acceptance] = field(default_factory=dict)
    since_tried: dict[str, int] = field(default_factory=dict)
    off_steps: int = 0  # consecutive choices of k = 0


class AdaptivePolicy:
    """One per deployment (or Triton instance): the measured costs and each drafter's running
    acceptance are shared; a request's own state is a RequestState the loop keeps with it."""

    def __init__(self, settings: AdaptiveSettings, clock: Callable[[], float] = time.perf_counter):
        self.settings = settings
        self.costs = CostModel(settings.free, settings.cost_window, clock)
        self.deployment: dict[str, Acceptance] = {m: Acceptance() for m in settings.methods}

    def new_request(self) -> RequestState:
        return RequestState({m: Acceptance() for m in self.settings.methods}, {m: 0 for m in self.settings.methods})

    def acceptance(self, state: RequestState, drafter: str) -> float:
        shared = self.deployment[drafter]
        prior = shared.rate(0.5, 1.0)  # an unmeasured drafter starts at one half
        return state.acceptance[drafter].rate(prior, self.settings.prior_weight)

    def choose(self, state: RequestState, offers: Mapping[str, int], ceiling: int, active: int) -> Choice:
        """The (drafter, k) with the best expected tokens per second for this request, k <= the
        ``ceiling`` (max_draft_len, the load cap, tokens left) and <= what a drafter ``offers``
        (a free drafter: its draft's length; the model: the ceiling). OFF when none beats
        target-only, except for a due re-probe."""
        fit = self.costs.fit()
        best, best_rate = Choice(OFF, 0), self._rate(state, None, 0, active, fit)
        for name in self.settings.methods:
            for k in range(1, min(ceiling, offers.get(name, 0)) + 1):
                rate = self._rate(state, name, k, active, fit)
                if rate > best_rate:
                    best, best_rate = Choice(name, k), rate
        return self._probe(state, best, offers, ceiling, active, fit)

    def rate(self, state: RequestState, drafter: str | None, k: int, active: int) -> float:
        """Expected tokens per second of drafting ``k`` with ``drafter`` (None: target-only)."""
        return self._rate(state, drafter, k, active, self.costs.fit())

    def _rate(self, state: RequestState, drafter: str | None, k: int, active: int, fit: tuple[float, float]) -> float:
        base, per_token = fit
        verify = base / max(active, 1) + per_token * (k + 1)
        seconds = verify + (k * self.costs.draft_cost(drafter) if drafter else 0.0)
        tokens = expected_tokens(self.acceptance(state, drafter), k) if drafter else 1.0
        return tokens / seconds if seconds > 0 else tokens * 1e12  # nothing measured yet: tokens decide

    def _probe(self, state: RequestState, best: Choice, offers: Mapping[str, int], ceiling: int, active: int, fit) -> Choice:
        """Re-probe after ``probe_every`` steps off, or try a drafter left untried that long. A
        free drafter measured on the last step without being sent (``shadow``) needs neither."""
        every = self.settings.probe_every
        offering = [m for m in self.settings.methods if min(ceiling, offers.get(m, 0)) > 0]
        state.off_steps = state.off_steps + 1 if best.k == 0 else 0
        stale = [m for m in offering if m != best.drafter and state.since_tried[m] >= every]
        unmeasured = [m for m in offering if state.since_tried[m] > 0]
        if best.k == 0 and state.off_steps >= every and unmeasured:
            state.off_steps = 0
            name = max(unmeasured, key=lambda m: self.acceptance(state, m))
            best = Choice(name, 1, probe=True)
        elif stale:
            name = stale[0]
            most = min(ceiling, offers[name])
            k = max(range(1, most + 1), key=lambda k: self._rate(state, name, k, active, fit))
            best = Choice(name, k, probe=True)
        for m in self.settings.methods:
            state.since_tried[m] = 0 if m == best.drafter else state.since_tried[m] + 1
        return best

    def observe(self, state: RequestState, drafter: str, drafted: int, accepted: int) -> None:
        """What the target accepted of ``drafter``'s draft for this request this step."""
        if drafter == OFF or drafted <= 0:
            return
        state.acceptance[drafter].add(drafted, accepted, self.settings.decay)
        self.deployment[drafter].add(drafted, accepted, 0.99)

    def shadow(self, state: RequestState, drafter: str, offer: Sequence[int], known: Sequence[int]) -> None:
        """What the target would have accepted of a free ``drafter``'s ``offer`` that this step did
        not send: ``known`` is the step's tokens (the accepted drafts, then the target's own), so
        the offer is checked position by position as far as they reach; an offer agreeing with all
        of them counts only those positions, none beyond as rejected. A drafter checked this way
        (an empty offer included: it would have drafted nothing) needs no probe."""
        if drafter not in self.settings.free:
            return
        state.since_tried[drafter] = 0
        reach = min(len(offer), len(known))
        agreed = next((n for n in range(reach) if offer[n] != known[n]), reach)
        self.observe(state, drafter, reach, agreed)

    def timed(self) -> float:
        return self.costs.clock()


def choice_key(drafter: str, k: int) -> str:
    """How metrics name a choice: "suffix:3", "off:0"."""
    return f"{drafter}:{k}"


def parse_choice_key(key: str) -> tuple[str, int]:
    drafter, _, k = key.rpartition(":")
    return drafter, int(k)

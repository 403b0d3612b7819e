"""Speculation that tunes itself: per request and per step, which drafter and how many tokens.

The loop asks ``AdaptivePolicy.choose`` before each step for every sequence that may draft,
then ``settle`` for the step's choices together, and tells it afterwards what the target
accepted (``observe``) and what the step cost (``CostModel.verified`` / ``drafted``, seconds
from the loop's own clock around the target's forward and the drafter's call). Nothing here
drafts or verifies: the accept step stays the loop's, so every choice is lossless.

Per sequence (``choose``), the (drafter, k) with the best expected tokens per second of its
share of a step in which every active sequence drafts as it does:

  E(a, k)      = (1 - a^(k+1)) / (1 - a)        tokens per target forward for a per-token
                                                  acceptance a and k drafts (k + 1 when a = 1)
  cost(d, k)   = k * step(d, active) / active + verify(k)
                                                  seconds: k draft steps of drafter d shared by
                                                  the active rows, then its share of the forward
  verify(k)    = base / active + per_token * (k + 1)
                                                  the target's forward, fitted online as
                                                  seconds = base + per_token * tokens scored
                                                  over the last ``cost_window`` steps
  target-only  = 1 / verify(0)                   the rate every choice must beat (k = 0)

Per batch (``settle``, pricing.py): a draft call and the verify delay every sequence, so the
step's choices are priced together, by the batch's expected tokens per second, against the
model draft's k capped, every row off, and the drafting rows dropped whose expected tokens do
not pay for the wait they impose on the batch; the best plan is sent. ``step(d, rows)`` is a
draft step's measured seconds by the number of rows drafted (not a cost per row: a step over 8
rows costs about what one over 1 row does on a memory-bound CPU).

``a`` is the request's own recent acceptance of that drafter: decayed counts (``decay`` per
observation) of accepted drafts over tried positions (a chain stops being tried at its first
rejection), started from the deployment's running acceptance of the drafter. Drafters that cost
nothing (n-gram, suffix: they offer a draft of what they found, and are used where it pays) have
no draft step, only their verify positions.

Measured without being sent: a free drafter's offer that the step did not send is checked
against the step's tokens (the accepted drafts and the target's own are the target's greedy
continuation), as far as they reach (``shadow``), on every step of a greedy request, off ones
included. Coming back: a request whose choice is "off" (k = 0) re-probes every
``probe_every`` steps with one draft token from its most promising drafter that nothing
measured since, and any drafter left untried and unmeasured that long is tried once (the
model draft; free drafters of sampled requests), so acceptance is measured, never assumed
from stale counts; ``settle`` never drops a probe, but a model-draft call that would only
probe runs at most once per ``probe_every`` steps of the batch (every row waits for it), so the
requests due re-probe together in it. A request that the batch turned off keeps
its own choice, so it drafts again on the first step at which the batch's price says it pays.
The load enters only through the rows of each step and the fitted costs, never through stored
state, so when the load falls the next choice is the low-load one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from trtspec.speculative.pricing import CostModel, Row, expected_tokens, settle

OFF = "off"  # the name of the choice that drafts nothing (k = 0)


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


@dataclass
class RequestState:
    """One request's recent acceptance per drafter and how long since each was tried."""

    acceptance: dict[str, Acceptance] = field(default_factory=dict)
    since_tried: dict[str, int] = field(default_factory=dict)
    off_steps: int = 0  # consecutive choices of k = 0
    # the counters before this step's choice, and its best choice before any probe: what
    # ``settle`` restores when the batch replaces the choice
    before: tuple[int, dict[str, int], Choice] = (0, {}, Choice(OFF, 0))
    fallback: Choice = Choice(OFF, 0)  # this step's best free drafter's choice that beats target-only


class AdaptivePolicy:
    """One per deployment (or Triton instance): the measured costs and each drafter's running
    acceptance are shared; a request's own state is a RequestState the loop keeps with it."""

    def __init__(self, settings: AdaptiveSettings, clock: Callable[[], float] = time.perf_counter):
        self.settings = settings
        self.costs = CostModel(settings.free, settings.cost_window, clock)
        self.deployment: dict[str, Acceptance] = {m: Acceptance() for m in settings.methods}
        self.since_call: dict[str, int] = {}  # model drafter -> steps settled since its last call

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
        best = fallback = Choice(OFF, 0)
        best_rate = free_rate = self._rate(state, None, 0, active, fit)
        for name in self.settings.methods:
            for k in range(1, min(ceiling, offers.get(name, 0)) + 1):
                rate = self._rate(state, name, k, active, fit)
                if rate > best_rate:
                    best, best_rate = Choice(name, k), rate
                if name in self.settings.free and rate > free_rate:
                    fallback, free_rate = Choice(name, k), rate
        state.fallback = fallback
        return self._probe(state, best, offers, ceiling, active, fit)

    def rate(self, state: RequestState, drafter: str | None, k: int, active: int) -> float:
        """Expected tokens per second of drafting ``k`` with ``drafter`` (None: target-only)."""
        return self._rate(state, drafter, k, active, self.costs.fit())

    def _rate(self, state: RequestState, drafter: str | None, k: int, active: int, fit: tuple[float, float]) -> float:
        base, per_token = fit
        active = max(active, 1)
        verify = base / active + per_token * (k + 1)
        seconds = verify + (k * self.costs.draft_cost(drafter, active) if drafter else 0.0)
        tokens = expected_tokens(self.acceptance(state, drafter), k) if drafter else 1.0
        return tokens / seconds if seconds > 0 else tokens * 1e12  # nothing measured yet: tokens decide

    def _probe(self, state: RequestState, best: Choice, offers: Mapping[str, int], ceiling: int, active: int, fit) -> Choice:
        """Re-probe after ``probe_every`` steps off, or try a drafter left untried that long. A
        free drafter measured on the last step without being sent (``shadow``) needs neither."""
        every = self.settings.probe_every
        offering = [m for m in self.settings.methods if min(ceiling, offers.get(m, 0)) > 0]
        state.before = (state.off_steps, dict(state.since_tried), best)
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
        self._tried(state, best.drafter)
        return best

    def _tried(self, state: RequestState, drafter: str) -> None:
        for m in self.settings.methods:
            state.since_tried[m] = 0 if m == drafter else state.since_tried[m] + 1

    def _instead(self, state: RequestState, choice: Choice) -> Choice:
        """This step's ``choice`` for ``state`` replaced by the batch: its counters as if the
        request had chosen it (a row turned off counts as off; a probe deferred stays due)."""
        off, tried, _ = state.before
        state.off_steps = off + 1 if choice.k == 0 else 0
        state.since_tried = dict(tried)
        self._tried(state, choice.drafter)
        return choice

    def settle(self, states: Sequence[RequestState], choices: Sequence[Choice]) -> list[Choice]:
        """The step's choices, one per active row (``Choice(OFF, 0)`` where a row has none),
        priced together (pricing.settle): a model-draft row the batch drops sends its request's
        best free drafter's choice, or nothing (counted as off for its request, which keeps its
        own choice for the next step); a capped row drafts fewer. A probe of a model draft whose
        call is not due (``_closed``) is priced as its request's best choice instead, and probes
        only if the call runs anyway (it stays due otherwise)."""
        closed = self._closed()
        held = [c.probe and c.drafter in closed for c in choices]
        priced = [s.before[2] if h else c for s, c, h in zip(states, choices, held)]
        sent = settle(self.costs, [self._row(s, c) for s, c in zip(states, priced)], self.costs.fit())
        running = {d for d, k in sent if k and d not in self.settings.free}
        out = []
        for state, c, h, (drafter, k) in zip(states, choices, held, sent):
            if h and c.drafter in running:
                out.append(c)  # the call runs anyway: the probe rides along
            elif not h and drafter == c.drafter and k == c.k:
                out.append(c)
            elif not h and drafter == c.drafter and k:
                out.append(Choice(drafter, k))
            else:
                out.append(self._instead(state, Choice(drafter, k) if k else Choice(OFF, 0)))
        self.since_call.update(dict.fromkeys(running, 0))
        return out

    def _row(self, state: RequestState, choice: Choice) -> Row:
        """``choice`` as the batch check prices it; a model draft's fallback is the request's
        best free drafter's choice."""
        if choice.k == 0:
            return Row(OFF, 0, 0.0)
        fb = state.fallback
        model = choice.drafter not in self.settings.free
        fallback = Row(fb.drafter, fb.k, self.acceptance(state, fb.drafter)) if model and fb.k else None
        return Row(choice.drafter, choice.k, self.acceptance(state, choice.drafter), choice.probe, fallback)

    def _closed(self) -> set[str]:
        """The model drafters whose call may not run only to probe this step: every row waits
        for a draft call, so the batch's re-probes of a model draft share one call per
        ``probe_every`` steps, the requests due sooner waiting for it (each stays due)."""
        every = self.settings.probe_every
        for name in self.settings.methods:
            if name not in self.settings.free:
                self.since_call[name] = self.since_call.get(name, every - 1) + 1
        return {name for name, steps in self.since_call.items() if steps < every}

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

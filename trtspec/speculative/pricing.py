"""What a step's choices cost the whole batch: the engine's measured costs (CostModel) and the
batch-level check (``settle``) that prices the step's per-sequence choices together.

A draft call and a target forward each run for every sequence of the batch, so the batch waits
for both, whichever rows drafted. A choice is therefore priced by what the batch gets per
second, from the loop's own timings:

  rate(plan) = sum_j E(a_j, k_j) / (draft + verify)        E = 1 for a row that drafts nothing
  draft      = sum over the model drafters d that draft: the longest k of d's rows x step(d, d's rows)
  verify     = base + per_token x sum_j (k_j + 1)           every row of the batch, drafting or not
  step(d, r) = seconds of one draft step of d over r rows: the median of its recent calls of r
               rows; between two measured row counts, interpolated; beyond them, the nearest

A draft step's cost is not linear in its rows (on a memory-bound CPU one step over 8 rows costs
about what a step over 1 row does), so it is kept by row count, never as a cost per row. Free
drafters (n-gram, suffix) cost no draft call but widen the verify.

``settle`` weighs the per-row choices against the same with the model draft's k capped, with no
model draft, and each of those with rows dropped to their fallbacks (a model-draft row's best
free drafter's choice, else nothing) one by one, least paying first, down to every row off.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

DRAFT_CALLS = 15  # recent model-draft calls of one row count whose median per-step time is that step's cost


def expected_tokens(a: float, k: int) -> float:
    """Tokens per target forward for a per-token acceptance ``a`` and ``k`` drafts."""
    if a >= 1.0:
        return float(k + 1)
    return (1 - a ** (k + 1)) / (1 - a)


class CostModel:
    """The engine's measured costs, learned online. ``clock`` is injectable so tests are
    deterministic; the loop times its own calls with it."""

    def __init__(self, free: frozenset[str], window: int = 64, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.free = free
        self.samples: deque[tuple[int, float]] = deque(maxlen=window)  # (tokens scored, seconds)
        # drafter -> rows drafted -> seconds per draft step of its recent calls over that many
        # rows; the cost is their median, so a call that also caught the draft up on a prompt
        # (tens of positions in one forward, once a request) does not read as every step's cost
        self.draft_steps: dict[str, dict[int, deque[float]]] = {}
        self.last_rows: dict[str, int] = {}  # drafter -> rows of its last call

    def verified(self, tokens: int, seconds: float) -> None:
        """One target forward that scored ``tokens`` positions (rows + drafts) in ``seconds``."""
        if tokens > 0 and seconds >= 0:
            self.samples.append((tokens, seconds))

    def drafted(self, drafter: str, steps: int, rows: int, seconds: float) -> None:
        """The drafter's call: ``steps`` draft steps over ``rows`` sequences in ``seconds``."""
        if drafter in self.free or steps <= 0 or rows <= 0:
            return
        self.draft_steps.setdefault(drafter, {}).setdefault(rows, deque(maxlen=DRAFT_CALLS)).append(seconds / steps)
        self.last_rows[drafter] = rows

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

    def draft_step(self, drafter: str, rows: int) -> float:
        """Seconds of one draft step of ``drafter`` over ``rows`` rows (0: free, or unmeasured)."""
        table = self.draft_steps.get(drafter)
        if drafter in self.free or not table:
            return 0.0
        if rows in table:
            return statistics.median(table[rows])
        below = max((r for r in table if r < rows), default=None)
        above = min((r for r in table if r > rows), default=None)
        if below is None or above is None:
            return statistics.median(table[above if below is None else below])
        low, high = statistics.median(table[below]), statistics.median(table[above])
        return low + (high - low) * (rows - below) / (above - below)

    def draft_cost(self, drafter: str, rows: int | None = None) -> float:
        """Seconds per draft step per row when ``rows`` rows draft together (None: as many as
        the drafter's last call)."""
        rows = rows or self.last_rows.get(drafter, 1)
        return self.draft_step(drafter, rows) / rows


@dataclass(frozen=True)
class Row:
    """One sequence's choice this step, as the batch check prices it."""

    drafter: str  # the chosen drafter (its name is ignored where k == 0)
    k: int  # drafts chosen (0: none)
    acceptance: float  # the request's acceptance of ``drafter``
    fixed: bool = False  # a probe: kept whatever it costs, so acceptance is measured
    # what the row sends where the batch drops this choice: its best free drafter's choice
    # (one that beats target-only on the row's own price), or None: nothing
    fallback: Row | None = None

    def tokens(self, k: int) -> float:
        return expected_tokens(self.acceptance, k) if k > 0 else 1.0

    @property
    def instead(self) -> Row:
        return self.fallback if self.fallback is not None else Row("", 0, 0.0)


class Tally:
    """A plan's expected tokens and seconds: per row what it sends, (Row, k); ``drop`` switches
    a row to its fallback."""

    def __init__(self, costs: CostModel, plan: Sequence[tuple[Row, int]], fit: tuple[float, float]):
        self.costs, self.fit = costs, fit
        self.tokens, self.width = 0.0, 0  # expected tokens; positions the target scores
        self.calls: dict[str, Counter[int]] = {}  # model drafter -> its rows' k, counted
        self._steps: dict[tuple[str, int], float] = {}
        for row, k in plan:
            self.add(row, k, 1)

    def add(self, row: Row, k: int, sign: int) -> None:
        self.tokens += sign * row.tokens(k)
        self.width += sign * (k + 1)
        if k > 0 and row.drafter not in self.costs.free:
            calls = self.calls.setdefault(row.drafter, Counter())
            calls[k] += sign
            if calls[k] == 0:
                del calls[k]

    def drop(self, row: Row, k: int, sign: int = 1) -> None:
        """``row``, drafting ``k``, sends its fallback instead (sign -1: back again)."""
        self.add(row, k, -sign)
        self.add(row.instead, row.instead.k, sign)

    def step(self, drafter: str, rows: int) -> float:
        key = (drafter, rows)
        if key not in self._steps:
            self._steps[key] = self.costs.draft_step(drafter, rows)
        return self._steps[key]

    def seconds(self) -> float:
        base, per_token = self.fit
        draft = sum(max(ks) * self.step(d, ks.total()) for d, ks in self.calls.items() if ks)
        return draft + base + per_token * self.width

    def rate(self) -> float:
        seconds = self.seconds()
        return self.tokens / seconds if seconds > 0 else self.tokens * 1e12  # nothing measured yet: tokens decide


def settle(costs: CostModel, rows: Sequence[Row], fit: tuple[float, float]) -> list[tuple[str, int]]:
    """Per row the drafter and k the batch sends (k = 0: none): of the per-row choices as they
    are, with the model drafters' k capped at each shorter length (0: their rows send their
    fallbacks), and each of those with its rows dropped to their fallbacks one by one, the
    least paying first (the last: every row off but the probes), the plan with the best
    expected tokens per second of the whole batch. Equal rates keep the earlier plan, so the
    per-row choices stand unless something pays more."""
    best_plan, best = [(r, r.k) for r in rows], -1.0
    longest = max((r.k for r in rows if r.drafter not in costs.free), default=0)
    for cap in range(longest, -1, -1):
        plan = [_capped(r, cap, costs.free) for r in rows]
        rate, drops = _drops(costs, plan, fit)
        if rate > best:
            best_plan, best = [(r.instead, r.instead.k) if j in drops else (r, k) for j, (r, k) in enumerate(plan)], rate
    return [(r.drafter, k) for r, k in best_plan]


def _capped(row: Row, cap: int, free: frozenset[str]) -> tuple[Row, int]:
    """What ``row`` sends with the model drafters' k capped at ``cap`` (0: its fallback)."""
    if row.fixed or row.drafter in free or row.k <= cap:
        return row, row.k
    return (row, cap) if cap > 0 else (row.instead, row.instead.k)


def _drops(costs: CostModel, plan: list[tuple[Row, int]], fit: tuple[float, float]) -> tuple[float, set[int]]:
    """The best rate of ``plan`` with its first n droppable rows sent as their fallbacks
    (n = 0, 1, ...), least paying first: the expected tokens a row adds beyond its fallback,
    less what the seconds it adds (its verify positions, the draft-call time it alone imposes
    on the batch) yield at the plan's rate; and the rows that plan drops."""
    tally = Tally(costs, plan, fit)
    droppable = [j for j, (r, k) in enumerate(plan) if k > 0 and not r.fixed]
    start, rate = tally.seconds(), tally.rate()

    def pays(j: int) -> float:
        row, k = plan[j]
        tally.drop(row, k)
        saved = start - tally.seconds()
        tally.drop(row, k, -1)
        return row.tokens(k) - row.instead.tokens(row.instead.k) - rate * saved

    order = sorted(droppable, key=pays)
    best, best_n = rate, 0
    for n, j in enumerate(order, 1):
        tally.drop(*plan[j])
        if (now := tally.rate()) > best:
            best, best_n = now, n
    return best, set(order[:best_n])

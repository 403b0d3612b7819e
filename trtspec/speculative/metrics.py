"""Speculative-decoding metrics, defined once and used by verify, serve and bench.

Definitions (one "step" = one target forward that verifies a draft, possibly empty):
  drafted                 draft tokens proposed to the target
  accepted                draft tokens the target agreed with (the longest agreeing prefix)
  acceptance_rate         accepted / drafted                          (0 when nothing drafted)
  target_forwards         target forwards (steps), prefill included
  tokens                  tokens the steps yielded: accepted + one target token per step
                          (the bonus or the correction), before stop/max_tokens truncation
  mean_acceptance_length  tokens / target_forwards: tokens per target forward incl. the bonus
  per_position_rate[i]    P(draft token at position i accepted | it was drafted); with draft
                          trees, position = depth: P(a node at depth i + 1 accepted | the
                          step drafted that deep)
  histogram[n]            number of steps that accepted exactly n draft tokens
  node_rate[key]          draft trees only: P(node accepted | drafted), the node named by the
                          ranks along its path ("0.1": the second candidate after the first);
                          the expected tokens per forward of any tree made of measured nodes
                          is 1 + the sum of their rates (greedy: a node is accepted exactly
                          when its path is the target's own chain, whatever else is drafted)
  choices["d:k"]          adaptive speculation only: steps whose drafter and draft length the
                          policy chose as d and k ("off:0": target-only that step; a step with
                          no room to draft, or a sequence's first, is no choice)
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field


@dataclass
class SpecMetrics:
    drafted: int = 0
    accepted: int = 0
    target_forwards: int = 0
    tokens: int = 0
    drafted_at: list[int] = field(default_factory=list)  # per draft position
    accepted_at: list[int] = field(default_factory=list)
    histogram: list[int] = field(default_factory=list)  # index = accepted drafts in a step
    node_drafted: dict[str, int] = field(default_factory=dict)  # draft trees: per node key
    node_accepted: dict[str, int] = field(default_factory=dict)
    choices: dict[str, int] = field(default_factory=dict)  # adaptive: "drafter:k" -> steps

    def record_choice(self, key: str) -> None:
        """One step whose (drafter, k) the adaptive policy chose (adaptive.choice_key)."""
        self.choices[key] = self.choices.get(key, 0) + 1

    def record_step(self, n_drafted: int, n_accepted: int, depth: int | None = None) -> None:
        """One target forward that saw ``n_drafted`` drafts and accepted ``n_accepted``; a
        draft tree's ``depth`` (None: a chain, as deep as it is long)."""
        depth = n_drafted if depth is None else depth
        if not 0 <= n_accepted <= depth <= n_drafted:
            raise ValueError(f"accepted {n_accepted} of {n_drafted} drafted ({depth} deep)")
        self.target_forwards += 1
        self.drafted += n_drafted
        self.accepted += n_accepted
        self.tokens += n_accepted + 1
        _grow(self.drafted_at, depth)
        _grow(self.accepted_at, depth)
        _grow(self.histogram, n_accepted + 1)
        for i in range(depth):
            self.drafted_at[i] += 1
            if i < n_accepted:
                self.accepted_at[i] += 1
        self.histogram[n_accepted] += 1

    def record_nodes(self, drafted: list[tuple[int, ...]], accepted: list[tuple[int, ...]]) -> None:
        """A draft tree's nodes (by key: their ranks from the root) and the accepted ones."""
        for key, counts in ((drafted, self.node_drafted), (accepted, self.node_accepted)):
            for k in key:
                name = node_name(k)
                counts[name] = counts.get(name, 0) + 1

    def merge(self, other: SpecMetrics) -> SpecMetrics:
        """Sum of two sets of counts (a new object)."""
        out = SpecMetrics(
            drafted=self.drafted + other.drafted,
            accepted=self.accepted + other.accepted,
            target_forwards=self.target_forwards + other.target_forwards,
            tokens=self.tokens + other.tokens,
        )
        out.drafted_at = _add(self.drafted_at, other.drafted_at)
        out.accepted_at = _add(self.accepted_at, other.accepted_at)
        out.histogram = _add(self.histogram, other.histogram)
        out.node_drafted = _add_counts(self.node_drafted, other.node_drafted)
        out.node_accepted = _add_counts(self.node_accepted, other.node_accepted)
        out.choices = _add_counts(self.choices, other.choices)
        return out

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return self.tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def per_position_rate(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    @property
    def node_rate(self) -> dict[str, float]:
        return {k: self.node_accepted.get(k, 0) / d for k, d in self.node_drafted.items() if d}

    def to_dict(self) -> dict:
        """The measures defined above, by name (node_rate only when a tree was drafted, choices
        only when a policy chose)."""
        out = {name: copy.copy(getattr(self, name)) for name in _REPORTED}
        out |= {"node_rate": self.node_rate} if self.node_drafted else {}
        return out | ({"choices": dict(self.choices)} if self.choices else {})


# What a report carries, in the order of the definitions at the top of this module.
_REPORTED = (
    "drafted",
    "accepted",
    "acceptance_rate",
    "target_forwards",
    "tokens",
    "mean_acceptance_length",
    "per_position_rate",
    "histogram",
)


def _grow(xs: list[int], n: int) -> None:
    if len(xs) < n:
        xs.extend([0] * (n - len(xs)))


def node_rates_text(node_rate: dict[str, float], most: int = 12) -> str:
    """Per-node acceptance for a report line, breadth-first: "0 0.80, 1 0.12, 0.0 0.61, ..."."""
    names = sorted(node_rate, key=lambda n: (len(node_key(n)), node_key(n)))
    text = ", ".join(f"{n} {node_rate[n]:.2f}" for n in names[:most])
    return text + (f", ... ({len(names)} nodes)" if len(names) > most else "")


def node_name(key: tuple[int, ...]) -> str:
    """A tree node's key as metrics name it: (0, 1) -> "0.1"."""
    return ".".join(str(r) for r in key)


def node_key(name: str) -> tuple[int, ...]:
    return tuple(int(r) for r in name.split("."))


def _add_counts(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: a.get(k, 0) + b.get(k, 0) for k in sorted(set(a) | set(b))}


def _add(a: list[int], b: list[int]) -> list[int]:
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]


def expected_tokens_per_forward(acceptance: float, k: int) -> float:
    """E[tokens per target forward] for i.i.d. acceptance a and draft length k."""
    if acceptance >= 1.0:
        return float(k + 1)
    return (1 - acceptance ** (k + 1)) / (1 - acceptance)


def speedup_bound(acceptance: float, k: int, cost_ratio: float, verify_cost: float = 1.0) -> float:
    """Walltime speedup bound (Leviathan et al. 2023), refined with the verify cost.

    cost_ratio c = draft step time / target step time; verify_cost = time of one target
    forward over k+1 tokens / time of one target decode step (1.0 in the paper's model).
    """
    return tree_speedup_bound(expected_tokens_per_forward(acceptance, k), k, cost_ratio, verify_cost)


def tree_speedup_bound(tokens_per_forward: float, draft_steps: int, cost_ratio: float, verify_cost: float) -> float:
    """The same bound for any draft shape: tokens per target forward over the forward's cost in
    target decode steps (``draft_steps`` draft steps at c each, then the verify). A chain of k
    drafts takes k draft steps; a draft tree one per depth."""
    return tokens_per_forward / (draft_steps * cost_ratio + verify_cost)


def metrics_json(m: SpecMetrics) -> str:
    """Raw counts (to rebuild SpecMetrics) plus the derived figures, as one JSON object."""
    return json.dumps(asdict(m) | m.to_dict(), sort_keys=True)


def metrics_from_json(text: str) -> SpecMetrics:
    data = json.loads(text)
    fields = SpecMetrics.__dataclass_fields__
    return SpecMetrics(**{k: v for k, v in data.items() if k in fields})


@dataclass
class SourceCounts:
    """Draft tokens by where they came from (suffix decoding: "suffix"; layered on a model
    draft: "suffix" or "model"). drafted[s]: tokens source s proposed to the target;
    accepted[s]: of those, the ones the target agreed with; acceptance_rate(s) = their ratio."""

    drafted: dict[str, int] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)

    def record(self, source: str, n_drafted: int, n_accepted: int) -> None:
        if not 0 <= n_accepted <= n_drafted:
            raise ValueError(f"accepted {n_accepted} of {n_drafted} drafted")
        self.drafted[source] = self.drafted.get(source, 0) + n_drafted
        self.accepted[source] = self.accepted.get(source, 0) + n_accepted

    def acceptance_rate(self, source: str) -> float:
        drafted = self.drafted.get(source, 0)
        return self.accepted.get(source, 0) / drafted if drafted else 0.0

    def to_dict(self) -> dict:
        return {s: {"drafted": n, "accepted": self.accepted.get(s, 0)} for s, n in sorted(self.drafted.items())}

"""`trtspec bench --trees`: which draft tree (or chain) this drafter and machine should use.

Three measurements, then one choice:
  acceptance per node  the spec's drafter drafts a wide probe tree (every chain node down to
                       max_draft_len, every path that leaves the top candidate once, then
                       twice, up to the most nodes a tree verifies) on the prompts, greedy;
                       SpecMetrics.node_rate gives P(node accepted) for each probe node;
  verify cost          one target forward over the context's last token + n tree nodes, in
                       target decode steps, for n = 1..the probe's size (measure.py);
  draft cost           c, one draft (or EAGLE-3 head) step in target decode steps.

Greedy acceptance of a node depends only on its own path (it is accepted exactly when its
path is the target's own greedy chain), so the probe's rates hold for every tree made of
probe nodes: a tree T verifies 1 + sum(rate(v) for v in T) tokens per target forward, at a
cost of verify(|T|) + depth(T) * c decode steps (one draft step per depth). The choice is
the tree (or chain) with the highest ratio (metrics.speedup_bound's model, per forward):
trees grown node by node, most accepted first, against the chains k = 1..max_draft_len. A
ratio at or below 1 beats no target-only decoding: the recommendation is then no drafting.

With ``timed``, the recommended shape, the best chain and target-only then generate the
prompts in turn (interleaved per prompt, prefix caches emptied before each): measured
tokens/s and mean acceptance length, on this machine at the time of the run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from trtspec.bench.measure import forward_seconds, measure_engine_costs
from trtspec.errors import RequestError
from trtspec.spec import MAX_TREE_NODES
from trtspec.speculative.metrics import SpecMetrics, node_key, tree_speedup_bound
from trtspec.speculative.tree import StaticTree

REPEATS = 5  # timed forwards per verify size (the median is kept)


def probe_shape(depth: int, nodes: int = MAX_TREE_NODES) -> StaticTree:
    """The probe: paths of up to ``depth`` ranks (rank < 4 at depth 1, < 3 at depth 2, < 2
    deeper), fewest departures from the top candidate first (then the smallest ranks, then
    the shallowest), at most ``nodes`` of them, each with its parent."""
    widths = [4, 3] + [2] * max(depth - 2, 0)
    paths: list[tuple[int, ...]] = [()]
    out: list[tuple[int, ...]] = []
    for d in range(depth):
        paths = [p + (r,) for p in paths for r in range(widths[d])]
        out += paths
    order = sorted(out, key=lambda p: (sum(r > 0 for r in p), sum(p), len(p), p))
    kept: set[tuple[int, ...]] = set()
    for p in order:
        if len(kept) == nodes:
            break
        if len(p) == 1 or p[:-1] in kept:
            kept.add(p)
    return StaticTree.of(kept)


@dataclass
class ShapeChoice:
    """A tree (or chain) and what the model expects of it."""

    choices: list[tuple[int, ...]]
    expected_length: float  # tokens per target forward: 1 + the nodes' acceptance rates
    cost: float  # decode steps per target forward: verify(nodes) + depth * c
    expected_speedup: float  # expected_length / cost: tokens per decode step vs target-only's 1

    @property
    def is_chain(self) -> bool:
        return all(set(c) == {0} for c in self.choices)

    def to_dict(self) -> dict:
        return {
            "choices": [list(c) for c in self.choices],
            "nodes": len(self.choices),
            "depth": max(map(len, self.choices), default=0),
            "chain": self.is_chain,
            "expected_length": round(self.expected_length, 3),
            "cost": round(self.cost, 3),
            "expected_speedup": round(self.expected_speedup, 3),
        }


def _choice(nodes: list[tuple[int, ...]], rates: dict[tuple[int, ...], float], verify: dict[int, float], c: float):
    depth = max(map(len, nodes))
    length = 1.0 + sum(rates.get(n, 0.0) for n in nodes)
    cost = verify[len(nodes)] + depth * c
    return ShapeChoice(
        sorted(nodes, key=lambda p: (len(p), p)), length, cost, tree_speedup_bound(length, depth, c, verify[len(nodes)])
    )


def recommend(
    rates: dict[tuple[int, ...], float], verify: dict[int, float], c: float, max_depth: int
) -> tuple[ShapeChoice | None, ShapeChoice | None, list[ShapeChoice]]:
    """(the best tree or chain, the best chain, every tree candidate by size). ``rates``: per
    node P(accepted); ``verify[n]``: a forward over n nodes + 1 in decode steps (n = 1 ..
    the largest tree considered); ``c``: a draft step in decode steps. None: nothing beats
    target-only (expected speedup <= 1)."""
    chains = []
    for k in range(1, max_depth + 1):
        nodes = [(0,) * d for d in range(1, k + 1)]
        if k in verify and all(n in rates for n in nodes):
            chains.append(_choice(nodes, rates, verify, c))
    trees, kept = [], []
    frontier = {n for n in rates if len(n) == 1}
    while frontier and len(kept) + 1 in verify:
        best = max(frontier, key=lambda n: (rates[n], -len(n), [-r for r in n]))
        frontier.remove(best)
        kept.append(best)
        frontier |= {n for n in rates if len(n) == len(best) + 1 and n[:-1] == best and len(n) <= max_depth}
        trees.append(_choice(list(kept), rates, verify, c))
    best_chain = max(chains, key=lambda s: s.expected_speedup, default=None)
    best = max([*trees, *chains], key=lambda s: s.expected_speedup, default=None)
    return (best if best is not None and best.expected_speedup > 1.0 else None), best_chain, trees


@dataclass
class TreeBench:
    probe_nodes: int
    probe_metrics: SpecMetrics
    verify: dict[int, float]  # nodes -> decode steps
    cost_ratio: float
    recommended: ShapeChoice | None
    best_chain: ShapeChoice | None
    chain_k1: ShapeChoice | None
    candidates: list[ShapeChoice] = field(default_factory=list)
    timed: dict = field(default_factory=dict)  # path -> {"tokens_per_s", "mean_acceptance_length"}

    def longest_within(self, nodes: int) -> ShapeChoice | None:
        """The candidate tree of at most ``nodes`` nodes with the longest expected acceptance."""
        fits = [s for s in self.candidates if len(s.choices) <= nodes]
        return max(fits, key=lambda s: s.expected_length, default=None)

    def to_dict(self) -> dict:
        m = self.probe_metrics
        return {
            "probe": {
                "nodes": self.probe_nodes,
                "target_forwards": m.target_forwards,
                "mean_acceptance_length": round(m.mean_acceptance_length, 3),
                "node_rate": {k: round(v, 4) for k, v in sorted(m.node_rate.items(), key=lambda kv: node_key(kv[0]))},
                "node_drafted": dict(sorted(m.node_drafted.items(), key=lambda kv: node_key(kv[0]))),
            },
            "verify_cost": {str(n): round(v, 3) for n, v in sorted(self.verify.items())},
            "cost_ratio": round(self.cost_ratio, 4),
            "recommended": self.recommended.to_dict() if self.recommended else None,
            "best_chain": self.best_chain.to_dict() if self.best_chain else None,
            "chain_k1": self.chain_k1.to_dict() if self.chain_k1 else None,
            # The acceptance length a tree reaches at a verify budget of 8 drafted tokens.
            "longest_within_8": (lambda s: s.to_dict() if s else None)(self.longest_within(8)),
            "candidates": [s.to_dict() | {"choices": None} for s in self.candidates],
            "timed": self.timed,
        }


def measure_trees(
    dep, prompts: list[str], max_tokens: int, timed: bool = True, rounds: int = 1, progress: Callable[[str], None] | None = None
) -> TreeBench:
    """The three measurements and the choice (module doc) for Deployment ``dep`` in process."""
    say = progress or (lambda s: None)
    if not hasattr(dep.drafter(), "propose_tree"):
        raise RequestError(
            f"--trees: method {dep.spec.speculative.method} drafts chains only; trees are drafted by draft_target and eagle3"
        )
    depth = dep.spec.speculative.max_draft_len
    probe = probe_shape(depth)
    say(f"probe tree ({probe.size} nodes)")
    metrics = SpecMetrics()
    for p in prompts:
        dep.forget_prefixes()
        (res,) = dep.generate([dep.request(dep.encode(p), max_tokens, tree=probe)])
        metrics = metrics.merge(res.metrics)
    rates = {node_key(k): v for k, v in metrics.node_rate.items()}
    say("verify costs")
    ctx = dep.encode(prompts[0])
    costs = measure_engine_costs(dep, prompts[0], 1)
    step = costs.target_step
    verify = {n: forward_seconds(dep.target, ctx, n + 1, REPEATS, tree=True) / step for n in range(1, probe.size + 1)}
    c = costs.cost_ratio
    best, best_chain, trees = recommend(rates, verify, c, depth)
    k1 = _choice([(0,)], rates, verify, c) if (0,) in rates else None
    out = TreeBench(probe.size, metrics, verify, c, best, best_chain, k1, trees)
    if timed:
        out.timed = _timed(dep, prompts, max_tokens, best, best_chain, rounds, say)
    dep.forget_prefixes()
    return out


def _timed(dep, prompts, max_tokens, best: ShapeChoice | None, chain: ShapeChoice | None, rounds: int, say) -> dict:
    """Measured tokens/s and acceptance length of target-only, the best chain and the
    recommended tree (when it is not that chain), interleaved per prompt."""
    paths: dict[str, tuple[bool, dict]] = {"target_only": (False, {})}
    if chain is not None:
        paths["best_chain"] = (True, {"num_draft_tokens": len(chain.choices), "tree": "chain"})
    if best is not None and not best.is_chain:
        paths["recommended"] = (True, {"tree": StaticTree.of(best.choices)})
    seconds = dict.fromkeys(paths, 0.0)
    tokens = dict.fromkeys(paths, 0)
    metrics = {name: SpecMetrics() for name in paths}
    for r in range(rounds):
        for i, p in enumerate(prompts):
            say(f"timed: round {r + 1}, prompt {i + 1}/{len(prompts)}")
            ids = dep.encode(p)
            for name, (speculative, kw) in paths.items():
                req = dep.request(ids, max_tokens, **kw)
                dep.forget_prefixes()
                t0 = time.perf_counter()
                (res,) = dep.generate([req], speculative=speculative)
                seconds[name] += time.perf_counter() - t0
                tokens[name] += len(res.output_ids)
                metrics[name] = metrics[name].merge(res.metrics)
    return {
        name: {
            "tokens_per_s": round(tokens[name] / seconds[name], 2) if seconds[name] else None,
            "mean_acceptance_length": round(metrics[name].mean_acceptance_length, 3),
        }
        for name in paths
    }

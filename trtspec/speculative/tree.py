"""Draft trees: several candidates per position, verified in one target forward.

A draft tree is nodes in breadth-first order (every parent before its children), each a
token, its parent (an earlier node, or ROOT: the last token of the context) and its rank
among its siblings by draft probability (0: the drafter's top choice there). A chain of k
drafts is the one-branch tree (parents ROOT, 0, 1, ..., ranks all 0): the loop handles
both with the same code.

How a tree reaches the engine (engines/torch/engine.py ForwardItem; the served path sends the
same three things as tensors):

    ForwardItem(tokens=context + list(tree.tokens), n_logits=len(tree) + 1, tree=tree.parents)

The engine writes the nodes' K/V after the context (cache rows L..L+n-1 for a context of L
tokens) at positions ``tree.positions(L)`` = L - 1 + depth, each node attending to the whole
context and to its own ancestors only (``tree.mask()``). Logits come back one row per tree
position: row 0 the target after the context, row j + 1 the target after node j's path (a
Verdict's target_ids are in the same order). The next call sends context + the accepted path
(+ whatever follows): the engine moves that path's K/V (and captured EAGLE-3 features) into
place and forgets every other node, so a rejected branch is never visible to a later step.
A call whose tree starts with the tree the engine holds after the same context (a drafter
growing a tree a depth at a time, n_logits = the newest nodes) computes only the new nodes.

Shapes (what a request asks its drafter for):
  StaticTree   choice lists as EAGLE and vLLM write them, e.g. [(0,), (1,), (0, 0)]: node
               (0, 1) is the second-best child of the best first token.
  DynamicTree  EAGLE-2: expand the top_k children of the top_k most likely nodes at each
               depth (by cumulative draft log probability), then keep the ``budget`` most
               likely nodes of all those candidates (always a tree: a parent is at least as
               likely as its child).
``TreeGrowth`` grows either shape one depth at a time from the drafter's ranked candidates,
so every drafter batches its model calls across sequences the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from trtspec.engines.torch.model import TREE_ROWS, tree_layout
from trtspec.spec import SpeculativeSpec

ROOT = -1  # the parent of a depth-1 node: the last token of the context

# A drafter's candidates after one node: (token, log probability), most likely first.
Candidates = list[tuple[int, float]]


def top_candidates(logits: torch.Tensor, width: int, ids: torch.Tensor | None = None) -> list[Candidates]:
    """Per row of ``logits`` [n, vocab] its ``width`` most likely tokens with their log
    probabilities (``ids`` [vocab]: the token id of each column, when they differ)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(logp, min(width, logp.shape[-1]), dim=-1)
    toks = top.indices if ids is None else ids[top.indices]
    return [list(zip(t, v)) for t, v in zip(toks.tolist(), top.values.tolist())]


@dataclass(frozen=True)
class DraftTree:
    tokens: tuple[int, ...]
    parents: tuple[int, ...]  # per node: an earlier node, or ROOT
    ranks: tuple[int, ...]  # per node: its rank among its parent's candidates (0: most likely)
    depths: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not len(self.tokens) == len(self.parents) == len(self.ranks):
            raise ValueError("a draft tree needs one parent and one rank per token")
        depths, _ = tree_layout(list(self.parents))  # validates the parents
        object.__setattr__(self, "depths", tuple(depths))

    @classmethod
    def chain(cls, tokens) -> DraftTree:
        """k drafts in a row: the one-branch tree."""
        n = len(tokens)
        return cls(tuple(tokens), tuple(range(-1, n - 1)), (0,) * n)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return self.parents == tuple(range(-1, len(self.tokens) - 1))

    @property
    def depth(self) -> int:
        return max(self.depths, default=0)

    def mask(self) -> torch.Tensor:
        """[n, n] bool: node i may attend node j (j is i or an ancestor of i)."""
        return tree_layout(list(self.parents))[1]

    def positions(self, context_len: int) -> list[int]:
        """Each node's position after a context of ``context_len`` tokens: by depth."""
        return [context_len - 1 + d for d in self.depths]

    def children(self, node: int) -> list[int]:
        """Nodes whose parent is ``node`` (ROOT: the depth-1 nodes), in node order."""
        return [i for i, p in enumerate(self.parents) if p == node]

    def path(self, node: int) -> list[int]:
        """Nodes from depth 1 down to ``node`` (empty for ROOT)."""
        out = []
        while node != ROOT:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def key(self, node: int) -> tuple[int, ...]:
        """The node's name in a choice list: the ranks along its path, e.g. (0, 1)."""
        return tuple(self.ranks[i] for i in self.path(node))

    def cut(self, max_nodes: int, max_depth: int) -> DraftTree:
        """The first ``max_nodes`` nodes no deeper than ``max_depth`` (breadth-first order keeps
        every kept node's ancestors)."""
        keep = [i for i, d in enumerate(self.depths) if d <= max_depth][: max(max_nodes, 0)]
        return self.subtree(keep)

    def subtree(self, keep: list[int]) -> DraftTree:
        """The nodes ``keep`` (ascending, closed under parents), renumbered."""
        new = {old: j for j, old in enumerate(keep)}
        return DraftTree(
            tuple(self.tokens[i] for i in keep),
            tuple(ROOT if self.parents[i] == ROOT else new[self.parents[i]] for i in keep),
            tuple(self.ranks[i] for i in keep),
        )


def accepted_path(tree: DraftTree, target_ids: list[int]) -> list[int]:
    """Greedy verification: the longest path whose tokens are the target's own greedy chain.

    ``target_ids[0]`` is the target's token after the context, ``target_ids[j + 1]`` after node
    j's path. From the root, the child whose token equals the target's token there is
    accepted, and so on down; the target's token after the last accepted node (the bonus or
    the correction) follows. For a chain this is the longest agreeing prefix. Siblings carry
    distinct tokens in a well-formed tree; with duplicates the first in node order is taken.
    """
    path: list[int] = []
    node = ROOT
    while True:
        row = node + 1
        if row >= len(target_ids):
            raise ValueError(
                f"verifier returned {len(target_ids)} token(s) for a tree of {len(tree)}: "
                "it must include the target's token after every node"
            )
        nxt = next((c for c in tree.children(node) if tree.tokens[c] == target_ids[row]), None)
        if nxt is None:
            return path
        path.append(nxt)
        node = nxt


@dataclass(frozen=True)
class StaticTree:
    """A fixed shape: each choice is a node named by the ranks along its path."""

    choices: tuple[tuple[int, ...], ...]  # breadth-first: by depth, then by ranks

    @classmethod
    def of(cls, choices) -> StaticTree:
        """A shape from a choice list in any order; every prefix of a choice must be a choice."""
        norm = {tuple(int(r) for r in c) for c in choices}
        if not norm or () in norm:
            raise ValueError("a tree needs at least one node, each a non-empty tuple of ranks such as (0,) or (0, 1)")
        for c in norm:
            if any(r < 0 for r in c):
                raise ValueError(f"tree node {c}: ranks are 0 (the most likely token) or more")
            if len(c) > 1 and c[:-1] not in norm:
                raise ValueError(f"tree node {c} has no parent {c[:-1]} in the choice list; add it")
        return cls(tuple(sorted(norm, key=lambda c: (len(c), c))))

    @classmethod
    def chain(cls, k: int) -> StaticTree:
        return cls(tuple((0,) * d for d in range(1, k + 1)))

    @property
    def size(self) -> int:
        return len(self.choices)

    @property
    def depth(self) -> int:
        return max((len(c) for c in self.choices), default=0)

    def cut(self, max_nodes: int, max_depth: int) -> StaticTree | None:
        """The first ``max_nodes`` choices no deeper than ``max_depth``; None when that is none."""
        kept = [c for c in self.choices if len(c) <= max_depth][: max(max_nodes, 0)]
        return StaticTree(tuple(kept)) if kept else None


@dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2's dynamic tree: top_k candidates per expanded node, top_k nodes expanded per
    depth, ``depth`` levels, the ``budget`` most likely nodes kept."""

    top_k: int
    depth: int
    budget: int

    def __post_init__(self) -> None:
        if self.top_k < 1 or self.depth < 1 or self.budget < 1:
            raise ValueError(f"a dynamic tree needs top_k, depth and budget >= 1 (got {self.top_k}, {self.depth}, {self.budget})")

    @property
    def size(self) -> int:
        return self.budget

    def cut(self, max_nodes: int, max_depth: int) -> DynamicTree | None:
        if max_nodes < 1 or max_depth < 1:
            return None
        return DynamicTree(self.top_k, min(self.depth, max_depth), min(self.budget, max_nodes))


TreeShape = StaticTree | DynamicTree


class TreeGrowth:
    """One sequence's tree grown a depth at a time. Each round the drafter reads ``frontier``
    (nodes to expand; ROOT first) and ``width`` (candidates wanted per node), scores each
    frontier node's path, and hands back its ranked candidates to ``grow``; ``tree()`` gives
    the draft once ``done``."""

    def __init__(self, shape: TreeShape):
        self.shape = shape
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.ranks: list[int] = []
        self.scores: list[float] = []  # cumulative draft log probability
        self.keys: list[tuple[int, ...]] = []
        self.frontier: list[int] = [ROOT]
        self.expanded: list[int] = []  # nodes expanded in earlier rounds (ROOT not counted)
        self.round = 0
        # Candidates asked per expanded node: the largest rank the shape names, + 1.
        self.width = 1 + max(c[-1] for c in shape.choices) if isinstance(shape, StaticTree) else shape.top_k

    @property
    def done(self) -> bool:
        return not self.frontier

    def grow(self, candidates: list[Candidates]) -> None:
        """Per frontier node, its candidates (token, log prob), most likely first."""
        self.round += 1
        self.expanded += [n for n in self.frontier if n != ROOT]
        added: list[int] = []
        for node, cands in zip(self.frontier, candidates):
            base = self.scores[node] if node != ROOT else 0.0
            key = self.keys[node] if node != ROOT else ()
            for rank, (tok, lp) in enumerate(cands[: self.width]):
                if isinstance(self.shape, StaticTree) and key + (rank,) not in self.shape.choices:
                    continue
                self.tokens.append(int(tok))
                self.parents.append(node)
                self.ranks.append(rank)
                self.scores.append(base + float(lp))
                self.keys.append(key + (rank,))
                added.append(len(self.tokens) - 1)
        if isinstance(self.shape, StaticTree):
            parents = {c[:-1] for c in self.shape.choices}
            self.frontier = [n for n in added if self.keys[n] in parents]
        else:
            # What a drafter scores (expanded nodes + frontier) stays within the cache rows a
            # tree may use (engines/torch/model.py TREE_ROWS): the widest trees stop early.
            room = TREE_ROWS - len(self.expanded)
            top = sorted(added, key=lambda n: (-self.scores[n], n))[: min(self.shape.top_k, room)]
            self.frontier = sorted(top) if self.round < self.shape.depth else []

    def scored(self) -> tuple[list[int], list[int], list[int]]:
        """What a drafter runs this round: (tokens, parents) of the nodes expanded so far and
        the frontier, renumbered (closed under parents, the frontier last), and the frontier's
        indices among them. Empty for the first round (the frontier is ROOT: the context's
        last token)."""
        nodes = sorted(self.expanded + [n for n in self.frontier if n != ROOT])
        new = {old: j for j, old in enumerate(nodes)}
        parents = [ROOT if self.parents[n] == ROOT else new[self.parents[n]] for n in nodes]
        return [self.tokens[n] for n in nodes], parents, [new[n] for n in self.frontier if n != ROOT]

    def tree(self) -> DraftTree:
        """The grown draft (a dynamic shape keeps its ``budget`` most likely nodes)."""
        tree = DraftTree(tuple(self.tokens), tuple(self.parents), tuple(self.ranks))
        if isinstance(self.shape, StaticTree) or len(tree) <= self.shape.budget:
            return tree
        order = sorted(range(len(tree)), key=lambda n: (-self.scores[n], tree.depths[n], n))
        kept: set[int] = set()
        for n in order:
            if len(kept) == self.shape.budget:
                break
            if tree.parents[n] == ROOT or tree.parents[n] in kept:
                kept.add(n)
        return tree.subtree(sorted(kept))


def tree_shape(spec: SpeculativeSpec) -> TreeShape | None:
    """The spec's ``speculative.tree`` as a shape (a dynamic tree is max_draft_len deep); None:
    the deployment drafts chains."""
    t = spec.tree
    if t is None:
        return None
    if t.choices is not None:
        return StaticTree.of(t.choices)
    return DynamicTree(t.dynamic.top_k, spec.max_draft_len, t.dynamic.nodes)

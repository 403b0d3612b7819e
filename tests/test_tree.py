"""Draft trees: the shape types, the engine's tree attention and KV keep/discard, greedy and
sampled verification through the one loop, per-node metrics."""

from __future__ import annotations

import pytest
import torch

from trtspec.engines.torch.engine import ForwardItem
from trtspec.speculative.tree import ROOT, DraftTree, DynamicTree, StaticTree, TreeGrowth, accepted_path


@pytest.fixture(scope="module")
def dep(built):
    return built("same")


def _seq(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 384, (n,), generator=g).tolist()


# A tree of 6 nodes: two depth-1 branches, (0) -> (0,0) -> (0,0,0), (0) -> (0,1), (1) -> (1,0).
TREE = DraftTree((11, 12, 21, 22, 31, 41), (ROOT, ROOT, 0, 0, 1, 2), (0, 1, 0, 1, 0, 0))


def test_tree_layout_depths_mask_positions_and_keys():
    assert TREE.depths == (1, 1, 2, 2, 2, 3)
    assert TREE.positions(10) == [10, 10, 11, 11, 11, 12]
    m = TREE.mask()
    assert m[5].tolist() == [True, False, True, False, False, True]  # itself, (0,0), (0)
    assert m[4].tolist() == [False, True, False, False, True, False]
    assert TREE.key(5) == (0, 0, 0) and TREE.key(4) == (1, 0) and TREE.path(5) == [0, 2, 5]
    assert DraftTree.chain([5, 6, 7]).mask().equal(torch.tril(torch.ones(3, 3, dtype=torch.bool)))
    assert DraftTree.chain([5, 6]).is_chain and not TREE.is_chain


def test_every_tree_node_scores_as_its_own_path_run_as_a_chain(dep):
    """One tree forward gives, at every node, the logits a plain forward over context + that
    node's path gives: each node sees its ancestors and nothing of its siblings' branches."""
    eng = dep.target
    ctx = _seq(20, 3)
    eng.forget_prefixes()
    (tree_logits,) = eng.run([ForwardItem(ctx + list(TREE.tokens), len(TREE) + 1, TREE.parents)])
    assert tree_logits.shape[0] == len(TREE) + 1
    for node in range(len(TREE)):
        eng.forget_prefixes()
        path = [TREE.tokens[i] for i in TREE.path(node)]
        (chain,) = eng.run([ForwardItem(ctx + path, 1)])
        torch.testing.assert_close(tree_logits[node + 1], chain[0], rtol=1e-4, atol=1e-4)
    eng.forget_prefixes()
    (root,) = eng.run([ForwardItem(ctx, 1)])
    torch.testing.assert_close(tree_logits[0], root[0], rtol=1e-4, atol=1e-4)


def test_a_rejected_branch_never_affects_later_tokens(dep):
    """After a tree step the next call continues along one path: its logits equal a run that
    never saw the tree, and the path's K/V was reused (only the new tokens computed)."""
    eng = dep.target
    ctx = _seq(18, 4)
    eng.forget_prefixes()
    eng.run([ForwardItem(ctx + list(TREE.tokens), len(TREE) + 1, TREE.parents)])
    path = [TREE.tokens[i] for i in TREE.path(4)]  # the second branch: (1) -> (1,0)
    nxt = ctx + path + [99, 100]
    (after_tree,) = eng.run([ForwardItem(nxt, 3)])
    assert eng.last_use[0][0] == len(ctx) + len(path)  # the path was kept, in place
    eng.forget_prefixes()
    (fresh,) = eng.run([ForwardItem(nxt, 3)])
    torch.testing.assert_close(after_tree, fresh, rtol=1e-4, atol=1e-4)


def test_static_tree_choice_lists_are_validated_and_ordered_breadth_first():
    shape = StaticTree.of([[0, 0], [1], [0]])
    assert shape.choices == ((0,), (1,), (0, 0)) and shape.size == 3 and shape.depth == 2
    assert StaticTree.chain(3).choices == ((0,), (0, 0), (0, 0, 0))
    with pytest.raises(ValueError, match=r"no parent \(1,\)"):
        StaticTree.of([(0,), (1, 0)])
    assert shape.cut(2, 5).choices == ((0,), (1,)) and shape.cut(5, 1).choices == ((0,), (1,))
    assert shape.cut(0, 3) is None


def _grow(shape, dist):
    """Grow ``shape`` where every node's candidates are dist's tokens, most likely first."""
    g = TreeGrowth(shape)
    while not g.done:
        g.grow([[(t, lp) for t, lp in dist] for _ in g.frontier])
    return g.tree()


def test_static_growth_follows_the_choices_by_rank():
    dist = [(7, -0.1), (8, -1.0), (9, -3.0)]
    tree = _grow(StaticTree.of([(0,), (1,), (0, 0), (0, 2), (0, 0, 1)]), dist)
    assert tree.tokens == (7, 8, 7, 9, 8)
    assert tree.parents == (ROOT, ROOT, 0, 0, 2)
    assert [tree.key(i) for i in range(len(tree))] == [(0,), (1,), (0, 0), (0, 2), (0, 0, 1)]


def test_dynamic_growth_keeps_the_most_likely_nodes_within_the_budget():
    dist = [(7, -0.1), (8, -1.0), (9, -3.0)]
    tree = _grow(DynamicTree(top_k=2, depth=3, budget=5), dist)
    # Cumulative log probs: (0) -0.1, (0,0) -0.2, (0,0,0) -0.3, (1) -1.0, (0,1) -1.1 (tied with
    # (1,0), expanded later), then (0,0,1) -1.2 and the rest.
    assert sorted(tree.key(i) for i in range(len(tree))) == [(0,), (0, 0), (0, 0, 0), (0, 1), (1,)]
    assert len(tree) == 5 and all(p < i for i, p in enumerate(tree.parents))
    assert list(tree.depths) == sorted(tree.depths)  # breadth-first


def test_greedy_acceptance_follows_the_target_chain_down_the_tree():
    # target after context: 12 (node 1), after node 1: 31 (node 4), after node 4: 5 (bonus)
    target = [12, 0, 31, 0, 0, 5, 0]
    assert accepted_path(TREE, target) == [1, 4]
    assert accepted_path(TREE, [11, 21, 0, 41, 0, 0, 3]) == [0, 2, 5]
    assert accepted_path(TREE, [99] * 7) == []
    assert accepted_path(DraftTree.chain([4, 5, 6]), [4, 5, 9, 9]) == [0, 1]

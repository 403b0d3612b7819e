"""Draft trees: the shape types, the engine's tree attention and KV keep/discard, greedy and
sampled verification through the one loop, per-node metrics."""

from __future__ import annotations

import pytest
import torch

from trtspec.engines.torch.engine import ForwardItem
from trtspec.speculative.capabilities import Capabilities, Drafter
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


TREE_SPEC = {"choices": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]}
PROMPTS = ["The quick brown fox", "Once upon a time", "1, 2, 3, 4,"]


def _deployment(folder, tiny_ckpts, **overrides):
    from conftest import write_spec

    from trtspec.engines.build import build
    from trtspec.runtime import Deployment
    from trtspec.spec import load_spec

    loaded = load_spec(write_spec(folder, tiny_ckpts, "draft", **overrides))
    build(loaded, loaded.output_dir())
    return Deployment(loaded, loaded.output_dir())


@pytest.fixture(scope="module")
def tree_dep(tmp_path_factory, tiny_ckpts):
    """The tiny pair (a weak draft) drafting a static tree."""
    return _deployment(tmp_path_factory.mktemp("tree"), tiny_ckpts, **{"speculative.tree": TREE_SPEC})


@pytest.mark.parametrize("shape", ["static", "dynamic", "chain"])
def test_greedy_tree_output_is_target_only(tree_dep, shape):
    from trtspec.speculative.tree import DynamicTree

    tree = {"static": None, "dynamic": DynamicTree(top_k=3, depth=3, budget=8), "chain": "chain"}[shape]
    dep = tree_dep
    reqs = [dep.request(dep.encode(p, chat_template=False), 40, tree=tree) for p in PROMPTS]
    dep.forget_prefixes()
    base = dep.generate(reqs, speculative=False)
    dep.forget_prefixes()
    spec = dep.generate(reqs)
    for b, s in zip(base, spec):
        assert s.output_ids == b.output_ids
    m = spec[0].metrics.merge(spec[1].metrics).merge(spec[2].metrics)
    assert m.accepted > 0
    if shape == "chain":
        assert not m.node_drafted
    else:
        assert m.node_drafted and m.drafted > m.target_forwards * 3


@pytest.fixture(scope="module")
def eagle_tree(tmp_path_factory, tiny_ckpts):
    """method eagle3 drafting a static tree: a random head on the tiny target, and the exact
    head on the bigram target (every rank-0 draft right)."""
    from conftest import write_spec
    from exact_head import make_bigram_target, make_exact_head
    from test_eagle3 import random_head

    from trtspec.engines.build import build
    from trtspec.runtime import Deployment
    from trtspec.spec import load_spec

    root = tmp_path_factory.mktemp("eagle-tree")
    bigram = make_bigram_target(root / "bigram-target", tiny_ckpts["target"])
    pairs = {
        "random": {"target": tiny_ckpts["target"], "head": random_head(tiny_ckpts["target"], root / "random", scale=1.0)},
        "exact": {"target": bigram, "head": make_exact_head(bigram, root / "exact")},
    }
    out = {}
    for name, ck in pairs.items():
        overrides = {"speculative.method": "eagle3", "speculative.tree": TREE_SPEC}
        loaded = load_spec(write_spec(root / name, ck, "head", **overrides))
        build(loaded, loaded.output_dir())
        out[name] = Deployment(loaded, loaded.output_dir())
    return out


def _both(dep, max_tokens=40, **kw):
    reqs = [dep.request(dep.encode(p, chat_template=False), max_tokens, **kw) for p in PROMPTS]
    dep.forget_prefixes()
    base = dep.generate(reqs, speculative=False)
    dep.forget_prefixes()
    return base, dep.generate(reqs)


def test_eagle3_tree_output_is_target_only(eagle_tree):
    base, spec = _both(eagle_tree["random"])
    for b, s in zip(base, spec):
        assert s.output_ids == b.output_ids
    assert all(s.metrics.node_drafted for s in spec)


def test_eagle3_head_states_follow_each_branch(eagle_tree):
    """The exact head drafts the bigram target's own chain along rank 0: every step accepts
    the whole (0,), (0, 0), (0, 0, 0) path, which needs each node drafted from its own
    parent's state (a sibling's state, or the context's, drafts another token)."""
    base, spec = _both(eagle_tree["exact"], max_tokens=33)
    for b, s in zip(base, spec):
        assert s.output_ids == b.output_ids
        m = s.metrics
        # Every step accepts the deepest rank-0 node it drafted (near max_tokens the tree is cut).
        assert m.accepted_at == m.drafted_at and m.drafted_at[2] >= 6
        assert m.node_rate["0.0.0"] == m.node_rate["0.0"] == m.node_rate["0"] == 1.0
        assert m.node_rate["1"] == m.node_rate["1.0"] == 0.0


# ------------------------------------------------------------------------------ sampling


class MarkovTreeDrafter(Drafter):
    """Trees of the Markov draft's top candidates (point masses to the sampler)."""

    capabilities = Capabilities(trees=True)

    def propose(self, contexts, ks):
        raise AssertionError("tree requests are drafted as trees")

    def propose_tree(self, contexts, shapes):
        from trtspec.speculative.tree import top_candidates
        from trtspec.testing.markov_pair import DRAFT

        out = []
        for ctx, shape in zip(contexts, shapes):
            g = TreeGrowth(shape)
            while not g.done:
                prev = [ctx[-1] if n == ROOT else g.tokens[n] for n in g.frontier]
                g.grow(top_candidates(DRAFT[prev], g.width))
            out.append(g.tree())
        return out


SAMPLED_TREE = StaticTree.of([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])


def tree_joint_counts(n: int, params, shape=SAMPLED_TREE, T=3):
    from trtspec.speculative.loop import GenerationRequest, generate
    from trtspec.speculative.sampling import SamplingParams
    from trtspec.testing.markov_pair import MarkovVerifier, V

    reqs = [
        GenerationRequest(
            [0], T, 3, sampling=SamplingParams(params.temperature, params.top_k, params.top_p, params.seed + i), tree=shape
        )
        for i in range(n)
    ]
    counts = torch.zeros((V,) * T, dtype=torch.float64)
    results = generate(reqs, MarkovTreeDrafter(), MarkovVerifier())
    for res in results:
        counts[tuple(res.output_ids)] += 1
    return counts, results


def exact_joint4(params) -> torch.Tensor:
    """P(x1..x4) of the Markov target from token 0."""
    from trtspec.speculative.sampling import warp
    from trtspec.testing.markov_pair import TARGET

    p = warp(TARGET, params)  # [V, V] rows: p(next | prev)
    return p[0][:, None, None, None] * p[:, :, None, None] * p[None, :, :, None] * p[None, None, :, :]


@pytest.mark.parametrize("which", [0, 1, 2])
def test_tree_rejection_sampling_draws_the_target_joint(which):
    from test_sampling import PARAMS, exact_joint, joint_p_value

    counts, results = tree_joint_counts(2000, PARAMS[which])
    assert joint_p_value(counts, exact_joint(PARAMS[which])) > 1e-3
    # Four tokens: the drafted step verifies two levels of the tree.
    counts4, results4 = tree_joint_counts(3000, PARAMS[which], T=4)
    assert joint_p_value(counts4, exact_joint4(PARAMS[which])) > 1e-3
    assert any(r.metrics.node_accepted.get("0.0", 0) + r.metrics.node_accepted.get("1.0", 0) for r in results4)
    m = results[0].metrics
    for r in results[1:]:
        m = m.merge(r.metrics)
    assert m.node_drafted["0"] > 0 and m.node_accepted.get("1", 0) > 0  # second candidates accepted too


def _siblings_against_p(tree, q, p, gen):
    """A WRONG tree sampler: every sibling is tried against the target's p, never the
    residual left by the siblings rejected before it."""
    from trtspec.speculative.sampling import draw

    path, node = [], ROOT
    while True:
        r = p[node + 1]
        nxt = None
        for child in tree.children(node):
            if float(torch.rand((), generator=gen, dtype=torch.float64)) < float(r[tree.tokens[child]]):
                nxt = child
                break
        if nxt is None:
            rest = r.clone()
            rest[[tree.tokens[c] for c in tree.children(node)]] = 0
            return [tree.tokens[c] for c in path] + [draw(rest / rest.sum(), gen)], path
        path.append(nxt)
        node = nxt


def _first_child_always(tree, q, p, gen):
    """A WRONG tree sampler: the first candidate is always accepted (no rejection step)."""
    from trtspec.speculative.sampling import draw

    path = [c for c in tree.children(ROOT)[:1]]
    while path and tree.children(path[-1]):
        path.append(tree.children(path[-1])[0])
    return [tree.tokens[c] for c in path] + [draw(p[(path[-1] if path else ROOT) + 1], gen)], path


@pytest.mark.parametrize(
    "wrong, n", [(_first_child_always, 2000), (_siblings_against_p, 12000)], ids=["no-rejection", "no-residual"]
)
def test_wrong_tree_samplers_are_caught(monkeypatch, wrong, n):
    """The same chi-square test rejects a tree sampler without the rejection step, and one
    that tries each sibling against p instead of the residual its rejected elders left."""
    from test_sampling import PARAMS, exact_joint, joint_p_value

    from trtspec.speculative import loop

    monkeypatch.setattr(loop, "accept_tree", wrong)
    counts, _ = tree_joint_counts(n, PARAMS[0])
    assert joint_p_value(counts, exact_joint(PARAMS[0])) < 1e-6


# ------------------------------------------------------------------------------ verify


def test_verify_proves_tree_outputs_identical_and_reports_per_node(tree_dep):
    from trtspec.verify.backends import InProcessBackend
    from trtspec.verify.identity import run_verify

    report = run_verify(InProcessBackend(tree_dep), PROMPTS, 32, "tiny-tree")
    assert report.identical and report.passes("any")
    m = report.metrics
    assert m.node_drafted["2"] > 0 and sum(m.node_accepted.values()) == m.accepted
    assert "node_rate" in m.to_dict() and len(m.per_position_rate) == 3  # per depth


def test_a_tree_step_replays_in_its_own_shape(tree_dep):
    """The verdict's verifier-shape replay of a tree step (its recorded parents, the accepted
    nodes holding the run's tokens) gives back every token that step emitted."""
    from trtspec.verify.verdicts import replay

    dep = tree_dep
    ids = dep.encode(PROMPTS[0], chat_template=False)
    dep.forget_prefixes()
    (res,) = dep.generate([dep.request(ids, 24)])
    assert res.step_trees, "the run drafted no tree"
    checked = 0
    for step, (_, path) in list(res.step_trees.items())[:3]:
        start = res.steps[step][0]
        for index in range(start, start + len(path) + 1):
            if index >= len(res.output_ids):
                break
            rep = replay(dep.target.run, dep.forget_prefixes, ids, res.output_ids, res.steps, index, res.step_trees)
            assert int(rep.verifier.argmax()) == res.output_ids[index]
            checked += 1
    assert checked >= 3


# ------------------------------------------------------------------------------ schedule


def test_the_load_schedule_shrinks_trees_and_switches_them_off():
    """Under load a tree is cut to the schedule's k nodes (breadth-first), or not drafted."""
    from trtspec.speculative.loop import Batch, GenerationRequest
    from trtspec.speculative.sampling import SamplingParams
    from trtspec.speculative.schedule import LoadPolicy
    from trtspec.testing.markov_pair import MarkovVerifier

    def drafted_per_row(active: int) -> list[int]:
        policy = LoadPolicy.of({1: 8, 2: 2, 3: 0}, None)
        batch = Batch(MarkovTreeDrafter(), MarkovVerifier(), policy=policy)
        for i in range(active):
            batch.add(GenerationRequest([0], 8, 3, sampling=SamplingParams(seed=i), tree=SAMPLED_TREE))
        batch.step()  # the first step drafts nothing (prefill)
        proposal = batch.propose(batch.active)
        return [len(d) for d in proposal.drafts]

    assert drafted_per_row(1) == [7]  # the whole tree
    assert drafted_per_row(2) == [2, 2]  # (0,), (1,)
    assert drafted_per_row(3) == [0, 0, 0]


def test_verify_sampling_with_trees_passes_and_catches_a_sampler_without_rejection(tree_dep, monkeypatch):
    """verify --sampling's test on the tree deployment: the tree sampler passes against the
    target's exact conditionals; one that accepts every first candidate is caught."""
    from trtspec.speculative import loop
    from trtspec.speculative.sampling import SamplingParams
    from trtspec.verify.sampling import check_deployment

    params = SamplingParams(temperature=1.0, seed=7)
    exact = check_deployment(tree_dep, PROMPTS, 20, 12, params)
    assert exact.values >= 60 and exact.passed, exact.describe()
    assert exact.metrics.node_drafted and exact.metrics.accepted > 0
    monkeypatch.setattr(loop, "accept_tree", _first_child_always)
    wrong = check_deployment(tree_dep, PROMPTS, 20, 12, params)
    assert not wrong.passed, wrong.describe()


# ------------------------------------------------------------------------------ bench --trees


def test_probe_holds_the_chain_and_the_one_departure_paths():
    from trtspec.bench.trees import probe_shape

    probe = probe_shape(6)
    assert probe.size == 64 and probe.depth == 6
    assert all((0,) * d in probe.choices for d in range(1, 7))
    assert {(3,), (0, 2), (0, 0, 1), (0, 0, 0, 0, 0, 1)} <= set(probe.choices)
    assert probe_shape(2, nodes=5).choices == ((0,), (1,), (0, 0), (0, 1), (1, 0))


def test_recommendation_weighs_node_acceptance_against_verify_cost():
    from trtspec.bench.trees import recommend

    rates = {(0,): 0.9, (0, 0): 0.8, (1,): 0.3, (0, 1): 0.05}
    cheap = {n: 1 + 0.1 * n for n in range(1, 5)}
    best, chain, trees = recommend(rates, cheap, 0.0, 2)
    # {(0,), (0,0), (1,)}: (1 + 0.9 + 0.8 + 0.3) / 1.3 = 2.31 beats chain k=2: 2.7 / 1.2 = 2.25
    assert best.choices == [(0,), (1,), (0, 0)] and round(best.expected_speedup, 2) == 2.31
    assert chain.choices == [(0,), (0, 0)] and [len(t.choices) for t in trees] == [1, 2, 3, 4]
    dear = {n: 1 + 0.5 * n for n in range(1, 5)}
    best, chain, _ = recommend(rates, dear, 0.0, 2)
    assert best.is_chain and best.choices == [(0,), (0, 0)]  # 2.7 / 2.0 = 1.35
    best, chain, _ = recommend({(0,): 0.1, (1,): 0.05}, dear, 0.5, 1)
    assert best is None and chain.expected_speedup < 1  # nothing beats target-only


def test_bench_trees_measures_nodes_and_costs_and_recommends(tree_dep):
    from trtspec.bench.trees import measure_trees

    out = measure_trees(tree_dep, PROMPTS[:2], 16, timed=True)
    d = out.to_dict()
    rates = d["probe"]["node_rate"]
    assert d["probe"]["nodes"] == 64 and "0" in rates and "1" in rates
    assert sorted(int(n) for n in d["verify_cost"]) == list(range(1, 65))
    k1 = d["chain_k1"]
    assert k1["nodes"] == 1 and abs(k1["expected_length"] - (1 + rates["0"])) < 1e-3
    assert d["longest_within_8"]["nodes"] <= 8 and d["longest_within_8"]["expected_length"] >= k1["expected_length"]
    rec = d["recommended"]
    assert rec is None or rec["expected_speedup"] > 1.0
    if rec is not None:
        assert rec["expected_speedup"] >= d["best_chain"]["expected_speedup"]
    assert set(d["timed"]) >= {"target_only", "best_chain"}


def test_cli_bench_trees_prints_the_recommendation_and_writes_it(tree_dep, tmp_path):
    import json

    from typer.testing import CliRunner

    from trtspec.cli.app import app

    spec = tree_dep.loaded.path
    args = ["bench", str(spec), "--trees", "--sweep", "none", "-c", "1", "--max-tokens", "12", "-p", PROMPTS[0]]
    r = CliRunner().invoke(app, [*args, "-o", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert "draft trees: probe of 64 nodes" in r.stdout and "recommended" in r.stdout
    trees = json.loads((tmp_path / "bench.json").read_text())["trees"]
    assert trees["chain_k1"]["nodes"] == 1 and "target_only" in trees["timed"]
    r = CliRunner().invoke(app, ["bench", str(spec), "--trees", "--url", "127.0.0.1:1"])
    assert r.exit_code == 2 and "--trees measures acceptance per tree node" in r.stderr


def test_cli_verify_reports_acceptance_per_tree_node(tree_dep, tmp_path):
    from typer.testing import CliRunner

    from trtspec.cli.app import app

    page = tmp_path / "verify.html"
    args = ["verify", str(tree_dep.loaded.path), "-p", PROMPTS[0], "-p", PROMPTS[2], "--max-tokens", "16"]
    r = CliRunner().invoke(app, [*args, "--html", str(page)])
    assert r.exit_code == 0, r.output
    assert "all identical" in r.stdout and "per tree node (ranks from the root) [0 " in r.stdout
    assert "acceptance per tree node" in page.read_text()


def test_eagle3_tree_rank0_path_is_the_heads_own_chain(eagle_tree):
    """The head grows a tree's rank-0 path exactly as it drafts a chain: the siblings it
    drafts beside that path (in the same head forwards) are invisible to it."""
    dep = eagle_tree["random"]
    drafter = dep.drafter()
    shape = StaticTree.of([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (2, 0), (0, 0, 0), (0, 1, 0), (1, 0, 0)])
    compared = 0
    for prompt in PROMPTS:
        ctx = dep.encode(prompt, chat_template=False)
        dep.forget_prefixes()
        dep.target.run([ForwardItem(ctx, 1)])  # the target's features of the context
        (tree,) = drafter.propose_tree([ctx + [5]], [shape])
        dep.forget_prefixes()
        dep.target.run([ForwardItem(ctx, 1)])
        (chain,) = drafter.propose([ctx + [5]], [3])
        rank0 = [tree.tokens[n] for n in range(len(tree)) if set(tree.key(n)) == {0}]
        assert rank0 == chain
        compared += 1
    assert compared == len(PROMPTS)


def test_head_tree_rows_see_only_their_ancestors(eagle_tree):
    """HeadRow.visible: nodes run side by side (and a child in a later call) give the outputs
    the head gives each node's own path run as a chain."""
    from trtspec.engines.torch.eagle3_head import HeadRow

    head = eagle_tree["random"].head
    g = torch.Generator().manual_seed(0)
    h, base = head.cfg.hidden_size, 12
    ctx_state, ctx_tokens = torch.randn(base, h, generator=g), torch.randint(0, 300, (base,), generator=g).tolist()
    nodes, toks = torch.randn(4, h, generator=g), [17, 18, 19, 20]  # three depth-1 nodes, then a child of node 1

    def context():
        head.extend([HeadRow(0, 0, ctx_state, ctx_tokens)])  # cache rows 0..base-1

    with torch.inference_mode():
        context()
        visible = torch.zeros(3, base + 3, dtype=torch.bool)
        visible[:, :base] = True
        visible[[0, 1, 2], [base, base + 1, base + 2]] = True
        (side,) = head.extend([HeadRow(0, base, nodes[:3], toks[:3], [base] * 3, visible)])
        child_visible = torch.zeros(1, base + 4, dtype=torch.bool)
        child_visible[0, :base] = True
        child_visible[0, [base + 1, base + 3]] = True  # its parent (node 1) and itself
        (child,) = head.extend([HeadRow(0, base + 3, nodes[3:], toks[3:], [base + 1], child_visible)])
        # Outputs run to hundreds here: 1e-3 is float32 rounding across forward shapes (a
        # leaked sibling moves them by hundreds).
        for j in range(3):
            context()
            (alone,) = head.extend([HeadRow(0, base, nodes[j : j + 1], toks[j : j + 1])])
            torch.testing.assert_close(side[j], alone[0], rtol=1e-3, atol=1e-3)
        context()
        (path,) = head.extend([HeadRow(0, base, torch.stack([nodes[1], nodes[3]]), [toks[1], toks[3]])])
        torch.testing.assert_close(child[0], path[1], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("name", ["repetition", "presence+frequency", "all"])
def test_processed_tree_requests_equal_token_by_token_decoding(tree_dep, name):
    """Penalties on a tree: each node's row counts its own path's tokens, so the output and
    its log probs are token-by-token decoding's with the same processing."""
    from test_processing import CASES, reference

    dep, proc = tree_dep, CASES[name]
    drafted = 0
    for prompt in PROMPTS:
        ids = dep.encode(prompt, chat_template=False)
        ref, ref_lp = reference(dep, ids, 24, proc)
        dep.forget_prefixes()
        (spec,) = dep.generate([dep.request(ids, 24, processing=proc, log_probs=True)])
        assert spec.output_ids == ref
        assert spec.log_probs == pytest.approx(ref_lp, abs=1e-4)
        drafted += len(spec.metrics.node_drafted)
    assert drafted > 0


def test_bench_sweeps_draft_chains_of_each_k_on_a_tree_spec(tree_dep):
    """bench's k sweep measures chains of k (the main comparison drafts the spec's tree)."""
    from trtspec.bench.measure import InProcessBench

    (main,), _ = InProcessBench(tree_dep).run_batch(PROMPTS[:1], 12, True, 2, 1)
    (swept,), _ = InProcessBench(tree_dep, use_schedule=False).run_batch(PROMPTS[:1], 12, True, 2, 1)
    assert main.metrics.node_drafted and len(main.metrics.drafted_at) == 3
    assert not swept.metrics.node_drafted and len(swept.metrics.drafted_at) == 2


def test_eagle3_dynamic_tree_and_sampling(eagle_tree):
    """The head grows EAGLE-2's dynamic tree too (greedy: target-only's tokens), and sampled
    requests through its trees pass verify --sampling's test."""
    from trtspec.speculative.sampling import SamplingParams
    from trtspec.speculative.tree import DynamicTree
    from trtspec.verify.sampling import check_deployment

    dep = eagle_tree["random"]
    base, spec = _both(dep, tree=DynamicTree(top_k=3, depth=3, budget=6))
    for b, s in zip(base, spec):
        assert s.output_ids == b.output_ids
        assert s.metrics.node_drafted and len(s.metrics.drafted_at) == 3  # three levels deep
    check = check_deployment(dep, PROMPTS, 20, 12, SamplingParams(temperature=1.0, seed=11))
    assert check.passed and check.metrics.node_drafted, check.describe()


def test_tree_and_chain_requests_batch_together(tree_dep, eagle_tree):
    """One batch mixing tree, chain and target-only requests: each gets target-only's tokens."""
    for dep in (tree_dep, eagle_tree["random"]):
        ids = [dep.encode(p, chat_template=False) for p in PROMPTS]
        reqs = [dep.request(ids[0], 30), dep.request(ids[1], 30, 3, tree="chain"), dep.request(ids[2], 30, 0)]
        dep.forget_prefixes()
        base = dep.generate(reqs, speculative=False)
        dep.forget_prefixes()
        spec = dep.generate(reqs)
        assert [s.output_ids for s in spec] == [b.output_ids for b in base]
        assert spec[0].metrics.node_drafted and not spec[1].metrics.node_drafted and spec[1].metrics.drafted
        assert spec[2].metrics.drafted == 0


def test_tree_nodes_keep_a_sliding_window_by_their_positions(dep, monkeypatch):
    """On a sliding-window model a node sees the context keys within the window of its own
    position (its depth's), as its path run as a chain does."""
    import dataclasses

    eng = dep.target
    monkeypatch.setattr(eng, "config", dataclasses.replace(eng.config, sliding_window=8))
    ctx = _seq(20, 5)
    eng.forget_prefixes()
    (tree_logits,) = eng.run([ForwardItem(ctx + list(TREE.tokens), len(TREE) + 1, TREE.parents)])
    for node in range(len(TREE)):
        eng.forget_prefixes()
        (chain,) = eng.run([ForwardItem(ctx + [TREE.tokens[i] for i in TREE.path(node)], 1)])
        torch.testing.assert_close(tree_logits[node + 1], chain[0], rtol=1e-4, atol=1e-4)
    eng.forget_prefixes()


def test_a_growing_tree_reuses_the_nodes_already_scored(dep, monkeypatch):
    """A drafter grows a tree a depth at a time: the engine computes only the new nodes (the
    first ones are the tree it holds after the same context), with the logits of a fresh run."""
    eng = dep.target
    ctx = _seq(16, 6)
    eng.forget_prefixes()
    eng.run([ForwardItem(ctx, 1)])
    eng.run([ForwardItem(ctx + list(TREE.tokens[:2]), 2, TREE.parents[:2])])  # depth 1
    widths = []
    real = eng.model.hidden_states

    def spy(step, *a, **kw):
        widths.append(step.tokens.shape[1])
        return real(step, *a, **kw)

    monkeypatch.setattr(eng.model, "hidden_states", spy)
    (grown,) = eng.run([ForwardItem(ctx + list(TREE.tokens), 4, TREE.parents)])
    assert widths == [4]  # the four deeper nodes only
    eng.forget_prefixes()
    (fresh,) = eng.run([ForwardItem(ctx + list(TREE.tokens), 4, TREE.parents)])
    assert widths[-1] == len(ctx) + len(TREE)
    torch.testing.assert_close(grown, fresh, rtol=1e-4, atol=1e-4)
    # Another tree after the same context shares no nodes: computed whole.
    other = DraftTree((12, 11), (ROOT, ROOT), (0, 1))
    eng.run([ForwardItem(ctx + list(other.tokens), 3, other.parents)])
    assert widths[-1] == len(other) + 1

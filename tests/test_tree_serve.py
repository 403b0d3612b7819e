"""Draft trees on the served path: the engine models' tree contract (draft_tree_parents,
return_top_k) and the orchestrator's drafter and verifier over it, without a server (the
engine calls go to EngineCore objects in this process, the code the engine models run) and on
a real tritonserver. Served trees run the same loop as in process: same tokens, same counts."""

from __future__ import annotations

import numpy as np
import pytest
from test_triton_cores import _call, _request

from trtspec.errors import RequestError
from trtspec.speculative.loop import generate
from trtspec.speculative.metrics import metrics_from_json
from trtspec.speculative.requests import Limits
from trtspec.speculative.tree import DraftTree, StaticTree, top_candidates
from trtspec.speculative.verifier import LogitsVerifier
from trtspec.triton.backend.bls import BlsDrafter, BlsVerifier
from trtspec.triton.backend.engine_core import EngineCore
from trtspec.triton.backend.orchestrator_core import Orchestrator, OrchestratorSettings

PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Triton serves models over HTTP and gRPC."]
CHOICES = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0], [0, 0, 0, 0]]
TREE = {"choices": CHOICES}
DYNAMIC = {"dynamic": {"top_k": 3, "nodes": 10}}
_DEPLOYMENTS: dict[str, object] = {}


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_ckpts):
    """The tiny draft_target pair with a draft tree (static by default), built once per shape;
    with tree None, the chain deployment."""
    from conftest import write_spec

    from trtspec.engines.build import build
    from trtspec.runtime import Deployment
    from trtspec.spec import load_spec

    def get(tree=TREE):
        key = repr(tree)
        if key not in _DEPLOYMENTS:
            folder = tmp_path_factory.mktemp("tree-deploy")
            loaded = load_spec(write_spec(folder, tiny_ckpts, "draft", **({} if tree is None else {"speculative.tree": tree})))
            build(loaded, loaded.output_dir())
            _DEPLOYMENTS[key] = Deployment(loaded, loaded.output_dir())
        return _DEPLOYMENTS[key]

    return get


def _cores(dep, draft_width: int | None = None):
    """The engine models' cores, each allowing the widths the repository writer gives them."""
    t, d = dep.target, dep.draft
    s = dep.spec.speculative
    batch = dep.spec.limits("target").max_batch_size
    return {
        "tensorrt_llm": EngineCore(t.run, Limits(t.vocab_size, t.max_seq_len, s.verify_width, max_batch_size=batch)),
        "tensorrt_llm_draft": EngineCore(
            d.run,
            Limits(d.vocab_size, d.max_seq_len, draft_width or s.tree.grown_nodes(s.max_draft_len), max_batch_size=batch),
            min(t.vocab_size, d.vocab_size),
        ),
    }


def _orchestrator(dep, mode="speculative", log=None):
    settings = OrchestratorSettings(
        mode=mode,
        decoupled=False,
        target_model="tensorrt_llm",
        draft_model="tensorrt_llm_draft",
        method=dep.spec.speculative.method,
        max_ngram=dep.spec.speculative.max_ngram,
        min_ngram=dep.spec.speculative.min_ngram,
        limits=dep.limits,
        draft_vocab_limit=dep.target.vocab_size,
        sampling_supported=True,
    )
    return Orchestrator(settings, _call(_cores(dep), log), dep.tokenizer, dep.end_ids)


def _ids(answer) -> list[int]:
    return answer["output_ids"][0, : answer["sequence_length"][0, 0]].tolist()


def _tree_inputs(ctx, tree: DraftTree, **extra):
    return {
        "input_ids": np.array([ctx], dtype=np.int32),
        "input_lengths": np.array([[len(ctx)]], dtype=np.int32),
        "request_output_len": np.array([[len(tree) + 1]], dtype=np.int32),
        "draft_input_ids": np.array([tree.tokens], dtype=np.int32),
        "draft_tree_parents": np.array([tree.parents], dtype=np.int32),
        "exclude_input_in_output": np.array([[True]]),
    } | extra


# ---------------------------------------------------------------- the engine models' contract


def test_an_engine_model_scores_a_tree_in_one_request_as_each_path_alone(built):
    dep = built()
    ctx = dep.encode(PROMPTS[0])
    tree = DraftTree((5, 9, 7, 3, 11, 4, 8), (-1, -1, 0, 0, 1, 2, 5), (0, 1, 0, 1, 0, 0, 0))
    core = _cores(dep)["tensorrt_llm"]
    (answer,) = core.infer([_tree_inputs(ctx, tree, return_top_k=np.array([[3]], dtype=np.int32))])
    ids = answer["output_ids"][0, 0, : answer["sequence_length"][0, 0]].tolist()
    assert len(ids) == len(tree) + 1  # the target's token after the context and after every node
    for node in [None, *range(len(tree))]:
        path = [] if node is None else [tree.tokens[n] for n in tree.path(node)]
        (chain,) = LogitsVerifier(dep.target.run).verify([ctx], [path])
        assert ids[0 if node is None else node + 1] == chain.target_ids[-1]
        top = top_candidates(chain.logits[-1:], 3)[0]
        row = 0 if node is None else node + 1
        assert answer["top_k_ids"][0, 0, row].tolist() == [t for t, _ in top]
        assert np.allclose(answer["top_k_log_probs"][0, 0, row], [lp for _, lp in top], atol=1e-4)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"draft_tree_parents": np.array([[-1, 1, 0]], dtype=np.int32)}, "draft_tree_parents[0]: tree node 1: parent 1 must be"),
        (
            {"draft_tree_parents": np.array([[-1, 0]], dtype=np.int32)},
            "draft_tree_parents must have the shape of draft_input_ids",
        ),
        ({"request_output_len": np.array([[8]], dtype=np.int32)}, "send request_output_len 4"),
        ({"repetition_penalty": np.array([[1.3]], dtype=np.float32)}, "logits processing (penalties"),
        ({"return_top_k": np.array([[-2]], dtype=np.int32)}, "return_top_k must be in 0.."),
    ],
)
def test_an_engine_model_refuses_a_bad_tree_request_alone(built, extra, message):
    dep = built()
    core = _cores(dep)["tensorrt_llm"]
    good = _tree_inputs(dep.encode(PROMPTS[0]), DraftTree((5, 9, 7), (-1, -1, 0), (0, 1, 0)))
    bad, ok = core.infer([good | extra, good])
    assert isinstance(bad, RequestError) and message in str(bad)
    assert isinstance(ok, dict)


def test_a_tree_may_reach_past_max_seq_len_by_its_nodes_not_by_its_depth(built):
    """The engine keeps a tree's nodes aside at their depths: input + depth must fit
    max_seq_len, input + nodes need not (the end of a long generation)."""
    dep = built()
    core = _cores(dep)["tensorrt_llm"]
    wide = DraftTree((5, 9, 7, 3, 11), (-1, -1, -1, -1, 0), (0, 1, 2, 3, 0))  # 5 nodes, 2 deep
    n = dep.target.max_seq_len - 2
    ctx = (dep.encode(PROMPTS[0]) * 100)[:n]
    (fits,) = core.infer([_tree_inputs(ctx, wide)])
    assert fits["sequence_length"][0, 0] == len(wide) + 1
    (late,) = core.infer([_tree_inputs(ctx + [5], wide)])
    assert isinstance(late, RequestError) and f"input ({n + 1} tokens) + a draft tree 2 deep exceeds max_seq_len" in str(late)


def test_served_trees_run_to_the_end_of_max_seq_len(tmp_path, tiny_ckpts):
    """A long generation's last steps grow trees whose scored nodes pass max_seq_len."""
    from conftest import write_spec

    from trtspec.engines.build import build
    from trtspec.runtime import Deployment
    from trtspec.spec import load_spec

    over = {"speculative.tree": {"dynamic": {"top_k": 4, "nodes": 12}}, "build.max_seq_len": 64, "build.max_input_len": 32}
    loaded = load_spec(write_spec(tmp_path, tiny_ckpts, "draft", **over, **{"verify.max_tokens": 32}))
    build(loaded, loaded.output_dir())
    dep = Deployment(loaded, loaded.output_dir())
    ids = dep.encode(PROMPTS[0])
    (out,) = _orchestrator(dep).run([_request(PROMPTS[0], max_tokens=64 - len(ids))])
    (base,) = dep.generate([dep.request(ids, 64 - len(ids))], speculative=False)
    assert not isinstance(out, Exception), out
    assert _ids(out) == base.output_ids and len(base.output_ids) == 64 - len(ids)


def test_the_bls_drafter_grows_the_trees_the_in_process_drafter_grows(built):
    from trtspec.speculative.drafters import ModelDrafter
    from trtspec.speculative.tree import DynamicTree

    dep = built()
    cores = _cores(dep, draft_width=12)  # DynamicTree(3, 4, 10) scores up to 3 x 4 nodes while growing
    bls = BlsDrafter(_call(cores), "tensorrt_llm_draft", dep.target.vocab_size)
    local = ModelDrafter(dep.draft.run, min(dep.target.vocab_size, dep.draft.vocab_size))
    ctxs = [dep.encode(p) for p in PROMPTS]
    shapes = [StaticTree.of(CHOICES), DynamicTree(3, 4, 10), StaticTree.of([[0], [1], [2], [0, 0]])]
    assert bls.propose_tree(ctxs, shapes) == local.propose_tree(ctxs, shapes)


def test_the_bls_verifier_sends_trees_and_chains_apart(built):
    dep = built()
    log = []
    verifier = BlsVerifier(_call(_cores(dep), log), "tensorrt_llm")
    ctxs = [dep.encode(p) for p in PROMPTS]
    tree = DraftTree((5, 9, 7), (-1, -1, 0), (0, 1, 0))
    got = verifier.verify(ctxs, [[1, 2, 3], list(tree.tokens), [4]], trees=[None, tree.parents, None])
    ref = LogitsVerifier(dep.target.run).verify(ctxs, [[1, 2, 3], list(tree.tokens), [4]], trees=[None, tree.parents, None])
    assert got[1].target_ids == ref[1].target_ids  # every node's answer
    assert len(log) == 3 and sum("draft_tree_parents" in shapes for _, shapes in log) == 1


# ---------------------------------------------------------------- the orchestrator


@pytest.mark.parametrize("tree", [TREE, DYNAMIC], ids=["static", "dynamic"])
def test_served_trees_and_chains_in_one_step_match_in_process_generation(built, tree):
    dep = built(tree)
    orch = _orchestrator(dep)
    requests = [_request(p) for p in PROMPTS] + [_request(PROMPTS[0], draft_tree=False)]
    answers = orch.run(requests)  # one batch: three trees and a chain step together
    refs = [dep.request(dep.encode(p), 24) for p in PROMPTS] + [dep.request(dep.encode(PROMPTS[0]), 24, tree="chain")]
    expected = generate(refs, dep.drafter(), dep.verifier())
    target_only = [r.output_ids for r in dep.generate([dep.request(dep.encode(p), 24) for p in PROMPTS], speculative=False)]
    assert [_ids(a) for a in answers] == [r.output_ids for r in expected]
    assert [_ids(a) for a in answers][:3] == target_only and _ids(answers[3]) == target_only[0]
    metrics = [metrics_from_json(a["perf_metrics_json"][0, 0].decode()) for a in answers]
    assert metrics == [r.metrics for r in expected]
    assert max(m.drafted for m in metrics[:3]) > 0


def test_draft_tree_true_is_refused_where_the_deployment_drafts_chains(built):
    dep = built(None)
    from test_triton_cores import _orchestrator as chain_orchestrator

    (answer,) = chain_orchestrator(dep).run([_request(PROMPTS[0], draft_tree=True)])
    assert isinstance(answer, RequestError) and "draft_tree true: this endpoint drafts chains" in str(answer)


def test_tree_settings_reach_the_endpoints_and_the_engine_models(tmp_path, tiny_ckpts):
    from conftest import write_spec

    from trtspec.engines.build import build
    from trtspec.spec import TreeSpec, load_spec
    from trtspec.speculative.tree import DynamicTree
    from trtspec.triton.backend.params import EngineEndpointParams
    from trtspec.triton.repository.writer import plan_repository

    loaded = load_spec(write_spec(tmp_path, tiny_ckpts, "draft", **{"speculative.tree": DYNAMIC}))
    build(loaded, loaded.output_dir())
    plan = plan_repository(loaded, loaded.output_dir())
    endpoints = {
        name: EngineEndpointParams.from_params(cfg.parameters)
        for name, (cfg, _) in plan.models.items()
        if "tensorrt_llm_model_name" in cfg.parameters
    }
    for name, params in endpoints.items():
        if params.mode == "target_only":
            assert params.tree is None
        else:  # the speculative endpoints draft the spec's tree, max_draft_len (8) deep
            assert params.tree == TreeSpec(dynamic={"top_k": 3, "nodes": 10}), name
            assert params.settings(False, 4).limits.default_tree == DynamicTree(3, 8, 10)
    widths = {cfg.name: cfg.parameters["max_draft_len"] for cfg, _ in plan.models.values() if "role" in cfg.parameters}
    # the target verifies up to 10 nodes; the draft scores up to 3 x 7 while growing a tree
    assert widths == {"tensorrt_llm": "10", "tensorrt_llm_draft": "21", "tensorrt_llm_control": "0"}


# -- a real server ------------------------------------------------------------------------------

grpcclient = pytest.importorskip("tritonclient.grpc", reason="needs the serve extra: pip install 'trtspec[serve]'")


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_ckpts):
    from conftest import serve_tiny

    yield from serve_tiny(tmp_path_factory, tiny_ckpts, "tree", **{"speculative.tree": TREE, "build.max_batch_size": 2})


@pytest.mark.server
def test_served_trees_stream_batch_with_chains_and_cancel_with_target_only_tokens(served):
    import concurrent.futures

    from test_serve import _bls, _ids, _stream
    from test_serve_batching import a_cancelled_stream_leaves

    from trtspec.layout import BLS_MODEL

    server, dep = served
    client = grpcclient.InferenceServerClient(server.grpc_endpoint)
    want = {p: dep.generate([dep.request(dep.encode(p), 40)], speculative=False)[0].output_ids for p in PROMPTS}
    # Trees and a chain (draft_tree false), unary and streamed, on an endpoint of batch 2.
    asks = [(p, {}) for p in PROMPTS] + [(PROMPTS[1], {"draft_tree": False})]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        unary = list(pool.map(lambda a: client.infer(BLS_MODEL, _bls(a[0], 40, **a[1])), asks))
        streamed = list(
            pool.map(
                lambda ia: sum((_ids(r) for r in _stream(server.grpc_endpoint, _bls(ia[1][0], 40, **ia[1][1]), f"s{ia[0]}")), []),
                enumerate(asks),
            )
        )
    assert [_ids(r) for r in unary] == [want[p] for p, _ in asks]
    assert streamed == [want[p] for p, _ in asks]
    # One at a time (batched rows may round a near-tie of draft candidates the other way),
    # a tree and a chain request count what in-process generation counts.
    (tree_ref,) = dep.generate([dep.request(dep.encode(PROMPTS[0]), 40)], speculative=True)
    (chain_ref,) = dep.generate([dep.request(dep.encode(PROMPTS[1]), 40, tree="chain")], speculative=True)
    for (prompt, flags), ref in (((PROMPTS[0], {}), tree_ref), ((PROMPTS[1], {"draft_tree": False}), chain_ref)):
        alone = client.infer(BLS_MODEL, _bls(prompt, 40, **flags))
        assert metrics_from_json(alone.as_numpy("perf_metrics_json")[0, 0].decode()) == ref.metrics
    assert tree_ref.metrics != chain_ref.metrics
    # A cancelled stream leaves; the next request is still answered exactly.
    a_cancelled_stream_leaves(server.grpc_endpoint, PROMPTS[2])
    assert _ids(client.infer(BLS_MODEL, _bls(PROMPTS[0], 40))) == want[PROMPTS[0]]


def test_served_eagle3_trees_match_in_process(tmp_path_factory, tiny_ckpts):
    """EAGLE-3 trees over BLS: the head runs in the orchestrator and reads the target engine
    model's features of the accepted path (hidden_states_from) after each tree is scored."""
    from conftest import write_spec
    from test_eagle3 import _eagle_orchestrator, random_head

    from trtspec.engines.build import build
    from trtspec.runtime import Deployment
    from trtspec.spec import load_spec

    folder = tmp_path_factory.mktemp("eagle-tree")
    ck = {"target": tiny_ckpts["target"], "head": random_head(tiny_ckpts["target"], folder / "head", scale=0.05)}
    over = {"speculative.method": "eagle3", "speculative.tree": TREE}
    loaded = load_spec(write_spec(folder, ck, "head", **over))
    build(loaded, loaded.output_dir())
    dep = Deployment(loaded, loaded.output_dir())
    log: list[str] = []
    orch, request = _eagle_orchestrator(dep, log)
    for prompt in PROMPTS[:2]:
        dep.forget_prefixes()
        (out,) = orch.run([request(prompt, 4)])
        (ref,) = dep.generate([dep.request(dep.encode(prompt), 30, 4)], speculative=True)
        (base,) = dep.generate([dep.request(dep.encode(prompt), 30, 4)], speculative=False)
        assert out["output_ids"][0, : out["sequence_length"][0, 0]].tolist() == ref.output_ids == base.output_ids
        served = metrics_from_json(out["perf_metrics_json"][0, 0].decode())
        assert served == ref.metrics and served.drafted > 0
    assert "features" in log and "verify" in log

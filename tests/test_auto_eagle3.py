"""Method auto listing eagle3: the spec's `draft` is an EAGLE-3 head, built as method eagle3
builds it (the torch build, the runtime and the Triton orchestrator load it), and the one loop
chooses per step between the head and n-gram: greedy outputs identical to target-only, in
process and in the orchestrator."""

from __future__ import annotations

import pytest
from conftest import write_spec
from test_eagle3 import random_head

from trtspec.errors import SpecError
from trtspec.spec import load_spec

AUTO_EAGLE = {"speculative.method": "auto", "speculative.auto": {"methods": ["eagle3", "ngram"]}}
PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Triton serves models over HTTP and gRPC. Triton serves"]


@pytest.fixture(scope="module")
def auto_eagle(tmp_path_factory, tiny_ckpts):
    """A tiny target with a random EAGLE-3 head under method auto [eagle3, ngram], built and
    loaded in process."""
    from trtspec.engines.build import build
    from trtspec.runtime import Deployment

    root = tmp_path_factory.mktemp("auto-eagle3")
    ck = {"target": tiny_ckpts["target"], "head": random_head(tiny_ckpts["target"], root / "head")}
    loaded = load_spec(write_spec(root, ck, "head", **AUTO_EAGLE))
    build(loaded, loaded.output_dir())
    return Deployment(loaded, loaded.output_dir())


def test_the_spec_takes_eagle3_in_auto_and_refuses_two_model_drafts(tmp_path, tiny_ckpts):
    ck = {"target": tiny_ckpts["target"], "head": tiny_ckpts["draft"]}
    s = load_spec(write_spec(tmp_path / "a", ck, "head", **AUTO_EAGLE)).spec.speculative
    assert s.methods == ("eagle3", "ngram") and s.model_draft == "eagle3"
    both = {"speculative.method": "auto", "speculative.auto": {"methods": ["eagle3", "draft_target", "ngram"]}}
    with pytest.raises(SpecError, match="eagle3 and draft_target both draft with the spec's one `draft` model") as e:
        load_spec(write_spec(tmp_path / "b", ck, "head", **both))
    assert e.value.exit_code == 2


def test_auto_over_eagle3_and_ngram_is_target_greedy_in_process(auto_eagle):
    from trtspec.speculative.loop import Menu

    dep = auto_eagle
    assert dep.head is not None and dep.draft is None  # the head, built and loaded as method eagle3's
    assert isinstance(dep.drafter(), Menu)
    reqs = [dep.request(dep.encode(p), 40) for p in PROMPTS]
    dep.forget_prefixes()
    target = dep.generate(reqs, speculative=False)
    dep.forget_prefixes()
    spec = dep.generate(reqs, speculative=True)
    for t, s in zip(target, spec):
        assert s.output_ids == t.output_ids
    chosen = {key.rpartition(":")[0] for s in spec for key in s.metrics.choices}
    assert "eagle3" in chosen  # the head drafted (an untried drafter is probed, never hidden)
    assert chosen <= {"eagle3", "ngram", "off"}


def test_auto_over_eagle3_and_ngram_is_target_greedy_in_the_triton_orchestrator(auto_eagle):
    """The repository written for this spec: the target engine model captures the head's
    layers, no draft engine model, and the speculative endpoint's parameters carry the head's
    folders; the orchestrator built from those parameters runs the head beside the loop (the
    target model answers its feature requests), token-identical to target-only in process."""
    from test_eagle3 import _eagle_orchestrator

    from trtspec.speculative.metrics import metrics_from_json
    from trtspec.triton.backend.params import EngineEndpointParams
    from trtspec.triton.repository.writer import TORCH_ENGINE_CALLS, _endpoint_models, _torch_engine_models

    dep = auto_eagle
    engines = dep.loaded.output_dir()
    vocab, batch = dep.target.vocab_size, dep.spec.limits("target").max_batch_size
    engine_models = _torch_engine_models(dep.loaded, engines, batch, vocab)
    assert "tensorrt_llm_draft" not in engine_models  # the head runs in the orchestrator
    assert engine_models["tensorrt_llm"][0].parameters["capture_layers"] == ",".join(map(str, dep.head.cfg.layer_ids))
    cfg, _ = _endpoint_models(dep.loaded, engines, vocab, TORCH_ENGINE_CALLS)["tensorrt_llm_bls"]
    params = EngineEndpointParams.from_params(cfg.parameters)
    assert (params.eagle3_head_dir, params.eagle3_target_dir) == (str(engines / "draft"), str(engines / "target"))
    assert params.draft_model is None and params.adaptive_methods == "eagle3,ngram"

    log: list[str] = []
    orch, request = _eagle_orchestrator(dep, log, params.settings(decoupled=False, max_batch_size=batch))
    assert orch.adaptive is not None
    target = dep.generate([dep.request(dep.encode(p, True), 30) for p in PROMPTS], speculative=False)
    outs = orch.run([request(p, 4) for p in PROMPTS])
    chosen = set()
    for out, ref in zip(outs, target):
        assert out["output_ids"][0, : int(out["sequence_length"][0, 0])].tolist() == ref.output_ids
        chosen |= {key.rpartition(":")[0] for key in metrics_from_json(out["perf_metrics_json"][0, 0].decode()).choices}
    assert "eagle3" in chosen and "features" in log  # the head drafted, reading the target model's features


def test_bench_runs_auto_and_the_head_alone_on_an_auto_spec(auto_eagle):
    """bench --methods on this spec: its eagle3 head alone, ngram and auto (the spec's list)."""
    from trtspec.bench.methods import compare_methods, method_set, methods_table

    dep = auto_eagle
    ms = method_set(dep, ["eagle3", "ngram", "auto"], 4)
    assert set(ms.drafters) == {"eagle3 k=4", "ngram k=4", "auto k<=4"}
    reqs = [dep.request(dep.encode(p), 24) for p in PROMPTS]
    rows = methods_table(compare_methods(dep.verifier(), ms.drafters, reqs, ms.forget))
    assert all(r["identical_to_target_only"] for r in rows)
    auto = next(r for r in rows if r["method"] == "auto k<=4")
    assert {key.rpartition(":")[0] for key in auto["choices"]} <= {"eagle3", "ngram", "off"}

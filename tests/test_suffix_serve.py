"""Suffix decoding served: the orchestrator's drafter comes from make_drafter with one bounded
cache and one set of per-source counts per endpoint instance; the settings travel through
config.pbtxt; Prometheus counts drafts per source; and a real tritonserver on 127.0.0.1
answers streamed, batched and cancelled suffix requests with target-only's tokens."""

from __future__ import annotations

import concurrent.futures
import re

import pytest
from conftest import serve_tiny
from test_triton_cores import _call, _cores, _request

from trtspec.spec import SuffixSpec
from trtspec.speculative.drafters import LayeredDrafter
from trtspec.speculative.metrics import SourceCounts
from trtspec.speculative.suffix import SuffixDrafter
from trtspec.triton.backend.metrics import EndpointMetrics, MemorySink
from trtspec.triton.backend.orchestrator_core import Orchestrator, OrchestratorSettings
from trtspec.triton.backend.params import EngineEndpointParams

SUFFIX = {"speculative.method": "suffix", "speculative.max_draft_len": 8, "draft": None}
PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(",
    '{"id": 1, "name": "a"}\n{"id": 2, "name": "b"}\n{"id": 3, "name": "',
    "The quick brown fox",
]


def _suffix_orchestrator(dep, suffix: SuffixSpec, method="suffix", mode="speculative"):
    settings = OrchestratorSettings(
        mode=mode,
        decoupled=False,
        target_model="tensorrt_llm",
        draft_model="tensorrt_llm_draft" if method != "suffix" else None,
        method=method,
        max_ngram=3,
        min_ngram=1,
        limits=dep.limits,
        draft_vocab_limit=dep.target.vocab_size,
        sampling_supported=True,
        suffix=suffix,
    )
    cores = _cores(dep) if method != "suffix" else {"tensorrt_llm": _cores_target(dep)}
    return Orchestrator(settings, _call(cores), dep.tokenizer, dep.end_ids)


def _cores_target(dep):
    from trtspec.speculative.requests import Limits
    from trtspec.triton.backend.engine_core import EngineCore

    t = dep.target
    lim = dep.spec.limits("target")
    return EngineCore(t.run, Limits(t.vocab_size, t.max_seq_len, 8, max_batch_size=lim.max_batch_size))


def test_orchestrator_suffix_answers_target_only_tokens_with_one_bounded_cache(built):
    dep = built(None, **{"speculative.method": "suffix", "speculative.max_draft_len": 8})
    sx = SuffixSpec(cache_responses=2, cache_tokens=48)
    orch = _suffix_orchestrator(dep, sx)
    assert isinstance(orch.drafter(), SuffixDrafter) and orch.drafter().cache is orch.suffix_cache
    for prompt in PROMPTS * 2:  # each run is a new batch: the cache and counts outlive it
        (out,) = orch.run([_request(prompt, 32, num_draft_tokens=8)])
        (ref,) = dep.generate([dep.request(dep.encode(prompt), 32)], speculative=False)
        assert out["output_ids"][0, : out["sequence_length"][0, 0]].tolist() == ref.output_ids
        assert orch.suffix_cache.live_tokens <= 48 and len(orch.suffix_cache.sizes) <= 2
    assert orch.suffix_cache.live_tokens > 0
    assert orch.sources.drafted.get("suffix", 0) > 0
    control = _suffix_orchestrator(dep, sx, mode="target_only")
    assert control.suffix_cache is None  # the target-only endpoint keeps no cache


def test_orchestrator_keeps_each_scope_apart_and_refuses_malformed_scopes(built):
    from trtspec.errors import RequestError

    dep = built(None, **{"speculative.method": "suffix", "speculative.max_draft_len": 8})
    orch = _suffix_orchestrator(dep, SuffixSpec())
    want = {p: dep.generate([dep.request(dep.encode(p), 24)], speculative=False)[0].output_ids for p in PROMPTS}
    scopes = {PROMPTS[0]: b"tenant-a", PROMPTS[1]: "tenant-é".encode(), PROMPTS[2]: None}
    for prompt, scope in scopes.items():
        extra = {"suffix_cache_scope": scope} if scope is not None else {"suffix_cache": False}
        (out,) = orch.run([_request(prompt, 24, num_draft_tokens=8, **extra)])
        assert out["output_ids"][0, : out["sequence_length"][0, 0]].tolist() == want[prompt]
    # Each response is in its own scope; the opted-out one (suffix_cache false) is nowhere.
    parts = {scope: part.index.tokens[part.start : -1] for scope, part in orch.suffix_cache.parts.items()}
    assert parts == {"tenant-a": want[PROMPTS[0]], "tenant-é": want[PROMPTS[1]]}
    (row,) = orch.parse(_request(PROMPTS[0], 8))
    assert row.request.suffix_scope == ""  # no scope sent: the deployment's shared one
    for extra, needle in (
        ({"suffix_cache_scope": b"x" * 257}, "suffix_cache_scope is 257 bytes, more than 256"),
        ({"suffix_cache_scope": b"\xff\xfe"}, "suffix_cache_scope is not valid UTF-8"),
        ({"suffix_cache_scope": b"a\x00b"}, "suffix_cache_scope holds a control character"),
        ({"suffix_cache_scope": b"a", "suffix_cache": False}, "send it or suffix_cache_scope, not both"),
    ):
        with pytest.raises(RequestError, match=needle):
            orch.parse(_request(PROMPTS[0], 8, **extra))


@pytest.mark.parametrize("name, value", [("suffix_cache_scope", b"tenant-a"), ("suffix_cache", False)])
def test_the_llmapi_endpoint_refuses_suffix_cache_scopes(name, value):
    import numpy as np

    from trtspec.errors import RequestError
    from trtspec.triton.backend.llmapi_core import LlmapiEndpoint

    core = LlmapiEndpoint.__new__(LlmapiEndpoint)
    with pytest.raises(RequestError, match=f"{name} is not supported by the LLM API endpoints"):
        core.parse({"text_input": np.array([[b"hi"]], dtype=np.object_), name: np.array([[value]])})


def test_orchestrator_layers_suffix_on_the_draft_model(built):
    dep = built("draft")
    orch = _suffix_orchestrator(dep, SuffixSpec(threshold=2), method="draft_target")
    drafter = orch.drafter()
    assert isinstance(drafter, LayeredDrafter) and drafter.sources is orch.sources
    for prompt in PROMPTS:
        (out,) = orch.run([_request(prompt, 32, num_draft_tokens=4)])
        (ref,) = dep.generate([dep.request(dep.encode(prompt), 32)], speculative=False)
        assert out["output_ids"][0, : out["sequence_length"][0, 0]].tolist() == ref.output_ids
    assert orch.sources.drafted.get("model", 0) > 0


def test_suffix_settings_round_trip_through_config_parameters(tmp_path, tiny_ckpts):
    from conftest import write_spec

    from trtspec.spec import load_spec
    from trtspec.triton.repository.writer import plan_repository

    sx = SuffixSpec(max_depth=16, cache_responses=3, threshold=5)
    base = dict(
        mode="speculative",
        method="eagle3",
        default_draft_tokens=4,
        max_input_len=8,
        max_seq_len=16,
        max_draft_len=4,
        vocab_size=10,
        tokenizer_dir="t",
    )
    params = EngineEndpointParams(**base, suffix=sx).to_params()
    assert EngineEndpointParams.from_params(params).suffix == sx
    assert EngineEndpointParams.from_params(EngineEndpointParams(**base).to_params()).suffix is None
    # The repository writer hands the spec's suffix settings to the speculative endpoints only.
    loaded = load_spec(write_spec(tmp_path, tiny_ckpts, None, **{"speculative.method": "suffix"}))
    from trtspec.engines.build import build

    build(loaded, loaded.output_dir())
    plan = plan_repository(loaded, loaded.output_dir())
    suffix_of = {
        name: EngineEndpointParams.from_params(cfg.parameters).suffix
        for name, (cfg, _) in plan.models.items()
        if "tensorrt_llm_model_name" in cfg.parameters
    }
    assert suffix_of and all((v == SuffixSpec()) == ("target_only" not in name) for name, v in suffix_of.items()), suffix_of


def test_prometheus_counts_drafts_per_source_by_delta():
    sink = MemorySink()
    m = EndpointMetrics(sink, "m", "speculative", "m_0", 8)
    counts = SourceCounts()
    m.sources(counts)  # nothing drafted yet: no series
    counts.record("suffix", 6, 5)
    counts.record("model", 4, 1)
    m.sources(counts)
    counts.record("suffix", 2, 2)
    m.sources(counts)
    m.sources(counts)  # unchanged: no double counting
    labels = {"model": "m", "mode": "speculative", "instance": "m_0"}
    assert sink.value("trtspec_source_draft_tokens_total", **labels, source="suffix").value == 8
    assert sink.value("trtspec_source_accepted_tokens_total", **labels, source="suffix").value == 7
    assert sink.value("trtspec_source_draft_tokens_total", **labels, source="model").value == 4
    assert sink.value("trtspec_source_accepted_tokens_total", **labels, source="model").value == 1


# -- a real server ------------------------------------------------------------------------------

grpcclient = pytest.importorskip("tritonclient.grpc", reason="needs the serve extra: pip install 'trtspec[serve]'")


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_ckpts):
    yield from serve_tiny(tmp_path_factory, tiny_ckpts, "suffix", **SUFFIX, **{"build.max_batch_size": 2})


@pytest.mark.server
def test_served_suffix_streams_batches_and_cancels_with_target_only_tokens(served):
    from test_serve import _bls, _ids, _stream
    from test_serve_batching import a_cancelled_stream_leaves
    from test_serve_metrics import scrape, total

    from trtspec.layout import BLS_MODEL

    server, dep = served
    client = grpcclient.InferenceServerClient(server.grpc_endpoint)
    want = {p: dep.generate([dep.request(dep.encode(p), 40)], speculative=False)[0].output_ids for p in PROMPTS}
    # Unary and streamed, three at once on an endpoint of batch 2 (continuous batching).
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        unary = list(pool.map(lambda p: _ids(client.infer(BLS_MODEL, _bls(p, 40))), PROMPTS))
        streamed = list(
            pool.map(
                lambda ip: sum((_ids(r) for r in _stream(server.grpc_endpoint, _bls(ip[1], 40), f"s{ip[0]}")), []),
                enumerate(PROMPTS),
            )
        )
    assert unary == [want[p] for p in PROMPTS]
    assert streamed == [want[p] for p in PROMPTS]
    # A cancelled stream leaves; the next request is still answered exactly.
    a_cancelled_stream_leaves(server.grpc_endpoint, PROMPTS[2])
    assert _ids(client.infer(BLS_MODEL, _bls(PROMPTS[0], 40))) == want[PROMPTS[0]]
    samples = scrape(server.metrics_url)
    assert total(samples, "trtspec_source_draft_tokens_total", source="suffix") > 0
    assert total(samples, "trtspec_source_accepted_tokens_total", source="suffix") > 0
    held = total(samples, "trtspec_suffix_cache_tokens")
    assert 0 < held <= 2 * SuffixSpec().cache_tokens  # the outputs answered so far, within the cap
    assert not [n for n in samples if re.search("source", n) and not n.startswith("trtspec_source_")]


@pytest.mark.server
def test_served_scopes_unary_and_streamed_with_target_only_tokens(served):
    from test_serve import _bls, _ids, _stream, _t

    from trtspec.layout import BLS_MODEL

    server, dep = served
    client = grpcclient.InferenceServerClient(server.grpc_endpoint)
    prompt = PROMPTS[1]
    want = dep.generate([dep.request(dep.encode(prompt), 40)], speculative=False)[0].output_ids
    a = _bls(prompt, 40) + [_t("suffix_cache_scope", b"tenant-a", "BYTES")]
    private = _bls(prompt, 40) + [_t("suffix_cache", False, "BOOL")]
    assert _ids(client.infer(BLS_MODEL, a)) == want
    assert _ids(client.infer(BLS_MODEL, private)) == want
    assert sum((_ids(r) for r in _stream(server.grpc_endpoint, a, "scoped")), []) == want
    bad = _bls(prompt, 40) + [_t("suffix_cache_scope", b"x" * 300, "BYTES")]
    with pytest.raises(Exception, match="suffix_cache_scope is 300 bytes, more than 256"):
        client.infer(BLS_MODEL, bad)


def test_peer_paths_of_a_suffix_spec_run_ours_identical(built):
    from peers import trtspec_paths

    dep = built(None, **{"speculative.method": "suffix", "speculative.max_draft_len": 8})
    paths = {p.key: p for p in trtspec_paths(dep)}
    assert list(paths) == ["ours_target", "ours_suffix", "ours_ngram"]
    ids = dep.encode(PROMPTS[0])
    target, suffix = paths["ours_target"].run(ids, 24), paths["ours_suffix"].run(ids, 24)
    assert suffix.output_ids == target.output_ids and suffix.metrics is not None

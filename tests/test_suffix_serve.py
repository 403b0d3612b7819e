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


def test_only_the_front_names_scopes_and_client_scopes_stay_in_the_direct_callers_tenant():
    import numpy as np

    from trtspec.errors import RequestError
    from trtspec.triton.backend import callers
    from trtspec.triton.backend.orchestrator_core import caller_scopes

    inputs = {"text_input": np.array([[b"hi"], [b"ho"]], dtype=np.object_)}
    scoped = inputs | {"suffix_cache_scope": np.array([[b"acme/bob"], [b""]], dtype=np.object_)}
    assert caller_scopes(scoped, callers.INSIDE, False) is scoped  # the front: as it sent them
    assert "suffix_cache_scope" not in caller_scopes(scoped, callers.ANYONE, False)  # anyone: the shared scope
    assert caller_scopes(inputs, callers.ANYONE, True) is inputs
    # Allowed client scopes go under the direct callers' tenant (""), never a front tenant's.
    kept = caller_scopes(scoped, callers.ANYONE, True)["suffix_cache_scope"]
    assert kept.shape == (2, 1) and kept.reshape(-1).tolist() == [b"/acme/bob", b""]
    with pytest.raises(RequestError, match="suffix_cache_scope is 256 bytes, more than 255"):
        caller_scopes(inputs | {"suffix_cache_scope": np.array([[b"x" * 256]] * 2, dtype=np.object_)}, callers.ANYONE, True)
    with pytest.raises(RequestError, match="the request's trtspec_caller key is not this server's"):
        caller_scopes(inputs, callers.WRONG_KEY, False)


def test_a_direct_callers_client_scope_never_reads_a_front_tenants_responses(built):
    """suffix.client_scopes: a direct caller naming the front tenant's scope drafts from the
    direct callers' share only: 0 drafts from the tenant's cached response."""
    import numpy as np

    from trtspec.triton.backend import callers
    from trtspec.triton.backend.orchestrator_core import caller_scopes

    dep = built(None, **{"speculative.method": "suffix", "speculative.max_draft_len": 8})
    orch = _suffix_orchestrator(dep, SuffixSpec(client_scopes=True))
    prompt = PROMPTS[2]

    def drafted(caller, scope):
        request = _request(prompt, 24, num_draft_tokens=8)
        request["suffix_cache_scope"] = np.array([[scope]], dtype=np.object_)
        (out,) = orch.run([caller_scopes(request, caller, True)])
        return int(out["total_draft_tokens"][0, 0])

    cold = drafted(callers.INSIDE, b"acme")
    assert drafted(callers.INSIDE, b"acme") > cold  # the tenant's response feeds the tenant
    for scope in (b"acme", b"acme/bob", b"/acme"):  # each a new direct scope: cold
        assert drafted(callers.ANYONE, scope) == cold, scope
    assert set(orch.suffix_cache.shares) == {"acme", ""}


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
    from conftest import endpoint_params, write_spec

    from trtspec.spec import load_spec
    from trtspec.triton.repository.writer import plan_repository

    sx = SuffixSpec(max_depth=16, cache_responses=3, threshold=5)
    params = endpoint_params(method="eagle3", suffix=sx).to_params()
    assert EngineEndpointParams.from_params(params).suffix == sx
    assert EngineEndpointParams.from_params(endpoint_params(method="eagle3").to_params()).suffix is None
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


PROBE = "Once upon a time, a small robot walked into the old library and"
KEY_ACME, KEY_UMBRELLA = "sk-acme-0123456789abcdef", "sk-umbrella-fedcba9876543210"


def _front_post(base: str, api_key: str | None, body: dict):
    try:
        import httpx2 as httpx
    except ImportError:
        import httpx
    headers = {} if api_key is None else {"Authorization": f"Bearer {api_key}"}
    return httpx.post(base + "/v1/completions", json=body, headers=headers, timeout=120, trust_env=False)


def _drafted(base: str, model: str, api_key: str, **body) -> tuple[str, int]:
    """The front's answer to PROBE for ``api_key``: (text, draft tokens)."""
    r = _front_post(base, api_key, {"model": model, "prompt": PROBE, "max_tokens": 40} | body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"], r.json()["usage"]["speculative"]["draft_tokens"]


@pytest.fixture
def keyed_front(served, tmp_path):
    """The real front, with two tenants' keys, on the served deployment: its base url."""
    from conftest import serve_app

    from trtspec.openai.app import FrontSettings, create_app
    from trtspec.openai.keys import ApiKeys
    from trtspec.openai.run import caller_key
    from trtspec.openai.triton import TritonText

    server, dep = served
    (tmp_path / "keys.yaml").write_text(f"{KEY_ACME}: acme\n{KEY_UMBRELLA}: umbrella\n")
    keys = ApiKeys.from_file(tmp_path / "keys.yaml")
    key = caller_key(server.grpc_endpoint, keys, scopes=True)  # found through the server's port
    settings = FrontSettings(model=dep.spec.name, max_seq_len=dep.spec.limits("target").max_seq_len, created=0)
    app = create_app(TritonText(server.grpc_endpoint, caller_key=key), dep.tokenizer, settings, keys)
    for port in serve_app(app, log_level="critical"):
        yield f"http://127.0.0.1:{port}"


@pytest.mark.server
def test_a_cross_tenant_probe_gets_no_draft_from_another_tenants_responses(served, keyed_front):
    """The real front (API keys) on the real server. Acme's cached response feeds acme's next
    request; umbrella, whatever user it sends, and a direct Triton caller, whatever scope it
    names, draft exactly as a cold scope does (0 drafts from acme's response); a request
    without a key is 401, a direct caller with a forged caller key is refused. Runs first on
    the server, so the direct callers' shared scope holds nothing yet."""
    from test_serve import _t

    from trtspec.layout import BLS_MODEL
    from trtspec.triton.backend import callers

    server, dep = served
    model = dep.spec.name
    text, cold = _drafted(keyed_front, model, KEY_ACME)  # acme's first: nothing cached in its scope yet
    own = _drafted(keyed_front, model, KEY_ACME)
    assert own[0] == text and own[1] > cold  # acme's cached response feeds acme
    for user in (None, "acme", "../acme", "acme/", "/acme"):  # each a new scope of umbrella
        probe = _drafted(keyed_front, model, KEY_UMBRELLA, **({} if user is None else {"user": user}))
        assert probe == (text, cold), user  # a cold scope's count: nothing from acme's response
    # A direct caller naming acme's scope, without the caller key: its scope is dropped, so it
    # drafts in the direct callers' scope (empty yet) exactly as a cold scope does.
    client = grpcclient.InferenceServerClient(server.grpc_endpoint)
    direct = [
        _t("text_input", PROBE.encode(), "BYTES"),
        _t("max_tokens", 40, "INT32"),
        _t("exclude_input_in_output", True, "BOOL"),
        _t("return_perf_metrics", True, "BOOL"),
    ]
    result = client.infer(BLS_MODEL, direct + [_t("suffix_cache_scope", b"acme", "BYTES")])
    assert int(result.as_numpy("total_draft_tokens")[0, 0]) == cold
    with pytest.raises(Exception, match="the request's trtspec_caller key is not this server's"):
        client.infer(BLS_MODEL, direct, parameters={callers.CALLER_PARAMETER: "forged"})
    r = _front_post(keyed_front, None, {"model": model, "prompt": PROBE})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


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
    from trtspec.triton.backend import callers

    server, dep = served
    client = grpcclient.InferenceServerClient(server.grpc_endpoint)
    prompt = PROMPTS[1]
    want = dep.generate([dep.request(dep.encode(prompt), 40)], speculative=False)[0].output_ids
    a = _bls(prompt, 40) + [_t("suffix_cache_scope", b"tenant-a", "BYTES")]
    private = _bls(prompt, 40) + [_t("suffix_cache", False, "BOOL")]
    assert _ids(client.infer(BLS_MODEL, a)) == want
    assert _ids(client.infer(BLS_MODEL, private)) == want
    assert sum((_ids(r) for r in _stream(server.grpc_endpoint, a, "scoped")), []) == want
    # A direct caller's scope is dropped (it is in the direct callers' scope), checked or not;
    # the front's (the server's caller key) is checked.
    bad = _bls(prompt, 40) + [_t("suffix_cache_scope", b"x" * 300, "BYTES")]
    assert _ids(client.infer(BLS_MODEL, bad)) == want
    front = {callers.CALLER_PARAMETER: callers.key_path(server.pid).read_text().strip()}
    with pytest.raises(Exception, match="suffix_cache_scope is 300 bytes, more than 256"):
        client.infer(BLS_MODEL, bad, parameters=front)

"""Prometheus metrics of the text endpoints (triton/backend/metrics.py).

The core is checked without Triton (MemorySink) against the counts the loop itself keeps;
then a real tritonserver on 127.0.0.1 serves tiny engines, and its /metrics page must add up
to exactly the perf metrics its responses reported.
"""

from __future__ import annotations

import re
import urllib.request
from collections import defaultdict
from collections.abc import Sequence

import numpy as np
import pytest
from test_loop import NoisyDrafter, OracleVerifier, PerfectDrafter
from test_triton_cores import PROMPTS, _orchestrator, _request

from trtspec.speculative.loop import GenerationRequest, NoDrafter, Verdict, Verifier, accepted_prefix, generate
from trtspec.speculative.metrics import SpecMetrics, metrics_from_json
from trtspec.triton.backend.metrics import (
    EndpointMetrics,
    MemorySink,
    StepCounts,
    TritonSink,
    acceptance_buckets,
)


class MeteredVerifier:
    """A verifier that reports each step to ``metrics``: the loop calls verify() exactly
    once per step, with every active sequence's context and draft (greedy requests: the
    accepted count is the loop's own rule, loop.accepted_prefix)."""

    def __init__(self, inner: Verifier, metrics: EndpointMetrics, k: int):
        self.inner = inner
        self.metrics = metrics
        self.k = k  # the draft length the batch's requests ask for

    def verify(self, contexts: Sequence[list[int]], drafts: Sequence[list[int]], **asks) -> list[Verdict]:
        verdicts = self.inner.verify(contexts, drafts, **asks)  # want_logits, context_phase: as the loop asked
        each, extra = [], 0
        for d, v in zip(drafts, verdicts):
            n = accepted_prefix(d, v)
            if d:
                each.append(n)
            if v.continued:  # the loop keeps these tokens, one target decode step each
                extra += len(v.target_ids) - (n + 1)
        drafted = sum(len(d) for d in drafts)
        self.metrics.step(StepCounts(len(contexts), drafted, sum(each), each, self.k if drafted else 0, extra))
        return verdicts

    def __getattr__(self, name: str):  # whatever else the loop reads from the verifier
        return getattr(self.inner, name)


LABELS = {"model": "m", "mode": "speculative", "instance": "m_0"}


def _metrics(max_draft_len=4):
    sink = MemorySink()
    return sink, EndpointMetrics(sink, "m", "speculative", "m_0", max_draft_len)


def _v(sink, name, **extra):
    return sink.value("trtspec_" + name, **LABELS, **extra)


def _as_histogram(spec: SpecMetrics) -> list[float]:
    """The acceptance lengths SpecMetrics' histogram stands for, sorted."""
    return sorted(float(n + 1) for n, count in enumerate(spec.histogram) for _ in range(count))


def test_a_step_adds_its_counts_and_sets_the_gauges():
    sink, m = _metrics()
    m.step(StepCounts(sequences=3, drafted=8, accepted=5, accepted_each=[4, 1], draft_len=4))
    m.step(StepCounts(sequences=1, drafted=4, accepted=0, accepted_each=[0], draft_len=4))
    assert _v(sink, "draft_tokens_total").value == 12
    assert _v(sink, "accepted_draft_tokens_total").value == 5
    # 5 and 2 from the drafting sequences, 1 from the one that did not draft, then 1.
    assert sorted(_v(sink, "acceptance_length").observations) == [1, 1, 2, 5]
    assert _v(sink, "active_sequences").value == 1
    assert _v(sink, "draft_length").value == 4
    m.load(active=0, queued=2)
    assert (_v(sink, "active_sequences").value, _v(sink, "queue_depth").value) == (0, 2)


def test_finished_counts_by_reason_and_unknown_reasons_as_error():
    sink, m = _metrics()
    for reason, tokens in [("eos", 3), ("eos", 4), ("length", 9), ("stop", 2), (None, 0), ("weird", 1)]:
        m.finished(reason, tokens)
    counts = {r: _v(sink, "requests_finished_total", reason=r).value for r in ("length", "eos", "stop", "error")}
    assert counts == {"length": 1, "eos": 2, "stop": 1, "error": 2}
    assert _v(sink, "output_tokens_total").value == 19


def test_buckets_cover_every_possible_step_length():
    assert acceptance_buckets(3) == [1.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize("make_drafter", [PerfectDrafter, lambda: NoisyDrafter(0.6, seed=3), NoDrafter])
def test_metered_loop_reports_exactly_the_loops_own_counts(make_drafter):
    sink, m = _metrics(max_draft_len=5)
    reqs = [GenerationRequest([1, 2, 3 + i], 30 + 7 * i, 5) for i in range(3)]
    plain = generate(reqs, make_drafter(), OracleVerifier())
    results = generate(reqs, make_drafter(), MeteredVerifier(OracleVerifier(), m, k=5))
    assert [r.output_ids for r in results] == [r.output_ids for r in plain]  # metering changes nothing
    total = SpecMetrics()
    for r in results:
        total = total.merge(r.metrics)
    assert _v(sink, "draft_tokens_total").value == total.drafted
    assert _v(sink, "accepted_draft_tokens_total").value == total.accepted
    assert sorted(_v(sink, "acceptance_length").observations) == _as_histogram(total)
    assert sum(_v(sink, "acceptance_length").observations) == total.tokens


def test_a_continued_verdict_counts_its_extra_forwards_like_the_loop():
    class Continuing:  # the target kept decoding after a rejection (TensorRT-LLM external drafts)
        def verify(self, contexts, drafts, context_phase=None):
            return [Verdict([9, 9, 9, 9], continued=True) for _ in contexts]

    sink, m = _metrics()
    (res,) = generate([GenerationRequest([1], 4, 2)], PerfectDrafter(), MeteredVerifier(Continuing(), m, k=2))
    assert sorted(_v(sink, "acceptance_length").observations) == _as_histogram(res.metrics)


class _FakePb:
    """The parts of triton_python_backend_utils TritonSink calls, recording the calls."""

    class MetricFamily:
        COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
        made: list = []

        def __init__(self, name, description, kind):
            self.name, self.kind = name, kind
            _FakePb.MetricFamily.made.append(self)

        def Metric(self, labels, buckets=None):  # noqa: N802 (upstream's name)
            if (self.kind == "histogram") != (buckets is not None):
                raise ValueError("buckets go with histograms only, as in the stub")
            return (self.name, tuple(sorted(labels.items())), buckets)


def test_triton_sink_makes_one_family_per_name_and_buckets_only_for_histograms():
    _FakePb.MetricFamily.made = []
    sink = TritonSink(_FakePb)
    EndpointMetrics(sink, "m", "speculative", "m_0", 2)
    names = [f.name for f in _FakePb.MetricFamily.made]
    assert len(names) == len(set(names)) == 9
    assert {f.kind for f in _FakePb.MetricFamily.made if f.name == "trtspec_acceptance_length"} == {"histogram"}
    assert len(sink.metrics) == 13  # 5 finish reasons share one family
    sink.close()
    assert not sink.metrics and not sink.families


def test_orchestrator_core_reports_what_its_responses_report(built):
    dep = built()
    orch = _orchestrator(dep)
    sink = MemorySink()
    orch.metrics = EndpointMetrics(sink, "m", "speculative", "m_0", dep.spec.speculative.max_draft_len)
    outs = orch.run([_request(p, num_draft_tokens=3) for p in PROMPTS])
    total = SpecMetrics()
    for out in outs:
        total = total.merge(metrics_from_json(out["perf_metrics_json"][0, 0].decode()))
    assert _v(sink, "draft_tokens_total").value == total.drafted == sum(int(o["total_draft_tokens"][0, 0]) for o in outs)
    assert _v(sink, "accepted_draft_tokens_total").value == total.accepted
    assert sorted(_v(sink, "acceptance_length").observations) == _as_histogram(total)
    assert _v(sink, "output_tokens_total").value == sum(int(o["sequence_length"][0, 0]) for o in outs)
    reasons = defaultdict(int)
    for o in outs:
        reasons[o["finish_reason"][0, 0].decode()] += 1
    for reason in ("length", "eos", "stop", "error"):
        assert _v(sink, "requests_finished_total", reason=reason).value == reasons[reason]
    assert (_v(sink, "active_sequences").value, _v(sink, "draft_length").value) == (0, 3)


# -- a real server ------------------------------------------------------------------------------

from conftest import processes_mentioning, write_spec  # noqa: E402

from trtspec.errors import ServerError  # noqa: E402
from trtspec.layout import BLS_MODEL, BLS_STREAMING_MODEL, CONTROL_MODEL  # noqa: E402

SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$")


def scrape(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text format -> name: [(labels, value)], only trtspec_ samples."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    for line in text.splitlines():
        match = SAMPLE.match(line)
        if match and match["name"].startswith("trtspec_"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', match["labels"] or ""))
            out[match["name"]].append((labels, float(match["value"])))
    return out


def total(samples, name: str, **labels: str) -> float:
    """The sum over instances (and any label not given) of ``name``'s samples."""
    return sum(v for lab, v in samples.get(name, []) if all(lab.get(k) == w for k, w in labels.items()))


@pytest.fixture(scope="module")
def metrics_server(tmp_path_factory, tiny_ckpts):
    from trtspec.engines.build import build
    from trtspec.spec import load_spec
    from trtspec.triton.repository.writer import write_repository
    from trtspec.triton.server.install import find_tritonserver
    from trtspec.triton.server.process import TritonServer

    pytest.importorskip("tritonclient.grpc", reason="needs the serve extra: pip install 'trtspec[serve]'")
    try:
        find_tritonserver()
    except ServerError as err:
        pytest.skip(str(err))
    folder = tmp_path_factory.mktemp("metrics")
    loaded = load_spec(write_spec(folder, tiny_ckpts))
    build(loaded, loaded.output_dir())
    repo = write_repository(loaded, loaded.output_dir(), folder / "repo")
    server = TritonServer.for_repository(repo, cache_root=tmp_path_factory.mktemp("backend-cache"))
    server.start(folder / "server.log")
    server.wait_ready(timeout=300)
    yield server
    server.stop()
    assert processes_mentioning(str(repo)) == [], "tritonserver or stub processes survived stop()"


def _grpc_inputs(request: dict[str, np.ndarray]):
    import tritonclient.grpc as grpcclient

    tensors = []
    for name, arr in request.items():
        if arr.dtype == np.int64:  # _request's extras come as int64; the contract says INT32
            arr = arr.astype(np.int32)
        dtype = "BYTES" if arr.dtype == np.object_ else {"int32": "INT32", "int64": "INT64", "bool": "BOOL"}[str(arr.dtype)]
        t = grpcclient.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        tensors.append(t)
    return tensors


def test_metrics_port_listens_on_loopback_only(metrics_server):
    assert f"--metrics-address={metrics_server.host}" in metrics_server.argv()
    # 0100007F = 127.0.0.1 in /proc/net/tcp's little-endian hex: nothing listens on 0.0.0.0.
    from trtspec.triton.backend.callers import listening_sockets

    assert {address for address, _ in listening_sockets(metrics_server.command.metrics_port)} == {"0100007F"}


def test_served_metrics_add_up_to_the_responses_perf_metrics(metrics_server):
    url = metrics_server.metrics_url
    before = scrape(url)
    for model in (BLS_MODEL, CONTROL_MODEL):  # families exist from load, at zero
        assert total(before, "trtspec_draft_tokens_total", model=model) == 0
        assert total(before, "trtspec_active_sequences", model=model) == 0
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(metrics_server.grpc_endpoint)
    spec_outs, control_outs = [], []
    for k, prompt in zip((2, 3, 4), PROMPTS):
        res = client.infer(BLS_MODEL, _grpc_inputs(_request(prompt, num_draft_tokens=k)))
        spec_outs.append({n: res.as_numpy(n) for n in ("perf_metrics_json", "sequence_length", "finish_reason")})
    for prompt in PROMPTS[:2]:
        res = client.infer(CONTROL_MODEL, _grpc_inputs(_request(prompt)))
        control_outs.append({n: res.as_numpy(n) for n in ("sequence_length", "finish_reason")})
    after = scrape(url)

    spec = SpecMetrics()
    for out in spec_outs:
        spec = spec.merge(metrics_from_json(out["perf_metrics_json"][0, 0].decode()))
    assert spec.drafted > 0
    m = {"model": BLS_MODEL}
    assert total(after, "trtspec_draft_tokens_total", **m) == spec.drafted
    assert total(after, "trtspec_accepted_draft_tokens_total", **m) == spec.accepted
    assert total(after, "trtspec_acceptance_length_count", **m) == spec.target_forwards
    assert total(after, "trtspec_acceptance_length_sum", **m) == spec.tokens
    buckets = {float(lab["le"]): v for lab, v in after["trtspec_acceptance_length_bucket"] if lab["model"] == BLS_MODEL}
    for le in acceptance_buckets(8):  # cumulative counts against the responses' histogram
        assert buckets[le] == sum(c for n, c in enumerate(spec.histogram) if n + 1 <= le), le
    assert buckets[float("inf")] == spec.target_forwards
    assert total(after, "trtspec_output_tokens_total", **m) == sum(int(o["sequence_length"][0, 0]) for o in spec_outs)
    assert total(after, "trtspec_active_sequences", **m) == 0
    assert total(after, "trtspec_queue_depth", **m) == 0
    assert total(after, "trtspec_draft_length", **m) == 4  # the last step asked for k = 4
    for model, outs in ((BLS_MODEL, spec_outs), (CONTROL_MODEL, control_outs)):
        reasons = defaultdict(int)
        for o in outs:
            reasons[o["finish_reason"][0, 0].decode()] += 1
        for reason in ("length", "eos", "stop", "error"):
            assert total(after, "trtspec_requests_finished_total", model=model, reason=reason) == reasons[reason]
    # The control drafts nothing; the streaming endpoint saw no request.
    assert total(after, "trtspec_draft_tokens_total", model=CONTROL_MODEL) == 0
    assert total(after, "trtspec_output_tokens_total", model=CONTROL_MODEL) == sum(
        int(o["sequence_length"][0, 0]) for o in control_outs
    )
    assert total(after, "trtspec_requests_finished_total", model=BLS_STREAMING_MODEL) == 0
    modes = {lab["mode"] for lab, _ in after["trtspec_draft_tokens_total"] if lab["model"] == CONTROL_MODEL}
    assert modes == {"target_only"}

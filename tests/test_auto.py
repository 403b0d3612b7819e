"""Method auto and adaptive k: the spec's settings, the one loop's choices (lossless, per
request, within a request, off and back), and where they reach (runtime, Triton, bench,
verify, Prometheus; exports: test_auto_exports.py)."""

from __future__ import annotations

import pytest
import yaml

from trtspec.errors import SpecError
from trtspec.spec import load_spec

BASE = {
    "name": "t",
    "target": {"path": "/tmp/x", "dtype": "float32"},
    "draft": {"path": "/tmp/x", "dtype": "bfloat16"},
}
AUTO = {"method": "auto", "auto": {"methods": ["draft_target", "suffix", "ngram"]}}


def _load(tmp_path, speculative: dict, draft: bool = True, **top):
    data = yaml.safe_load(yaml.safe_dump(BASE)) | {"speculative": speculative} | top
    if not draft:
        data.pop("draft")
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(data))
    return load_spec(p).spec


def _error(tmp_path, speculative: dict, draft: bool = True, **top) -> str:
    with pytest.raises(SpecError) as e:
        _load(tmp_path, speculative, draft, **top)
    assert e.value.exit_code == 2
    return str(e.value)


# ---------------------------------------------------------------- spec


def test_auto_lists_its_drafters_and_adapts(tmp_path):
    s = _load(tmp_path, AUTO).speculative
    assert s.methods == ("draft_target", "suffix", "ngram") and s.model_draft == "draft_target"
    assert s.adapts and s.suffix_drafting is not None
    free = _load(tmp_path, {"method": "auto", "auto": {"methods": ["ngram"]}}, draft=False).speculative
    assert free.model_draft is None and free.suffix_drafting is None
    one = _load(tmp_path, {"method": "ngram", "adaptive": True}, draft=False).speculative
    assert one.methods == ("ngram",) and one.adapts
    assert not _load(tmp_path, {"method": "ngram"}, draft=False).speculative.adapts


@pytest.mark.parametrize(
    "speculative, draft, expected",
    [
        ({"method": "auto"}, True, "method auto needs `auto: {methods: [draft_target, suffix, ngram]}`"),
        ({"method": "ngram", "auto": {"methods": ["ngram"]}}, False, "auto: applies to method auto; remove auto"),
        ({"method": "auto", "auto": {"methods": ["medusa"]}}, True, "auto.methods.0: Input should be"),
        ({"method": "auto", "auto": {"methods": ["auto"]}}, True, "auto.methods.0: Input should be"),
        ({"method": "auto", "auto": {"methods": []}}, True, "auto.methods"),
        ({"method": "auto", "auto": {"methods": ["ngram", "ngram"]}}, False, "lists a method twice"),
        ({"method": "auto", "auto": {"methods": ["draft_target", "eagle3"]}}, True, "both draft with the spec's one `draft`"),
        (AUTO, False, "auto.methods lists draft_target, which drafts with a `draft` model; add draft or remove"),
        ({"method": "auto", "auto": {"methods": ["suffix", "ngram"]}}, True, "use no draft model; remove `draft`"),
        (AUTO | {"tree": {"dynamic": {"top_k": 2, "nodes": 4}}}, True, "tree: method auto drafts one continuation"),
        (
            {"method": "draft_target", "adaptive": True, "tree": {"dynamic": {"top_k": 2, "nodes": 4}}},
            True,
            "remove tree or adaptive",
        ),
        ({"method": "auto", "auto": {"methods": ["ngram"]}, "suffix": {}}, False, "auto.methods lists no suffix"),
        (AUTO | {"suffix": {"threshold": 3}}, True, "remove threshold"),
    ],
)
def test_auto_settings_are_refused_by_name(tmp_path, speculative, draft, expected):
    assert expected in _error(tmp_path, speculative, draft)


def test_trtllm_engine_runtime_refuses_adaptive_and_auto(tmp_path):
    trt = {"backend": "trtllm", "trtllm": {"runtime": "engine", "line": "1.2"}}
    assert "speculative.adaptive: trtllm.runtime engine drafts the k a request sends" in _error(
        tmp_path, {"method": "draft_target", "adaptive": True}, **trt
    )
    assert "speculative.method auto: trtllm.runtime engine builds draft_target" in _error(tmp_path, AUTO, **trt)


# ---------------------------------------------------------------- the one loop

from test_loop import OracleVerifier, oracle, reference  # noqa: E402

from trtspec.speculative.adaptive import AdaptivePolicy, AdaptiveSettings, parse_choice_key  # noqa: E402
from trtspec.speculative.capabilities import Drafter  # noqa: E402
from trtspec.speculative.drafters import NgramDrafter  # noqa: E402
from trtspec.speculative.loop import Batch, GenerationRequest, Menu, NoDrafter, Verdict, generate  # noqa: E402


class Clock:
    """Virtual seconds: the fake engines below advance it by what their calls would cost."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


CYCLE = [5, 6, 7, 8, 9, 10]


def switching(ctx: list[int], prompt_len: int = 3, repeats: int = 36) -> int:
    """A target whose first ``repeats`` output tokens cycle (predictable: n-gram drafts them),
    then free text (the oracle's hash)."""
    out = len(ctx) - prompt_len
    return CYCLE[out % len(CYCLE)] if out < repeats else oracle(ctx)


class TimedVerifier(OracleVerifier):
    """The oracle (or ``target``) as the target, costing base + per_token x tokens scored."""

    def __init__(self, clock: Clock, target=oracle, base=0.030, per_token=0.0005):
        super().__init__()
        self.clock, self.target, self.base, self.per_token = clock, target, base, per_token

    def verify(self, contexts, drafts, **asks):
        self.clock.now += self.base + self.per_token * sum(len(d) + 1 for d in drafts)
        out = []
        for ctx, d in zip(contexts, drafts):
            seq, ids = list(ctx), []
            for tok in list(d) + [None]:
                ids.append(self.target(seq))
                if tok is None or tok != ids[-1]:
                    break
                seq.append(tok)
            out.append(Verdict(ids, [1.0] * len(ids)))
        return out


class ModelDraft(Drafter):
    """A model draft that agrees with ``target`` except every ``miss``-th token, costing
    ``step`` seconds per draft step."""

    def __init__(self, clock: Clock, target=oracle, miss: int = 3, step: float = 0.003):
        self.clock, self.target, self.miss, self.step = clock, target, miss, step

    def propose(self, contexts, ks):
        self.clock.now += self.step * max(ks, default=0)
        out = []
        for ctx, k in zip(contexts, ks):
            seq, d = list(ctx), []
            for _ in range(k):
                t = self.target(seq)
                d.append(t if len(seq) % self.miss else (t + 1) % 50)
                seq.append(d[-1])
            out.append(d)
        return out


def menu(clock: Clock, drafters: dict, probe_every: int = 16, max_draft_len: int = 5) -> Menu:
    free = frozenset(n for n in drafters if n in ("ngram", "suffix"))
    return Menu(drafters, AdaptivePolicy(AdaptiveSettings(tuple(drafters), free, max_draft_len, probe_every), clock))


class Recording(Menu):
    """A Menu whose policy's choices are kept in order (per request key)."""

    def __init__(self, inner: Menu):
        super().__init__(inner.drafters, inner.policy)
        self.seen: list[tuple[str, int]] = []
        choose = self.policy.choose

        def spy(state, offers, ceiling, active):
            c = choose(state, offers, ceiling, active)
            self.seen.append((c.drafter, c.k))
            return c

        self.policy.choose = spy


def test_auto_output_is_target_greedy_and_its_choices_are_counted():
    clock = Clock()
    m = menu(clock, {"draft_target": ModelDraft(clock), "ngram": NgramDrafter()})
    reqs = [GenerationRequest([1, 2, 3 + i], 40, 5) for i in range(3)]
    results = generate(reqs, m, TimedVerifier(clock))
    for i, res in enumerate(results):
        assert res.output_ids == reference(40, (1, 2, 3 + i))
        assert sum(res.metrics.choices.values()) == res.metrics.target_forwards - 1  # every step but the prefill's
        assert res.metrics.drafted > 0
    assert m.policy.deployment["draft_target"].tried > 0 and m.policy.costs.draft_cost("draft_target") > 0


def test_the_choice_changes_within_a_request_as_its_text_does():
    """Repetitive then free text in ONE request: n-gram (free) while the text repeats, the
    model draft once it does not; the output is the target's greedy output throughout."""
    clock = Clock()
    m = Recording(menu(clock, {"draft_target": ModelDraft(clock, switching), "ngram": NgramDrafter()}))
    (res,) = generate([GenerationRequest([1, 2, 3], 90, 5)], m, TimedVerifier(clock, switching))
    assert res.output_ids == reference(90, target=switching)
    names = [d for d, _ in m.seen]
    early, late = names[2:8], names[-8:]
    assert early.count("ngram") >= 5, m.seen
    assert late.count("draft_target") >= 6, m.seen


def test_speculation_turns_off_where_it_loses_and_comes_back():
    """Adaptive n-gram on a compute-bound target: free text rejects every draft, so it turns
    off; its offers are still checked against each step's token (no probe step is spent on
    them), so when the text repeats again it drafts again."""
    clock = Clock()
    phases = lambda ctx: oracle(ctx) if len(ctx) - 3 < 60 else CYCLE[(len(ctx) - 3) % len(CYCLE)]  # noqa: E731

    class Wrong(NgramDrafter):  # before token 60 its drafts are always wrong
        def propose(self, contexts, ks):
            out = super().propose(contexts, ks)
            return [d if len(c) - 3 >= 60 else [(t + 1) % 50 for t in d] or [0] * k for c, d, k in zip(contexts, out, ks)]

    m = Recording(menu(clock, {"ngram": Wrong()}, probe_every=4))
    (res,) = generate([GenerationRequest([1, 2, 3], 120, 5)], m, TimedVerifier(clock, phases, base=0.010, per_token=0.004))
    assert res.output_ids == reference(120, target=phases)
    ks = [k for _, k in m.seen]
    off = [i for i, k in enumerate(ks) if k == 0]
    assert len(off) >= 10  # it turned off ...
    assert all(k == 0 for k in ks[off[0] : off[-1]])  # ... measured its offers without a probe step ...
    assert max(ks[off[-1] + 1 :]) >= 3  # ... and came back once the text repeated
    assert res.metrics.choices.get("off:0", 0) == len(off)


def test_free_offers_the_step_did_not_send_are_measured_and_never_probed():
    """Free text with a good model draft: the n-gram's offers are checked against each step's
    tokens without being sent, so it is measured on every step (its acceptance is known and
    poor) and never takes a step from the model as a probe; the output stays the target's."""
    clock = Clock()
    m = Recording(menu(clock, {"draft_target": ModelDraft(clock, miss=50), "ngram": NgramDrafter()}, probe_every=4))
    (res,) = generate([GenerationRequest([1, 2, 3], 80, 5)], m, TimedVerifier(clock))
    assert res.output_ids == reference(80)
    assert all(d == "draft_target" for d, _ in m.seen), m.seen
    assert m.policy.deployment["ngram"].tried >= 3  # measured, though never sent
    assert m.policy.acceptance(m.policy.new_request(), "ngram") < 0.5


def test_target_only_and_auto_agree_on_a_batch_that_grows_and_shrinks():
    clock = Clock()
    m = menu(clock, {"draft_target": ModelDraft(clock), "ngram": NgramDrafter()})
    batch, plain = Batch(m, TimedVerifier(clock)), Batch(NoDrafter(), OracleVerifier())
    for b in (batch, plain):
        keys = [b.add(GenerationRequest([1, 2, 3 + i], 20 + 7 * i, 5)) for i in range(2)]
        b.step()
        keys.append(b.add(GenerationRequest([4, 5, 6], 25, 5)))
        while b.active:
            b.step()
        b.out = [b.pop(k).output_ids for k in keys]
    assert batch.out == plain.out
    assert not batch.states  # no request's state outlives it


def test_a_lone_model_draft_among_eight_rows_waits_for_a_call_that_runs_anyway():
    """One request of 8 has a good model draft, the 7 others' drafts are always rejected. A
    draft call costs the same over 1 row or 8, and all 8 wait for it: the good row drafts only
    in a step whose call runs anyway (the others' re-probes), never alone; once the 7 finish,
    it drafts on every step. Outputs stay the target's."""

    class OnlyFirst(ModelDraft):  # request 0's prompt is [1, 2, 3]
        def propose(self, contexts, ks):
            out = super().propose(contexts, ks)
            return [d if c[2] == 3 else [(t + 1) % 50 for t in d] for c, d in zip(contexts, out)]

    clock = Clock()
    m = menu(clock, {"draft_target": OnlyFirst(clock, miss=10, step=0.020)}, probe_every=4)
    batch = Batch(m, TimedVerifier(clock, base=0.030, per_token=0.000511))
    keys = [batch.add(GenerationRequest([1, 2, 3 + i], 90 if i == 0 else 40, 5)) for i in range(8)]
    steps = []  # per step: (sequences, the k chosen for each row that chose)
    while batch.active:
        n = len(batch.active)
        steps.append((n, [parse_choice_key(c)[1] for c in batch.step().chosen]))
    loaded = [ks for n, ks in steps[3:] if n == 8 and len(ks) == 8]  # once the costs are measured
    assert len(loaded) >= 20 and any(ks[0] == 0 for ks in loaded)
    assert all(any(ks[1:]) for ks in loaded if ks[0])  # never a call for row 0 alone
    alone = [ks[0] for n, ks in steps if n == 1]
    assert alone[:4].count(0) < 4 and all(alone[4:-1])
    outs = [batch.pop(k).output_ids for k in keys]
    assert outs == [reference(90 if i == 0 else 40, (1, 2, 3 + i)) for i in range(8)]


# ---------------------------------------------------------------- in process, tiny engines


def _deployment(tmp_path_factory, ckpts, draft, **overrides):
    """A tiny deployment built and loaded in process (conftest's ``built`` keys its cache by
    hashable overrides; auto's list is not)."""
    from conftest import write_spec

    from trtspec.engines.build import build
    from trtspec.runtime import Deployment

    loaded = load_spec(write_spec(tmp_path_factory.mktemp("auto"), ckpts, draft, **overrides))
    build(loaded, loaded.output_dir())
    return Deployment(loaded, loaded.output_dir())


PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Triton serves models over HTTP and gRPC. Triton serves"]
AUTO_TINY = {"speculative.method": "auto", "speculative.auto": {"methods": ["draft_target", "suffix", "ngram"]}}
AUTO_TINY_FLAT = {"speculative.method": "auto", "speculative.auto.methods": ["draft_target", "suffix", "ngram"]}


@pytest.mark.parametrize(
    "draft, overrides",
    [
        ("draft", AUTO_TINY),
        ("draft", {"speculative.adaptive": True}),
        (None, {"speculative.method": "ngram", "speculative.adaptive": True}),
        (None, {"speculative.method": "auto", "speculative.auto": {"methods": ["suffix", "ngram"]}}),
    ],
    ids=["auto", "adaptive-draft_target", "adaptive-ngram", "auto-free"],
)
def test_auto_and_adaptive_are_token_identical_on_tiny_engines(tmp_path_factory, tiny_ckpts, draft, overrides):
    from trtspec.speculative.loop import Menu

    dep = _deployment(tmp_path_factory, tiny_ckpts, draft, **overrides)
    assert isinstance(dep.drafter(), Menu)
    reqs = [dep.request(dep.encode(p), 40) for p in PROMPTS]
    target = dep.generate(reqs, speculative=False)
    spec = dep.generate(reqs, speculative=True)
    for t, s in zip(target, spec):
        assert s.output_ids == t.output_ids
        assert s.metrics.choices and sum(s.metrics.choices.values()) <= s.metrics.target_forwards - 1
    assert dep.adaptive.costs.samples  # the target's forwards were timed


# ---------------------------------------------------------------- the Triton orchestrator


def test_triton_orchestrator_chooses_per_request_streams_batches_and_counts(built):
    """The orchestrator runs the same loop: auto over the two engine models, several prompts
    batched and one streamed, token-identical to target-only in process; its Prometheus
    counters hold exactly the choices the responses report."""
    from test_triton_cores import _call, _cores, _request, settings_for

    from trtspec.spec import SuffixSpec
    from trtspec.speculative.metrics import SpecMetrics, metrics_from_json
    from trtspec.triton.backend.metrics import EndpointMetrics, MemorySink
    from trtspec.triton.backend.orchestrator_core import Orchestrator

    dep = built()
    settings = settings_for(dep, decoupled=True, adaptive_methods=("draft_target", "suffix", "ngram"), suffix=SuffixSpec())
    orch = Orchestrator(settings, _call(_cores(dep)), dep.tokenizer, dep.end_ids)
    sink = MemorySink()
    orch.metrics = EndpointMetrics(sink, "m", "speculative", "m_0", dep.spec.speculative.max_draft_len)
    assert orch.adaptive is not None
    outs = orch.run([_request(p, 32) for p in PROMPTS])
    sent = []
    assert orch.run([_request(PROMPTS[1], 32, stream=True)], lambda i, t, final: sent.append(t)) == [None]
    target = dep.generate([dep.request(dep.encode(p, True), 32) for p in PROMPTS], speculative=False)
    for out, ref in zip(outs, target):
        assert out["output_ids"][0, : int(out["sequence_length"][0, 0])].tolist() == ref.output_ids
    assert [tok for t in sent for tok in t["output_ids"][0].tolist()] == target[1].output_ids
    total = SpecMetrics()
    for m in [metrics_from_json(o["perf_metrics_json"][0, 0].decode()) for o in outs] + [
        metrics_from_json(sent[-1]["perf_metrics_json"][0, 0].decode())
    ]:
        total = total.merge(m)
    assert total.choices
    by_drafter: dict[str, int] = {}
    for key, n in total.choices.items():
        by_drafter[key.rpartition(":")[0]] = by_drafter.get(key.rpartition(":")[0], 0) + n
    for drafter, n in by_drafter.items():
        assert (
            sink.value("trtspec_chosen_drafter_total", model="m", mode="speculative", instance="m_0", drafter=drafter).value == n
        )
    ks = sorted(int(key.rpartition(":")[2]) for key, n in total.choices.items() for _ in range(n))
    assert sorted(sink.value("trtspec_chosen_draft_length", model="m", mode="speculative", instance="m_0").observations) == ks


def test_endpoint_params_carry_the_adaptive_methods(tmp_path):
    from conftest import endpoint_params

    from trtspec.triton.backend.params import EngineEndpointParams, load_aware

    spec = _load(tmp_path, AUTO).speculative
    params = endpoint_params(method="auto", **load_aware(spec))
    back = EngineEndpointParams.from_params(params.to_params())
    settings = back.settings(decoupled=False, max_batch_size=2)
    assert settings.adaptive_methods == ("draft_target", "suffix", "ngram") and settings.probe_every == 16
    assert settings.adaptive_policy().settings.free == frozenset({"suffix", "ngram"})
    fixed = _load(tmp_path, {"method": "ngram"}, draft=False).speculative
    assert "adaptive_methods" not in load_aware(fixed)


# ---------------------------------------------------------------- bench and verify


def test_bench_compares_auto_with_the_fixed_methods_and_reports_its_choices_per_request(built):
    from trtspec.bench.methods import compare_methods, method_set, methods_table

    dep = built()
    ms = method_set(dep, ["draft_target", "ngram", "suffix", "auto"], 4)
    assert "auto k<=4" in ms.drafters
    reqs = [dep.request(dep.encode(p), 24) for p in PROMPTS]
    rows = methods_table(compare_methods(dep.verifier(), ms.drafters, reqs, ms.forget))
    auto = next(r for r in rows if r["method"] == "auto k<=4")
    assert all(r["identical_to_target_only"] for r in rows)
    assert len(auto["choices_per_request"]) == len(PROMPTS)
    assert sum(auto["choices"].values()) == sum(sum(c.values()) for c in auto["choices_per_request"])
    assert {key.rpartition(":")[0] for key in auto["choices"]} <= {"draft_target", "suffix", "ngram", "off"}


def test_verify_passes_with_auto_greedy_and_sampled(tmp_path_factory, tiny_ckpts, tmp_path):
    """`trtspec verify` on an auto spec: greedy outputs identical, and --sampling's chi-square
    test p >= 0.01 with the drafter chosen per step (the accept rule is the standard one)."""
    import json

    from conftest import built_spec
    from typer.testing import CliRunner

    from trtspec.cli.app import app

    spec = built_spec(tmp_path_factory, tiny_ckpts, "auto-verify", **AUTO_TINY_FLAT)
    greedy = CliRunner().invoke(app, ["verify", str(spec), "--max-tokens", "24"])
    assert greedy.exit_code == 0, greedy.output
    report = tmp_path / "sampling.json"
    args = ["verify", str(spec), "--sampling", "40", "--temperature", "0.9", "--seed", "3", "--max-tokens", "8"]
    sampled = CliRunner().invoke(app, args + ["--json-file", str(report)])
    assert sampled.exit_code == 0, sampled.output
    s = json.loads(report.read_text())["sampling"]
    assert s["p_value"] >= 0.01 and s["passed"] is True
    assert s["metrics"]["drafted"] > 0 and s["metrics"].get("choices")

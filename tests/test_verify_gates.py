"""verify's gates through the CLI: verdict classes in every report, --fail-on, and the
acceptance regression gate (--baseline / --max-acceptance-drop / --min-acceptance-length)."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest
import torch
from conftest import built_spec, write_spec
from typer.testing import CliRunner

from trtspec.cli.app import app
from trtspec.engines.torch.engine import TorchEngine

runner = CliRunner()


@pytest.fixture(scope="module")
def spec_file(tmp_path_factory, tiny_ckpts):
    return built_spec(tmp_path_factory, tiny_ckpts, "gates", **{"verify.max_tokens": 24})


@pytest.fixture(scope="module")
def baseline(spec_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("baseline") / "previous.json"
    r = runner.invoke(app, ["verify", str(spec_file), "--json-file", str(out)])
    assert r.exit_code == 0, r.output
    return out


def near_tie_flips(monkeypatch, delta: float):
    """Multi-row forwards raise every runner-up within ``delta`` of the top by ``delta``: a
    shape-dependent logit change of at most delta, i.e. pure numerics."""
    real = TorchEngine.run

    def run(self, items):
        out = [t.clone() for t in real(self, items)]
        for it, logits in zip(items, out):  # [n_logits, vocab]
            if it.n_logits > 1:
                top = torch.topk(logits, 2, dim=-1)
                rows = ((top.values[:, 0] - top.values[:, 1]) < delta).nonzero().flatten()
                logits[rows, top.indices[rows, 1]] += delta
        return out

    monkeypatch.setattr(TorchEngine, "run", run)


def test_numerical_divergence_fails_any_and_passes_algorithmic(spec_file, tmp_path, monkeypatch):
    near_tie_flips(monkeypatch, delta=2.0)
    j, x = tmp_path / "r.json", tmp_path / "r.xml"
    args = ["verify", str(spec_file), "--tie-epsilon", "4", "--json-file", str(j), "--junit", str(x)]
    r = runner.invoke(app, args)
    assert r.exit_code == 1, r.output
    data = json.loads(j.read_text())
    n = data["diverged"]
    assert n > 0 and data["verdicts"] == {"numerical": n, "algorithmic": 0, "unclassified": 0}
    v = next(p for p in data["results"] if p["divergence"])["divergence"]["verdict"]
    assert v["verdict"] == "numerical" and v["epsilon"] == 4.0
    assert v["evidence"]["control_gap"] < 2.0 and v["evidence"]["forward_rows"] > 1
    assert f"{n} numerical" in r.stdout
    failures = ET.parse(x).getroot().findall(".//failure")
    assert len(failures) == n and {f.get("type") for f in failures} == {"numerical"}

    r = runner.invoke(app, [*args, "--fail-on", "algorithmic"])
    assert r.exit_code == 0, r.output
    suite = ET.parse(x).getroot().find("testsuite")
    assert suite.get("failures") == "0"
    assert any("tolerated divergence" in (c.findtext("system-out") or "") for c in suite.iter("testcase"))
    props = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert props["verdict"] == "numerical"


def test_same_flips_beyond_epsilon_are_algorithmic(spec_file, tmp_path, monkeypatch):
    near_tie_flips(monkeypatch, delta=2.0)
    j = tmp_path / "r.json"
    r = runner.invoke(
        app, ["verify", str(spec_file), "--tie-epsilon", "0.001", "--fail-on", "algorithmic", "--json-file", str(j)]
    )
    assert r.exit_code == 1
    data = json.loads(j.read_text())
    assert data["verdicts"]["algorithmic"] == data["diverged"] > 0


def test_acceptance_gate_passes_on_the_same_deployment(spec_file, baseline, tmp_path):
    j = tmp_path / "r.json"
    r = runner.invoke(
        app,
        [
            "verify",
            str(spec_file),
            "--baseline",
            str(baseline),
            "--max-acceptance-drop",
            "5%",
            "--min-acceptance-length",
            "1.5",
            "--json-file",
            str(j),
        ],
    )
    assert r.exit_code == 0, r.output
    gate = json.loads(j.read_text())["acceptance_gate"]
    assert gate["passed"] is True and len(gate["checks"]) == 2


def test_acceptance_drop_fails_with_both_figures(spec_file, baseline, tmp_path, tiny_ckpts):
    # The same spec and prompts, but a draft that agrees less often: outputs stay identical,
    # acceptance falls. Build it in another folder under the same spec name.
    worse = write_spec(tmp_path / "worse", tiny_ckpts, draft="unrelated", **{"verify.max_tokens": 24})
    assert runner.invoke(app, ["build", str(worse)]).exit_code == 0
    r = runner.invoke(app, ["verify", str(worse), "--baseline", str(baseline), "--max-acceptance-drop", "5%"])
    assert r.exit_code == 1, r.output
    base = json.loads(baseline.read_text())
    line = next(x for x in r.stdout.splitlines() if x.startswith("FAILED"))
    assert "acceptance rate on spec.yaml verify.prompts [5 prompts, sha256" in line
    assert f"baseline {base['metrics']['acceptance_rate']:.4f} -> now" in line
    assert "at most 5.0% allowed" in line
    assert "all identical" in r.stdout  # identity alone would have passed


def test_min_acceptance_length_fails(spec_file):
    r = runner.invoke(app, ["verify", str(spec_file), "--min-acceptance-length", "9"])
    assert r.exit_code == 1
    assert "FAILED: mean acceptance length on spec.yaml verify.prompts" in r.stdout
    assert "(at least 9 required)" in r.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["-p", "hello there"], "was measured with another prompt set"),
        (["-k", "2"], "was measured with another num draft tokens (4; this run: 2)"),
        (["--max-tokens", "8"], "was measured with another max tokens (24; this run: 8)"),
    ],
)
def test_incomparable_baseline_exit_2(spec_file, baseline, args, message):
    r = runner.invoke(app, ["verify", str(spec_file), *args, "--baseline", str(baseline), "--max-acceptance-drop", "5%"])
    assert r.exit_code == 2, r.output
    assert message in r.stderr


def test_a_baseline_of_another_k_than_the_deployment_decided_exit_2(spec_file, baseline, tmp_path, monkeypatch):
    """Without -k, the baseline's k is held against the one the deployment decides (its
    default_draft_tokens, 4), asked of the deployment before any prompt is generated."""
    import trtspec.verify.run as verify_run

    other = tmp_path / "k3.json"
    other.write_text(json.dumps(json.loads(baseline.read_text()) | {"num_draft_tokens": 3}))

    def generated(*args, **kwargs):
        raise AssertionError("the baseline was refused only after generating")

    monkeypatch.setattr(verify_run, "run_verify", generated)
    r = runner.invoke(app, ["verify", str(spec_file), "--baseline", str(other), "--max-acceptance-drop", "5%"])
    assert r.exit_code == 2, r.output
    assert "was measured with another num draft tokens (3; this run: 4)" in r.stderr


def test_baseline_of_another_spec_exit_2(spec_file, tmp_path):
    other = tmp_path / "other.json"
    other.write_text(
        json.dumps({"spec": "something-else", "metrics": {}, "prompt_set_sha256": "x", "num_draft_tokens": 4, "max_tokens": 24})
    )
    r = runner.invoke(app, ["verify", str(spec_file), "--baseline", str(other), "--max-acceptance-drop", "5%"])
    assert r.exit_code == 2
    assert "was measured with another spec (something-else; this run: tiny-llama)" in r.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-acceptance-drop", "5%"], "--baseline and --max-acceptance-drop go together"),
        (["--baseline", "nope.json", "--max-acceptance-drop", "half"], "takes a percentage or a fraction in 0..1"),
        (["--baseline", "nope.json", "--max-acceptance-drop", "5%"], "--baseline nope.json: no such file"),
    ],
)
def test_bad_gate_flags_exit_2(spec_file, args, message):
    r = runner.invoke(app, ["verify", str(spec_file), *args])
    assert r.exit_code == 2
    assert message in r.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--temperature", "0.7"], "--temperature only apply to sampling; add --sampling N"),
        (["--sampling", "5"], "use --sampling 10 or more"),
        (["--sampling", "20", "--temperature", "0"], "temperature must be > 0"),
        (["--sampling", "0"], "--sampling: Input should be greater than or equal to 1"),
        (["--fail-on", "some"], "--fail-on: Input should be 'any' or 'algorithmic'"),
        (["--url", "http://127.0.0.1:8001"], "--url takes HOST:PORT"),
    ],
)
def test_bad_sampling_flags_exit_2(spec_file, args, message):
    r = runner.invoke(app, ["verify", str(spec_file), *args])
    assert r.exit_code == 2, r.output
    assert message in r.stderr


def test_sampling_check_passes_and_catches_a_sampler_without_rejection(built, monkeypatch):
    """On tiny models, against the target's exact conditionals: the real sampler passes; one
    that accepts every draft is caught. The unrelated draft makes q far from p, as a broken
    or mismatched draft would be (seeded: deterministic)."""
    from trtspec.speculative import loop
    from trtspec.speculative.sampling import SamplingParams
    from trtspec.testing.markov_pair import accept_all
    from trtspec.verify.sampling import check_deployment

    dep = built("unrelated")
    prompts = ["The quick brown fox", "def fibonacci(n):", "Triton serves models over HTTP and gRPC."]
    params = SamplingParams(temperature=1.0, seed=7)
    exact = check_deployment(dep, prompts, 20, 12, params)
    assert exact.values >= 60 and exact.passed, exact.describe()
    assert 0 < exact.metrics.accepted < exact.metrics.drafted
    monkeypatch.setattr(loop, "accept_or_resample", accept_all)
    biased = check_deployment(dep, prompts, 20, 12, params)
    assert not biased.passed, biased.describe()


def test_sampling_check_gives_every_prompt_its_own_random_stream(built, monkeypatch):
    """The chi-square test assumes independent values. Prompts that shared seeds would draw
    from one random stream: the same prompt given twice would be tested on the same samples
    twice (and prompts that end alike on dependent ones), raising the false-alarm rate."""
    from trtspec.runtime import Deployment
    from trtspec.speculative.sampling import SamplingParams
    from trtspec.verify.sampling import check_deployment

    dep = built("unrelated")
    seeds, outputs = [], []
    real_request, real_generate = Deployment.request, Deployment.generate

    def request(self, ids, max_tokens, k=None, sampling=None):
        seeds.append(sampling.seed)
        return real_request(self, ids, max_tokens, k, sampling)

    def generate(self, reqs, speculative=True):
        results = real_generate(self, reqs, speculative=speculative)
        outputs.extend(tuple(r.output_ids) for r in results)
        return results

    monkeypatch.setattr(Deployment, "request", request)
    monkeypatch.setattr(Deployment, "generate", generate)
    check_deployment(dep, ["The quick brown fox"] * 2, 25, 4, SamplingParams(seed=3))
    assert sorted(seeds) == list(range(3, 53))
    assert outputs[:25] != outputs[25:]  # the second copy is new samples, not a replay

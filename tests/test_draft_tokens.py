"""A request's draft length (num_draft_tokens) is decided at one place,
speculative.requests.decide_num_draft_tokens: verify in process, bench and a served request all run
(and report) the deployment's default_draft_tokens, and a k beyond max_draft_len is refused
with the same words everywhere."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from test_triton_cores import PROMPTS, _call, _cores, _orchestrator, _request
from typer.testing import CliRunner

from trtspec.cli.app import app
from trtspec.errors import RequestError
from trtspec.layout import BLS_MODEL
from trtspec.speculative.metrics import metrics_from_json
from trtspec.speculative.requests import Limits, decide_num_draft_tokens, make_request
from trtspec.triton.backend.orchestrator_core import Orchestrator
from trtspec.triton.backend.params import EngineEndpointParams
from trtspec.triton.repository import pbtxt
from trtspec.triton.repository.writer import write_repository

runner = CliRunner()


def test_num_draft_tokens_fills_the_default_and_checks_the_bound():
    assert decide_num_draft_tokens(None, 4, 8) == 4
    assert decide_num_draft_tokens(0, 4, 8) == 0 and decide_num_draft_tokens(8, 4, 8) == 8
    for sent, default in ((9, 4), (-1, 4), (None, 9)):
        with pytest.raises(RequestError, match=r"num_draft_tokens must be in 0\.\.8 \(max_draft_len"):
            decide_num_draft_tokens(sent, default, 8)


def test_an_endpoint_that_drafts_nothing_still_checks_the_request():
    """Triton's target_only control: the request's num_draft_tokens is checked as the
    speculative endpoint checks it, then decided 0 (no tree either), in make_request alone."""
    limits = Limits(vocab_size=50, max_seq_len=64, max_draft_len=8, default_draft_tokens=4, drafts=False)
    req = make_request([1, 2], 8, 5, limits)
    assert (req.num_draft_tokens, req.tree) == (0, None)
    assert make_request([1, 2], 8, None, limits).num_draft_tokens == 0
    with pytest.raises(RequestError, match=r"num_draft_tokens must be in 0\.\.8"):
        make_request([1, 2], 8, 9, limits)


def _served_limits(dep, tmp_path):
    """The limits the orchestrator model reads from its written config.pbtxt parameters."""
    repo = write_repository(dep.loaded, dep.loaded.output_dir(), tmp_path / "repo")
    cfg = pbtxt.parse((repo / BLS_MODEL / "config.pbtxt").read_text())
    params = EngineEndpointParams.from_params({k: v.string_value for k, v in cfg.parameters.items()})
    return params.settings(False, 1).limits


def test_verify_bench_and_a_served_request_run_the_deployment_default(built, tmp_path):
    dep = built()
    s = dep.spec.speculative
    k = s.default_draft_tokens
    assert 0 < k < s.max_draft_len  # a default that is neither the bound nor off
    spec = str(dep.loaded.path)

    r = runner.invoke(app, ["verify", spec, "--json", "--max-tokens", "16"])
    assert r.exit_code == 0, r.output
    verified = json.loads(r.stdout)
    assert verified["num_draft_tokens"] == k
    assert len(verified["metrics"]["per_position_rate"]) == k  # the steps drafted k, not more

    out = tmp_path / "bench"
    r = runner.invoke(app, ["bench", spec, "--json", "--sweep", "none", "-c", "1", "--max-tokens", "16", "-o", str(out)])
    assert r.exit_code == 0, r.output
    benched = json.loads(r.stdout)
    assert benched["k"] == k and len(benched["metrics"]["per_position_rate"]) == k

    orch = _orchestrator(dep)
    served = Orchestrator(replace(orch.s, limits=_served_limits(dep, tmp_path)), _call(_cores(dep)), dep.tokenizer, dep.end_ids)
    (answer,) = served.run([_request(PROMPTS[0], max_tokens=16)])  # no num_draft_tokens input
    assert len(metrics_from_json(answer["perf_metrics_json"][0, 0].decode()).per_position_rate) == k


def test_a_k_beyond_the_bound_is_refused_alike_in_verify_and_bench(built):
    spec = str(built().loaded.path)
    for command in (["verify", spec, "-k", "9"], ["bench", spec, "-k", "9", "--sweep", "none", "-c", "1"]):
        r = runner.invoke(app, command)
        assert r.exit_code == 2 and "-k/--num-draft-tokens 9 is outside 0..8" in " ".join(r.stderr.split())


def _grpc_backend(params: dict[str, str], num_draft_tokens: int | None = None):
    """A GrpcBackend whose server's tensorrt_llm_bls config has ``params`` (no server)."""
    from types import SimpleNamespace

    from trtspec.triton.client import GrpcBackend

    backend = GrpcBackend.__new__(GrpcBackend)
    backend.url, backend.num_draft_tokens, backend._error = "127.0.0.1:1", num_draft_tokens, RuntimeError
    config = SimpleNamespace(parameters={k: SimpleNamespace(string_value=v) for k, v in params.items()})
    backend.client = SimpleNamespace(get_model_config=lambda model, client_timeout=None: SimpleNamespace(config=config))
    return backend


def test_over_grpc_the_reported_draft_length_is_the_served_endpoints():
    """verify and bench --url report the k the served endpoint decides: the one sent, else its
    own default_draft_tokens parameter (never the local spec's); a server whose config names
    none is refused with the fix."""
    assert _grpc_backend({"default_draft_tokens": "3"}).decided_draft_tokens() == 3
    assert _grpc_backend({"default_draft_tokens": "3"}, num_draft_tokens=5).decided_draft_tokens() == 5
    with pytest.raises(RequestError, match="names no default_draft_tokens in its config; serve a repository"):
        _grpc_backend({}).decided_draft_tokens()

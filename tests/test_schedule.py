"""Load-aware speculation: the draft-length schedule and the acceptance switch-off, in the one
loop (in process, through the LLM API double, in the Triton orchestrator), in the spec, in the
files written for TensorRT-LLM, and as `trtspec bench --schedule` measures and recommends it."""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import write_spec
from test_loop import OracleVerifier, PerfectDrafter, reference
from typer.testing import CliRunner

from trtspec.cli.app import app
from trtspec.errors import SpecError
from trtspec.spec import SwitchOffSpec, load_spec
from trtspec.speculative.loop import GenerationRequest, generate
from trtspec.speculative.schedule import (
    AcceptanceSwitch,
    DraftSchedule,
    GridPoint,
    LoadPolicy,
    break_even_length,
    recommend,
    vllm_shape,
)

runner = CliRunner()


class RecordingDrafter(PerfectDrafter):
    """Perfect drafts; remembers (active sequences, ks asked) per step."""

    def __init__(self):
        self.asked: list[tuple[int, list[int]]] = []

    def propose(self, contexts, ks):
        self.asked.append((len(contexts), list(ks)))
        return super().propose(contexts, ks)


def test_schedule_thresholds_are_the_largest_key_not_above_the_load():
    s = DraftSchedule.from_mapping({1: 4, 4: 2, 8: 0})
    assert [s.k_for(n) for n in (1, 2, 3, 4, 7, 8, 100)] == [4, 4, 4, 2, 2, 0, 0]
    assert DraftSchedule.from_mapping({1: 3, 2: 3, 4: 1, 8: 1}).compact().to_mapping() == {1: 3, 4: 1}
    with pytest.raises(ValueError, match="must start at 1"):
        DraftSchedule.from_mapping({2: 4})


def test_the_loop_caps_k_by_the_number_of_active_sequences():
    """Four requests asking k=4 under {1: 4, 2: 2, 4: 0}: no drafting while four run, k<=2
    while two or three do, 4 when one is left; the output is the target's greedy output."""
    caps: list[tuple[int, int]] = []

    class Spy(LoadPolicy):
        def cap(self, active):
            caps.append((active, super().cap(active)))
            return caps[-1][1]

    policy = Spy(DraftSchedule.from_mapping({1: 4, 2: 2, 4: 0}))
    drafter = RecordingDrafter()
    reqs = [GenerationRequest([1, 2, 3 + i], 10 + 6 * i, 4) for i in range(4)]
    results = generate(reqs, drafter, OracleVerifier(), policy=policy)
    for i, res in enumerate(results):
        assert res.output_ids == reference(10 + 6 * i, (1, 2, 3 + i))
    assert {a: c for a, c in caps} == {4: 0, 3: 2, 2: 2, 1: 4}  # every load was seen
    steps_with_drafts = [c for c in caps if c[1] > 0]  # the last may draft 0: max_tokens is near
    assert 0 < len(steps_with_drafts) - len(drafter.asked) <= 1
    for (_, cap), (_, ks) in zip(steps_with_drafts, drafter.asked):
        assert max(ks) <= cap
    assert any(max(ks) == 4 for _, ks in drafter.asked)  # the last one alone drafts its full k
    assert results[0].metrics.drafted == 0  # the shortest ran only while all four were active


def test_without_a_schedule_every_request_drafts_its_own_k():
    drafter = RecordingDrafter()
    generate([GenerationRequest([1, 2, 3 + i], 12, 4) for i in range(4)], drafter, OracleVerifier())
    assert any(4 in ks for _, ks in drafter.asked)


def test_the_switch_off_stops_drafting_for_good_once_the_window_mean_falls():
    sw = AcceptanceSwitch(window=2, threshold=2.0)
    sw.record(3.0)
    assert not sw.off
    sw.record(0.9)  # mean 1.95 < 2.0
    assert sw.off
    sw.record(5.0)
    assert sw.off  # for good, as TensorRT-LLM's acceptance window
    policy = LoadPolicy(None, AcceptanceSwitch(window=1, threshold=9.0))
    drafter = RecordingDrafter()
    first = generate([GenerationRequest([1, 2, 3], 12, 4)], drafter, OracleVerifier(), policy=policy)[0]
    assert first.metrics.drafted > 0 and policy.switch.off  # length 5 < 9 over a window of 1
    asked = len(drafter.asked)
    second = generate([GenerationRequest([1, 2, 4], 12, 4)], drafter, OracleVerifier(), policy=policy)[0]
    assert second.metrics.drafted == 0 and len(drafter.asked) == asked
    assert second.output_ids == reference(12, (1, 2, 4))


def test_recommend_and_break_even_from_a_grid():
    grid = [
        GridPoint(1, 0, 30.0, 1.0),
        GridPoint(1, 2, 45.0, 2.2),
        GridPoint(1, 4, 50.0, 3.0),
        GridPoint(4, 0, 80.0, 1.0),
        GridPoint(4, 2, 90.0, 2.2),
        GridPoint(4, 4, 70.0, 3.0),
        GridPoint(8, 0, 120.0, 1.0),
        GridPoint(8, 2, 100.0, 2.2),
    ]
    s = recommend(grid)
    assert s.to_mapping() == {1: 4, 4: 2, 8: 0}
    # drafting 2 at concurrency 8 gives 100 tok/s at length 2.2: a step costs 2.2 * 120/100
    assert break_even_length(grid, 8, 2) == pytest.approx(2.64)
    assert vllm_shape(s, 16) == {
        "num_speculative_tokens": 4,
        "num_speculative_tokens_per_batch_size": [[1, 3, 4], [4, 7, 2], [8, 16, 0]],
    }
    # served with a batch of 4, no step runs 8 sequences: the point measured there is left out
    assert recommend(grid, max_batch_size=4).to_mapping() == {1: 4, 4: 2}
    assert recommend(grid, max_batch_size=8).to_mapping() == {1: 4, 4: 2, 8: 0}
    with pytest.raises(ValueError, match=r"no grid point at a concurrency <= max_batch_size \(2\); measure -c 1,2"):
        recommend([p for p in grid if p.concurrency == 4], max_batch_size=2)


@pytest.mark.parametrize("schedule, warned", [({1: 4, 4: 0}, False), ({1: 4, 2: 2, 8: 0, 16: 0}, True)])
def test_check_warns_of_a_schedule_threshold_above_the_batch(tmp_path, tiny_ckpts, schedule, warned):
    """No step runs more than build.max_batch_size sequences (served, the rest wait uncounted;
    TensorRT-LLM and vLLM alike), so a threshold above it never fires: check names it."""
    spec = write_spec(tmp_path, tiny_ckpts, **{"speculative.schedule": schedule})
    r = runner.invoke(app, ["check", str(spec)])
    assert r.exit_code == 0, r.output
    line = "warning: speculative.schedule: threshold 8, 16 is above build.max_batch_size (4) and never fires served"
    assert (line in " ".join(r.output.split())) == warned
    r = runner.invoke(app, ["check", str(spec), "--json"])
    warnings = json.loads(r.stdout)["warnings"]
    assert len(warnings) == int(warned) and (not warned or "lower it to <= 4 or raise build.max_batch_size" in warnings[0])


@pytest.mark.parametrize(
    "schedule, needle",
    [
        ({2: 4}, "schedule must start at 1 active sequence"),
        ({1: 9}, "schedule draft lengths must be <= max_draft_len (8)"),
        ({1: 2, 4: 3}, "schedule draft lengths must not grow with load"),
        ({1: -1}, "speculative.schedule.1: Input should be greater than or equal to 0"),
    ],
)
def test_bad_schedules_are_refused_by_name(tmp_path, tiny_ckpts, schedule, needle):
    with pytest.raises(SpecError) as info:
        load_spec(write_spec(tmp_path, tiny_ckpts, **{"speculative.schedule": schedule}))
    assert info.value.exit_code == 2 and needle in str(info.value)


def test_llmapi_files_carry_the_schedule_and_the_double_applies_it(tmp_path, tiny_ckpts):
    from trtspec.engines.build import build
    from trtspec.trtllm_lines.fields import unknown_keys

    over = {
        "backend": "trtllm",
        "trtllm.runtime": "llmapi",
        "trtllm.line": "1.2",
        "speculative.max_draft_len": 4,
        "speculative.default_draft_tokens": None,
        "speculative.schedule": {1: 4, 2: 0},
        "speculative.switch_off": {"window": 8, "min_acceptance_length": 1.5},
    }
    loaded = load_spec(write_spec(tmp_path, tiny_ckpts, **over))
    build(loaded, loaded.output_dir())
    args = yaml.safe_load((loaded.output_dir() / "llmapi" / "speculative.yaml").read_text())
    sc = args["speculative_config"]
    assert sc["draft_len_schedule"] == {1: 4, 2: 0} and sc["max_draft_len"] == 4
    assert (sc["acceptance_window"], sc["acceptance_length_threshold"]) == (8, 1.5)
    assert unknown_keys(args, "1.2") == []
    # the conformance double runs it in the one loop: two prompts at once draft nothing
    from trtspec.speculative.llmapi import acceptance, greedy_params, load_api, make_llm

    api = load_api("double", "1.2")
    llm = make_llm(api, loaded.output_dir() / "llmapi" / "speculative.yaml")
    sp = greedy_params(api, 12, True)
    pair = llm.generate(["The quick brown fox", "Pack my box with"], sp)
    assert [acceptance(o.outputs[0])[1] for o in pair] == [0, 0]
    alone = llm.generate("The quick brown fox", sp)
    assert acceptance(alone.outputs[0])[1] > 0
    assert alone.outputs[0].token_ids == pair[0].outputs[0].token_ids


@pytest.mark.parametrize(
    "over, needle",
    [
        ({"speculative.schedule": {1: 2}}, "TensorRT-LLM's draft_len_schedule must map 1 sequence to max_draft_len"),
        (
            {"trtllm.line": "1.3+", "speculative.switch_off": {"window": 4, "min_acceptance_length": 2}},
            "TensorRT-LLM 1.3+ switches speculation off on an acceptance rate",
        ),
    ],
)
def test_llmapi_schedule_refusals(tmp_path, tiny_ckpts, over, needle):
    with pytest.raises(SpecError) as info:
        load_spec(
            write_spec(
                tmp_path,
                tiny_ckpts,
                **({"backend": "trtllm", "trtllm.runtime": "llmapi", "speculative.default_draft_tokens": None} | over),
            )
        )
    assert needle in str(info.value)


def test_triton_parameters_carry_the_schedule_to_the_orchestrator(tmp_path, tiny_ckpts):
    from trtspec.engines.build import build
    from trtspec.triton.backend.orchestrator_core import OrchestratorSettings
    from trtspec.triton.backend.params import EngineEndpointParams, load_aware
    from trtspec.triton.repository.writer import plan_repository

    schedule = {
        "speculative.schedule": {1: 5, 4: 2, 8: 0},
        "speculative.switch_off": {"window": 16, "min_acceptance_length": 1.3},
    }
    loaded = load_spec(write_spec(tmp_path, tiny_ckpts, **schedule))
    build(loaded, loaded.output_dir())
    plan = plan_repository(loaded, loaded.output_dir())
    params = {name: cfg.parameters for name, (cfg, _) in plan.models.items() if "mode" in (cfg.parameters or {})}
    assert (
        {n for n, p in params.items() if "draft_len_schedule" in p}
        == {n for n, p in params.items() if p["mode"] == "speculative"}
        != set()
    )
    spec_params = next(p for p in params.values() if p["mode"] == "speculative")
    assert json.loads(spec_params["draft_len_schedule"]) == {"1": 5, "4": 2, "8": 0}
    back = EngineEndpointParams.from_params(spec_params)
    assert EngineEndpointParams(**{**back.__dict__, **load_aware(loaded.spec.speculative)}) == back
    assert back.to_params() == spec_params
    assert (back.schedule, back.switch_off) == (((1, 5), (4, 2), (8, 0)), SwitchOffSpec(window=16, min_acceptance_length=1.3))
    settings = back.settings(decoupled=False, max_batch_size=4)
    policy = settings.load_policy()
    assert [policy.cap(n) for n in (1, 4, 9)] == [5, 2, 0]
    assert OrchestratorSettings(**{**settings.__dict__, "mode": "target_only"}).load_policy() is None


def test_bench_schedule_measures_the_grid_and_recommends(tmp_path, tiny_ckpts):
    spec = write_spec(tmp_path, tiny_ckpts)
    assert runner.invoke(app, ["build", str(spec)]).exit_code == 0
    out = tmp_path / "bench"
    grid = "--schedule --sweep 1,3 -c 1,2 --max-tokens 8".split()
    r = runner.invoke(app, ["bench", str(spec), *grid, "-p", "The quick brown fox", "-o", str(out)])
    assert r.exit_code == 0, r.output
    report = json.loads((out / "bench.json").read_text())
    cells = {(p["concurrency"], p["k"]) for p in report["grid"]}
    assert cells == {(c, k) for c in (1, 2) for k in (0, 1, 3)}
    assert all(p["tokens_per_s"] > 0 for p in report["grid"])
    sched = report["schedule"]["spec"]["schedule"]
    assert "1" in sched or 1 in sched
    assert "recommended schedule (speculative.schedule)" in r.output
    assert (out / "schedule.png").stat().st_size > 0
    refused = runner.invoke(app, ["bench", str(spec), "--schedule", "--url", "127.0.0.1:1"])
    assert refused.exit_code == 2 and "--schedule measures the k x concurrency grid in process" in refused.output
    above = runner.invoke(app, ["bench", str(spec), "--schedule", "-c", "8", "-o", str(out)])
    assert above.exit_code == 2 and "--schedule recommends from concurrencies <= build.max_batch_size (4)" in above.output

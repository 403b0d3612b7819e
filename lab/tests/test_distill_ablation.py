"""lab/distill_ablation.py's result file: rows of several runs merge, one per variant and
step count, a later run replacing an earlier one, each command kept once."""

from __future__ import annotations

import sys

from lab import distill_ablation
from lab._common import Result


def _row(variant: str, steps: int, k1: float, cpu: float | None) -> dict:
    return {
        "variant": variant,
        "change": f"{variant}'s change",
        "steps": steps,
        "k1_acceptance": k1,
        "acceptance_length_k3": 1.5,
        "per_position": [k1, 0.4, 0.5],
        "train_cpu_s": cpu,
    }


def test_rows_of_several_runs_merge_into_one_result_file(tmp_path, monkeypatch):
    monkeypatch.setattr(distill_ablation, "RESULTS", tmp_path)
    monkeypatch.setattr(sys, "argv", ["distill_ablation.py", "spec.yaml", "--steps", "400"])
    distill_ablation.record("abl", [_row("ttt3", 400, 0.37, 900.4), _row("all", 400, 0.40, None)])
    monkeypatch.setattr(sys, "argv", ["distill_ablation.py", "spec.yaml", "--steps", "456"])
    distill_ablation.record("abl", [_row("ttt3", 456, 0.38, 1020.0)])
    monkeypatch.setattr(sys, "argv", ["distill_ablation.py", "spec.yaml", "--steps", "400"])
    path = distill_ablation.record("abl", [_row("ttt3", 400, 0.36, 880.0)])  # the 400-step row again
    r = Result.read(path)
    assert [(x["variant"], x["steps"], x["k1_acceptance"]) for x in r.values["rows"]] == [
        ("all", 400, 0.40),
        ("ttt3", 400, 0.36),
        ("ttt3", 456, 0.38),
    ]
    assert r.values["table"]["rows"][0][-1] == "not recorded" and r.values["table"]["rows"][1][-1] == "880"
    assert r.values["table"]["rows"][2][3:6] == ["0.380", "1.500", "0.38 / 0.40 / 0.50"]
    assert r.command.splitlines() == [
        "python -m lab.distill_ablation spec.yaml --steps 400",
        "python -m lab.distill_ablation spec.yaml --steps 456",
    ]


def test_train_step_times_the_trainers_own_steps_on_a_heads_capture(tmp_path, tiny_ckpts):
    """lab/train_step.py reads a distilled head's capture and options back and times the
    trainer's loss and backward at each depth asked (nothing generated again)."""
    from test_distill import eagle_spec, small_opts

    from lab import train_step
    from trtspec.distill.run import distill
    from trtspec.spec import load_spec

    spec = eagle_spec(tmp_path, tiny_ckpts["target"])
    result = distill(load_spec(spec), small_opts(tmp_path))
    rows = train_step.time_steps(spec, result.output, 2, [1, 2])
    assert [(r["depth"], r["steps"]) for r in rows] == [(1, 2), (2, 2)]
    assert all(r["median_s"] > 0 and r["cpu_s"] >= 0 and r["threads"] >= 1 for r in rows)


def test_generation_rate_profiles_a_round_by_op_group(built, capsys):
    """lab/generation_rate.py --profile: one more generation round under the profiler, its
    wall time split into op groups and the time outside any op, nothing left over."""
    from lab import generation_rate

    folder = built("same").target.folder
    assert (
        generation_rate.main(
            [
                str(folder),
                "--prompts",
                "3",
                "--rows",
                "4",
                "--max-tokens",
                "3",
                "--rounds",
                "1",
                "--step-repeats",
                "0",
                "--profile",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "round 1:" in out and "profiled round:" in out and "matmuls" in out


def test_generation_profile_groups_add_up_to_the_round(built):
    from lab import generation_rate
    from trtspec.engines.torch.engine import TorchEngine
    from trtspec.speculative.loop import GenerationRequest

    target = TorchEngine.load(built("same").target.folder, slots=4)
    target.capture_features((0, 1))
    prof = generation_rate._profile(target, [GenerationRequest([5, 17, 42], 4), GenerationRequest([5, 8], 4)])
    assert prof["tokens"] > 0 and prof["sgemm_2048_gflop_s"] > 0
    assert set(prof["seconds"]) == {*generation_rate.OP_GROUPS, "other_ops", "outside_ops"}
    assert abs(sum(prof["seconds"].values()) - prof["wall_s"]) <= 0.1 + 0.01 * prof["wall_s"]

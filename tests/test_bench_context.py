"""trtspec bench --context-sweep on the tiny pair: one row per context length with each role's
step, every timed step attending to exactly its context, bad lengths refused, the plot."""

from __future__ import annotations

import json

import pytest
from conftest import built_spec, write_spec
from typer.testing import CliRunner

from trtspec.bench.context import check_contexts, context_ids, context_points, step_seconds
from trtspec.cli.app import app
from trtspec.errors import RequestError, RuntimeFailure

runner = CliRunner()
PROMPT = "The quick brown fox"
ROW_KEYS = {"context", "target_step", "draft_step", "verify_step", "k", "cost_ratio", "verify_cost", "step_bytes", "paths"}


@pytest.fixture(scope="module")
def spec_file(tmp_path_factory, tiny_ckpts):
    return built_spec(tmp_path_factory, tiny_ckpts, "bench-context", **{"verify.max_tokens": 8})


def test_the_sweep_times_each_role_at_each_context_length(built):
    dep = built("draft")
    points = list(context_points(dep, dep.encode(PROMPT), [8, 24, 64], 3, None, lambda s: None))
    assert [p.context for p in points] == [8, 24, 64]
    for p in points:
        c = p.costs
        assert c.target_step > 0 and c.draft_step > 0 and c.verify_step > 0 and c.k == 3
        assert c.cost_ratio == c.draft_step / c.target_step and c.verify_cost == c.verify_step / c.target_step
        assert (c.weight_bytes, c.kv_bytes) == dep.target.step_bytes(p.context)  # the K/V of exactly this context
        assert set(c.paths) == set(c.paths_busy) == {"target", "draft"}
        row = p.to_dict()
        assert ROW_KEYS <= set(row) and row["context"] == p.context and row["of_copy_bandwidth"] is None


def test_a_timed_step_attends_to_exactly_its_context_and_computes_only_its_own(built):
    dep = built("draft")
    engine, ctx = dep.target, context_ids(dep.encode(PROMPT), 40)
    step_seconds(engine, ctx, 3, repeats=2)
    assert engine.last_use[0][0] == 40  # the context reused, none of the last step's new tokens
    held = engine.pool.tokens[engine.last_slots[0]]
    assert held[:40] == ctx and len(held) == 43


def test_a_step_that_recomputed_its_context_is_an_error_not_a_timing():
    class Forgetful:  # an engine whose prefix cache kept nothing
        last_use = [(0, 0)]

        def run(self, items):
            return []

    with pytest.raises(RuntimeFailure, match="after 16 tokens reused only 0 of them"):
        step_seconds(Forgetful(), list(range(10, 26)), 1, repeats=1)


def test_a_context_repeats_the_prompt_and_starts_with_every_shorter_one():
    assert context_ids([5, 6, 7], 7) == [5, 6, 7, 5, 6, 7, 5]
    assert context_ids([5, 6, 7], 2) == [5, 6]
    with pytest.raises(RequestError, match="has none"):
        context_ids([], 4)


def test_a_context_must_leave_room_for_the_steps_it_measures():
    check_contexts([64, 507], 512, 4, head=False)  # 507 + the verify's 5 tokens = 512
    with pytest.raises(RequestError, match="--context-sweep 508: .* needs 5 past its context; use context lengths up to 507"):
        check_contexts([64, 508], 512, 4, head=False)
    with pytest.raises(RequestError, match="up to 503"):  # an EAGLE-3 head's step runs after 4 more tokens
        check_contexts([507], 512, 4, head=True)


def test_the_eagle3_heads_step_is_timed_at_each_context(tmp_path_factory, tiny_ckpts):
    from test_eagle3 import random_head

    from trtspec.engines.build import build
    from trtspec.runtime import Deployment
    from trtspec.spec import load_spec

    root = tmp_path_factory.mktemp("context-eagle3")
    ckpts = {"target": tiny_ckpts["target"], "head": random_head(tiny_ckpts["target"], root / "head")}
    loaded = load_spec(write_spec(root, ckpts, "head", **{"speculative.method": "eagle3"}))
    build(loaded, loaded.output_dir())
    dep = Deployment(loaded, loaded.output_dir())
    points = list(context_points(dep, dep.encode(PROMPT), [16, 48], 2, None, lambda s: None))
    assert [p.context for p in points] == [16, 48] and all(p.costs.draft_step > 0 for p in points)


def test_cli_context_sweep_reports_a_row_per_length_and_plots_them(spec_file, tmp_path):
    from PIL import Image

    args = ["bench", str(spec_file), "--sweep", "none", "-c", "1", "--context-sweep", "16,64", "-o", str(tmp_path)]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "step costs by context length" in r.stdout and "target steps (context sweep):" in r.stdout
    rows = json.loads((tmp_path / "bench.json").read_text())["context_sweep"]
    assert [row["context"] for row in rows] == [16, 64]
    for row in rows:
        assert ROW_KEYS <= set(row) and row["k"] == 4
        assert row["target_step"] > 0 and row["draft_step"] > 0 and row["verify_step"] > 0 and row["step_bytes"] > 0
        assert row["of_copy_bandwidth"] > 0  # against the bandwidth the costs line measured
    with Image.open(tmp_path / "context.png") as image:
        assert image.format == "PNG" and image.width > 100 and image.height > 100
        image.verify()


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--context-sweep", "0,16"],
            "--context-sweep: context lengths must be positive and increasing, e.g. 64,256,1024; got 0,16",
        ),
        (["--context-sweep", "64,16"], "context lengths must be positive and increasing, e.g. 64,256,1024; got 64,16"),
        (["--context-sweep", "16,16"], "got 16,16"),
        (["--context-sweep", "a,b"], "--context-sweep 'a,b' is not a list"),
        (
            ["--context-sweep", "16,508"],
            "--context-sweep 508: the engines hold 512 positions (build.max_seq_len) and a step at k=4 needs 5 past "
            "its context; use context lengths up to 507",
        ),
        (
            ["--context-sweep", "16", "--url", "127.0.0.1:8001"],
            "--context-sweep times each engine's steps in process; drop --url",
        ),
    ],
)
def test_cli_context_sweep_bad_lengths_exit_2_with_one_line(spec_file, args, message):
    r = runner.invoke(app, ["bench", str(spec_file), *args])
    assert r.exit_code == 2 and message in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr

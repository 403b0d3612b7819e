"""The head recipe in the spec: the ``distill:`` block validated with the spec, flags given on
the command line overriding it (and only those), the resolved recipe in the head's manifest
with where each value came from, and --resume refusing a changed recipe."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from conftest import write_spec
from safetensors.torch import load_file
from test_distill import PROMPTS, eagle_spec, prompts_file
from typer.testing import CliRunner

import trtspec.distill.run as distill_run
from trtspec.cli.app import app
from trtspec.distill.options import DistillOptions, resolve
from trtspec.errors import SpecError, TrtspecError
from trtspec.recipe import RECIPE_FIELDS, DistillRecipe
from trtspec.spec import load_spec

runner = CliRunner()


def recipe_spec(folder: Path, target: Path, recipe: dict | None) -> Path:
    """An eagle3 spec for the tiny target whose ``distill:`` block is ``recipe``."""
    path = eagle_spec(folder, target)
    if recipe is not None:
        data = yaml.safe_load(path.read_text())
        data["distill"] = recipe
        path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


# ------------------------------------------------------------------------------ the block


def test_the_block_is_read_with_the_spec(tmp_path, tiny_ckpts):
    spec = recipe_spec(
        tmp_path,
        tiny_ckpts["target"],
        {"time_budget": "30m", "layer_ids": [0, 1], "scaling": [0.25, 0.5], "labels": "hard", "warmup": 0.1},
    )
    block = load_spec(spec).spec.distill
    assert (block.time_budget, block.layer_ids, block.scaling, block.labels, block.warmup) == (
        1800.0,
        (0, 1),
        (0.25, 0.5),
        "hard",
        0.1,
    )
    assert block.model_fields_set == {"time_budget", "layer_ids", "scaling", "labels", "warmup"}


@pytest.mark.parametrize(
    "recipe, message",
    [
        ({"learning_rate": 0.01}, "distill.learning_rate: unknown key; remove or rename it (allowed: prompts, eval_prompts,"),
        ({"output": "x"}, "distill.output: unknown key"),  # a run setting, not the recipe
        ({"force": True}, "distill.force: unknown key"),
        ({"max_steps": 0}, "distill.max_steps: Input should be greater than or equal to 1"),
        ({"time_budget": "soon"}, "distill.time_budget takes a positive duration like 600, 600s, 10m or 1h (got 'soon')"),
        ({"scaling": [0.5, 2]}, "distill.scaling takes comma-separated fractions of the data below 1"),
        ({"labels": "fuzzy"}, "distill.labels: Input should be 'soft' or 'hard'"),
        ({"ttt_steps": 17}, "distill.ttt_steps: Input should be less than or equal to 16"),
        (
            {"label_temperature": 2, "labels": "hard"},
            "distill: label_temperature 2 softens soft labels under the KL; it needs labels soft",
        ),
    ],
)
def test_bad_blocks_are_refused_with_the_specs_message(tmp_path, tiny_ckpts, recipe, message):
    spec = recipe_spec(tmp_path, tiny_ckpts["target"], recipe)
    with pytest.raises(SpecError) as e:
        load_spec(spec)
    assert f"{spec}: {message}" in str(e.value)
    r = runner.invoke(app, ["distill", str(spec)])
    assert r.exit_code == 2 and message in " ".join(r.stderr.split())


def test_only_an_eagle3_spec_carries_a_recipe(tmp_path, tiny_ckpts):
    spec = write_spec(tmp_path, tiny_ckpts, **{"distill.max_steps": 10})
    with pytest.raises(SpecError, match="distill: the recipe trains an EAGLE-3 head, and method draft_target drafts"):
        load_spec(spec)


# ------------------------------------------------------------------------------ precedence


@pytest.fixture
def resolved_by_cli(monkeypatch):
    """Run `trtspec distill` up to the library call and return the options it resolves to
    (the head is not trained)."""

    def invoke(args: list[str]) -> tuple[DistillOptions, dict]:
        seen = []

        def stop(loaded, opts):
            seen.append(resolve(loaded, opts))
            raise TrtspecError("stopped before training")

        monkeypatch.setattr(distill_run, "distill", stop)
        r = runner.invoke(app, ["distill", *args])
        assert "stopped before training" in r.output, r.output
        return seen[0]

    return invoke


def test_flags_given_override_the_block_and_only_those(tmp_path, tiny_ckpts, resolved_by_cli):
    (tmp_path / "data").mkdir()
    prompts_file(tmp_path / "data")
    block = {"max_steps": 7, "lr": 0.01, "max_tokens": 64, "seed": 3, "anchor": False, "prompts": "data/prompts.jsonl"}
    spec = recipe_spec(tmp_path, tiny_ckpts["target"], block)
    # --seed 0 and --anchor are at their defaults, but given: they override the block
    opts, sources = resolved_by_cli([str(spec), "--max-steps", "9", "--seed", "0", "--anchor", "--time-budget", "2m"])
    assert (opts.max_steps, opts.seed, opts.anchor, opts.time_budget) == (9, 0, True, 120.0)
    assert (opts.lr, opts.max_tokens) == (0.01, 64)  # not given: the block's, not the flags' defaults
    assert opts.prompts == tmp_path / "data" / "prompts.jsonl"  # relative to the spec file
    assert opts.weight_decay == 0.0 and opts.labels == "soft"  # in neither: the defaults
    assert {k for k, v in sources.items() if v == "cli"} == {"max_steps", "seed", "anchor", "time_budget"}
    assert {k for k, v in sources.items() if v == "spec"} == {"lr", "max_tokens", "prompts"}
    assert set(sources) == set(RECIPE_FIELDS) and sources["weight_decay"] == "default"


def test_without_a_block_the_flags_and_defaults_are_the_recipe(tmp_path, tiny_ckpts, resolved_by_cli):
    spec = recipe_spec(tmp_path, tiny_ckpts["target"], None)
    opts, sources = resolved_by_cli([str(spec), "--no-anchor", "--layers", "0,1", "--scaling", "0.5"])
    assert (opts.anchor, opts.layer_ids, opts.scaling, opts.max_steps) == (False, (0, 1), (0.5,), 2000)
    assert {k for k, v in sources.items() if v != "default"} == {"anchor", "layer_ids", "scaling"}


def test_none_clears_the_blocks_budget_curve_and_layers(tmp_path, tiny_ckpts, resolved_by_cli):
    spec = recipe_spec(tmp_path, tiny_ckpts["target"], {"time_budget": "30m", "scaling": [0.5], "layer_ids": [0, 1]})
    opts, sources = resolved_by_cli([str(spec), "--time-budget", "none", "--scaling", "none", "--layers", "none"])
    assert (opts.time_budget, opts.scaling, opts.layer_ids) == (None, (), None)
    assert sources["time_budget"] == sources["scaling"] == sources["layer_ids"] == "cli"


# ------------------------------------------------------------------------------ the manifest


def small_recipe(folder: Path) -> dict:
    """A spec block for a tiny run (seconds on one thread)."""
    prompts_file(folder)
    return {
        "prompts": "prompts.jsonl",
        "max_steps": 6,
        "eval_every": 3,
        "max_tokens": 12,
        "draft_vocab": 120,
        "batch_size": 4,
        "held_out": 0.2,
        "weight_decay": 0.01,
    }


def test_the_manifest_holds_the_resolved_recipe_and_it_trains_the_same_head(tmp_path, tiny_ckpts):
    """The manifest's recipe, with where each value came from; a spec whose block is that recipe
    trains the same head with no flags at all."""
    a = tmp_path / "a"
    a.mkdir()
    loaded = load_spec(recipe_spec(a, tiny_ckpts["target"], small_recipe(a)))
    distill_run.distill(loaded, DistillOptions(gen_batch=4, seed=5, labels="hard"))  # two flags given
    manifest = json.loads((a / "head" / "trtspec-head.json").read_text())
    recipe, sources = manifest["recipe"], manifest["recipe_from"]
    assert set(recipe) == set(RECIPE_FIELDS) == set(sources)  # the manifest is written with sorted keys
    assert (recipe["seed"], recipe["labels"], sources["seed"], sources["labels"]) == (5, "hard", "cli", "cli")
    assert (recipe["weight_decay"], recipe["max_steps"], sources["weight_decay"]) == (0.01, 6, "spec")
    assert recipe["prompts"] == str(a / "prompts.jsonl") and sources["prompts"] == "spec"
    assert (recipe["lr"], sources["lr"], recipe["time_budget"]) == (0.001, "default", None)
    assert manifest["run"]["gen_batch"] == 4 and "seed" not in manifest["run"] and "output" in manifest["run"]
    assert manifest["steps"] == 6

    b = tmp_path / "b"
    again = load_spec(recipe_spec(b, tiny_ckpts["target"], recipe))
    distill_run.distill(again, DistillOptions(gen_batch=4))
    rebuilt = json.loads((b / "head" / "trtspec-head.json").read_text())
    assert rebuilt["recipe"] == recipe and set(rebuilt["recipe_from"].values()) == {"spec"}
    first, second = (load_file(str(d / "head" / "model.safetensors")) for d in (a, b))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    assert DistillRecipe.model_validate(recipe).model_dump(mode="json") == recipe


# ------------------------------------------------------------------------------ resume


def interrupted_run(folder: Path, target: Path, recipe: dict, **flags):
    """A run stopped by Ctrl-C after step 2, its checkpoint left in the work folder."""

    def interrupt(row):
        if row["step"] == 2:
            raise KeyboardInterrupt

    loaded = load_spec(recipe_spec(folder, target, recipe))
    with pytest.raises(KeyboardInterrupt):
        distill_run.distill(loaded, DistillOptions(gen_batch=4, **flags), on_step=interrupt)


def test_resume_refuses_a_changed_recipe_from_the_spec(tmp_path, tiny_ckpts):
    recipe = small_recipe(tmp_path)
    interrupted_run(tmp_path, tiny_ckpts["target"], recipe)
    changed = load_spec(recipe_spec(tmp_path, tiny_ckpts["target"], {**recipe, "weight_decay": 0.02}))
    with pytest.raises(TrtspecError, match="other data, seed or training options"):
        distill_run.distill(changed, DistillOptions(gen_batch=4, resume=True))
    # the same recipe, a value now given as a flag and a longer budget: resumed
    same = load_spec(recipe_spec(tmp_path, tiny_ckpts["target"], {k: v for k, v in recipe.items() if k != "weight_decay"}))
    result = distill_run.distill(same, DistillOptions(gen_batch=4, resume=True, weight_decay=0.01, time_budget=3600))
    assert result.steps == 6


@pytest.mark.parametrize("change", [{"weight_decay": 0.02}, {"held_out": 0.3}, {"max_len": 64}, {"warmup": 0.5}])
def test_resume_refuses_a_changed_recipe_from_the_options(tmp_path, tiny_ckpts, change):
    """Every recipe field that shapes the weights is in the checkpoint's key: weight decay,
    the held-out split, the training sequence length, the warmup."""
    prompts = prompts_file(tmp_path, PROMPTS)
    base = dict(prompts=prompts, max_steps=6, eval_every=3, max_tokens=12, draft_vocab=120, batch_size=4, held_out=0.2)
    interrupted_run(tmp_path, tiny_ckpts["target"], None, **base)
    loaded = load_spec(recipe_spec(tmp_path, tiny_ckpts["target"], None))
    with pytest.raises(TrtspecError, match="other data, seed or training options"):
        distill_run.distill(loaded, DistillOptions(gen_batch=4, resume=True, **{**base, **change}))


def test_flags_and_the_block_that_contradict_each_other_are_refused_together(tmp_path, tiny_ckpts):
    """The spec says labels: hard, the command --label-temperature 2: each is valid alone, the
    merged recipe is not (exit 2, the message names both settings and the fix)."""
    spec = recipe_spec(tmp_path, tiny_ckpts["target"], {"labels": "hard"})
    with pytest.raises(SpecError, match="label_temperature 2 softens soft labels under the KL.*got labels hard, loss kl"):
        resolve(load_spec(spec), DistillOptions(label_temperature=2.0))
    r = runner.invoke(app, ["distill", str(spec), "--label-temperature", "2"])
    assert r.exit_code == 2 and "use --labels soft --loss kl" in " ".join(r.stderr.split())
    assert not (tmp_path / "head").exists()

"""What `trtspec distill` is asked: the head recipe (trtspec/recipe.py, also the spec's
``distill:`` block) plus the settings of one run, each value's type, default and bounds once
(the command's flags, trtspec/cli/distill.py, are validated into it)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import Field, ValidationError

from trtspec.errors import SpecError
from trtspec.recipe import RECIPE_FIELDS, DistillRecipe
from trtspec.spec import LoadedSpec

GEN_BATCH_MAX = 512  # --gen-batch's upper limit


class DistillOptions(DistillRecipe):
    """The recipe and how this run goes: where the head goes, whether it replaces one or
    resumes a run, how many sequences are generated at once. None of these shape the head."""

    output: Path | None = None
    force: bool = False
    resume: bool = False
    gen_batch: Annotated[int | None, Field(ge=1, le=GEN_BATCH_MAX)] = None  # None: distill/run.generation_rows
    allow_pickle: bool = False  # the command's --allow-pickle (cli/common.py)
    # Continuing a head on served traffic (distill/refine.py, docs/capture.md).
    from_capture: Path | None = None
    init: Path | None = None
    replay: Annotated[float, Field(ge=0, lt=1)] = 0.5
    capture_held_out: Annotated[float, Field(gt=0, lt=1)] = 0.2


# Where a recipe value came from, as the head's manifest records it.
DEFAULT, SPEC, CLI = "default", "spec", "cli"


def resolve(loaded: LoadedSpec, opts: DistillOptions) -> tuple[DistillOptions, dict[str, str]]:
    """The options a run uses: each recipe field set on ``opts`` (the flags given on the
    command line) wins, else the spec's ``distill:`` key (paths relative to the spec file), else
    the field's default; and where each recipe value came from (CLI, SPEC or DEFAULT)."""
    block = loaded.spec.distill
    update, sources = {}, {}
    for name in RECIPE_FIELDS:
        if name in opts.model_fields_set:
            sources[name] = CLI
        elif block is not None and name in block.model_fields_set:
            value = getattr(block, name)
            update[name] = loaded.resolve(str(value)) if isinstance(value, Path) else value
            sources[name] = SPEC
        else:
            sources[name] = DEFAULT
    given = {name: getattr(opts, name) for name in opts.model_fields_set}
    try:  # validated whole: the flags and the spec's block together may contradict each other
        merged = DistillOptions.model_validate({**given, **update})
    except ValidationError as e:
        problems = "; ".join(str(err["msg"]).removeprefix("Value error, ") for err in e.errors())
        raise SpecError(f"{loaded.path}: distill: {problems}") from None
    return merged, sources


def recipe_dump(opts: DistillOptions) -> dict:
    """The recipe's values as JSON: what a spec's ``distill:`` block holds to train this head again."""
    return opts.model_dump(mode="json", include=set(RECIPE_FIELDS))


def run_dump(opts: DistillOptions) -> dict:
    """The settings of this run that are not the recipe."""
    return opts.model_dump(mode="json", exclude=set(RECIPE_FIELDS))

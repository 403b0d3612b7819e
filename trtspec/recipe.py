"""The head recipe: how `trtspec distill` trains an EAGLE-3 head, each setting declared once.

``DistillRecipe`` is both the engine spec's optional ``distill:`` block (trtspec/spec.py) and
the recipe part of distill's options (trtspec/distill/options.py): a field's type, default and
bounds are written here; each has a flag of the same name in trtspec/cli/distill.py, validated
into it. Flags given on the command line override the spec's block; the resolved recipe, with
where each value came from, is written into the head's manifest.

Run settings that do not shape the head (--output, --force, --resume, --gen-batch) are not
part of the recipe.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smh]?)$")
_FRACTIONS = "fractions of the data below 1, e.g. 0.125,0.25,0.5"


def parse_duration(value: str | float | int | None) -> float | None:
    """Seconds from 600, '600', '600s', '10m' or '1.5h'; None from 'none' (no budget: a flag
    that clears the spec's); ValueError names the format."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "none"):
        return None
    m = _DURATION.match(str(value).strip())
    if isinstance(value, bool) or not m or float(m.group(1)) <= 0:
        raise ValueError(f"takes a positive duration like 600, 600s, 10m or 1h (got {value!r})")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


def _listed(value, kind: type, what: str, none):
    """A comma-separated flag value ("1,14,26") or the spec's YAML list, as a tuple of
    ``kind``; "none" gives ``none`` (the field's default: a flag that clears the spec's)."""
    if not isinstance(value, str):
        return value
    if value.strip().lower() == "none":
        return none
    try:
        return tuple(kind(x) for x in value.split(","))
    except ValueError:
        raise ValueError(f"takes comma-separated {what} (got {value!r})") from None


class DistillRecipe(BaseModel):
    """What shapes a distilled head: its data, its training and its evaluation."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # the data
    prompts: Path | None = None  # in the spec: relative to the spec file
    eval_prompts: Path | None = None
    corpus: Path | None = None  # a user's conversations (distill/corpus.py), captured without generation
    max_tokens: Annotated[int, Field(ge=1)] = 128
    samples_per_prompt: Annotated[int, Field(ge=1, le=64)] = 1
    branches_per_prompt: Annotated[int, Field(ge=0, le=64)] = 0
    temperature: Annotated[float, Field(ge=0.05, le=2.0)] = 0.8  # labels stay the target's greedy tokens
    held_out: Annotated[float, Field(gt=0, lt=1)] = 0.1  # fraction of prompts never trained on
    max_len: Annotated[int, Field(ge=2)] = 512  # positions per training sequence
    # the head
    layer_ids: tuple[int, ...] | None = None  # default: engines/eagle3_checkpoint.distill_layer_ids
    draft_vocab: Annotated[int, Field(ge=1)] = 8192
    anchor: bool = True
    train_lm_head: bool = False
    # the training
    max_steps: Annotated[int, Field(ge=1)] = 2000
    time_budget: float | None = None  # seconds, the whole run, data generation included
    seed: int = 0
    batch_size: Annotated[int, Field(ge=1)] = 8
    lr: float = 1e-3
    weight_decay: Annotated[float, Field(ge=0.0)] = 0.0
    schedule: Literal["cosine", "constant"] = "cosine"  # cosine: linear warmup then cosine decay to lr/10
    warmup: Annotated[float, Field(ge=0, le=1)] = 0.05  # fraction of max_steps
    labels: Literal["soft", "hard"] = "soft"
    loss: Literal["kl", "lk"] = "kl"  # lk measured on the demo's capture: docs/codesign.md
    label_temperature: Annotated[float, Field(gt=0.0, le=10.0)] = 1.0
    all_positions: bool = False
    ttt_steps: Annotated[int | None, Field(ge=1, le=16)] = None  # None: the spec's default_draft_tokens
    # 0.5 (weights 1, 0.5, 0.25 for 3 steps): on the demo's capture it kept the first draft at
    # the depth-1 head's level and lifted drafts 2-3 (docs/codesign.md); EAGLE-3's 0.8 lowered both.
    step_decay: Annotated[float, Field(ge=0.0, le=1.0)] = 0.5
    ttt_phase: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    ttt_reach: bool = False
    feature_noise: Annotated[float, Field(ge=0.0)] = 0.0
    dropout: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.0
    start_decay: Annotated[float, Field(ge=0.0)] = 0.0
    ema: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.0
    norms: bool = False
    # the evaluation
    eval_every: Annotated[int, Field(ge=1)] = 50
    scaling: tuple[float, ...] = ()

    @field_validator("time_budget", mode="before")
    @classmethod
    def _duration(cls, v):
        return parse_duration(v)

    @field_validator("layer_ids", mode="before")
    @classmethod
    def _layer_list(cls, v):
        return _listed(v, int, "target layer ids, e.g. 1,14,26", None)

    @field_validator("scaling", mode="before")
    @classmethod
    def _scaling_list(cls, v):
        return _listed(v, float, _FRACTIONS, ())

    @field_validator("scaling")
    @classmethod
    def _fractions(cls, v: tuple[float, ...]) -> tuple[float, ...]:
        if not all(0 < f < 1 for f in v):
            raise ValueError(f"takes comma-separated {_FRACTIONS} (got {','.join(f'{f:g}' for f in v)})")
        return v

    @model_validator(mode="after")
    def _consistent(self):
        if problem := self.conflict():
            raise ValueError(problem)
        return self

    def conflict(self) -> str | None:
        """What makes these settings contradict each other, or None (the model validator's
        check; distill's options are validated again once the flags and the spec's block merge)."""
        if self.label_temperature != 1.0 and (self.labels != "soft" or self.loss != "kl"):
            return (
                f"label_temperature {self.label_temperature:g} softens soft labels under the KL; it needs labels soft "
                f"and loss kl (got labels {self.labels}, loss {self.loss}): drop it or use --labels soft --loss kl"
            )
        return None


RECIPE_FIELDS: tuple[str, ...] = tuple(DistillRecipe.model_fields)

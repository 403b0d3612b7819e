"""The head recipe: how `trtspec distill` trains an EAGLE-3 head, each setting declared once.

``DistillRecipe`` is both the engine spec's optional ``distill:`` block (trtspec/spec.py) and
the recipe part of distill's options (trtspec/distill/options.py): a field's type, default,
bounds and --help text are written here, and the command's flags are built from it
(trtspec/cli/options.py). Flags given on the command line override the spec's block; the
resolved recipe, with where each value came from, is written into the head's manifest.

Run settings that do not shape the head (--output, --force, --resume, --gen-batch) are not
part of the recipe.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from trtspec.flags import Flag

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
    prompts: Annotated[Path | None, Flag('JSONL prompts ({"prompt": ...} per line); default: the shipped set.')] = (
        None  # in the spec: relative to the spec file
    )
    eval_prompts: Annotated[
        Path | None,
        Flag(
            "JSONL prompts scored as unseen beside the spec's verify prompts (never trained on), e.g. the chat set trtspec ships, trtspec/bench/prompts.jsonl in its install folder."
        ),
    ] = None
    corpus: Annotated[
        Path | None,
        Flag(
            "Your own conversations, trained on without generation: OpenAI messages JSONL or ShareGPT JSON; "
            "assistant turns are the response positions, labels are the target's own tokens."
        ),
    ] = None  # a user's conversations (distill/corpus.py), captured without generation
    max_tokens: Annotated[int, Field(ge=1), Flag("Target response length per prompt.")] = 128
    samples_per_prompt: Annotated[
        int,
        Field(ge=1, le=64),
        Flag(
            "Training responses per prompt: the greedy one plus N-1 sampled ones (more contexts; labels stay the "
            "target's greedy tokens). Held-out prompts keep their greedy response only."
        ),
    ] = 1
    branches_per_prompt: Annotated[
        int,
        Field(ge=0, le=64),
        Flag("Sampled continuations per training prompt from a random point inside its greedy response."),
    ] = 0
    temperature: Annotated[float, Field(ge=0.05, le=2.0), Flag("Temperature of the sampled responses (top-p 0.95).")] = (
        0.8  # labels stay the target's greedy tokens
    )
    held_out: Annotated[float, Field(gt=0, lt=1)] = 0.1  # fraction of prompts never trained on
    max_len: Annotated[int, Field(ge=2)] = 512  # positions per training sequence
    # the head
    layer_ids: Annotated[
        tuple[int, ...] | None,
        Flag(
            "Target layer ids the head reads (default or none: {1, L//2-1, L-2}: the latest vLLM can name).",
            name="--layers",
            text=True,
        ),
    ] = None  # default: engines/eagle3_checkpoint.distill_layer_ids
    draft_vocab: Annotated[int, Field(ge=1), Flag("Draft vocabulary size (the target's most frequent outputs).")] = 8192
    anchor: Annotated[
        bool,
        Flag("Start the head as the target's own next-token predictor (copy of its last layer).", negatable=True),
    ] = True
    train_lm_head: Annotated[bool, Flag("Train the LM head too (default: the target's, frozen).")] = False
    # the training
    max_steps: Annotated[int, Field(ge=1), Flag("Training steps at most.")] = 2000
    time_budget: Annotated[
        float | None,
        Flag(
            "Stop training when the run (data included) reaches this: 600, 10m, 1h (none: no budget); "
            "no head when it is reached before the first step.",
            text=True,
        ),
    ] = None  # seconds, the whole run, data generation included
    seed: Annotated[int, Flag("Seed of the split, the initialisation and the batches.")] = 0
    batch_size: Annotated[int, Field(ge=1), Flag("Sequences per training step.")] = 8
    lr: Annotated[float, Flag("AdamW learning rate.")] = 1e-3
    weight_decay: Annotated[float, Field(ge=0.0), Flag("AdamW weight decay.")] = 0.0
    schedule: Annotated[Literal["cosine", "constant"], Flag("cosine: warmup then cosine decay; constant.")] = (
        "cosine"  # cosine: linear warmup then cosine decay to lr/10
    )
    warmup: Annotated[float, Field(ge=0, le=1)] = 0.05  # fraction of max_steps
    labels: Annotated[
        Literal["soft", "hard"],
        Flag(
            "soft: train on the target's distribution (its top-32 logits over the draft vocabulary), more signal "
            "per captured token; hard: on its greedy token."
        ),
    ] = "soft"
    loss: Annotated[
        Literal["kl", "lk"],
        Flag(
            "kl: cross-entropy to the target's distribution (KL up to a constant); lk: -log of the acceptance "
            "rate sum_x min(p_x, q_x) over the same top-32 (LK losses, arXiv 2602.23881). Soft labels only: with "
            "--labels hard the two are the same loss."
        ),
    ] = "kl"  # lk measured on the demo's capture: docs/codesign.md
    label_temperature: Annotated[
        float,
        Field(gt=0.0, le=10.0),
        Flag(
            "Soft labels with --loss kl: the target's and the head's logits both divided by T and the loss "
            "scaled by T^2 (distillation's temperature); above 1 the runner-ups weigh more. 1: the plain KL."
        ),
    ] = 1.0
    all_positions: Annotated[bool, Flag("Also train on prompt and template positions (default: response positions only).")] = (
        False
    )
    ttt_steps: Annotated[
        int | None,
        Field(ge=1, le=16),
        Flag("Unrolled drafting steps trained per position (training-time test); default: the k the spec drafts."),
    ] = None  # None: the spec's default_draft_tokens
    # 0.5 (weights 1, 0.5, 0.25 for 3 steps): on the demo's capture it kept the first draft at
    # the depth-1 head's level and lifted drafts 2-3 (docs/codesign.md); EAGLE-3's 0.8 lowered both.
    step_decay: Annotated[float, Field(ge=0.0, le=1.0), Flag("Loss weight of unrolled step j: DECAY^j (1: equal weights).")] = 0.5
    ttt_phase: Annotated[
        float,
        Field(ge=0.0, le=1.0),
        Flag(
            "Fraction of --max-steps that train the first draft step alone before every unrolled step (the depth-1 head first)."
        ),
    ] = 0.0
    ttt_reach: Annotated[
        bool,
        Flag(
            "Weight each position of unrolled step j >= 1 by the head's own probability (not trained through) that "
            "the chain's earlier drafts there are the target's tokens: deeper steps learn where the runtime reaches them."
        ),
    ] = False
    feature_noise: Annotated[
        float, Field(ge=0.0), Flag("Uniform noise in [-A, A] added to the target's features while training.")
    ] = 0.0
    dropout: Annotated[
        float,
        Field(ge=0.0, lt=1.0),
        Flag(
            "Dropout on the head's fused input and on its attention output while training (a head trained for "
            "several passes over a small capture learns it by heart)."
        ),
    ] = 0.0
    start_decay: Annotated[
        float,
        Field(ge=0.0),
        Flag(
            "Pull the trained weights back toward the head's start (with --anchor: the target's own layer) by "
            "lr x this each step, as AdamW's weight decay pulls toward zero (L2-SP); 0: no pull."
        ),
    ] = 0.0
    ema: Annotated[
        float,
        Field(ge=0.0, lt=1.0),
        Flag(
            "Keep a running average of the trained weights, avg = D x avg + (1 - D) x weights after every step, and "
            "evaluate and write the average instead of the last weights (0: the last weights)."
        ),
    ] = 0.0
    norms: Annotated[
        bool,
        Flag(
            "EAGLE-3.1's norms (speculators' default): the fused features normed before fc, the hidden-normed state "
            "as the residual, the normed output fed back. vLLM and TensorRT-LLM read them; SGLang does not, so off "
            "by default (docs/codesign.md)."
        ),
    ] = False
    # the evaluation
    eval_every: Annotated[int, Field(ge=1), Flag("Held-out evaluation and checkpoint every N steps.")] = 50
    scaling: Annotated[
        tuple[float, ...],
        Flag(
            "Also train on these fractions of the data (e.g. 0.125,0.25,0.5; steps in proportion) and plot "
            "unseen-prompt acceptance against training tokens (data-scaling.png in the head folder; none: no curve).",
            text=True,
        ),
    ] = ()

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
        """What makes these settings contradict each other, or None. The validator runs it on a
        recipe built at once; distill's options run it again once the command's flags and the
        spec's block are merged (a copy is not validated)."""
        if self.label_temperature != 1.0 and (self.labels != "soft" or self.loss != "kl"):
            return (
                f"label_temperature {self.label_temperature:g} softens soft labels under the KL; it needs labels soft "
                f"and loss kl (got labels {self.labels}, loss {self.loss}): drop it or use --labels soft --loss kl"
            )
        return None


RECIPE_FIELDS: tuple[str, ...] = tuple(DistillRecipe.model_fields)

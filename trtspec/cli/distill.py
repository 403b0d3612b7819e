"""`trtspec distill SPEC`: train an EAGLE-3 head for the spec's target."""

from __future__ import annotations

import re
from enum import Enum
from pathlib import Path

import typer

from trtspec.cli.common import AllowPickleOpt, DeviceOpt, JsonFileOpt, JsonOpt, SpecArg, handle_errors, with_device
from trtspec.cli.output import emit
from trtspec.errors import TrtspecError
from trtspec.spec import load_spec

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smh]?)$")


class Labels(str, Enum):
    hard = "hard"
    soft = "soft"


class Schedule(str, Enum):
    cosine = "cosine"
    constant = "constant"


def parse_duration(text: str | None) -> float | None:
    """Seconds from '90', '90s', '10m' or '1.5h'; TrtspecError names the format."""
    if text is None:
        return None
    m = _DURATION.match(text.strip())
    if not m or float(m.group(1)) <= 0:
        raise TrtspecError(f"--time-budget takes a positive duration like 600, 600s, 10m or 1h (got {text!r})")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


def _layers(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise TrtspecError(f"--layers takes comma-separated target layer ids, e.g. 1,14,26 (got {text!r})") from None


def _fractions(text: str | None) -> tuple[float, ...]:
    if text is None:
        return ()
    try:
        out = tuple(float(x) for x in text.split(","))
    except ValueError:
        out = ()
    if not out or not all(0 < f < 1 for f in out):
        raise TrtspecError(f"--scaling takes comma-separated fractions of the data below 1, e.g. 0.125,0.25,0.5 (got {text!r})")
    return out


@handle_errors
def distill(
    spec: SpecArg,
    prompts: Path | None = typer.Option(
        None, "--prompts", help='JSONL prompts ({"prompt": ...} per line); default: the shipped set.'
    ),
    eval_prompts: Path | None = typer.Option(
        None,
        "--eval-prompts",
        help="JSONL prompts scored as unseen beside the spec's verify prompts (never trained on), e.g. bench/prompts.jsonl.",
    ),
    output: Path | None = typer.Option(None, "--output", "-o", help="Head folder (default: the spec's draft.path)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing head folder."),
    resume: bool = typer.Option(False, "--resume", help="Continue from the last checkpoint of an interrupted run."),
    max_steps: int = typer.Option(2000, "--max-steps", min=1, help="Training steps at most."),
    time_budget: str | None = typer.Option(
        None, "--time-budget", help="Stop training when the run (data included) reaches this: 600, 10m, 1h."
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of the split, the initialisation and the batches."),
    draft_vocab: int = typer.Option(
        8192, "--draft-vocab", min=1, help="Draft vocabulary size (the target's most frequent outputs)."
    ),
    ttt_steps: int | None = typer.Option(
        None,
        "--ttt-steps",
        min=1,
        max=16,
        help="Unrolled drafting steps trained per position (training-time test); default: the k the spec drafts.",
    ),
    max_tokens: int = typer.Option(128, "--max-tokens", min=1, help="Target response length per prompt."),
    batch_size: int = typer.Option(8, "--batch-size", min=1, help="Sequences per training step."),
    lr: float = typer.Option(1e-3, "--lr", help="AdamW learning rate."),
    weight_decay: float = typer.Option(0.0, "--weight-decay", min=0.0, help="AdamW weight decay."),
    labels: Labels = typer.Option(
        Labels.soft,
        "--labels",
        help="soft: train on the target's distribution (its top-32 logits over the draft vocabulary), "
        "more signal per captured token; hard: on its greedy token.",
    ),
    samples_per_prompt: int = typer.Option(
        1,
        "--samples-per-prompt",
        min=1,
        max=64,
        help="Training responses per prompt: the greedy one plus N-1 sampled ones (more contexts; "
        "labels stay the target's greedy tokens). Held-out prompts keep their greedy response only.",
    ),
    branches_per_prompt: int = typer.Option(
        0,
        "--branches-per-prompt",
        min=0,
        max=64,
        help="Sampled continuations per training prompt from a random point inside its greedy response.",
    ),
    temperature: float = typer.Option(
        0.8, "--temperature", min=0.05, max=2.0, help="Temperature of the sampled responses (top-p 0.95)."
    ),
    gen_batch: int | None = typer.Option(
        None,
        "--gen-batch",
        min=1,
        max=512,
        help="Sequences generated at once (one decode step reads the weights once for all); default 32 on CPU, "
        "on CUDA as many as fit in the free GPU memory (docs/codesign.md).",
        show_default=False,
    ),
    corpus: Path | None = typer.Option(
        None,
        "--corpus",
        help="Your own conversations, trained on without generation: OpenAI messages JSONL or ShareGPT JSON; "
        "assistant turns are the response positions, labels are the target's own tokens.",
    ),
    layers: str | None = typer.Option(
        None, "--layers", help="Target layer ids the head reads (default: {1, L//2-1, L-2}: the latest vLLM can name)."
    ),
    anchor: bool = typer.Option(
        True, "--anchor/--no-anchor", help="Start the head as the target's own next-token predictor (copy of its last layer)."
    ),
    train_lm_head: bool = typer.Option(False, "--train-lm-head", help="Train the LM head too (default: the target's, frozen)."),
    all_positions: bool = typer.Option(
        False, "--all-positions", help="Also train on prompt and template positions (default: response positions only)."
    ),
    step_decay: float = typer.Option(
        0.8, "--step-decay", min=0.0, max=1.0, help="Loss weight of unrolled step j: DECAY^j (1: equal weights)."
    ),
    ttt_phase: float = typer.Option(
        0.0,
        "--ttt-phase",
        min=0.0,
        max=1.0,
        help="Fraction of --max-steps that train the first draft step alone before every unrolled step (the depth-1 head first).",
    ),
    feature_noise: float = typer.Option(
        0.0, "--feature-noise", min=0.0, help="Uniform noise in [-A, A] added to the target's features while training."
    ),
    schedule: Schedule = typer.Option(Schedule.cosine, "--schedule", help="cosine: warmup then cosine decay; constant."),
    scaling: str | None = typer.Option(
        None,
        "--scaling",
        help="Also train on these fractions of the data (e.g. 0.125,0.25,0.5; steps in proportion) and plot "
        "unseen-prompt acceptance against training tokens (data-scaling.png in the head folder).",
    ),
    eval_every: int = typer.Option(50, "--eval-every", min=1, help="Held-out evaluation and checkpoint every N steps."),
    allow_pickle: AllowPickleOpt = False,
    device: DeviceOpt = None,
    as_json: JsonOpt = False,
    json_file: JsonFileOpt = None,
) -> None:
    """Train an EAGLE-3 head for SPEC's target and write it at the spec's draft.path.

    Data are the target's own responses to the prompts (10% held out, never trained on),
    captured as they are generated, plus --corpus conversations. The spec's verify prompts
    are never trained on: distill scores the head on them per draft position, measures its
    costs and recommends default_draft_tokens. Ctrl-C keeps the last good checkpoint; --resume
    finishes the run exactly as if uninterrupted. Exit 2 on bad input (existing output without
    --force, empty prompts, a corpus in another format, a work folder in use).

    Examples:
      trtspec distill engine_specs/smollm2-135m-eagle3.yaml --time-budget 25m
      trtspec distill engine_specs/smollm2-135m-eagle3.yaml --corpus chats.jsonl --max-steps 3000
      trtspec distill engine_specs/tiny-llama-eagle3.yaml --max-steps 200 --force
      trtspec distill my-8b-eagle3.yaml --device cuda --time-budget 2h   # target, capture and training on the GPU
    """
    from trtspec.distill.run import DistillOptions
    from trtspec.distill.run import distill as run

    loaded = with_device(load_spec(spec), device)
    opts = DistillOptions(
        prompts=prompts,
        eval_prompts=eval_prompts,
        output=output,
        force=force,
        resume=resume,
        max_steps=max_steps,
        time_budget_s=parse_duration(time_budget),
        seed=seed,
        draft_vocab=draft_vocab,
        ttt_steps=ttt_steps,
        max_tokens=max_tokens,
        batch_size=batch_size,
        lr=lr,
        weight_decay=weight_decay,
        labels=labels.value,
        samples_per_prompt=samples_per_prompt,
        branches_per_prompt=branches_per_prompt,
        temperature=temperature,
        gen_batch=gen_batch,
        corpus=corpus,
        anchor=anchor,
        train_lm_head=train_lm_head,
        response_only=not all_positions,
        step_decay=step_decay,
        ttt_phase=ttt_phase,
        feature_noise=feature_noise,
        schedule=schedule.value,
        scaling=_fractions(scaling),
        eval_every=eval_every,
        layer_ids=_layers(layers),
        allow_pickle=allow_pickle,
    )
    result = run(loaded, opts)
    m = result.metrics
    k = result.advice["recommended_k"]
    emit(
        result,
        lambda out: out.print(
            f"head written to {result.output}: {result.steps} steps ({result.stopped_by}); unseen prompts: "
            f"per-position acceptance {'/'.join(f'{a:.2f}' for a in m['unseen_accepted'])}, acceptance length "
            f"{m['unseen_acceptance_length']:.2f} at k={len(m['unseen_accepted'])}; "
            + (f"recommended default_draft_tokens: {k}" if k else "no draft length beats target-only with this head")
        ),
        as_json=as_json,
        json_file=json_file,
    )

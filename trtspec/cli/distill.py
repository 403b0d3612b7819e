"""`trtspec distill SPEC`: train an EAGLE-3 head for the spec's target."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from trtspec.cli.common import AllowPickleOpt, DeviceOpt, JsonFileOpt, JsonOpt, SpecArg, handle_errors, with_device
from trtspec.cli.options import from_flags
from trtspec.cli.output import emit
from trtspec.distill.options import DistillOptions
from trtspec.spec import load_spec

# The recipe's flags (trtspec/recipe.py: a flag given overrides the spec's distill: key) and the
# run's own (trtspec/distill/options.py), validated into DistillOptions.
Opt = typer.Option
PromptsOpt = Annotated[Path | None, Opt("--prompts", help='JSONL prompts ({"prompt": ...} per line); default: the shipped set.')]
EvalPromptsOpt = Annotated[
    Path | None,
    Opt(
        "--eval-prompts",
        help="JSONL prompts scored as unseen beside the spec's verify prompts (never trained on), e.g. the chat set trtspec ships: prompts.jsonl in the trtspec/bench folder of its install.",
    ),
]
CorpusOpt = Annotated[
    Path | None,
    Opt(
        "--corpus",
        help="Your own conversations, trained on without generation: OpenAI messages JSONL or ShareGPT JSON; assistant turns are the response positions, labels are the target's own tokens.",
    ),
]
MaxTokensOpt = Annotated[int, Opt("--max-tokens", help="Target response length per prompt.")]
SamplesPerPromptOpt = Annotated[
    int,
    Opt(
        "--samples-per-prompt",
        help="Training responses per prompt: the greedy one plus N-1 sampled ones (more contexts; labels stay the target's greedy tokens). Held-out prompts keep their greedy response only.",
    ),
]
BranchesPerPromptOpt = Annotated[
    int,
    Opt(
        "--branches-per-prompt", help="Sampled continuations per training prompt from a random point inside its greedy response."
    ),
]
TemperatureOpt = Annotated[float, Opt("--temperature", help="Temperature of the sampled responses (top-p 0.95).")]
LayerIdsOpt = Annotated[
    str | None,
    Opt("--layers", help="Target layer ids the head reads (default or none: {1, L//2-1, L-2}: the latest vLLM can name)."),
]
DraftVocabOpt = Annotated[int, Opt("--draft-vocab", help="Draft vocabulary size (the target's most frequent outputs).")]
AnchorOpt = Annotated[
    bool, Opt("--anchor/--no-anchor", help="Start the head as the target's own next-token predictor (copy of its last layer).")
]
TrainLmHeadOpt = Annotated[bool, Opt("--train-lm-head", help="Train the LM head too (default: the target's, frozen).")]
MaxStepsOpt = Annotated[int, Opt("--max-steps", help="Training steps at most.")]
TimeBudgetOpt = Annotated[
    str | None,
    Opt(
        "--time-budget",
        help="Stop training when the run (data included) reaches this: 600, 10m, 1h (none: no budget); no head when it is reached before the first step.",
    ),
]
SeedOpt = Annotated[int, Opt("--seed", help="Seed of the split, the initialisation and the batches.")]
BatchSizeOpt = Annotated[int, Opt("--batch-size", help="Sequences per training step.")]
LrOpt = Annotated[float, Opt("--lr", help="AdamW learning rate.")]
WeightDecayOpt = Annotated[float, Opt("--weight-decay", help="AdamW weight decay.")]
ScheduleOpt = Annotated[str, Opt("--schedule", help="cosine: warmup then cosine decay; constant. One of: cosine, constant.")]
LabelsOpt = Annotated[
    str,
    Opt(
        "--labels",
        help="soft: train on the target's distribution (its top-32 logits over the draft vocabulary), more signal per captured token; hard: on its greedy token. One of: soft, hard.",
    ),
]
LossOpt = Annotated[
    str,
    Opt(
        "--loss",
        help="kl: cross-entropy to the target's distribution (KL up to a constant); lk: -log of the acceptance rate sum_x min(p_x, q_x) over the same top-32 (LK losses, arXiv 2602.23881). Soft labels only: with --labels hard the two are the same loss. One of: kl, lk.",
    ),
]
LabelTemperatureOpt = Annotated[
    float,
    Opt(
        "--label-temperature",
        help="Soft labels with --loss kl: the target's and the head's logits both divided by T and the loss scaled by T^2 (distillation's temperature); above 1 the runner-ups weigh more. 1: the plain KL.",
    ),
]
AllPositionsOpt = Annotated[
    bool, Opt("--all-positions", help="Also train on prompt and template positions (default: response positions only).")
]
TttStepsOpt = Annotated[
    int | None,
    Opt("--ttt-steps", help="Unrolled drafting steps trained per position (training-time test); default: the k the spec drafts."),
]
StepDecayOpt = Annotated[float, Opt("--step-decay", help="Loss weight of unrolled step j: DECAY^j (1: equal weights).")]
TttPhaseOpt = Annotated[
    float,
    Opt(
        "--ttt-phase",
        help="Fraction of --max-steps that train the first draft step alone before every unrolled step (the depth-1 head first).",
    ),
]
TttReachOpt = Annotated[
    bool,
    Opt(
        "--ttt-reach",
        help="Weight each position of unrolled step j >= 1 by the head's own probability (not trained through) that the chain's earlier drafts there are the target's tokens: deeper steps learn where the runtime reaches them.",
    ),
]
FeatureNoiseOpt = Annotated[
    float, Opt("--feature-noise", help="Uniform noise in [-A, A] added to the target's features while training.")
]
DropoutOpt = Annotated[
    float,
    Opt(
        "--dropout",
        help="Dropout on the head's fused input and on its attention output while training (a head trained for several passes over a small capture learns it by heart).",
    ),
]
StartDecayOpt = Annotated[
    float,
    Opt(
        "--start-decay",
        help="Pull the trained weights back toward the head's start (with --anchor: the target's own layer) by lr x this each step, as AdamW's weight decay pulls toward zero (L2-SP); 0: no pull.",
    ),
]
EmaOpt = Annotated[
    float,
    Opt(
        "--ema",
        help="Keep a running average of the trained weights, avg = D x avg + (1 - D) x weights after every step, and evaluate and write the average instead of the last weights (0: the last weights).",
    ),
]
NormsOpt = Annotated[
    bool,
    Opt(
        "--norms",
        help="EAGLE-3.1's norms (speculators' default): the fused features normed before fc, the hidden-normed state as the residual, the normed output fed back. vLLM and TensorRT-LLM read them; SGLang does not, so off by default (docs/codesign.md).",
    ),
]
EvalEveryOpt = Annotated[int, Opt("--eval-every", help="Held-out evaluation and checkpoint every N steps.")]
ScalingOpt = Annotated[
    str,
    Opt(
        "--scaling",
        help="Also train on these fractions of the data (e.g. 0.125,0.25,0.5; steps in proportion) and plot unseen-prompt acceptance against training tokens (data-scaling.png in the head folder; none: no curve).",
    ),
]
OutputOpt = Annotated[Path | None, Opt("--output", "-o", help="Head folder (default: the spec's draft.path).")]
ForceOpt = Annotated[bool, Opt("--force", help="Replace an existing head folder.")]
ResumeOpt = Annotated[bool, Opt("--resume", help="Continue from the last checkpoint of an interrupted run.")]
GenBatchOpt = Annotated[
    int | None,
    Opt(
        "--gen-batch",
        help="Sequences generated at once (one decode step reads the weights once for all); default: on a CPU the fastest batch measured on the machine, on CUDA as many as fit in the free GPU memory (docs/codesign.md).",
    ),
]
FromCaptureOpt = Annotated[
    Path | None, Opt("--from-capture", help="A serve.capture folder: continue --init's head on the requests captured there.")
]
InitOpt = Annotated[Path | None, Opt("--init", help="The head to continue from (with --from-capture); it is only read.")]
ReplayOpt = Annotated[
    float,
    Opt(
        "--replay",
        help="With --from-capture: the share of training sequences from the head's original data (so it does not forget).",
    ),
]
CaptureHeldOutOpt = Annotated[
    float,
    Opt(
        "--capture-held-out",
        help="With --from-capture: the share of captured requests, the newest, held out (never trained on) to score both heads.",
    ),
]

HELP = """Train an EAGLE-3 head for SPEC's target and write it at the spec's draft.path.

    Data are the target's own responses to the prompts (10% held out, never trained on),
    captured as they are generated, plus --corpus conversations. The spec's verify prompts
    are never trained on: distill scores the head on them per draft position, measures its
    costs and recommends default_draft_tokens. The recipe is the spec's distill: block, if it
    has one; a recipe flag given here overrides its key (none clears --time-budget, --scaling,
    --layers). Ctrl-C keeps the last good checkpoint; --resume finishes the run exactly as if
    uninterrupted, under the same recipe. Exit 2 on bad input (existing output without --force,
    empty prompts, a corpus in another format, a work folder in use, a changed recipe on --resume).

    Examples:
      trtspec distill engine_specs/smollm2-135m-eagle3.yaml
      trtspec distill engine_specs/smollm2-135m-eagle3.yaml --time-budget 25m
      trtspec distill engine_specs/smollm2-135m-eagle3.yaml --corpus chats.jsonl \\
        --max-steps 3000
      trtspec distill engine_specs/tiny-llama-eagle3.yaml --max-steps 200 --force
      trtspec distill my-8b-eagle3.yaml --device cuda --time-budget 2h  # a GPU
      trtspec distill my.yaml --from-capture captured --init heads/v1 \\
        -o heads/v2 --max-steps 300

    With --from-capture DIR --init HEAD: continue HEAD on the requests serve.capture kept in DIR
    (docs/capture.md), --replay of the training sequences from HEAD's original data; the newest
    --capture-held-out of the captured requests are never trained on, and both heads are scored
    side by side on them and on the spec's verify prompts (acceptance at k=1).
"""


# An option that names a DistillOptions field defaults to the field's default, declared there once.
DEFAULTS = DistillOptions()


@handle_errors
def distill(
    ctx: typer.Context,
    spec: SpecArg,
    prompts: PromptsOpt = DEFAULTS.prompts,
    eval_prompts: EvalPromptsOpt = DEFAULTS.eval_prompts,
    corpus: CorpusOpt = DEFAULTS.corpus,
    max_tokens: MaxTokensOpt = DEFAULTS.max_tokens,
    samples_per_prompt: SamplesPerPromptOpt = DEFAULTS.samples_per_prompt,
    branches_per_prompt: BranchesPerPromptOpt = DEFAULTS.branches_per_prompt,
    temperature: TemperatureOpt = DEFAULTS.temperature,
    layer_ids: LayerIdsOpt = DEFAULTS.layer_ids,
    draft_vocab: DraftVocabOpt = DEFAULTS.draft_vocab,
    anchor: AnchorOpt = DEFAULTS.anchor,
    train_lm_head: TrainLmHeadOpt = DEFAULTS.train_lm_head,
    max_steps: MaxStepsOpt = DEFAULTS.max_steps,
    time_budget: TimeBudgetOpt = DEFAULTS.time_budget,
    seed: SeedOpt = DEFAULTS.seed,
    batch_size: BatchSizeOpt = DEFAULTS.batch_size,
    lr: LrOpt = DEFAULTS.lr,
    weight_decay: WeightDecayOpt = DEFAULTS.weight_decay,
    schedule: ScheduleOpt = DEFAULTS.schedule,
    labels: LabelsOpt = DEFAULTS.labels,
    loss: LossOpt = DEFAULTS.loss,
    label_temperature: LabelTemperatureOpt = DEFAULTS.label_temperature,
    all_positions: AllPositionsOpt = DEFAULTS.all_positions,
    ttt_steps: TttStepsOpt = DEFAULTS.ttt_steps,
    step_decay: StepDecayOpt = DEFAULTS.step_decay,
    ttt_phase: TttPhaseOpt = DEFAULTS.ttt_phase,
    ttt_reach: TttReachOpt = DEFAULTS.ttt_reach,
    feature_noise: FeatureNoiseOpt = DEFAULTS.feature_noise,
    dropout: DropoutOpt = DEFAULTS.dropout,
    start_decay: StartDecayOpt = DEFAULTS.start_decay,
    ema: EmaOpt = DEFAULTS.ema,
    norms: NormsOpt = DEFAULTS.norms,
    eval_every: EvalEveryOpt = DEFAULTS.eval_every,
    scaling: ScalingOpt = DEFAULTS.scaling,
    output: OutputOpt = DEFAULTS.output,
    force: ForceOpt = DEFAULTS.force,
    resume: ResumeOpt = DEFAULTS.resume,
    gen_batch: GenBatchOpt = DEFAULTS.gen_batch,
    from_capture: FromCaptureOpt = DEFAULTS.from_capture,
    init: InitOpt = DEFAULTS.init,
    replay: ReplayOpt = DEFAULTS.replay,
    capture_held_out: CaptureHeldOutOpt = DEFAULTS.capture_held_out,
    allow_pickle: AllowPickleOpt = DEFAULTS.allow_pickle,
    device: DeviceOpt = None,
    as_json: JsonOpt = False,
    json_file: JsonFileOpt = None,
) -> None:
    from trtspec.distill.refine import refine
    from trtspec.distill.run import distill as run

    opts = from_flags(DistillOptions, ctx)
    loaded = with_device(load_spec(spec), device)
    result = refine(loaded, opts) if opts.from_capture or opts.init else run(loaded, opts)
    emit(result, lambda out: out.print(result.summary()), as_json=as_json, json_file=json_file)

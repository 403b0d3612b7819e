"""`trtspec verify SPEC`: speculative vs target-only, token by token."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.progress import Progress

from trtspec import console
from trtspec.cli.common import (
    DeviceOpt,
    EnginesOpt,
    JsonFileOpt,
    JsonOpt,
    LlmapiOpt,
    MaxTokensOpt,
    NumDraftTokensOpt,
    PromptOpt,
    SpecArg,
    UrlOpt,
    handle_errors,
    spec_and_engines,
)
from trtspec.cli.options import from_flags
from trtspec.cli.output import emit
from trtspec.errors import EXIT_DIVERGED, EXIT_OK
from trtspec.verify.run import VerifyOptions, run

Opt = typer.Option
StreamOpt = Annotated[bool, Opt("--stream", help="With --url: take the speculative path from the streaming endpoint.")]
FailOnOpt = Annotated[
    str,
    Opt(
        "--fail-on",
        help="Exit 1 on any divergence, or only on algorithmic ones (numerical near-tie flips are reported, "
        "not failed). One of: any, algorithmic.",
    ),
]
BaselineOpt = Annotated[
    Path | None,
    Opt(
        "--baseline",
        help="A previous `verify --json` report of the same spec, prompts, k and max_tokens to gate acceptance against.",
    ),
]
MaxDropOpt = Annotated[
    str | None,
    Opt(
        "--max-acceptance-drop",
        help="With --baseline: exit 1 if the acceptance rate fell by more than this (5% or 0.05), relative.",
    ),
]
MinLengthOpt = Annotated[
    float | None,
    Opt("--min-acceptance-length", help="Exit 1 if the mean acceptance length (tokens per target forward) is below this."),
]
SamplingOpt = Annotated[
    int | None,
    Opt(
        "--sampling",
        help="Also test speculative SAMPLING: N samples per prompt, checked against the target's exact distribution "
        "(chi-square, false-alarm rate 0.01). In process, or with --url from the served speculative endpoint, "
        "scored by the target engine built here.",
    ),
]
TemperatureOpt = Annotated[float | None, Opt("--temperature", help="With --sampling: temperature (> 0; default 1).")]
TopKOpt = Annotated[int | None, Opt("--top-k", help="With --sampling: keep the k most likely tokens (0: all).")]
TopPOpt = Annotated[float | None, Opt("--top-p", help="With --sampling: nucleus mass in (0, 1] (1: all).")]
SeedOpt = Annotated[
    int | None, Opt("--seed", help="With --sampling: first seed (sample i of prompt j uses seed + j*N + i; default 0).")
]
TieEpsilonOpt = Annotated[
    float | None,
    Opt(
        "--tie-epsilon",
        help="Logit gap below which a flip reproduced by the verifier's forward shape is numerical "
        "(default per target dtype: float32 0.01, float16 0.25, bfloat16 1.0).",
    ),
]
HtmlOpt = Annotated[
    Path | None,
    Opt(
        "--html",
        help="Also write a self-contained HTML report: both outputs per prompt, divergences highlighted with their "
        "verdicts, acceptance plots.",
    ),
]
JunitOpt = Annotated[Path | None, Opt("--junit", help="Also write a JUnit XML report (one testcase per prompt).")]

HELP = """Prove greedy speculative outputs are token-identical to target-only outputs.

    Each divergence is replayed on the target alone in both forward shapes and classed
    numerical (a near-tie flipped by the verifier's batched forward) or algorithmic.

    Exit codes: 0 passed (--fail-on), 1 a failing divergence, 2 bad spec or usage.

    Examples:
      trtspec verify engine_specs/smollm2-135m-cpu.yaml
      trtspec verify my-spec.yaml --json-file report.json --junit verify.xml \\
        --html report.html
      trtspec verify half-precision.yaml --fail-on algorithmic
      trtspec verify engine_specs/tiny-llama.yaml --sampling 200 \\
        --temperature 0.8 --top-p 0.95
      trtspec verify engine_specs/tiny-llama.yaml \\
        --sampling 200 --url 127.0.0.1:8001
      trtspec verify my-spec.yaml --baseline previous.json \\
        --max-acceptance-drop 5% --min-acceptance-length 3
      trtspec verify engine_specs/smollm2-135m-cpu.yaml --url 127.0.0.1:8001 \\
        --stream
      trtspec verify my-llmapi-spec.yaml                  # LLM API, on a GPU
      trtspec verify my-llmapi-spec.yaml --llmapi double  # CPU conformance double
      trtspec verify my-spec.yaml --device cuda           # torch engines on a GPU
"""


# An option that names a VerifyOptions field defaults to the field's default, declared there once.
DEFAULTS = VerifyOptions()


@handle_errors
def verify(
    ctx: typer.Context,
    spec: SpecArg,
    prompts: PromptOpt = DEFAULTS.prompts,
    max_tokens: MaxTokensOpt = DEFAULTS.max_tokens,
    num_draft_tokens: NumDraftTokensOpt = DEFAULTS.num_draft_tokens,
    url: UrlOpt = DEFAULTS.url,
    stream: StreamOpt = DEFAULTS.stream,
    fail_on: FailOnOpt = DEFAULTS.fail_on,
    baseline: BaselineOpt = DEFAULTS.baseline,
    max_acceptance_drop: MaxDropOpt = DEFAULTS.max_acceptance_drop,
    min_acceptance_length: MinLengthOpt = DEFAULTS.min_acceptance_length,
    samples: SamplingOpt = DEFAULTS.samples,
    temperature: TemperatureOpt = DEFAULTS.temperature,
    top_k: TopKOpt = DEFAULTS.top_k,
    top_p: TopPOpt = DEFAULTS.top_p,
    seed: SeedOpt = DEFAULTS.seed,
    tie_epsilon: TieEpsilonOpt = DEFAULTS.tie_epsilon,
    html_file: HtmlOpt = DEFAULTS.html_file,
    engines: EnginesOpt = None,
    as_json: JsonOpt = False,
    json_file: JsonFileOpt = None,
    junit_file: JunitOpt = None,
    llmapi_impl: LlmapiOpt = DEFAULTS.llmapi_impl,
    device: DeviceOpt = None,
) -> None:
    opts = from_flags(VerifyOptions, ctx)  # help: HELP, registered in app.py
    loaded, engines_folder = spec_and_engines(spec, device, engines, num_draft_tokens, url)
    bars = _Bars()
    try:
        outcome = run(loaded, engines_folder, opts, progress=bars.update)
    finally:
        bars.close()
    emit(outcome, outcome.render, as_json=as_json, json_file=json_file)
    if junit_file:
        outcome.write_junit(junit_file)
    if opts.html_file:
        from trtspec.machine import description as machine_description

        outcome.write_html(opts.html_file, machine_description())
        console.info(f"wrote {opts.html_file}")
    raise typer.Exit(EXIT_OK if outcome.passed else EXIT_DIVERGED)


class _Bars:
    """One transient progress bar per phase of the run (rich shows one live display at a
    time, and loading the engines shows its own)."""

    def __init__(self):
        self.phase, self.bar, self.task = None, None, None

    def update(self, phase: str, done: int, total: int) -> None:
        if phase != self.phase:
            self.close()
            self.phase, self.bar = phase, Progress(console=console.err, transient=True)
            self.bar.start()
            self.task = self.bar.add_task(phase, total=total)
        self.bar.update(self.task, completed=done)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
        self.phase, self.bar = None, None

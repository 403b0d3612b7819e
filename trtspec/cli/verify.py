"""`trtspec verify SPEC`: speculative vs target-only, token by token."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import Progress

from trtspec import console
from trtspec.cli.common import (
    DeviceOpt,
    JsonFileOpt,
    JsonOpt,
    LlmapiOpt,
    OutputOpt,
    SpecArg,
    UrlOpt,
    handle_errors,
    parse_url,
    with_device,
)
from trtspec.cli.output import emit
from trtspec.errors import EXIT_DIVERGED, EXIT_OK, RequestError
from trtspec.spec import load_spec
from trtspec.speculative.llmapi import TENSORRT_LLM
from trtspec.speculative.sampling import SamplingParams
from trtspec.verify.acceptance import parse_fraction
from trtspec.verify.run import VerifyOptions, run


class FailOn(str, Enum):
    any = "any"
    algorithmic = "algorithmic"


@handle_errors
def verify(
    spec: SpecArg,
    output: OutputOpt = None,
    prompt: Annotated[
        list[str] | None,
        typer.Option("--prompt", "-p", help="Prompt to verify (repeatable); default: the spec's verify prompts."),
    ] = None,
    max_tokens: Annotated[
        int | None, typer.Option("--max-tokens", min=1, help="Tokens per prompt (default: verify.max_tokens).")
    ] = None,
    num_draft_tokens: Annotated[
        int | None, typer.Option("--num-draft-tokens", "-k", min=0, help="Draft length k (default: the spec's).")
    ] = None,
    as_json: JsonOpt = False,
    json_file: JsonFileOpt = None,
    junit_file: Annotated[
        Path | None, typer.Option("--junit", help="Also write a JUnit XML report (one testcase per prompt).")
    ] = None,
    html_file: Annotated[
        Path | None,
        typer.Option(
            "--html",
            help="Also write a self-contained HTML report: both outputs per prompt, divergences highlighted with their verdicts, acceptance plots.",
        ),
    ] = None,
    url: UrlOpt = None,
    stream: Annotated[
        bool, typer.Option("--stream", help="With --url: take the speculative path from the streaming endpoint.")
    ] = False,
    fail_on: Annotated[
        FailOn,
        typer.Option(
            "--fail-on",
            help="Exit 1 on any divergence, or only on algorithmic ones (numerical near-tie flips are reported, not failed).",
        ),
    ] = FailOn.any,
    baseline: Annotated[
        Path | None,
        typer.Option(
            "--baseline",
            help="A previous `verify --json` report of the same spec, prompts, k and max_tokens to gate acceptance against.",
        ),
    ] = None,
    max_acceptance_drop: Annotated[
        str | None,
        typer.Option(
            "--max-acceptance-drop",
            help="With --baseline: exit 1 if the acceptance rate fell by more than this (5% or 0.05), relative.",
        ),
    ] = None,
    min_acceptance_length: Annotated[
        float | None,
        typer.Option(
            "--min-acceptance-length",
            min=1.0,
            help="Exit 1 if the mean acceptance length (tokens per target forward) is below this.",
        ),
    ] = None,
    sampling: Annotated[
        int | None,
        typer.Option(
            "--sampling",
            min=1,
            help="Also test speculative SAMPLING: N samples per prompt, checked against the target's exact distribution (chi-square, false-alarm rate 0.01). In process, or with --url from the served speculative endpoint, scored by the target engine built here.",
        ),
    ] = None,
    temperature: Annotated[
        float | None, typer.Option("--temperature", help="With --sampling: temperature (> 0; default 1).")
    ] = None,
    top_k: Annotated[int | None, typer.Option("--top-k", help="With --sampling: keep the k most likely tokens (0: all).")] = None,
    top_p: Annotated[float | None, typer.Option("--top-p", help="With --sampling: nucleus mass in (0, 1] (1: all).")] = None,
    seed: Annotated[
        int | None,
        typer.Option("--seed", help="With --sampling: first seed (sample i of prompt j uses seed + j*N + i; default 0)."),
    ] = None,
    tie_epsilon: Annotated[
        float | None,
        typer.Option(
            "--tie-epsilon",
            min=0.0,
            help="Logit gap below which a flip reproduced by the verifier's forward shape is numerical (default per target dtype: float32 0.01, float16 0.25, bfloat16 1.0).",
        ),
    ] = None,
    llmapi_impl: LlmapiOpt = TENSORRT_LLM,
    device: DeviceOpt = None,
) -> None:
    """Prove greedy speculative outputs are token-identical to target-only outputs.

    Each divergence is replayed on the target alone in both forward shapes and classed
    numerical (a near-tie flipped by the verifier's batched forward) or algorithmic.

    Exit codes: 0 passed (--fail-on), 1 a failing divergence, 2 bad spec or usage.

    Examples:
      trtspec verify engine_specs/smollm2-135m-cpu.yaml
      trtspec verify my-spec.yaml --json-file report.json --junit verify.xml --html report.html
      trtspec verify half-precision.yaml --fail-on algorithmic
      trtspec verify engine_specs/tiny-llama.yaml --sampling 200 --temperature 0.8 --top-p 0.95
      trtspec verify engine_specs/tiny-llama.yaml --sampling 200 --url 127.0.0.1:8001
      trtspec verify my-spec.yaml --baseline previous.json --max-acceptance-drop 5% --min-acceptance-length 3
      trtspec verify engine_specs/smollm2-135m-cpu.yaml --url 127.0.0.1:8001 --stream
      trtspec verify engine_specs/llama3.1-8b-instruct-llmapi.yaml     # LLM API, on a GPU
      trtspec verify my-llmapi-spec.yaml --llmapi double               # CPU conformance double
      trtspec verify my-spec.yaml --device cuda --fail-on algorithmic  # torch engines on a GPU
    """
    loaded = with_device(load_spec(spec), device)
    opts = VerifyOptions(
        prompts=list(prompt) if prompt else None,
        max_tokens=max_tokens,
        num_draft_tokens=num_draft_tokens,
        url=parse_url(url),
        stream=stream,
        fail_on=fail_on.value,
        baseline=baseline,
        max_acceptance_drop=parse_fraction(max_acceptance_drop) if max_acceptance_drop is not None else None,
        min_acceptance_length=min_acceptance_length,
        samples=sampling,
        sampling=_sampling_params(sampling, temperature, top_k, top_p, seed),
        tie_epsilon=tie_epsilon,
        llmapi_impl=llmapi_impl,
        html_file=html_file,
    )
    bars = _Bars()
    try:
        outcome = run(loaded, loaded.output_dir(output), opts, progress=bars.update)
    finally:
        bars.close()
    emit(outcome, outcome.render, as_json=as_json, json_file=json_file)
    if junit_file:
        outcome.write_junit(junit_file)
    if html_file:
        from trtspec.machine import description as machine_description

        outcome.write_html(html_file, machine_description())
        console.info(f"wrote {html_file}")
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


def _sampling_params(n, temperature, top_k, top_p, seed):
    given = [
        name
        for name, v in (("--temperature", temperature), ("--top-k", top_k), ("--top-p", top_p), ("--seed", seed))
        if v is not None
    ]
    if n is None:
        if given:
            raise RequestError(f"{', '.join(given)} only apply to sampling; add --sampling N (samples per prompt)")
        return None
    return SamplingParams(
        temperature=1.0 if temperature is None else temperature,
        top_k=top_k or 0,
        top_p=1.0 if top_p is None else top_p,
        seed=seed or 0,
    )

"""`trtspec verify SPEC`: speculative vs target-only, token by token."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import Progress

from trtspec import console, report_html
from trtspec.acceptance import check as check_acceptance
from trtspec.acceptance import identity, load_baseline, parse_fraction
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
from trtspec.speculative.sampling import SamplingParams
from trtspec.verify import open_backend, render_table, run_verify, write_junit
from trtspec.verify_sampling import check_deployment, check_sample_count, check_url


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
            help="Also test speculative SAMPLING: N samples per prompt, checked against the target's exact distribution (chi-square, false-alarm rate 0.01). In process only.",
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
    llmapi_impl: LlmapiOpt = "tensorrt_llm",
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
      trtspec verify my-spec.yaml --baseline previous.json --max-acceptance-drop 5% --min-acceptance-length 3
      trtspec verify engine_specs/smollm2-135m-cpu.yaml --url 127.0.0.1:8001 --stream
      trtspec verify engine_specs/llama3.1-8b-instruct-llmapi.yaml     # LLM API, on a GPU
      trtspec verify my-llmapi-spec.yaml --llmapi double               # CPU conformance double
      trtspec verify my-spec.yaml --device cuda --fail-on algorithmic  # torch engines on a GPU
    """
    loaded = with_device(load_spec(spec), device)
    prompts = list(prompt) if prompt else loaded.verify_prompts()
    drop = parse_fraction(max_acceptance_drop) if max_acceptance_drop is not None else None
    if (drop is None) != (baseline is None):
        raise RequestError(
            "--baseline and --max-acceptance-drop go together: pass both (e.g. --baseline previous.json --max-acceptance-drop 5%)"
        )
    if not prompts:
        raise RequestError("no prompts to verify: add verify.prompts to the spec or pass --prompt")
    n_tokens = max_tokens if max_tokens is not None else loaded.spec.verify.max_tokens
    url = parse_url(url)
    if html_file is not None and html_file.is_dir():
        raise RequestError(f"--html {html_file} is a folder; give a file path (e.g. {html_file / 'report.html'})")
    sampling_params = _sampling_params(sampling, temperature, top_k, top_p, seed)
    if sampling is not None:
        check_sample_count(sampling, len(prompts))
    k = num_draft_tokens if num_draft_tokens is not None else loaded.spec.speculative.default_draft_tokens
    prompt_set = _prompt_set_name(loaded, prompt)
    # A baseline that cannot compare is refused before minutes of generation, not after.
    base = None
    if baseline is not None:
        base = load_baseline(baseline, identity(loaded.spec.name, prompts, prompt_set, k, n_tokens))
    backend, mode = open_backend(loaded, loaded.output_dir(output), url, stream, num_draft_tokens, tie_epsilon, llmapi_impl)
    with Progress(console=console.err, transient=True) as bar:
        task = bar.add_task("verifying prompts", total=len(prompts))
        report = run_verify(
            backend,
            prompts,
            n_tokens,
            loaded.spec.name,
            mode=mode,
            progress=lambda i, n: bar.update(task, completed=i),
            prompt_set=prompt_set,
            num_draft_tokens=k,
        )
    gate = None
    if baseline is not None or min_acceptance_length is not None:
        gate = check_acceptance(report.to_dict(), base, drop, min_acceptance_length)
    sampled = None
    if sampling_params is not None:
        with Progress(console=console.err, transient=True) as bar:
            task = bar.add_task("sampling", total=sampling * len(prompts))
            tick = lambda i, n: bar.update(task, completed=i)  # noqa: E731
            if url is None:
                sampled = check_deployment(backend.dep, prompts, sampling, n_tokens, sampling_params, num_draft_tokens, tick)
            else:
                sampled = check_url(
                    loaded, loaded.output_dir(output), backend, prompts, sampling, n_tokens, sampling_params, tick
                )

    def human(out) -> None:
        render_table(report, out)
        for line in gate.lines if gate else []:
            out.print(line, markup=False)
        if sampled is not None:
            out.print(sampled.describe(), markup=False)

    full = _WithGates(report, gate, sampled)
    emit(full, human, as_json=as_json, json_file=json_file)
    if junit_file:
        write_junit(report, junit_file, fail_on.value)
    ok = report.passes(fail_on.value) and (gate is None or gate.passed) and (sampled is None or sampled.passed)
    if html_file:
        from trtspec.bench.measure import machine_description

        report_html.write(
            html_file, full.to_dict(), backend.token_text, machine=machine_description(), fail_on=fail_on.value, passed=ok
        )
        console.info(f"wrote {html_file}")
    raise typer.Exit(EXIT_OK if ok else EXIT_DIVERGED)


class _WithGates:
    """The verify report's JSON plus the acceptance gate and sampling check, when run."""

    def __init__(self, report, gate, sampled):
        self.report, self.gate, self.sampled = report, gate, sampled

    def to_dict(self) -> dict:
        data = self.report.to_dict()
        if self.gate is not None:
            data["acceptance_gate"] = self.gate.to_dict()
        if self.sampled is not None:
            data["sampling"] = self.sampled.to_dict()
        return data


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


def _prompt_set_name(loaded, prompt: list[str] | None) -> str:
    if prompt:
        return "--prompt"
    where = [f"{loaded.path.name} verify.prompts"] if loaded.spec.verify.prompts else []
    if loaded.spec.verify.prompts_file:
        where.append(loaded.spec.verify.prompts_file)
    return " + ".join(where)

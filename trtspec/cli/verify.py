"""`trtspec verify SPEC`: speculative vs target-only, token by token."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.progress import Progress

from trtspec import console
from trtspec.cli.common import JsonFileOpt, JsonOpt, LlmapiOpt, OutputOpt, SpecArg, UrlOpt, handle_errors, parse_url
from trtspec.cli.output import emit
from trtspec.errors import EXIT_DIVERGED, EXIT_OK, RequestError
from trtspec.spec import load_spec
from trtspec.verify import open_backend, render_table, run_verify, write_junit


@handle_errors
def verify(
    spec: SpecArg,
    output: OutputOpt = None,
    prompt: Annotated[list[str] | None, typer.Option("--prompt", "-p", help="Prompt to verify (repeatable); default: the spec's verify prompts.")] = None,
    max_tokens: Annotated[int | None, typer.Option("--max-tokens", min=1, help="Tokens per prompt (default: verify.max_tokens).")] = None,
    num_draft_tokens: Annotated[int | None, typer.Option("--num-draft-tokens", "-k", min=0, help="Draft length k (default: the spec's).")] = None,
    as_json: JsonOpt = False,
    json_file: JsonFileOpt = None,
    junit_file: Annotated[Path | None, typer.Option("--junit", help="Also write a JUnit XML report (one testcase per prompt).")] = None,
    url: UrlOpt = None,
    stream: Annotated[bool, typer.Option("--stream", help="With --url: take the speculative path from the streaming endpoint.")] = False,
    llmapi_impl: LlmapiOpt = "tensorrt_llm",
) -> None:
    """Prove greedy speculative outputs are token-identical to target-only outputs.

    Exit codes: 0 all identical, 1 any divergence, 2 bad spec or usage.

    Examples:
      trtspec verify engine_specs/smollm2-135m-cpu.yaml
      trtspec verify my-spec.yaml --json-file report.json --junit verify.xml
      trtspec verify engine_specs/smollm2-135m-cpu.yaml --url 127.0.0.1:8001 --stream
      trtspec verify engine_specs/llama3.1-8b-instruct-llmapi.yaml     # LLM API, on a GPU
      trtspec verify my-llmapi-spec.yaml --llmapi double               # CPU conformance double
    """
    loaded = load_spec(spec)
    prompts = list(prompt) if prompt else loaded.verify_prompts()
    if not prompts:
        raise RequestError("no prompts to verify: add verify.prompts to the spec or pass --prompt")
    n_tokens = max_tokens if max_tokens is not None else loaded.spec.verify.max_tokens
    backend, mode = open_backend(loaded, loaded.output_dir(output), parse_url(url), stream, num_draft_tokens, llmapi_impl)
    with Progress(console=console.err, transient=True) as bar:
        task = bar.add_task("verifying prompts", total=len(prompts))
        report = run_verify(
            backend, prompts, n_tokens, loaded.spec.name, mode=mode,
            progress=lambda i, n: bar.update(task, completed=i),
        )
    emit(report, lambda out: render_table(report, out), as_json=as_json, json_file=json_file)
    if junit_file:
        write_junit(report, junit_file)
    raise typer.Exit(EXIT_OK if report.identical else EXIT_DIVERGED)

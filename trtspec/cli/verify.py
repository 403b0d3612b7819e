"""`trtspec verify SPEC`: speculative vs target-only, token by token."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.progress import Progress

from trtspec import console
from trtspec.cli.common import JsonOpt, OutputOpt, SpecArg, handle_errors
from trtspec.errors import EXIT_DIVERGED, EXIT_OK, RequestError
from trtspec.spec import load_spec
from trtspec.verify import InProcessBackend, render_table, run_verify, write_json, write_junit


@handle_errors
def verify(
    spec: SpecArg,
    output: OutputOpt = None,
    prompt: Annotated[list[str] | None, typer.Option("--prompt", "-p", help="Prompt to verify (repeatable); default: the spec's verify prompts.")] = None,
    max_tokens: Annotated[int | None, typer.Option("--max-tokens", min=1, help="Tokens per prompt (default: verify.max_tokens).")] = None,
    num_draft_tokens: Annotated[int | None, typer.Option("--num-draft-tokens", "-k", min=0, help="Draft length k (default: the spec's).")] = None,
    json_file: JsonOpt = None,
    junit_file: Annotated[Path | None, typer.Option("--junit", help="Also write a JUnit XML report (one testcase per prompt).")] = None,
    url: Annotated[str | None, typer.Option("--url", help="Verify a running server over gRPC (HOST:PORT of `trtspec serve`) instead of in process.")] = None,
    stream: Annotated[bool, typer.Option("--stream", help="With --url: take the speculative path from the streaming endpoint.")] = False,
) -> None:
    """Prove greedy speculative outputs are token-identical to target-only outputs.

    Exit codes: 0 all identical, 1 any divergence, 2 bad spec or usage.

    Examples:
      trtspec verify engine_specs/smollm2-135m-cpu.yaml
      trtspec verify my-spec.yaml --json report.json --junit verify.xml
      trtspec verify engine_specs/smollm2-135m-cpu.yaml --url 127.0.0.1:8001 --stream
    """
    loaded = load_spec(spec)
    prompts = list(prompt) if prompt else loaded.verify_prompts()
    if not prompts:
        raise RequestError("no prompts to verify: add verify.prompts to the spec or pass --prompt")
    n_tokens = max_tokens if max_tokens is not None else loaded.spec.verify.max_tokens
    if stream and url is None:
        raise RequestError("--stream verifies a server's streaming endpoint; add --url HOST:PORT")
    if url is not None:
        backend, mode = _grpc_backend(loaded, output, url, stream, num_draft_tokens)
    else:
        from trtspec.runtime import Deployment

        with console.step("loading engines"):
            dep = Deployment(loaded, loaded.output_dir(output))
        backend, mode = InProcessBackend(dep, num_draft_tokens=num_draft_tokens), "in-process"
    with Progress(console=console.err, transient=True) as bar:
        task = bar.add_task("verifying prompts", total=len(prompts))
        report = run_verify(
            backend, prompts, n_tokens, loaded.spec.name, mode=mode,
            progress=lambda i, n: bar.update(task, completed=i),
        )
    render_table(report, console.out)
    if json_file:
        write_json(report, json_file)
    if junit_file:
        write_junit(report, junit_file)
    raise typer.Exit(EXIT_OK if report.identical else EXIT_DIVERGED)


def _grpc_backend(loaded, output, url: str, stream: bool, k: int | None):
    """GrpcBackend for ``url``; token texts come from the local tokenizer when there is one."""
    from trtspec.triton.client import GrpcBackend

    if ":" not in url or url.startswith(("http://", "https://", "grpc://")):
        raise RequestError(f"--url takes HOST:PORT (the gRPC port, e.g. 127.0.0.1:8001), not {url!r}")
    tokenizer = None
    for folder in (loaded.output_dir(output) / "target", loaded.output_dir(output) / "target" / "tokenizer"):
        if (folder / "tokenizer_config.json").is_file():
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(folder)
            break
    with console.step(f"connecting to {url}"):
        backend = GrpcBackend(url, tokenizer, loaded.spec.verify.chat_template, k, stream)
    return backend, f"grpc://{url}" + (" streaming" if stream else "")

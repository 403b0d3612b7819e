"""`trtspec openai`: the OpenAI-compatible API in front of a running `trtspec serve`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from trtspec import console
from trtspec.cli.common import EnginesOpt, handle_errors
from trtspec.triton.client import parse_url
from trtspec.triton.server import launch


@handle_errors
def openai(
    target: Annotated[
        Path, typer.Argument(help="Engine spec YAML or the model repository `trtspec serve` serves.", show_default=False)
    ],
    url: Annotated[str, typer.Option("--url", help="The Triton deployment's gRPC HOST:PORT.")] = "127.0.0.1:8001",
    host: Annotated[
        str, typer.Option("--host", help="Address to bind. The API has no auth: keep it on loopback unless a proxy guards it.")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=1, max=65535, help="HTTP port of the API.")] = 8080,
    engines: EnginesOpt = None,
) -> None:
    """Serve /v1/models, /v1/completions and /v1/chat/completions (SSE streaming) for a
    deployment already running under `trtspec serve`; every request goes to it over gRPC.

    Model names: the spec's name (speculative) and `<name>-target-only` (the control).
    Greedy decoding only: temperature > 0, n > 1, penalties, logprobs and tools get an
    OpenAI-shaped 400 error naming the field.

    Examples:
      trtspec serve engine_specs/smollm2-135m-cpu.yaml --detach
      trtspec openai engine_specs/smollm2-135m-cpu.yaml --port 8080
    """
    from trtspec.openai.run import run

    t = launch.serve_target(target, engines, write=False)
    url = parse_url(url)
    console.err.print(f"OpenAI API on http://{host}:{port}/v1 -> Triton gRPC {url}; Ctrl-C to stop")
    run(t.repo_dir, url, host, port)

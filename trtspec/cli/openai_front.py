"""`trtspec openai`: the OpenAI-compatible API in front of a running `trtspec serve`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from trtspec import console
from trtspec.cli.common import EnginesOpt, handle_errors
from trtspec.triton.client import parse_url
from trtspec.triton.server import launch

Opt = typer.Option
TargetArg = Annotated[
    Path, typer.Argument(help="Engine spec YAML or the model repository `trtspec serve` serves.", show_default=False)
]
# the front's upstream: always a served deployment (verify's and bench's --url is optional)
UrlOpt = Annotated[str, Opt("--url", help="The Triton deployment's gRPC HOST:PORT.")]
HostOpt = Annotated[
    str, Opt("--host", help="Address to bind. Without --api-key(s) anyone who reaches it may call: keep it on loopback.")
]
PortOpt = Annotated[int, Opt("--port", min=1, max=65535, help="HTTP port of the API.")]
ApiKeysOpt = Annotated[
    Path | None,
    Opt(
        "--api-keys",
        help="YAML/JSON file mapping API key -> tenant; each tenant its own suffix cache scope. Re-read when it changes.",
    ),
]
ApiKeyOpt = Annotated[str | None, Opt("--api-key", help="One API key (tenant 'default'); prefer --api-keys: argv is visible.")]
MaxConnectionsOpt = Annotated[
    int | None,
    Opt(
        "--max-connections",
        min=1,
        help="Most HTTP connections held at once (default 512); past it a new one closes the longest idle or slow one.",
        show_default=False,
    ),
]
# a head is at most 16 KiB (h11's limit): a client that needs longer than this is a slow loris
HEAD_TIMEOUT_MAX_S = 120.0
HeadTimeoutOpt = Annotated[
    float | None,
    Opt(
        "--head-timeout",
        metavar="SECONDS",
        help="Most seconds a request's head may take to arrive whole (default 10); then 408, or a silent close if none came.",
        show_default=False,
    ),
]


@handle_errors
def openai(
    target: TargetArg,
    url: UrlOpt = "127.0.0.1:8001",
    host: HostOpt = "127.0.0.1",
    port: PortOpt = 8080,
    api_keys: ApiKeysOpt = None,
    api_key: ApiKeyOpt = None,
    max_connections: MaxConnectionsOpt = None,
    head_timeout: HeadTimeoutOpt = None,
    engines: EnginesOpt = None,
) -> None:
    """Serve /v1/models, /v1/completions and /v1/chat/completions (SSE streaming) for a
    deployment already running under `trtspec serve`; every request goes to it over gRPC.

    Model names: the spec's name (speculative) and `<name>-target-only` (the control).
    Greedy decoding only: temperature > 0, n > 1, penalties, logprobs and tools get an
    OpenAI-shaped 400 error naming the field.

    Every /v1 request needs `Authorization: Bearer <key>` when --api-keys or --api-key is
    given (401 otherwise); the key's tenant is the request's suffix cache scope, which `user`
    narrows inside it. Without keys the deployment is single-tenant.

    A request's head must arrive within --head-timeout (10 s) of its connection's start (or of
    the previous answer); at --max-connections a new connection closes the one that has waited longest
    for a head.

    Examples:
      trtspec serve engine_specs/smollm2-135m-cpu.yaml --detach
      trtspec openai engine_specs/smollm2-135m-cpu.yaml --port 8080
      trtspec openai engine_specs/smollm2-135m-cpu.yaml --host 0.0.0.0 \\
        --api-keys keys.yaml
    """
    from trtspec.errors import SpecError
    from trtspec.openai.keys import ApiKeys
    from trtspec.openai.run import run

    if api_keys is not None and api_key is not None:
        raise SpecError("give --api-keys FILE or --api-key KEY, not both")
    if head_timeout is not None and not 0 < head_timeout <= HEAD_TIMEOUT_MAX_S:
        raise SpecError(f"--head-timeout takes seconds above 0 and at most {HEAD_TIMEOUT_MAX_S:g}, not {head_timeout:g}")
    keys = ApiKeys.from_file(api_keys) if api_keys is not None else ApiKeys.single(api_key) if api_key is not None else None
    t = launch.serve_target(target, engines, write=False)
    url = parse_url(url)
    console.err.print(f"OpenAI API on http://{host}:{port}/v1 -> Triton gRPC {url}; Ctrl-C to stop")
    run(t.repo_dir, url, host, port, keys, max_connections, head_timeout)

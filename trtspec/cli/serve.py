"""`trtspec serve SPEC|REPO`: run a real tritonserver on the generated repository."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from trtspec import console
from trtspec.cli.common import EnginesOpt, LlmapiOpt, MetricsPortOpt, PidFileOpt, handle_errors
from trtspec.speculative.llmapi import TENSORRT_LLM
from trtspec.triton.server import launch
from trtspec.triton.server.install import CACHE_ENV, SERVER_GLIBC_ENV

Opt = typer.Option
TargetArg = Annotated[
    Path,
    typer.Argument(help="Engine spec YAML (its repository is written first) or a model repository folder.", show_default=False),
]
HostOpt = Annotated[str | None, Opt("--host", help="Address to bind (default: serve.host, 127.0.0.1). The server has no auth.")]
HttpPortOpt = Annotated[int | None, Opt("--http-port", min=1, max=65535, help="Default: serve.http_port (8000).")]
GrpcPortOpt = Annotated[int | None, Opt("--grpc-port", min=1, max=65535, help="Default: serve.grpc_port (8001).")]
RepoOpt = Annotated[Path | None, Opt("--repo", help="Where to write the repository (SPEC only).")]
TimeoutOpt = Annotated[float, Opt("--timeout", min=1, help="Seconds to wait for readiness.")]
DryRunOpt = Annotated[bool, Opt("--dry-run", help="Print the command and environment; start nothing.")]
DetachOpt = Annotated[bool, Opt("--detach", help="Return once ready; the server keeps running (stop it with `trtspec stop`).")]
LogFileOpt = Annotated[
    Path | None, Opt("--log-file", help="Server log (default: beside the pid file when detached, else a temp file).")
]


def _print_dry_run(server, t) -> None:
    """The command line and the environment the server would get (install.server_env)."""
    console.out.print(" ".join(server.shown_argv()))
    env = server.env or {}
    shown = ["PATH", "LD_LIBRARY_PATH", "LD_PRELOAD", "MALLOC_CONF", *SERVER_GLIBC_ENV, "BASH_ENV", *CACHE_ENV]
    for key in [*shown, *sorted(k for k in env if k.startswith("TRTLLM_"))]:
        console.out.print(f"{key}={env.get(key, os.environ.get(key, ''))}")
    if t.loaded is not None:
        console.out.print(f"repository (not written in a dry run): {t.repo_dir}")


def _run_attached(server, timeout: float, log_file: Path | None, endpoints: str) -> int:
    """Serve until Ctrl-C / SIGTERM; the server's exit code."""

    def ready(secs: float) -> None:
        console.out.print(f"ready in {secs:.1f}s: {endpoints}", highlight=False)
        console.err.print(f"log: {server.log_path}; Ctrl-C to stop")

    code = launch.run_attached(server, timeout, log_file, ready)
    console.err.print("tritonserver stopped")
    return code


@handle_errors
def serve(
    target: TargetArg,
    host: HostOpt = None,
    http_port: HttpPortOpt = None,
    grpc_port: GrpcPortOpt = None,
    metrics_port: MetricsPortOpt = None,
    engines: EnginesOpt = None,
    repo_dir: RepoOpt = None,
    timeout: TimeoutOpt = 900.0,
    dry_run: DryRunOpt = False,
    detach: DetachOpt = False,
    pid_file: PidFileOpt = launch.DEFAULT_PID_FILE,
    log_file: LogFileOpt = None,
    llmapi_impl: LlmapiOpt = TENSORRT_LLM,
) -> None:
    """Serve SPEC (or a written REPO) on tritonserver and wait until every model is ready.

    Binds 127.0.0.1 unless --host. A model that fails to load ends with exit code 3 and the
    server log's relevant lines. Ctrl-C / SIGTERM stop the server and all its stub processes.

    Examples:
      trtspec serve engine_specs/smollm2-135m-cpu.yaml
      trtspec serve engine_specs/smollm2-135m-cpu.yaml --detach && trtspec stop
      trtspec serve model_repo/smollm2-135m-cpu --grpc-port 9001 --dry-run
    """
    t = launch.serve_target(target, engines, repo_dir, write=not dry_run, llmapi_impl=llmapi_impl)
    server = launch.server_for(t, host, http_port, grpc_port, metrics_port)
    if dry_run:
        _print_dry_run(server, t)
        return
    endpoints = f"gRPC {server.grpc_endpoint} | HTTP {server.http_endpoint} | metrics {server.metrics_url}"
    if detach:
        log = log_file or pid_file.with_suffix(".log")
        with console.step(f"starting tritonserver on {t.repo_dir}"):
            secs = launch.start_detached(server, timeout, pid_file, log)
        console.out.print(f"ready in {secs:.1f}s: {endpoints}")
        console.out.print(f"pid {server.pid}; pid file {pid_file}; log {log}; stop with `trtspec stop --pid-file {pid_file}`")
        return
    raise typer.Exit(_run_attached(server, timeout, log_file, endpoints))

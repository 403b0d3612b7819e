"""`trtspec serve`: from a spec (or a written repository) to a ready tritonserver.

serve_target() resolves what to serve; server_for() builds the TritonServer (ports and host
from the flags, else the spec's serve settings); run_attached() waits for readiness, then
keeps the server in the foreground until it exits or SIGINT/SIGTERM arrives, and stops it
with every stub process.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from pathlib import Path

from trtspec.errors import EXIT_INTERRUPTED, EXIT_OK, ServerError, SpecError
from trtspec.spec import LoadedSpec, ServeSpec, load_spec
from trtspec.speculative.llmapi import TENSORRT_LLM
from trtspec.triton.repository.writer import plan_repository, read_repo_info, write_repository
from trtspec.triton.server.process import TritonServer

DEFAULT_PID_FILE = Path(".trtspec/server.json")


@dataclass
class ServeTarget:
    repo_dir: Path
    serve: ServeSpec
    loaded: LoadedSpec | None  # None when a repository was given


def serve_target(
    path: Path, engines: Path | None = None, repo_out: Path | None = None, write: bool = True, llmapi_impl: str = TENSORRT_LLM
) -> ServeTarget:
    """A folder is a model repository; a file is a spec whose repository is (re)written."""
    path = Path(path)
    if path.is_dir():
        info = read_repo_info(path)
        if info is None and not any(p.joinpath("config.pbtxt").is_file() for p in path.iterdir()):
            raise SpecError(f"{path} is neither a spec file nor a model repository (no model folders with config.pbtxt)")
        serve = ServeSpec.model_validate(info["serve"]) if info else ServeSpec()
        return ServeTarget(path.resolve(), serve, None)
    loaded = load_spec(path)
    engines_dir = loaded.output_dir(engines)
    repo_dir = loaded.repo_dir(repo_out)
    if write:
        write_repository(loaded, engines_dir, repo_dir, llmapi_impl)
    else:
        plan_repository(loaded, engines_dir, llmapi_impl)  # same checks, nothing written
    return ServeTarget(repo_dir, loaded.spec.serve, loaded)


def server_for(
    target: ServeTarget, host: str | None, http_port: int | None, grpc_port: int | None, metrics_port: int | None
) -> TritonServer:
    s = target.serve
    server = TritonServer.for_repository(
        target.repo_dir,
        address=host or s.host,
        http_port=http_port or s.http_port,
        grpc_port=grpc_port or s.grpc_port,
        metrics_port=metrics_port or s.metrics_port,
    )
    # trtllm.runtime llmapi: one plain tritonserver, as upstream; the LLM API starts its own
    # workers for tensor_parallel_size > 1.
    if target.loaded is not None and target.loaded.spec.backend == "trtllm" and target.loaded.spec.trtllm.runtime == "engine":
        # TensorRT-LLM engines: one rank per GPU under mpirun, orchestrator mode when several
        # tensorrtllm models share the server (trtllm_launch.launch_for_spec).
        from trtspec.triton.server.trtllm_launch import launch_for_spec

        launch = launch_for_spec(target.loaded.spec, server.command)
        server.launcher = launch.argv
        server.env = {**(server.env or {}), **launch.env}
    return server


class _Terminated(Exception):
    pass


def _on_sigterm(signum, frame):
    raise _Terminated()


def run_attached(server: TritonServer, timeout: float, log_path: Path | None, on_ready) -> int:
    """Start, wait until ready, block until the server ends or a signal arrives.

    Returns the exit code for the CLI: 0 after SIGTERM, 130 after SIGINT. A server that
    dies by itself raises ServerError with its log lines (exit 3).
    """
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        server.start(log_path)
        try:
            seconds = server.wait_ready(timeout)
            on_ready(seconds)
            while server.is_running():
                time.sleep(0.5)
            raise server.fail("tritonserver exited unexpectedly")
        except KeyboardInterrupt:
            server.stop()
            return EXIT_INTERRUPTED
        except _Terminated:
            server.stop()
            return EXIT_OK
        except BaseException:
            server.stop()
            raise
    finally:
        signal.signal(signal.SIGTERM, previous)


def start_detached(server: TritonServer, timeout: float, pid_file: Path, log_path: Path) -> float:
    """Start a server that outlives this process; pid and endpoints go to ``pid_file``."""
    if pid_file.exists():
        raise ServerError(f"{pid_file} exists: a server may be running; `trtspec stop --pid-file {pid_file}` first")
    server.start(log_path, detach=True, pid_file=pid_file)
    try:
        return server.wait_ready(timeout)
    except BaseException:
        server.stop()
        pid_file.unlink(missing_ok=True)
        raise

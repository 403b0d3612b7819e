"""One real ``tritonserver`` process: its command line, start, readiness, stop, failures.

Typical use::

    server = TritonServer.for_repository("repo/")       # free ports on 127.0.0.1
    with server:                                        # start + wait_ready; stop on exit
        client = tritonclient.grpc.InferenceServerClient(server.grpc_endpoint)

Process model: the server runs in its own session (process group == its pid). The Python
backend's ``triton_python_backend_stub`` processes are its children in the same group, so
stopping signals the whole group and then checks /proc until no member is left.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import re
import secrets
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from trtspec.errors import ServerError, TrtspecError
from trtspec.triton.server import hidden_args
from trtspec.triton.server.detached import write_pid_file
from trtspec.triton.server.install import Allocator, find_tritonserver, prepare_backend_dir, python_env, server_env
from trtspec.triton.server.procgroup import end_group, signal_group

_LOG_EXCERPT_LINES = 30
# glog puts a whole Python traceback on one line ("...\n\nAt:\n ..."); its head says enough.
_LOG_EXCERPT_WIDTH = 400
# Lines worth showing when the server fails: glog error lines (E1130 ...), Python tracebacks
# from a model's initialize(), loader failures, dynamic-linker errors.
_RELEVANT = re.compile(r"^E\d{4} |error|fail|traceback|exception|undefined symbol|cannot open shared object", re.I)
# Noise every CPU-only start prints (no CUDA driver, no NVML/DCGM): never the cause.
_HARMLESS = re.compile(r"CudaDriverHelper|NVML|DCGM|pinned system memory|CUDA driver version", re.I)
_LOAD_FAILURE = re.compile(r"failed to load '([^']+)'")
# Known failure signatures → the next step for the user.
_HINTS: tuple[tuple[re.Pattern[str], str], ...] = (
    (
        re.compile(r"undefined symbol|libpython", re.I),
        "the Python-backend stub loaded a libpython that does not match the venv's interpreter: "
        "LD_LIBRARY_PATH must start with that interpreter's LIBDIR (server_env() does this)",
    ),
    (
        re.compile(r"No module named", re.I),
        "the stub's Python does not see the package: PATH must start with the serving venv's "
        "bin/ (server_env() does this) or set the model parameter EXECUTION_ENV_PATH",
    ),
    (
        re.compile(r"address already in use", re.I),
        "a port is taken: pick free ports (free_ports()) or stop the other server",
    ),
    (
        re.compile(r"boost::interprocess::lock_exception"),
        "the Python backend aborted the server on an interprocess lock, a known upstream failure "
        "(triton-inference-server/server#8882) seen here while stubs started on a CPU busy with other "
        "jobs: start the server again, on a less loaded machine or with fewer jobs beside it",
    ),
)


# Triton's admin APIs, closed to requests without the admin header (--http-restricted-api /
# --grpc-restricted-protocol): log settings and traces (a client could turn on verbose logging
# or tracing and fill the disk), shared-memory registration (a client could map host memory
# regions into the server) and model load/unload.
RESTRICTED_APIS = ("shared-memory", "model-repository", "trace", "logging")
ADMIN_HEADER = "triton-admin-key"
ADMIN_KEY_ENV = "TRTSPEC_ADMIN_KEY"  # the header's value; unset: a random key nobody knows
ADMIN_KEY_FILE_ENV = "TRTSPEC_ADMIN_KEY_FILE"  # or a file holding it (a mounted Secret)
REDACTED = "<admin key>"  # what argv shows in place of the key anywhere trtspec writes it


def _admin_key() -> str:
    """The key from the file TRTSPEC_ADMIN_KEY_FILE names (absent: an optional Secret that does
    not exist), else TRTSPEC_ADMIN_KEY, else a random key nobody knows. tritonserver 2.51 reads
    it only from its command line (--http-restricted-api / --grpc-restricted-protocol), so
    start() passes those arguments through the server's environment (readable by its own user
    only) and its command line shows REDACTED (hidden_args); so do the pid file and printed
    commands."""
    path = os.environ.get(ADMIN_KEY_FILE_ENV)
    if path:
        try:
            key = Path(path).read_text(encoding="utf-8").strip()
        except FileNotFoundError:
            key = ""
        except OSError as err:
            raise TrtspecError(
                f"cannot read the admin key file {path} ({err.strerror}); make it readable or unset {ADMIN_KEY_FILE_ENV}"
            ) from None
        if key:
            return key
    return os.environ.get(ADMIN_KEY_ENV) or secrets.token_urlsafe(24)


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct free ports; the sockets stay open until all are chosen."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


@dataclass(frozen=True)
class ServerCommand:
    """Every tritonserver option trtspec sets, rendered by :meth:`argv`."""

    binary: Path
    model_repository: Path
    backend_directory: Path | None = None
    cache_directory: Path | None = None
    address: str = "127.0.0.1"  # loopback unless the user asks: the server has no auth
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    allow_metrics: bool = True
    log_verbose: int = 0
    exit_on_error: bool = True  # a model that fails to load stops the server: fail loudly
    strict_readiness: bool = True  # "ready" only when every model is ready
    # trtspec writes complete configs; auto-complete would also start an extra stub per
    # Python model just to call auto_complete_config().
    disable_auto_complete_config: bool = True
    model_control_mode: Literal["none", "poll", "explicit"] = "none"
    load_models: Sequence[str] = ()  # explicit mode only; "*" loads all
    exit_timeout_secs: int = 30
    extra_args: Sequence[str] = ()
    restricted_apis: Sequence[str] = RESTRICTED_APIS
    admin_key: str = field(default_factory=_admin_key, repr=False)
    # Inference request/response objects the gRPC frontend keeps for reuse (Triton's default
    # 8). A kept request message keeps the capacity of the largest tensors it ever carried: two
    # refused 256 MiB inputs left tritonserver holding +577 MiB for good (operations.md:
    # memory). 0: each request's buffers are freed when it is answered.
    grpc_infer_allocation_pool_size: int = 0

    def __post_init__(self) -> None:
        if self.load_models and self.model_control_mode != "explicit":
            raise ServerError("load_models needs model_control_mode='explicit' (tritonserver refuses --load-model otherwise)")
        ports = [self.http_port, self.grpc_port] + ([self.metrics_port] if self.allow_metrics else [])
        if len(set(ports)) != len(ports) or not all(0 < p < 65536 for p in ports):
            raise ServerError(f"ports must be distinct and in 1..65535, got {ports}")

    def argv(self) -> list[str]:
        args = [
            str(self.binary),
            f"--model-repository={self.model_repository}",
            f"--http-address={self.address}",
            f"--http-port={self.http_port}",
            f"--grpc-address={self.address}",
            f"--grpc-port={self.grpc_port}",
            f"--allow-metrics={_bool(self.allow_metrics)}",
            f"--log-verbose={self.log_verbose}",
            f"--exit-on-error={_bool(self.exit_on_error)}",
            f"--strict-readiness={_bool(self.strict_readiness)}",
            f"--exit-timeout-secs={self.exit_timeout_secs}",
            f"--model-control-mode={self.model_control_mode}",
            f"--grpc-infer-allocation-pool-size={self.grpc_infer_allocation_pool_size}",
        ]
        if self.allow_metrics:
            args += [f"--metrics-address={self.address}", f"--metrics-port={self.metrics_port}"]
        if self.backend_directory is not None:
            args.append(f"--backend-directory={self.backend_directory}")
        if self.cache_directory is not None:
            args.append(f"--cache-directory={self.cache_directory}")
        if self.disable_auto_complete_config:
            args.append("--disable-auto-complete-config")
        if self.restricted_apis:
            rule = f"{','.join(self.restricted_apis)}:{ADMIN_HEADER}={self.admin_key}"
            args += [f"--http-restricted-api={rule}", f"--grpc-restricted-protocol={rule}"]
        args += [f"--load-model={name}" for name in self.load_models]
        args += list(self.extra_args)
        return args


def _bool(value: bool) -> str:
    return "true" if value else "false"


# Attached servers still running when the interpreter exits are stopped by atexit; a crash of
# the parent is covered by PR_SET_PDEATHSIG (below).
_ATTACHED: weakref.WeakSet[TritonServer] = weakref.WeakSet()
_PR_SET_PDEATHSIG = 1
# Resolved in the parent: the forked child must not dlopen (another thread may hold its lock).
_LIBC = ctypes.CDLL(None, use_errno=True)


def die_with_parent() -> None:
    """Runs in the child between fork and exec: SIGTERM the server when its parent dies."""
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class TritonServer:
    """One tritonserver subprocess: start, wait until ready, stop with all its stubs."""

    def __init__(
        self, command: ServerCommand, env: Mapping[str, str] | None = None, launcher: Sequence[str] | None = None
    ) -> None:
        self.command = command
        self.env = dict(env) if env is not None else None
        # A full argv that wraps the server (mpirun with one rank per GPU for TensorRT-LLM);
        # ``command`` still says where clients connect.
        self.launcher = list(launcher) if launcher is not None else None
        self.log_path: Path | None = None
        self.ready_seconds: float | None = None  # start → READY, measured by wait_ready
        self._proc: subprocess.Popen[bytes] | None = None
        self._started_at = 0.0

    @classmethod
    def for_repository(
        cls,
        model_repository: str | os.PathLike[str],
        *,
        venv: str | os.PathLike[str] | None = None,
        address: str = "127.0.0.1",
        cache_root: Path | None = None,
        allocator: Allocator = "auto",
        **options: object,
    ) -> TritonServer:
        """A server for ``model_repository`` on free ports, its stub running in ``venv``, with
        ``allocator`` preloaded (install.find_allocator).

        ``options`` are further :class:`ServerCommand` fields (log_verbose, ports, ...).
        """
        install = find_tritonserver()
        py = python_env(venv)
        ports = free_ports(3, "127.0.0.1" if address in ("0.0.0.0", "") else address)
        fields = {"http_port": ports[0], "grpc_port": ports[1], "metrics_port": ports[2]} | options
        command = ServerCommand(
            binary=install.binary,
            model_repository=Path(model_repository).resolve(),
            backend_directory=prepare_backend_dir(install, py.version, cache_root),
            cache_directory=install.cache_dir,
            address=address,
            **fields,  # type: ignore[arg-type]
        )
        return cls(command, server_env(py, install, allocator=allocator))

    def argv(self) -> list[str]:
        """What start() runs: the launcher when set, else the plain server command."""
        return self.launcher if self.launcher is not None else self.command.argv()

    def shown_argv(self) -> list[str]:
        """argv() with the admin key replaced by REDACTED: what is printed or recorded."""
        key = self.command.admin_key
        return [a.replace(key, REDACTED) for a in self.argv()] if key else self.argv()

    # -- endpoints (tritonclient takes "host:port" without a scheme) --------------------------

    @property
    def host(self) -> str:
        return "127.0.0.1" if self.command.address in ("0.0.0.0", "") else self.command.address

    @property
    def http_endpoint(self) -> str:
        return f"{self.host}:{self.command.http_port}"

    @property
    def grpc_endpoint(self) -> str:
        return f"{self.host}:{self.command.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.command.metrics_port}/metrics"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # -- lifecycle -----------------------------------------------------------------------------

    def start(
        self,
        log_path: str | os.PathLike[str] | None = None,
        *,
        detach: bool = False,
        pid_file: str | os.PathLike[str] | None = None,
    ) -> None:
        """Launch the server; returns at once (call :meth:`wait_ready`).

        Output goes to ``log_path`` (default: a new temp file; ``-``: this process's stdout,
        as a container's log, which `kubectl logs` shows). A detached server outlives
        this Python process; it needs ``pid_file`` so that :func:`stop_detached` can end it.
        """
        if self.is_running():
            raise ServerError(f"this server is already running (pid {self.pid})")
        if detach and pid_file is None:
            raise ServerError("a detached server needs a pid_file to be stopped later")
        if self.command.restricted_apis:  # refused up front, by name, where the key cannot be hidden
            hidden_args.require_tracing(str(self.command.binary))
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix="tritonserver-", suffix=".log")
            os.close(fd)
            log_path = name
        to_stdout = str(log_path) == "-"
        if to_stdout and detach:
            raise ServerError("a detached server cannot log to stdout (--log-file -); give a file")
        self.log_path = None if to_stdout else Path(log_path)
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path or os.devnull, "wb") as log:  # the child keeps its own copy of the fd
            try:
                # The admin key never on the command line (/proc/PID/cmdline is world-readable):
                # argv shows REDACTED, the server reads the key from its environment (hidden_args).
                shown, real = self.shown_argv(), self.argv()
                self._proc = hidden_args.spawn(
                    shown,
                    {i: arg for i, (arg, seen) in enumerate(zip(real, shown, strict=True)) if arg != seen},
                    self.env,
                    None if detach else die_with_parent,
                    stdin=subprocess.DEVNULL,
                    stdout=None if to_stdout else log,
                    stderr=None if to_stdout else subprocess.STDOUT,
                    # Own session: the group can be signalled as a whole, and Ctrl-C in the
                    # caller's terminal does not reach the server behind our back.
                    start_new_session=True,
                    # PDEATHSIG follows the *thread* that forks: start from a long-lived thread.
                )
            except OSError as err:
                raise ServerError(f"could not run {self.command.binary}: {err}") from err
        self._started_at = time.monotonic()
        self.ready_seconds = None
        if detach:
            try:
                write_pid_file(Path(pid_file), self)  # type: ignore[arg-type]
            except TrtspecError:  # another server's pid file (exclusive): do not leave ours unrecorded
                self.stop()
                raise
        else:
            _ATTACHED.add(self)

    def wait_ready(self, timeout: float = 120.0) -> float:
        """Block until ``/v2/health/ready`` answers 200 and, with metrics on, ``/metrics`` does
        too (Triton starts its metrics endpoint after the HTTP one); return seconds since start.

        On failure (process exit, a model that failed to load, timeout) the server is stopped
        and ServerError carries the relevant log lines.
        """
        if self._proc is None:
            raise ServerError("wait_ready() before start()")
        url = f"http://{self.http_endpoint}/v2/health/ready"
        deadline = time.monotonic() + timeout
        while True:
            code = self._proc.poll()
            if code is not None:
                raise self.fail(f"tritonserver exited with code {code} before it was ready")
            if _http_ok(url) and (not self.command.allow_metrics or _http_ok(self.metrics_url)):
                self.ready_seconds = time.monotonic() - self._started_at
                return self.ready_seconds
            # With exit_on_error the server exits by itself (handled above, with full logs);
            # without it, it would stay up but never ready: fail as soon as the log says so.
            if not self.command.exit_on_error:
                failed = _LOAD_FAILURE.findall(self._read_log())
                if failed:
                    raise self.fail(f"model(s) {', '.join(sorted(set(failed)))} failed to load")
            if time.monotonic() > deadline:
                raise self.fail(f"tritonserver was not ready after {timeout:.0f} s")
            time.sleep(0.1)

    def stop(self, timeout: float = 30.0) -> int | None:
        """Stop the server and every process of its group; return its exit code.

        SIGINT first, as Ctrl-C in a terminal would send to the whole group: Triton unloads
        the models (running their finalize()) and exits. SIGKILL after ``timeout``.
        """
        proc = self._proc
        if proc is None:
            return None
        _ATTACHED.discard(self)
        if proc.poll() is None:
            signal_group(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                signal_group(proc.pid, signal.SIGKILL)
                proc.wait(10)
        end_group(proc.pid, grace=min(timeout, 10.0))
        return proc.returncode

    def __enter__(self) -> TritonServer:
        if not self.is_running():
            self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"pid {self.pid}" if self.is_running() else "stopped"
        return f"TritonServer({self.command.model_repository}, http={self.http_endpoint}, {state})"

    # -- diagnostics ---------------------------------------------------------------------------

    def _read_log(self) -> str:
        if self.log_path is None or not self.log_path.is_file():
            return ""
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def fail(self, headline: str) -> ServerError:
        """Stop the server and return the error to raise, with the log lines that explain it."""
        self.stop()
        return ServerError(failure_message(headline, self._read_log(), self.log_path))


def failure_message(headline: str, log: str, log_path: Path | None) -> str:
    """``headline`` + the log lines that explain it + a hint for known causes."""
    lines = log.splitlines()
    relevant = [line for line in lines if _RELEVANT.search(line) and not _HARMLESS.search(line)]
    relevant = relevant or lines
    parts = [headline]
    if relevant:
        parts.append("server log (relevant lines):")
        parts += ["  " + _shorten(line) for line in relevant[-_LOG_EXCERPT_LINES:]]
    parts += ["hint: " + hint for pattern, hint in _HINTS if pattern.search(log)]
    if log_path is not None:
        parts.append(f"full log: {log_path}")
    return "\n".join(parts)


def _shorten(line: str) -> str:
    return line if len(line) <= _LOG_EXCERPT_WIDTH else line[:_LOG_EXCERPT_WIDTH] + " [...]"


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never proxy loopback


def _http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with _NO_PROXY.open(url, timeout=timeout) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):  # refused while starting, 400 while loading
        return False


@atexit.register
def _stop_attached() -> None:
    for server in list(_ATTACHED):
        try:
            server.stop(timeout=10.0)
        except TrtspecError:
            pass  # exiting anyway; nothing better to do with it here

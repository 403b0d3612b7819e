"""Start a program whose command line shows a placeholder where it reads a secret.

Why: tritonserver takes its admin key only on its command line (--http-restricted-api /
--grpc-restricted-protocol), and any local user can read a process's command line
(/proc/PID/cmdline, ps). A process's environment (/proc/PID/environ) is readable only by its
own user. So the secret argument travels in the environment, the command line carries a
placeholder, and before the program runs its first instruction its argv pointer is turned to
the environment's copy: the program parses the secret, /proc/PID/cmdline shows the placeholder.

How: the child asks to be traced (PTRACE_TRACEME), so the kernel stops it right after exec.
Its parent reads where the stack's argv array (/proc/PID/stat: startstack, just above argc)
and the environment strings (env_start) are, rewrites the hidden entries of argv through
/proc/PID/mem, and detaches. Where tracing is not allowed (Yama's kernel.yama.ptrace_scope 3,
or 2 without CAP_SYS_PTRACE; a seccomp profile that forbids ptrace) the start is refused with
one ServerError naming the fix, before anything runs, rather than show the secret: tritonserver
has no other way to take its admin key (no file or environment form).
"""

from __future__ import annotations

import ctypes
import os
import signal
import struct
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path

from trtspec.errors import ServerError

ENV_PREFIX = "TRTSPEC_HIDDEN_ARG_"  # + the argument's index: its real text
_PTRACE_TRACEME, _PTRACE_DETACH = 0, 17
_WORD = struct.calcsize("P")
# Resolved in the parent: the forked child must not dlopen or dlsym (another thread may hold the lock).
_PTRACE = ctypes.CDLL(None, use_errno=True).ptrace


YAMA_SCOPE = Path("/proc/sys/kernel/yama/ptrace_scope")
_CAP_SYS_PTRACE = 19
_FIX = (
    "allow a process to trace its own child (sysctl kernel.yama.ptrace_scope=1, or CAP_SYS_PTRACE, "
    "e.g. docker run --cap-add SYS_PTRACE; a seccomp profile that allows ptrace)"
)


def tracing_refusal() -> str | None:
    """Why the kernel will not let this process trace its child, as far as it says up front
    (Yama), or None. A seccomp filter shows only when the child asks (spawn)."""
    try:
        scope = int(YAMA_SCOPE.read_text())
    except (OSError, ValueError):
        return None  # no Yama: a parent may trace its own child
    if scope >= 3:
        return f"kernel.yama.ptrace_scope is {scope}: no process may trace another (it holds until a reboot)"
    if scope == 2 and not _has_capability(_CAP_SYS_PTRACE):
        return "kernel.yama.ptrace_scope is 2 and this process lacks CAP_SYS_PTRACE"
    return None


def _has_capability(bit: int) -> bool:
    """Whether this process holds capability ``bit`` (its effective set, /proc/self/status)."""
    status = Path("/proc/self/status").read_text(encoding="ascii", errors="replace")
    line = next((x for x in status.splitlines() if x.startswith("CapEff:")), "CapEff: 0")
    return bool(int(line.split()[1], 16) >> bit & 1)


def refused(program: str, reason: str) -> ServerError:
    """The one error for a program whose secret arguments cannot be kept off its command line."""
    return ServerError(
        f"cannot start {Path(program).name} with its admin key off its command line, which every local user can "
        f"read: {reason}; {_FIX}"
    )


def require_tracing(program: str) -> None:
    """Raise :func:`refused` where the kernel says up front that spawn could not hide arguments."""
    reason = tracing_refusal()
    if reason is not None:
        raise refused(program, reason)


def _trace_me() -> None:
    if _PTRACE(ctypes.c_int(_PTRACE_TRACEME), ctypes.c_int(0), None, None) != 0:
        raise OSError(ctypes.get_errno(), "PTRACE_TRACEME")


def _stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat from field 3 on (the name in field 2 may hold spaces and parentheses)."""
    text = open(f"/proc/{pid}/stat", encoding="ascii", errors="replace").read()
    return text[text.rindex(")") + 2 :].split()


def _point_argv_at_env(pid: int, argc_given: int, hidden: Mapping[int, str]) -> None:
    fields = _stat_fields(pid)
    start_stack, env_start = int(fields[28 - 3]), int(fields[50 - 3])
    environ = open(f"/proc/{pid}/environ", "rb").read()
    mem = os.open(f"/proc/{pid}/mem", os.O_RDWR)
    try:
        (argc,) = struct.unpack("P", os.pread(mem, _WORD, start_stack))
        shift = argc - argc_given  # an interpreter line (#!) puts its own words first
        if shift < 0:
            raise ServerError(f"the started program has {argc} arguments, not the {argc_given} given")
        for index in hidden:
            entry = f"{ENV_PREFIX}{index}=".encode()
            at = (b"\0" + environ).find(b"\0" + entry)
            if at < 0:
                raise ServerError(f"argument {index} is not in the started program's environment")
            value = env_start + at + len(entry)
            os.pwrite(mem, struct.pack("P", value), start_stack + _WORD * (1 + index + shift))
    finally:
        os.close(mem)


def spawn(
    argv: list[str],
    hidden: Mapping[int, str],
    env: Mapping[str, str] | None,
    preexec: Callable[[], None] | None = None,
    **popen: object,
) -> subprocess.Popen[bytes]:
    """Popen(argv) where each ``argv[i]`` for ``i`` in ``hidden`` is what the command line shows
    and ``hidden[i]`` is what the program reads. Must be called from the thread that will not
    exit before the program is running (it is the tracer until detach)."""
    if not hidden:
        return subprocess.Popen(argv, env=env, preexec_fn=preexec, **popen)  # type: ignore[call-overload]
    require_tracing(argv[0])
    env = {**(os.environ if env is None else env), **{f"{ENV_PREFIX}{i}": text for i, text in hidden.items()}}

    def child() -> None:
        if preexec is not None:
            preexec()
        _trace_me()

    try:
        proc = subprocess.Popen(argv, env=env, preexec_fn=child, **popen)  # type: ignore[call-overload]
    except subprocess.SubprocessError as err:  # _trace_me failed in the child
        raise refused(argv[0], "the kernel refused to let the child be traced (PTRACE_TRACEME)") from err
    _, status = os.waitpid(proc.pid, 0)  # the stop at exec
    if not os.WIFSTOPPED(status):
        proc.returncode = os.waitstatus_to_exitcode(status)
        return proc
    try:
        _point_argv_at_env(proc.pid, len(argv), hidden)
    except BaseException as err:
        os.kill(proc.pid, signal.SIGKILL)
        _PTRACE(ctypes.c_int(_PTRACE_DETACH), ctypes.c_int(proc.pid), None, None)
        proc.wait()
        if isinstance(err, OSError):  # /proc/PID/mem closed to its tracer (a hardened kernel, gVisor)
            raise refused(argv[0], f"its memory cannot be written through /proc ({err.strerror})") from err
        raise
    if _PTRACE(ctypes.c_int(_PTRACE_DETACH), ctypes.c_int(proc.pid), None, None) != 0:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        raise ServerError(f"could not release {argv[0]} after starting it (errno {ctypes.get_errno()})")
    return proc

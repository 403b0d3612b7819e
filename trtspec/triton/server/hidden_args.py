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
/proc/PID/mem, and detaches. Where tracing is not allowed (a seccomp profile that forbids
ptrace) the start fails with ServerError rather than show the secret.
"""

from __future__ import annotations

import ctypes
import os
import signal
import struct
import subprocess
from collections.abc import Callable, Mapping

from trtspec.errors import ServerError

ENV_PREFIX = "TRTSPEC_HIDDEN_ARG_"  # + the argument's index: its real text
_PTRACE_TRACEME, _PTRACE_DETACH = 0, 17
_WORD = struct.calcsize("P")
# Resolved in the parent: the forked child must not dlopen or dlsym (another thread may hold the lock).
_PTRACE = ctypes.CDLL(None, use_errno=True).ptrace


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
    env = {**(os.environ if env is None else env), **{f"{ENV_PREFIX}{i}": text for i, text in hidden.items()}}

    def child() -> None:
        if preexec is not None:
            preexec()
        _trace_me()

    try:
        proc = subprocess.Popen(argv, env=env, preexec_fn=child, **popen)  # type: ignore[call-overload]
    except subprocess.SubprocessError as err:  # _trace_me failed in the child
        raise ServerError(
            f"cannot start {argv[0]} with its secret arguments off its command line: tracing the child is "
            f"not allowed here ({err}); allow ptrace for this process (seccomp, kernel.yama.ptrace_scope < 3)"
        ) from err
    _, status = os.waitpid(proc.pid, 0)  # the stop at exec
    if not os.WIFSTOPPED(status):
        proc.returncode = os.waitstatus_to_exitcode(status)
        return proc
    try:
        _point_argv_at_env(proc.pid, len(argv), hidden)
    except BaseException:
        os.kill(proc.pid, signal.SIGKILL)
        _PTRACE(ctypes.c_int(_PTRACE_DETACH), ctypes.c_int(proc.pid), None, None)
        proc.wait()
        raise
    if _PTRACE(ctypes.c_int(_PTRACE_DETACH), ctypes.c_int(proc.pid), None, None) != 0:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        raise ServerError(f"could not release {argv[0]} after starting it (errno {ctypes.get_errno()})")
    return proc

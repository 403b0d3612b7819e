"""The admin key on no command line: not on mpirun's, not on a rank's, not on tritonserver's;
and where the kernel forbids the tracing that hides it, a start refused by name, nothing run.

tritonserver takes its admin key only on its command line (--http-restricted-api /
--grpc-restricted-protocol; no file or environment form), which every local user can read in
/proc/PID/cmdline. A trtllm deployment runs its ranks under mpirun, which starts each rank with
the words it was given, so each rank is trtspec.triton.server.rank around its tritonserver."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import processes_mentioning
from typer.testing import CliRunner

from trtspec.cli.app import app
from trtspec.errors import ServerError
from trtspec.spec import load_spec
from trtspec.triton.server import hidden_args
from trtspec.triton.server.process import ADMIN_KEY_ENV, REDACTED, ServerCommand, TritonServer
from trtspec.triton.server.rank import MODULE
from trtspec.triton.server.trtllm_launch import launch_command, launch_for_spec

KEY = "s3cret-admin-key"
SPECS = Path(__file__).parent / "data" / "specs"


def _command(**fields) -> ServerCommand:
    return ServerCommand(binary=Path("/opt/tritonserver/bin/tritonserver"), model_repository=Path("/r"), admin_key=KEY, **fields)


@pytest.mark.parametrize("spawn_processes", [True, False], ids=["orchestrator-spawned", "orchestrator-ranks"])
def test_no_rank_command_line_holds_the_key(spawn_processes):
    """Every rank is the rank module around its tritonserver, whose admin rules show REDACTED;
    mpirun exports the key by name (-x), its value only in the launch's environment."""
    spec = load_spec(SPECS / "trtllm-tp2.yaml").spec
    launch = launch_for_spec(spec, _command(), spawn_processes=spawn_processes, python="python3")
    assert not any(KEY in a for a in launch.argv)
    assert launch.argv[:4] == ["mpirun", "--allow-run-as-root", "-x", ADMIN_KEY_ENV] and launch.env[ADMIN_KEY_ENV] == KEY
    ranks = " ".join(launch.argv[4:]).split(" : ")
    assert len(ranks) == launch.world_size
    for rank in ranks:
        assert rank.startswith(f"-n 1 python3 -m {MODULE} /opt/tritonserver/bin/tritonserver ")
        assert rank.count(f"triton-admin-key={REDACTED}") == 2  # HTTP and gRPC rules


def test_leader_mode_ranks_hold_no_key_and_without_admin_rules_nothing_is_exported():
    launch = launch_command(_command(), [("tensorrt_llm", 2)], python="python3")
    assert launch.world_size == 2 and not any(KEY in a for a in launch.argv) and launch.env == {ADMIN_KEY_ENV: KEY}
    open_launch = launch_command(_command(restricted_apis=()), [("tensorrt_llm", 2)], python="python3")
    assert "-x" not in open_launch.argv and open_launch.env == {}


def _recorder(tmp_path: Path) -> tuple[Path, Path]:
    """A stand-in tritonserver: records what it parsed and what others see, then waits."""
    out = tmp_path / "seen.json"
    script = tmp_path / "tritonserver"
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys, time\n"
        "cmdline = open('/proc/self/cmdline', 'rb').read().decode().split('\\0')\n"
        f"open({str(out)!r}, 'w').write(json.dumps({{'argv': sys.argv, 'cmdline': cmdline, 'ppid': os.getppid()}}))\n"
        "time.sleep(60)\n"
    )
    script.chmod(0o755)
    return script, out


def test_a_rank_starts_its_server_with_the_key_hidden_and_passes_signals_on(tmp_path):
    """What mpirun runs for one rank, run here with the environment mpirun exports: the server
    parses the key, neither its command line nor the rank's shows it, and SIGTERM to the rank
    ends the server and the rank with the server's status."""
    script, out = _recorder(tmp_path)
    server_argv = ServerCommand(binary=script, model_repository=tmp_path, admin_key=KEY).argv()
    rank = launch_command(ServerCommand(binary=script, model_repository=tmp_path, admin_key=KEY), [("m", 1)])
    words = rank.argv[rank.argv.index("-n") + 2 :]  # after "-n 1": this rank's own words
    env = {"PATH": "/usr/bin:/bin", **rank.env}
    proc = subprocess.Popen(words, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not out.exists() or not out.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()
            time.sleep(0.05)
        seen = json.loads(out.read_text())
        outside = [Path(f"/proc/{pid}/cmdline").read_bytes().decode() for pid in (proc.pid, seen["ppid"])]
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
    finally:
        proc.kill()
    assert seen["argv"][1:] == [w.replace(REDACTED, KEY) for w in words[4:]] and seen["ppid"] == proc.pid
    assert set(server_argv) <= set(seen["argv"])  # the admin rules parsed with the key, every other word as given
    assert not any(KEY in text for text in [*outside, " ".join(seen["cmdline"])])
    assert " ".join(seen["cmdline"]).count(REDACTED) == 2
    assert code == 128 + signal.SIGTERM  # the server's own end, as a shell reports it
    assert processes_mentioning(str(tmp_path)) == []


def test_under_a_real_mpirun_no_process_shows_the_key(tmp_path):
    """Two ranks in leader mode as `trtspec serve` launches them (Open MPI's mpirun): each
    stand-in server parses the key, and no process of the launch shows it on its command
    line; stopping the launch ends every rank."""
    import os
    import shutil

    if shutil.which("mpirun") is None:
        pytest.skip("needs Open MPI's mpirun (apt-get install openmpi-bin)")
    script = tmp_path / "tritonserver"  # records what it parsed, one file per rank (its shm prefix)
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, sys, time\n"
        "rank = next(a for a in sys.argv if 'shm-region-prefix-name=' in a).rsplit('=', 1)[1]\n"
        f"open({str(tmp_path)!r} + '/seen-' + rank + 'json', 'w').write(json.dumps(sys.argv))\n"
        "time.sleep(120)\n"
    )
    script.chmod(0o755)
    command = ServerCommand(binary=script, model_repository=tmp_path, admin_key=KEY)
    launch = launch_command(command, [("m", 2)])
    server = TritonServer(command, env={**os.environ, **launch.env}, launcher=launch.argv)
    server.start(tmp_path / "log")
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("seen-*"))) < 2 or not all(f.read_text() for f in tmp_path.glob("seen-*")):
            assert server.is_running() and time.monotonic() < deadline, (tmp_path / "log").read_text()
            time.sleep(0.1)
        parsed = [json.loads(f.read_text()) for f in sorted(tmp_path.glob("seen-*"))]
        shown = _command_lines(str(tmp_path))
    finally:
        server.stop(timeout=10)
    assert len(parsed) == 2 and all(sum(a.endswith(f"triton-admin-key={KEY}") for a in argv) == 2 for argv in parsed)
    assert len(shown) >= 5 and not any(KEY in line for line in shown)  # mpirun, 2 ranks, 2 servers
    assert sum(f"triton-admin-key={REDACTED}" in line for line in shown) >= 5
    deadline = time.monotonic() + 30
    while processes_mentioning(str(tmp_path)):
        assert time.monotonic() < deadline, processes_mentioning(str(tmp_path))
        time.sleep(0.2)


def _command_lines(text: str) -> list[str]:
    """The whole command line of every live process whose command line holds ``text``."""
    lines = []
    for entry in Path("/proc").iterdir():
        try:
            line = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace") if entry.name.isdigit() else ""
        except OSError:
            continue
        if text in line:
            lines.append(line)
    return lines


def _yama(tmp_path, monkeypatch, scope: int) -> None:
    (tmp_path / "ptrace_scope").write_text(f"{scope}\n")
    monkeypatch.setattr(hidden_args, "YAMA_SCOPE", tmp_path / "ptrace_scope")


def test_serve_refuses_by_name_where_yama_forbids_tracing(tmp_path, monkeypatch):
    """kernel.yama.ptrace_scope 3: `trtspec serve` exits 3 with one Error line naming the cause
    and the fix, and starts nothing (a started server would show its key)."""
    _yama(tmp_path, monkeypatch, 3)
    repo = tmp_path / "repo"
    (repo / "m").mkdir(parents=True)
    (repo / "m" / "config.pbtxt").write_text('name: "m"\n')
    result = CliRunner().invoke(app, ["serve", str(repo)])
    assert result.exit_code == 3, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: cannot start tritonserver with its admin key off its command line")
    assert "kernel.yama.ptrace_scope is 3" in lines[0] and "sysctl kernel.yama.ptrace_scope=1" in lines[0]
    assert processes_mentioning(str(repo)) == []


def test_scope_2_refuses_only_without_cap_sys_ptrace(tmp_path, monkeypatch):
    _yama(tmp_path, monkeypatch, 2)
    monkeypatch.setattr(hidden_args, "_has_capability", lambda bit: False)
    assert "lacks CAP_SYS_PTRACE" in hidden_args.tracing_refusal()
    monkeypatch.setattr(hidden_args, "_has_capability", lambda bit: bit == 19)
    assert hidden_args.tracing_refusal() is None
    _yama(tmp_path, monkeypatch, 1)
    assert hidden_args.tracing_refusal() is None


def test_a_child_the_kernel_will_not_let_be_traced_is_refused_by_name(tmp_path, monkeypatch):
    """A seccomp profile that forbids ptrace shows only when the child asks to be traced:
    the start is refused by name and no process is left."""
    script, out = _recorder(tmp_path)

    def forbidden() -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(hidden_args, "_trace_me", forbidden)
    server = TritonServer(ServerCommand(binary=script, model_repository=tmp_path, admin_key=KEY))
    with pytest.raises(ServerError, match=r"the kernel refused to let the child be traced .*CAP_SYS_PTRACE") as info:
        server.start(tmp_path / "log")
    assert info.value.exit_code == 3 and "\n" not in str(info.value)
    assert not out.exists() and processes_mentioning(str(tmp_path)) == []


def test_a_rank_where_tracing_is_forbidden_says_so_in_one_line(tmp_path):
    """Under mpirun the refusal is the rank's: one Error line in the server log, exit 3."""
    (tmp_path / "ptrace_scope").write_text("3\n")
    script, out = _recorder(tmp_path)
    words = [sys.executable, "-c", _RANK_WITH_YAMA.format(path=str(tmp_path / "ptrace_scope"))]
    words += [str(script), f"--http-restricted-api=logging:triton-admin-key={REDACTED}"]
    done = subprocess.run(words, env={ADMIN_KEY_ENV: KEY}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 3 and not out.exists()
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("Error: cannot start tritonserver with its admin key")


_RANK_WITH_YAMA = (
    "import sys; from pathlib import Path; from trtspec.triton.server import hidden_args, rank; "
    "hidden_args.YAMA_SCOPE = Path({path!r}); sys.exit(rank.main(sys.argv[1:]))"
)

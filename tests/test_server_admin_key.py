"""The admin key: read from a file (a mounted Secret) or the environment, never written by
trtspec: the pid file and printed commands show it redacted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trtspec.errors import TrtspecError
from trtspec.triton.server.process import ADMIN_KEY_ENV, ADMIN_KEY_FILE_ENV, REDACTED, ServerCommand, TritonServer

KEY = "s3cret-admin-key"


def _server(**fields) -> TritonServer:
    return TritonServer(ServerCommand(binary=Path("/bin/sleep"), model_repository=Path("/r"), **fields))


def test_the_key_comes_from_the_file_first_then_the_environment(tmp_path, monkeypatch):
    (tmp_path / "key").write_text(KEY + "\n")
    monkeypatch.setenv(ADMIN_KEY_ENV, "from-env")
    monkeypatch.setenv(ADMIN_KEY_FILE_ENV, str(tmp_path / "key"))
    assert ServerCommand(binary=Path("t"), model_repository=Path("r")).admin_key == KEY
    # an optional Secret that does not exist mounts no file: the environment, else random
    monkeypatch.setenv(ADMIN_KEY_FILE_ENV, str(tmp_path / "absent"))
    assert ServerCommand(binary=Path("t"), model_repository=Path("r")).admin_key == "from-env"
    monkeypatch.delenv(ADMIN_KEY_ENV)
    a, b = (ServerCommand(binary=Path("t"), model_repository=Path("r")).admin_key for _ in range(2))
    assert a != b and len(a) >= 24


def test_an_unreadable_key_file_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv(ADMIN_KEY_FILE_ENV, str(tmp_path))  # a folder
    with pytest.raises(TrtspecError, match=rf"cannot read the admin key file {tmp_path} .*unset {ADMIN_KEY_FILE_ENV}"):
        ServerCommand(binary=Path("t"), model_repository=Path("r"))


def test_the_pid_file_and_the_shown_command_never_hold_the_key(tmp_path):
    server = _server(admin_key=KEY)
    assert any(KEY in a for a in server.argv())  # tritonserver 2.51 takes it only on its command line
    shown = server.shown_argv()
    assert not any(KEY in a for a in shown) and sum(REDACTED in a for a in shown) == 2  # HTTP and gRPC rules
    server.start(tmp_path / "log", detach=True, pid_file=tmp_path / "server.pid")
    try:
        text = (tmp_path / "server.pid").read_text()
    finally:
        server.stop(timeout=5)
    assert KEY not in text and json.loads(text)["argv"] == shown


def test_the_shown_command_of_a_launched_server_hides_the_key_too():
    server = _server(admin_key=KEY)
    server.launcher = ["mpirun", "-n", "1", *server.command.argv()]
    assert not any(KEY in a for a in server.shown_argv()) and server.shown_argv()[0] == "mpirun"


def test_the_running_server_reads_the_key_but_its_command_line_never_shows_it(tmp_path):
    """/proc/PID/cmdline is readable by every local user: the started process must parse the
    admin rules while its command line (what ps shows) carries only REDACTED."""
    import sys
    import time

    out = tmp_path / "seen.json"
    script = tmp_path / "tritonserver"  # stands in for the binary: records what it parsed and what others see
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, sys, time\n"
        "cmdline = open('/proc/self/cmdline', 'rb').read().decode().split('\\0')\n"
        f"open({str(out)!r}, 'w').write(json.dumps({{'argv': sys.argv, 'cmdline': cmdline}}))\n"
        "time.sleep(60)\n"
    )
    script.chmod(0o755)
    server = TritonServer(ServerCommand(binary=script, model_repository=tmp_path, admin_key=KEY))
    server.start(tmp_path / "log")
    try:
        deadline = time.monotonic() + 30
        while not out.exists() or not out.read_text():
            assert server.is_running() and time.monotonic() < deadline, (tmp_path / "log").read_text()
            time.sleep(0.05)
        seen = json.loads(out.read_text())
        outside = (Path("/proc") / str(server.pid) / "cmdline").read_bytes().decode()
    finally:
        server.stop(timeout=5)
    rules = [a for a in seen["argv"] if a.startswith(("--http-restricted-api=", "--grpc-restricted-protocol="))]
    assert len(rules) == 2 and all(a.endswith(f"triton-admin-key={KEY}") for a in rules)  # the server parses the key
    assert seen["argv"][1:] == server.command.argv()[1:]  # every other argument as given
    assert KEY not in outside and KEY not in " ".join(seen["cmdline"]) and outside.count(REDACTED) == 2

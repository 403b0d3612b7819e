"""The CLI through typer's CliRunner: exit codes, messages, reports."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest
from conftest import built_spec, write_spec
from typer.testing import CliRunner

from trtspec.cli.app import app

runner = CliRunner()


@pytest.fixture(scope="module")
def spec_file(tmp_path_factory, tiny_ckpts):
    return built_spec(tmp_path_factory, tiny_ckpts, "cli", **{"verify.max_tokens": 24})


def test_help_lists_commands_and_exit_codes():
    r = runner.invoke(app, ["--help"])
    assert r.exit_code == 0
    for word in ("check", "build", "verify", "Exit codes"):
        assert word in r.output


def test_verify_help_says_sampling_runs_over_url_too():
    """--sampling works in process and with --url (tests/test_serve.py runs both); its help says so."""
    r = runner.invoke(app, ["verify", "--help"], terminal_width=400)
    text = " ".join(r.output.replace("│", " ").split())
    assert r.exit_code == 0
    assert "In process only" not in text
    assert "In process, or with --url from the served speculative endpoint" in text
    assert "--sampling 200 --url 127.0.0.1:8001" in text


def test_check_ok(spec_file):
    r = runner.invoke(app, ["check", str(spec_file), "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert [m["role"] for m in data["models"]] == ["target", "draft"]
    assert data["models"][0]["vocab"] == 384 and data["models"][0]["embedding_rows"] == 400


def test_check_incompatible_pair_exit_2(tmp_path, tiny_ckpts):
    path = write_spec(tmp_path, tiny_ckpts, draft="other-vocab")
    r = runner.invoke(app, ["check", str(path)])
    assert r.exit_code == 2
    assert "Error: draft and target tokenizers are incompatible" in r.stderr
    assert "Traceback" not in r.output


def test_bad_spec_exit_2_no_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ntarget: {path: /x, colour: blue}\n")
    for cmd in ("check", "build", "verify"):
        r = runner.invoke(app, [cmd, str(bad)])
        assert r.exit_code == 2
        assert "target.colour: unknown key; remove or rename it" in r.stderr
        assert "Traceback" not in r.stderr


def test_debug_env_shows_traceback(tmp_path, monkeypatch):
    monkeypatch.setenv("TRTSPEC_DEBUG", "1")
    r = runner.invoke(app, ["check", str(tmp_path / "missing.yaml")])
    assert r.exit_code == 2 and "Traceback" in r.stderr


def test_build_dry_run_writes_nothing(tmp_path, tiny_ckpts):
    path = write_spec(tmp_path, tiny_ckpts)
    r = runner.invoke(app, ["build", str(path), "--dry-run"])
    assert r.exit_code == 0
    assert "target:" in r.stdout and "[build]" in r.stdout and "dry run: nothing written" in r.stdout
    assert not (tmp_path / "engines").exists()


def test_build_twice_says_nothing_to_do(spec_file):
    r = runner.invoke(app, ["build", str(spec_file)])
    assert r.exit_code == 0 and "nothing to do" in r.stdout


def test_verify_identical_with_reports(spec_file, tmp_path):
    j, x = tmp_path / "r.json", tmp_path / "r.xml"
    r = runner.invoke(app, ["verify", str(spec_file), "--json-file", str(j), "--junit", str(x)])
    assert r.exit_code == 0, r.output
    assert "all identical" in r.stdout and "speedup" in r.stdout
    data = json.loads(j.read_text())
    assert data["identical"] is True and data["prompts"] == 5
    assert all(p["target_ids"] == p["spec_ids"] for p in data["results"])
    suite = ET.parse(x).getroot().find("testsuite")
    assert suite.get("tests") == "5" and suite.get("failures") == "0"
    assert len(suite.findall("testcase")) == 5


def test_verify_reports_a_divergence_exit_1(spec_file, tmp_path, monkeypatch):
    """A deliberately broken speculative path (drafts checked by the draft model instead of
    the target) must be caught and explained."""
    from trtspec.runtime import Deployment
    from trtspec.speculative.loop import generate
    from trtspec.speculative.verifier import LogitsVerifier

    real = Deployment.generate

    def broken(self, requests, speculative=True, on_step=None):
        if speculative:
            return generate(requests, self.drafter(), LogitsVerifier(self.draft.run), on_step)
        return real(self, requests, speculative, on_step)

    monkeypatch.setattr(Deployment, "generate", broken)
    j, x = tmp_path / "r.json", tmp_path / "r.xml"
    r = runner.invoke(app, ["verify", str(spec_file), "--json-file", str(j), "--junit", str(x)])
    assert r.exit_code == 1
    assert "diverged" in r.stdout
    data = json.loads(j.read_text())
    bad = [p for p in data["results"] if not p["identical"]]
    assert bad
    d = bad[0]["divergence"]
    assert d["target_id"] == bad[0]["target_ids"][d["index"]]
    assert d["spec_id"] != d["target_id"]
    assert d["target_margin"] is not None and d["target_margin"] >= 0
    assert bad[0]["target_ids"][: d["index"]] == bad[0]["spec_ids"][: d["index"]]
    suite = ET.parse(x).getroot().find("testsuite")
    assert int(suite.get("failures")) == len(bad)


def test_verify_prompt_option_and_k(spec_file):
    r = runner.invoke(app, ["verify", str(spec_file), "-p", "hello there", "-k", "2", "--max-tokens", "8"])
    assert r.exit_code == 0, r.output
    assert "1 prompts: all identical" in r.stdout


def test_verify_prompt_too_long_exit_2(spec_file):
    r = runner.invoke(app, ["verify", str(spec_file), "-p", "word " * 400])
    assert r.exit_code == 2
    assert "more than max_input_len 256; shorten it or rebuild with a larger build.max_input_len" in r.stderr


def test_verify_unbuilt_engines_exit_2(tmp_path, tiny_ckpts):
    path = write_spec(tmp_path, tiny_ckpts)
    r = runner.invoke(app, ["verify", str(path)])
    assert r.exit_code == 2
    assert "does not exist; run `trtspec build SPEC`" in r.stderr


@pytest.mark.parametrize("cmd", ["verify", "bench"])
def test_k_beyond_max_draft_len_is_refused_before_any_engine_loads(spec_file, cmd, monkeypatch):
    """-k is checked against the spec's max_draft_len (8 here) before the engines load, which
    takes a minute on a real pair: the loader fails the test if it is called."""
    from trtspec.runtime import Deployment

    def load(*args, **kwargs):
        raise AssertionError("the engines were loaded before -k was checked")

    monkeypatch.setattr(Deployment, "__init__", load)
    r = runner.invoke(app, [cmd, str(spec_file), "-k", "9", "-p", "hi"])
    assert r.exit_code == 2, r.output
    said = " ".join(r.stderr.split())  # one line, however rich wraps it
    assert said == (
        "Error: -k/--num-draft-tokens 9 is outside 0..8 (spec.yaml's speculative.max_draft_len); "
        "pass -k 0..8, or rebuild with a larger max_draft_len"
    )


def test_json_means_stdout_and_json_file_means_a_file_for_every_reporting_command(spec_file, tmp_path):
    r = runner.invoke(app, ["verify", str(spec_file), "--json", "-p", "def fibonacci(n):"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["identical"] is True  # stdout is JSON alone: no table
    out = tmp_path / "check.json"
    r = runner.invoke(app, ["check", str(spec_file), "--json-file", str(out)])
    assert r.exit_code == 0 and "trtspec check" in r.stdout  # the table, and the file as well
    assert json.loads(out.read_text())["ok"] is True
    r = runner.invoke(app, ["build", str(spec_file), "--dry-run", "--json"])
    assert r.exit_code == 0
    plan = json.loads(r.stdout)
    assert plan["written"] is False
    assert [u["state"] for u in plan["units"]] == ["up to date unless the source weights changed"] * 2


@pytest.mark.parametrize("cmd", ["verify", "bench"])
@pytest.mark.parametrize("url", ["http://127.0.0.1:8001", "127.0.0.1", "127.0.0.1:http", ":8001", "127.0.0.1:70000"])
def test_url_is_checked_the_same_way_by_every_command(spec_file, cmd, url):
    r = runner.invoke(app, [cmd, str(spec_file), "--url", url])
    assert r.exit_code == 2
    assert f"--url takes HOST:PORT (the gRPC port, e.g. 127.0.0.1:8001), not {url!r}" in r.stderr


def test_openai_refuses_what_is_not_a_deployment_exit_2(tmp_path, spec_file):
    r = runner.invoke(app, ["openai", str(tmp_path)])
    assert r.exit_code == 2 and "is neither a spec file nor a model repository" in r.stderr
    r = runner.invoke(app, ["openai", str(spec_file), "--url", "http://127.0.0.1:8001"])
    assert r.exit_code == 2 and "--url takes HOST:PORT" in r.stderr


@pytest.mark.parametrize("value", ["0", "-1", "121", "nan", "inf"])
def test_openai_refuses_a_head_timeout_out_of_range_exit_2(spec_file, value):
    r = runner.invoke(app, ["openai", str(spec_file), "--head-timeout", value])
    assert r.exit_code == 2
    assert r.stderr.strip().splitlines() == [f"Error: --head-timeout takes seconds above 0 and at most 120, not {float(value):g}"]


# ----------------------------------------------------------------------- trtspec stop


def _sleeper(tmp_path, name="server.json"):
    """A detached stand-in server (a long sleep) recorded in a pid file, as `serve --detach` does."""
    from pathlib import Path

    from trtspec.triton.server.process import ServerCommand, TritonServer

    server = TritonServer(ServerCommand(binary=Path("/bin/false"), model_repository=tmp_path), launcher=["sleep", "600.4321"])
    pid_file = tmp_path / name
    server.start(tmp_path / "log", detach=True, pid_file=pid_file)
    return server, pid_file


def _gone(pid):
    from trtspec.triton.server.procgroup import alive

    return not alive(pid)


def test_stop_leaves_alone_a_reused_pid_with_another_start_time(tmp_path):
    server, pid_file = _sleeper(tmp_path)
    try:
        info = json.loads(pid_file.read_text())
        assert isinstance(info["start_time"], int)
        # Same pid, same program name, but started at another time: the pid was reused.
        pid_file.write_text(json.dumps(info | {"start_time": info["start_time"] - 1}))
        r = runner.invoke(app, ["stop", "--pid-file", str(pid_file)])
        assert r.exit_code == 0, r.output
        assert "had already exited" in r.stdout
        assert not _gone(server.pid), "stop signalled a process it did not start"
        assert not pid_file.exists()
    finally:
        server.stop(timeout=5)
    assert _gone(server.pid)


def test_stop_ends_the_recorded_process(tmp_path):
    server, pid_file = _sleeper(tmp_path)
    r = runner.invoke(app, ["stop", "--pid-file", str(pid_file), "--timeout", "5"])
    assert r.exit_code == 0, r.output
    assert "stopped the server" in r.stdout
    assert _gone(server.pid) and not pid_file.exists()


def test_a_second_detached_server_on_the_same_pid_file_is_refused_and_stopped(tmp_path):
    first, pid_file = _sleeper(tmp_path)
    try:
        before = pid_file.read_text()
        from trtspec.errors import ServerError

        with pytest.raises(ServerError, match="exists: a server may be running"):
            _sleeper(tmp_path)
        assert pid_file.read_text() == before  # the first server's record is untouched
        assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
        import subprocess

        sleeps = subprocess.run(["pgrep", "-f", "^sleep 600.4321$"], capture_output=True, text=True).stdout.split()
        assert sleeps == [str(first.pid)], "the refused second server was left running"
    finally:
        first.stop(timeout=5)


def test_stop_not_permitted_is_one_clean_error(tmp_path, monkeypatch):
    """Another user's server: os.killpg raises PermissionError; stop says so, exit 3."""
    import trtspec.triton.server.detached as detached

    server, pid_file = _sleeper(tmp_path)
    try:

        def refused(pgid, sig):
            raise PermissionError(1, "Operation not permitted")

        monkeypatch.setattr(detached, "signal_group", refused)
        r = runner.invoke(app, ["stop", "--pid-file", str(pid_file)])
        assert r.exit_code == 3, r.output
        assert (
            f"Error: not permitted to signal the server (pid {server.pid}): Operation not permitted; run `trtspec stop` as"
            in (r.stderr)
        )
        assert "Traceback" not in r.output
    finally:
        server.stop(timeout=5)


def test_stop_with_an_unreadable_pid_file_is_exit_2(tmp_path, monkeypatch):
    from pathlib import Path

    pid_file = tmp_path / "server.json"
    pid_file.write_text("{}")
    real = Path.read_text

    def read_text(self, *a, **kw):
        if self == pid_file:
            raise PermissionError(13, "Permission denied")
        return real(self, *a, **kw)

    monkeypatch.setattr(Path, "read_text", read_text)
    r = runner.invoke(app, ["stop", "--pid-file", str(pid_file)])
    assert r.exit_code == 2, r.output
    assert f"Error: cannot read the pid file {pid_file} (Permission denied); run `trtspec stop` as the user" in r.stderr

"""`trtspec refresh` without a server: the scheduler lets requests in flight finish on the old
head and admits new ones only on the new head, an endpoint instance's head swap (the control
file, a head that cannot be loaded, the metrics), the loop's rounds, and bad input answered
with one Error line and exit 2."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import write_spec
from test_scheduler import ListReply, _step_until, _target_only
from test_triton_cores import PROMPTS, _orchestrator, _request
from typer.testing import CliRunner

from trtspec.cli.app import app
from trtspec.distill import refresh_loop
from trtspec.distill.refresh_loop import LoopOptions, distill_command, run_loop
from trtspec.errors import RequestError
from trtspec.triton.backend.head_swap import CONTROL_FILE, HeadRecord, HeadSwap, read_record
from trtspec.triton.backend.metrics import EndpointMetrics, MemorySink
from trtspec.triton.backend.scheduler import Scheduler

runner = CliRunner()


class Renewal:
    def __init__(self):
        self.pending, self.applied = False, 0

    def due(self) -> bool:
        return self.pending

    def apply(self) -> None:
        self.pending, self.applied = False, self.applied + 1


def test_a_due_renewal_lets_the_request_in_flight_finish_on_its_batch_and_starts_the_next_on_a_new_one(built):
    dep = built()
    renewal = Renewal()
    scheduler = Scheduler(_orchestrator(dep), max_active=4, max_queue=8, renewal=renewal)
    first, second = ListReply(), ListReply()
    scheduler.submit(_request(PROMPTS[0], max_tokens=24), first)
    scheduler.step()
    old_batch = scheduler.batch
    renewal.pending = True  # a new head was loaded
    scheduler.submit(_request(PROMPTS[1], max_tokens=8), second)
    while not first.finished:
        stats = scheduler.step()
        assert scheduler.batch is old_batch and renewal.applied == 0  # in flight: the old batch, the old head
        assert stats.sequences <= 1  # nothing joins it
    assert not second.sent and second.error is None  # waited, not refused
    _step_until(scheduler, lambda: second.finished)
    assert renewal.applied == 1 and scheduler.batch is not old_batch  # the next request runs on the new one
    assert first.ids() == _target_only(dep, PROMPTS[0], 24)
    assert second.ids() == _target_only(dep, PROMPTS[1], 8)


def test_an_idle_scheduler_applies_a_due_renewal_at_once(built):
    renewal = Renewal()
    scheduler = Scheduler(_orchestrator(built()), max_active=4, max_queue=8, renewal=renewal)
    renewal.pending = True
    assert scheduler.step().sequences == 0
    assert renewal.applied == 1


def _swap(tmp_path, loads: dict, seen: list):
    def load(folder: str):
        if loads.get(folder) is None:
            raise OSError(f"no head in {folder}")
        return loads[folder]

    return HeadSwap(tmp_path / CONTROL_FILE, load, "/h/1", seen.append)


def test_an_instance_takes_the_newer_head_the_control_file_names_once_applied(tmp_path):
    seen: list[HeadRecord] = []
    swap = _swap(tmp_path, {"/h/1": "head-1", "/h/2": "head-2"}, seen)
    swap.poll()
    assert not swap.due() and swap.head == "head-1"  # no control file: the repository's head
    (tmp_path / CONTROL_FILE).write_text(json.dumps({"version": 2, "head": "/h/2", "live": 0.1, "new": 0.6}))
    woken = []
    swap.wake = lambda: woken.append(1)
    swap.poll()
    assert swap.due() and swap.head == "head-1" and woken == [1]  # loaded; the old head drafts until applied
    swap.apply()
    assert swap.head == "head-2" and not swap.due()
    assert seen == [HeadRecord(2, "/h/2", 0.1, 0.6)]
    swap.poll()
    assert not swap.due()  # the same version is not loaded twice


def test_a_head_that_cannot_be_loaded_is_skipped_and_the_instance_keeps_its_head(tmp_path):
    seen: list[HeadRecord] = []
    swap = _swap(tmp_path, {"/h/1": "head-1"}, seen)
    (tmp_path / CONTROL_FILE).write_text(json.dumps({"version": 2, "head": "/gone"}))
    swap.poll()
    assert not swap.due() and swap.head == "head-1" and seen == []
    (tmp_path / CONTROL_FILE).write_text("{torn")
    assert read_record(tmp_path / CONTROL_FILE) is None


def test_the_head_version_and_both_heads_figures_are_exported():
    sink = MemorySink()
    m = EndpointMetrics(sink, "tensorrt_llm_bls", "speculative", "i0", 4)
    labels = {"model": "tensorrt_llm_bls", "mode": "speculative", "instance": "i0"}
    m.head(1, None, None)
    assert sink.value("trtspec_eagle3_head_version", **labels).value == 1
    assert sink.value("trtspec_eagle3_head_swaps_total", **labels).value == 0
    m.head(2, 0.25, 0.5)
    assert sink.value("trtspec_eagle3_head_version", **labels).value == 2
    assert sink.value("trtspec_eagle3_head_swaps_total", **labels).value == 1
    assert sink.value("trtspec_eagle3_head_acceptance", **labels, head="serving").value == 0.5
    assert sink.value("trtspec_eagle3_head_acceptance", **labels, head="replaced").value == 0.25


def test_the_loop_runs_its_rounds_and_a_failed_round_does_not_stop_it(tmp_path):
    calls, sleeps = [], []

    def one_round(n: int) -> str:
        calls.append(n)
        if n == 2:
            raise RequestError("not better")
        return "deployed"

    opts = LoopOptions(60.0, tmp_path, tmp_path, rounds=3)
    assert run_loop(one_round, opts, sleep=sleeps.append) == 3
    assert calls == [1, 2, 3] and sleeps == [60.0, 60.0]  # no wait after the last round


def test_a_round_trains_at_the_lowest_priority_and_one_that_has_nothing_to_train_on_deploys_nothing(tmp_path, monkeypatch):
    class Loaded:
        path = tmp_path / "spec.yaml"

    opts = LoopOptions(1.0, tmp_path / "cap", tmp_path, distill_args=["--max-steps", "5"])
    cmd = distill_command(Loaded(), tmp_path / "v1", tmp_path / "v2", opts)
    assert cmd[:3] == ["nice", "-n", "19"] and cmd[3] == sys.executable
    assert cmd[4:] == ["-m", "trtspec", "distill", str(Loaded.path), "--from-capture", str(tmp_path / "cap"), "--init",
                       str(tmp_path / "v1"), "-o", str(tmp_path / "v2"), "--max-steps", "5"]  # fmt: skip

    class Done:
        returncode = 2

    monkeypatch.setattr(refresh_loop.subprocess, "run", lambda *a, **kw: Done())
    assert refresh_loop.train(Loaded(), tmp_path / "v1", tmp_path / "v2", opts) is None


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--url", "127.0.0.1:8001", "--head", "{tmp}/missing"], "is not a folder"),
        (["--url", "http://127.0.0.1:8001", "--rollback"], "HOST:PORT"),
        (["--url", "127.0.0.1:8001"], "one of --head NEW, --rollback or --every"),
        (["--url", "127.0.0.1:8001", "--rollback", "--head", "{tmp}"], "one of --head NEW"),
        (["--url", "127.0.0.1:8001", "--every", "soon"], "--every takes a positive duration"),
    ],
)
def test_bad_input_is_one_error_line_and_exit_2(tmp_path, tiny_ckpts, args, says):
    spec = write_spec(tmp_path / "spec", tiny_ckpts, **{"serve.repo_dir": str(tmp_path / "repo")})
    r = runner.invoke(app, ["refresh", str(spec), *[a.replace("{tmp}", str(tmp_path)) for a in args]])
    assert r.exit_code == 2, r.output
    assert r.output.count("Error: ") == 1 and says in r.output, r.output


def test_a_spec_without_a_written_repository_is_refused_before_the_server_is_asked(tmp_path, tiny_ckpts):
    spec = write_spec(tmp_path / "spec", tiny_ckpts, **{"serve.repo_dir": str(tmp_path / "repo")})
    r = runner.invoke(app, ["refresh", str(spec), "--url", "127.0.0.1:1", "--rollback"])
    assert r.exit_code == 2 and r.output.count("Error: ") == 1, r.output
    assert "holds no model repository" in r.output


def test_the_head_refresh_builds_alone_is_still_checked_against_the_target(tmp_path, tiny_ckpts):
    from test_eagle3 import _edited_head, random_head

    from trtspec.distill.refresh import build_head
    from trtspec.errors import TrtspecError
    from trtspec.spec import load_spec

    head = random_head(tiny_ckpts["target"], tmp_path / "head")
    bad = _edited_head(head, tmp_path / "bad", vocab_size=512)
    ck = {"target": tiny_ckpts["target"], "head": head}
    loaded = load_spec(write_spec(tmp_path / "s", ck, "head", **{"speculative.method": "eagle3"}))
    with pytest.raises(TrtspecError, match="maps into a vocabulary of 512, the target's has 400") as info:
        build_head(loaded, bad, 2)
    assert info.value.exit_code == 2
    assert not (loaded.output_dir().with_name(loaded.output_dir().name + ".refresh") / "v2" / "draft").exists()
    built = build_head(loaded, head, 2)
    assert (built / "config.json").is_file() and not (built.parent / "target").exists()  # the head alone


def test_a_loop_round_continues_the_live_heads_distill_folder_and_refreshes_with_what_it_trained(tmp_path, monkeypatch):
    calls = []

    class FakeDeployed:
        def __init__(self, loaded, url, metrics_url):
            self.live = {"version": 2, "head": "/engines.refresh/v2/draft", "source": "/heads/v2"}

    def fake_train(loaded, init, out, opts):
        calls.append(("train", init, out.parent))
        return out

    def fake_refresh(loaded, deployed, head, identical, margin, folder):
        calls.append(("refresh", head.parent, margin, folder))

        class Result:
            def summary(self):
                return "deployed"

        return Result()

    monkeypatch.setattr(refresh_loop, "Deployed", FakeDeployed)
    monkeypatch.setattr(refresh_loop, "train", fake_train)
    monkeypatch.setattr(refresh_loop, "refresh", fake_refresh)
    opts = LoopOptions(1.0, tmp_path / "cap", tmp_path / "work", rounds=1)
    assert refresh_loop.loop(object(), "h:1", "h:2", opts, lambda *a: True, 0.05) == 1
    rounds = tmp_path / "work" / "rounds"
    assert calls == [("train", refresh_loop.Path("/heads/v2"), rounds), ("refresh", rounds, 0.05, tmp_path / "work")]


def test_the_control_file_is_the_repositorys_unless_the_environment_names_a_shared_one(tmp_path, monkeypatch):
    from trtspec.triton.backend.head_swap import CONTROL_ENV, control_file

    monkeypatch.delenv(CONTROL_ENV, raising=False)
    assert control_file(tmp_path / "repo") == tmp_path / "repo" / CONTROL_FILE
    monkeypatch.setenv(CONTROL_ENV, str(tmp_path / "shared" / "head.json"))
    assert control_file(tmp_path / "repo") == tmp_path / "shared" / "head.json"


def test_engines_given_on_the_command_line_are_the_ones_refresh_reads_and_builds_beside(tmp_path, tiny_ckpts):
    from trtspec.cli.refresh import _loaded
    from trtspec.distill.refresh import refresh_dir

    spec = write_spec(tmp_path / "spec", tiny_ckpts)
    loaded = _loaded(spec, tmp_path / "mounted" / "engines")
    assert loaded.output_dir() == (tmp_path / "mounted" / "engines").resolve()
    assert refresh_dir(loaded) == (tmp_path / "mounted" / "engines.refresh").resolve()


def test_a_round_continues_the_live_source_else_the_specs_head_else_the_served_head_engine(tmp_path, tiny_ckpts):
    from trtspec.distill.refresh_loop import init_head
    from trtspec.spec import load_spec

    (tmp_path / "head").mkdir()
    ck = {"target": tiny_ckpts["target"], "head": tmp_path / "head"}
    loaded = load_spec(write_spec(tmp_path / "s", ck, "head"))
    assert init_head(loaded, {"head": "/e/draft", "source": "/heads/v3"}) == refresh_loop.Path("/heads/v3")
    assert init_head(loaded, {"head": "/e/draft"}) == tmp_path / "head"
    (tmp_path / "head").rmdir()  # a pod has the built engines only
    assert init_head(loaded, {"head": "/e/draft"}) == refresh_loop.Path("/e/draft")


class _FakeDeployed:
    """Deployed's record keeping without a server: every put serves at once."""

    url = "127.0.0.1:8001"
    control = "eagle3_head.json"

    def __init__(self):
        self.history = [{"version": 1, "head": "/engines/draft"}]

    @property
    def live(self) -> dict:
        return self.history[-1]

    def put(self, head: str, **figures) -> dict:
        self.history.append({"version": self.live["version"] + 1, "head": head, **figures})
        return self.history[-1]


@pytest.mark.parametrize(("margin", "deployed"), [(0.1, False), (0.01, True)])
def test_the_new_head_must_beat_the_live_one_by_the_margin(tmp_path, monkeypatch, margin, deployed):
    from trtspec.distill import refresh as flow

    monkeypatch.setattr(flow, "measure", lambda loaded, live, new: (0.40, 0.45))
    monkeypatch.setattr(flow, "build_head", lambda loaded, head, version, folder: tmp_path / f"v{version}" / "draft")
    target = _FakeDeployed()
    if not deployed:
        with pytest.raises(flow.Refused, match=r"0\.450 at k=1 .* the live head 0\.400 \(--margin 0\.1\)") as info:
            flow.refresh(None, target, tmp_path, lambda *a: True, margin)
        assert info.value.exit_code == 1 and len(target.history) == 1  # nothing changed
        return
    result = flow.refresh(None, target, tmp_path, lambda *a: True, margin)
    assert (result.action, result.version, result.live, result.new) == ("deployed", 2, 0.40, 0.45)
    assert target.live == {
        "version": 2,
        "head": str(tmp_path / "v2" / "draft"),
        "source": str(tmp_path.resolve()),
        "live": 0.40,
        "new": 0.45,
    }


def test_a_divergence_after_the_swap_puts_the_live_head_back_and_exits_1(tmp_path, monkeypatch):
    from trtspec.distill import refresh as flow

    monkeypatch.setattr(flow, "measure", lambda loaded, live, new: (0.1, 0.9))
    monkeypatch.setattr(flow, "build_head", lambda loaded, head, version, folder: tmp_path / "v2" / "draft")
    target = _FakeDeployed()
    with pytest.raises(flow.Refused, match="differ from target-only") as info:
        flow.refresh(None, target, tmp_path, lambda *a: False)
    assert info.value.exit_code == 1
    assert [h["head"] for h in target.history] == ["/engines/draft", str(tmp_path / "v2" / "draft"), "/engines/draft"]
    assert target.history[-1]["rollback_of"] == 2


def test_a_swap_the_instances_never_take_puts_the_live_head_back_and_exits_3(tmp_path, monkeypatch):
    from trtspec.distill import refresh as flow
    from trtspec.errors import RuntimeFailure

    monkeypatch.setattr(flow, "measure", lambda loaded, live, new: (0.1, 0.9))
    monkeypatch.setattr(flow, "build_head", lambda loaded, head, version, folder: tmp_path / "v2" / "draft")
    target = _FakeDeployed()
    put = target.put

    def stuck(head, **figures):
        entry = put(head, **figures)
        if head != "/engines/draft":
            raise RuntimeFailure("the server's instances serve head versions [1] after 300 s, not 2")
        return entry

    target.put = stuck
    with pytest.raises(RuntimeFailure, match="the live head serves again") as info:
        flow.refresh(None, target, tmp_path, lambda *a: True)
    assert info.value.exit_code == 3 and target.live["head"] == "/engines/draft"

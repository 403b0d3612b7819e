"""A measured choice knows how busy the machine was (contention.py): measured while other
processes kept the cores busy it is provisional, measured again at a later load that finds the
machine quiet, and reused as it is while the machine stays busy."""

from __future__ import annotations

import json
import os

import pytest
from test_kernels import _choose, _dense, _fake_timer, _layout_of

from trtspec.engines.torch import compiled, contention, kernels
from trtspec.engines.torch.contention import CpuSnapshot

REAL_SNAPSHOT = contention.snapshot  # as the module defines it (conftest's session stub comes later)


class FakeMachine:
    """/proc/stat as seen by this process: each snapshot advances the cores by 1000 jiffies, of
    which ``level`` were other processes' work (this process uses no CPU time here)."""

    def __init__(self, level: float | None):
        self.level, self.busy, self.total = level, 0, 0

    def snapshot(self) -> CpuSnapshot | None:
        if self.level is None:  # no /proc/stat: unknown
            return None
        self.total += 1000
        self.busy += round(self.level * 1000)
        return CpuSnapshot(self.busy, self.total, 0.0)


@pytest.fixture
def machine(monkeypatch):
    fake = FakeMachine(0.0)
    monkeypatch.setattr(contention, "snapshot", fake.snapshot)
    monkeypatch.delenv(contention.REMEASURE_ENV, raising=False)
    return fake


@pytest.fixture
def two_layouts(built, monkeypatch):
    """A fresh dense target's two first candidate layouts, and a loader of another fresh one."""
    fresh = lambda: _dense(built().target.folder, monkeypatch)  # noqa: E731
    first = fresh()
    names = kernels.candidates(first.model)
    if len(names) < 2:
        pytest.skip("one kernel layout here: nothing to choose")
    return first, fresh, names[0], names[1]


def _timer(faster: str, calls: list[str], machine: FakeMachine, level: float):
    """_fake_timer's step timer, with the machine at ``level`` while it runs."""
    make = _fake_timer(faster, calls)

    def wrapped(model, cos, sin, sizes):
        timed = make(model, cos, sin, sizes)

        def run():
            machine.level = level
            return timed()

        return run

    return wrapped


def _record(tmp_path, name: str, key: str) -> dict:
    return json.loads((tmp_path / name).read_text())[key]


def _provisional_then_again(two_layouts, machine, tmp_path, monkeypatch, probed: float, measured: float):
    """The first layout chosen with others at 0.83 of the CPUs; then a fresh engine's load that
    probes the machine at ``probed`` and, if it measures, finds the second layout faster with
    others at ``measured``. Returns (the first choice, the second, the second engine, the
    second load's timer calls)."""
    engine, fresh, noise, best = two_layouts
    monkeypatch.setattr(kernels, "step_timer", _timer(noise, [], machine, 0.83))
    first = _choose(engine, tmp_path)
    calls: list[str] = []
    monkeypatch.setattr(kernels, "step_timer", _timer(best, calls, machine, measured))
    machine.level = probed
    again = fresh()
    return first, _choose(again, tmp_path), again, calls


def test_others_busy_is_the_other_processes_share_of_this_processes_cores(tmp_path, monkeypatch):
    stat = tmp_path / "stat"
    monkeypatch.setattr(contention, "PROC_STAT", stat)
    monkeypatch.setattr(contention.os, "sched_getaffinity", lambda pid: {0, 2})
    monkeypatch.setattr(contention, "snapshot", REAL_SNAPSHOT)
    monkeypatch.setattr(contention.os, "times", lambda: os.times_result((1.0, 0.5, 0.0, 0.0, 0.0)))

    def write(cpu0: list[int], cpu2: list[int]) -> None:
        rows = [("cpu", [99] * 10), ("cpu0", cpu0), ("cpu1", [500, 0, 0, 0, 0, 0, 0, 0, 0, 0]), ("cpu2", cpu2)]
        stat.write_text("".join(f"{n} {' '.join(map(str, v))} 0 0\n" for n, v in rows) + "intr 1 2\n")

    write([100, 0, 50, 800, 50, 0, 0, 0, 0, 0], [0, 0, 0, 1000, 0, 0, 0, 0, 0, 0])
    before = contention.snapshot()
    assert (before.busy, before.total) == (150, 2000)  # cpu1 is not this process's: not counted
    # 300 more busy jiffies on cpu0 (steal counts: another VM's work), 100 idle on each core
    write([300, 0, 100, 900, 50, 0, 0, 50, 0, 0], [0, 0, 0, 1100, 0, 0, 0, 0, 0, 0])
    after = contention.snapshot()
    assert contention.others_busy(before, after) == round(300 / 500, 2)
    own = CpuSnapshot(after.busy, after.total, before.own + 100 / contention.os.sysconf("SC_CLK_TCK"))
    assert contention.others_busy(before, own) == round(200 / 500, 2)  # this process's own 100 jiffies are not others'
    assert contention.others_busy(None, after) is None and contention.others_busy(after, after) is None
    monkeypatch.setattr(contention, "PROC_STAT", tmp_path / "missing")  # not Linux: unknown
    assert contention.snapshot() is None


def test_a_kernel_choice_measured_on_a_busy_machine_is_provisional(two_layouts, machine, tmp_path, monkeypatch, capsys):
    engine, _, slow, _ = two_layouts
    monkeypatch.setattr(kernels, "step_timer", _timer(slow, [], machine, 0.83))
    choice = _choose(engine, tmp_path)
    assert (choice.layout, choice.source, choice.others_busy) == (slow, "measured", 0.83)
    assert _record(tmp_path, kernels.CACHE_FILE, choice.key)["others_busy"] == 0.83
    assert "measured on a busy machine (others 0.83 of the CPUs): provisional" in capsys.readouterr().err


def test_a_provisional_kernel_choice_is_measured_again_on_a_quiet_machine_and_replaced(
    two_layouts, machine, tmp_path, monkeypatch, capsys
):
    _, fresh, _, best = two_layouts
    first, second, again, calls = _provisional_then_again(two_layouts, machine, tmp_path, monkeypatch, 0.0, 0.0)
    assert (second.layout, second.source, second.others_busy) == (best, "measured", 0.0) and calls
    assert _layout_of(again.model) == best
    assert _record(tmp_path, kernels.CACHE_FILE, first.key) | {"measured_at": ""} == {
        "layout": best,
        "seconds": second.seconds,
        "steps": second.steps,
        "sizes": list(second.sizes),
        "measured_at": "",
        "others_busy": 0.0,
    }
    assert "measuring again now that it is quiet" in capsys.readouterr().err
    measured = len(calls)
    monkeypatch.setattr(contention, "probe", lambda *a: pytest.fail("a final choice was probed"))
    third = _choose(fresh(), tmp_path)  # now final: cached without a probe
    assert (third.layout, third.source, len(calls)) == (best, "cached", measured)


def test_a_provisional_kernel_choice_is_reused_without_measuring_while_the_machine_stays_busy(
    two_layouts, machine, tmp_path, monkeypatch, capsys
):
    noise = two_layouts[2]
    # the probe finds the machine still busy
    _, second, again, calls = _provisional_then_again(two_layouts, machine, tmp_path, monkeypatch, 0.6, 0.6)
    assert (second.layout, second.source, second.others_busy, calls) == (noise, "cached", 0.83, [])
    assert _layout_of(again.model) == noise
    assert "measured on a busy machine (others 0.83 of the CPUs) and is still busy; using it" in capsys.readouterr().err


def test_a_measurement_again_that_is_itself_contended_leaves_the_provisional_record(
    two_layouts, machine, tmp_path, monkeypatch, capsys
):
    noise, other = two_layouts[2:]
    # quiet when probed; a neighbour arrives while it measures
    first, second, _, _ = _provisional_then_again(two_layouts, machine, tmp_path, monkeypatch, 0.0, 0.9)
    assert (second.layout, second.source, second.others_busy) == (other, "measured", 0.9)
    record = _record(tmp_path, kernels.CACHE_FILE, first.key)
    assert (record["layout"], record["others_busy"]) == (noise, 0.83)
    assert "the earlier choice stays cached" in capsys.readouterr().err


def test_a_quiet_or_unknown_or_old_record_is_final_and_never_probed(two_layouts, machine, tmp_path, monkeypatch):
    engine, fresh, slow, _ = two_layouts
    calls: list[str] = []
    machine.level = None  # not Linux: how busy is unknown, and the choice is final as before
    monkeypatch.setattr(kernels, "step_timer", _timer(slow, calls, machine, None))
    first = _choose(engine, tmp_path)
    assert first.others_busy is None and _record(tmp_path, kernels.CACHE_FILE, first.key)["others_busy"] is None
    monkeypatch.setattr(contention, "probe", lambda *a: pytest.fail("a final choice was probed"))
    measured = len(calls)
    assert _choose(fresh(), tmp_path).source == "cached" and len(calls) == measured
    entries = json.loads((tmp_path / kernels.CACHE_FILE).read_text())
    del entries[first.key]["others_busy"]  # a record written before the figure was kept
    (tmp_path / kernels.CACHE_FILE).write_text(json.dumps(entries))
    assert _choose(fresh(), tmp_path).source == "cached" and len(calls) == measured


def test_remeasure_forces_a_new_measurement_of_a_final_choice(two_layouts, machine, tmp_path, monkeypatch):
    engine, fresh, first_best, later_best = two_layouts
    monkeypatch.setattr(kernels, "step_timer", _timer(first_best, [], machine, 0.0))
    first = _choose(engine, tmp_path)
    monkeypatch.setattr(kernels, "step_timer", _timer(later_best, [], machine, 0.0))
    monkeypatch.setenv(contention.REMEASURE_ENV, "1")
    second = _choose(fresh(), tmp_path)
    assert (first.layout, second.layout, second.source) == (first_best, later_best, "measured")
    assert _record(tmp_path, kernels.CACHE_FILE, first.key)["layout"] == later_best


# -- the compiled-or-eager choice --------------------------------------------------------------


@pytest.fixture
def programs(monkeypatch, machine):
    """choose_program measuring with a fake ``measure`` (no compiler needed)."""
    monkeypatch.setenv(compiled.COMPILE_ENV, "auto")
    monkeypatch.setattr(compiled, "compiler_missing", lambda: None)
    monkeypatch.setattr(compiled, "_configure", lambda: None)
    return machine


def _measure(faster: str, machine: FakeMachine, level: float, calls: list[str]):
    def measure():
        machine.level = level
        calls.append(faster)
        slow = {"1": 2.0, "2": 2.0}
        return {"eager": {"1": 1.0, "2": 1.0} if faster == "eager" else slow, "compiled": {"1": 1.0, "2": 1.0}}

    return measure


KEY = json.dumps({"shape": "64x128x2x384/4/2/16", "dtype": "torch.float32", "layout": "dense"})


def test_a_program_choice_measured_on_a_busy_machine_is_measured_again_when_quiet(programs, tmp_path, capsys):
    calls: list[str] = []
    first = compiled.choose_program(KEY, _measure("eager", programs, 0.83, calls), tmp_path)
    assert (first.one, first.source, first.others_busy) == ("eager", "measured", 0.83)
    programs.level = 0.6  # still busy: the provisional choice, not measured again
    second = compiled.choose_program(KEY, _measure("compiled", programs, 0.6, calls), tmp_path)
    assert (second.one, second.source, calls) == ("eager", "cached", ["eager"])
    programs.level = 0.0  # quiet: measured again, and the uncontended choice replaces it
    third = compiled.choose_program(KEY, _measure("compiled", programs, 0.0, calls), tmp_path)
    assert (third.one, third.many, third.source, third.others_busy) == ("compiled", "compiled", "measured", 0.0)
    fourth = compiled.choose_program(KEY, _measure("eager", programs, 0.0, calls), tmp_path)
    assert (fourth.one, fourth.source, calls) == ("compiled", "cached", ["eager", "compiled"])
    err = capsys.readouterr().err
    assert "the compiled-or-eager choice for 64x128x2x384/4/2/16 torch.float32 dense was measured on a busy machine" in err
    assert "measuring again now that it is quiet" in err


# -- seeing and clearing them -------------------------------------------------------------------


def test_cli_choices_lists_each_cached_choice_with_how_busy_and_clear_removes_them(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from trtspec.cli.app import app

    monkeypatch.setenv("TRTSPEC_CACHE", str(tmp_path))
    shape = {"shape": "576x1536x30x49152/9/3/64", "dtype": "torch.bfloat16", "threads": "2"}
    busy_key, old_key = json.dumps(shape | {"quantization": "int4_wo"}), json.dumps(shape)
    (tmp_path / kernels.CACHE_FILE).write_text(
        json.dumps(
            {
                busy_key: {"layout": "dense|panel@6", "measured_at": "2026-12-07T10:00:00Z", "others_busy": 0.83},
                old_key: {"layout": "onednn", "measured_at": "2026-12-01T10:00:00Z"},  # before the figure was kept
            }
        )
    )
    programs_key = json.dumps(shape | {"layout": "dense", "programs": compiled.PROGRAMS_VERSION})
    (tmp_path / compiled.CACHE_FILE).write_text(
        json.dumps({programs_key: {"one": "compiled", "many": "eager", "others_busy": 0.1}})
    )
    listed = CliRunner().invoke(app, ["choices", "--json"])
    assert listed.exit_code == 0, listed.output
    rows = {(c["kind"], c["choice"]): c for c in json.loads(listed.stdout)["choices"]}
    assert set(rows) == {("kernels", "dense|panel@6"), ("kernels", "onednn"), ("programs", "one row compiled, more rows eager")}
    busy = rows[("kernels", "dense|panel@6")]
    assert (busy["what"], busy["threads"], busy["others_busy"], busy["provisional"]) == (
        "576x1536x30x49152/9/3/64 torch.bfloat16 int4_wo",
        "2",
        0.83,
        True,
    )
    assert (rows[("kernels", "onednn")]["others_busy"], rows[("kernels", "onednn")]["provisional"]) == (None, False)
    assert rows[("programs", "one row compiled, more rows eager")]["provisional"] is False
    table = CliRunner().invoke(app, ["choices"])
    assert "0.83 (provisional)" in table.stdout and "unknown" in table.stdout
    cleared = CliRunner().invoke(app, ["choices", "--clear"])
    assert cleared.exit_code == 0 and "cleared" in cleared.stdout and "dense|panel@6" in cleared.stdout
    assert not (tmp_path / kernels.CACHE_FILE).exists() and not (tmp_path / compiled.CACHE_FILE).exists()
    assert "no measured choices cached" in CliRunner().invoke(app, ["choices"]).stdout

"""The thread governor: fewer threads while a neighbour holds a core, all of them back when it
leaves, chosen from measured forward times (a fake clock stands in for the neighbour)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trtspec.engines.torch import threads
from trtspec.errors import SpecError


class Machine:
    """A fake clock whose forwards cost what a 2-core machine's did (ms): quiet, 2 threads 38 and
    1 thread 60; beside a busy neighbour, 2 threads 590 and 1 thread 63."""

    COST = {(2, False): 0.038, (1, False): 0.060, (2, True): 0.590, (1, True): 0.063}

    def __init__(self):
        self.now = 0.0
        self.neighbour = False
        self.applied: list[int] = []

    def clock(self) -> float:
        return self.now

    def run(self, gov: threads.Governor, key="decode", gap: float = 0.0) -> int:
        with gov.forward(key) as n:
            self.now += self.COST[(n, self.neighbour)]
        self.now += gap
        return n


def make(machine: Machine, most: int = 2) -> threads.Governor:
    return threads.Governor(most, clock=machine.clock, set_threads=machine.applied.append)


def test_quiet_it_keeps_every_core_after_trying_fewer_once():
    m = Machine()
    gov = make(m)
    used = [m.run(gov) for _ in range(50)]
    assert used[:2] == [2, 1]  # the shape is tried at each count once
    assert gov.current == 2 and gov.switches == 0
    # Probes of one thread are rare once the choice holds (backoff doubles to PROBE_MAX).
    assert used[2:].count(1) <= 2


def test_a_neighbour_costs_at_most_a_few_forwards_and_its_departure_is_noticed():
    m = Machine()
    gov = make(m)
    for _ in range(10):
        m.run(gov)
    m.neighbour = True
    slow = [m.run(gov) for _ in range(10)]
    assert gov.current == 1
    assert slow.count(2) <= 3, slow  # two slow forwards move the median; at most one probe more
    m.neighbour = False
    m.now += threads.PROBE_MAX  # the next probe is due
    back = [m.run(gov) for _ in range(3)]
    assert back[0] == 2 and gov.current == 2, back


def test_probes_back_off_while_the_choice_holds():
    m = Machine()
    gov = make(m)
    m.neighbour = True
    used = [m.run(gov, gap=0.1) for _ in range(400)]  # 400 forwards over ~65 s
    assert gov.current == 1
    probes = used[5:].count(2)
    assert 1 <= probes <= 8, probes  # every 1, 2, 4, 8, 16, 16 ... s, not every forward
    assert gov.backoff == threads.PROBE_MAX


def test_each_shape_is_judged_on_its_own_times():
    m = Machine()
    gov = make(m)
    for _ in range(5):
        m.run(gov, key="decode")
    # A new shape is tried at both counts before the governor compares anything for it.
    assert [m.run(gov, key="verify") for _ in range(2)] == [2, 1]


def test_the_pool_is_resized_only_when_the_count_changes():
    m = Machine()
    gov = make(m)
    for _ in range(20):
        m.run(gov)
    assert m.applied[:3] == [2, 1, 2]
    assert len(m.applied) <= 5


def test_pinned_work_runs_at_the_full_count_whatever_the_neighbour():
    # training: a count changed by a probe mid-run changes the weights' last bits
    m = Machine()
    gov = make(m)
    m.neighbour = True
    for _ in range(10):
        m.run(gov)
    assert gov.current == 1
    for _ in range(5):
        with gov.pinned() as n:
            assert n == 2
            m.now += 0.05
    assert m.applied[-1] == 2 and gov.current == 1  # pinned work is not timed
    assert m.run(gov) == 1 and m.applied[-1] == 1  # the engine's next forward gets its count back


def test_one_core_means_one_thread_and_nothing_to_probe():
    m = Machine()
    gov = make(m, most=1)
    assert [m.run(gov, gap=1.0) for _ in range(40)] == [1] * 40
    assert m.applied == [1]


def test_candidate_counts():
    assert threads.candidates(1) == [1]
    assert threads.candidates(2) == [2, 1]
    assert threads.candidates(16) == [16, 15, 8, 1]


def test_a_fixed_count_and_malformed_values(monkeypatch):
    assert threads.fixed_threads("auto") is None
    assert threads.fixed_threads("") is None
    assert threads.fixed_threads("3") == 3
    for bad in ("0", "-1", "two"):
        with pytest.raises(SpecError, match="TRTSPEC_THREADS"):
            threads.fixed_threads(bad)
    monkeypatch.setenv(threads.ENV, "1")
    monkeypatch.setattr(threads, "_governor", None)  # the process's governor is made again, under TRTSPEC_THREADS=1
    gov = threads.governor()
    assert gov.current == 1
    with gov.forward("x") as n:
        assert n == 1


def test_usable_cores_follow_the_cgroup_quota(tmp_path):
    assert threads.usable_cores(quota=1.5, affinity=2) == 1
    assert threads.usable_cores(quota=0.5, affinity=2) == 1  # never below one
    assert threads.usable_cores(quota=8.0, affinity=2) == 2
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert threads.quota_cores(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert threads.quota_cores(tmp_path) is None
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("200000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert threads.quota_cores(v1) == 2.0
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert threads.quota_cores(v1) is None


def test_the_engine_runs_each_forward_under_the_governor(built, monkeypatch):
    """Every forward of the torch engine asks the governor, per shape (rows, new tokens, keys)."""
    from trtspec.engines.torch.engine import ForwardItem, TorchEngine

    seen = []

    class Recorder:
        current = 1

        def forward(self, key, compiles=None, allowed=None):
            import contextlib

            seen.append(key[1:])
            return contextlib.nullcontext(1)

        def in_turn(self):  # a load makes its matmul shapes at each count (engine.warm_matmuls)
            yield 1

    monkeypatch.setattr(threads, "_governor", Recorder())
    engine = TorchEngine.load(built().target.folder, slots=1)
    engine.run([ForwardItem([1, 2, 3, 4], 1)])  # prefill of 4 tokens
    engine.run([ForwardItem([1, 2, 3, 4, 5], 1)])  # a decode step
    assert seen == [(1, (4).bit_length(), (4).bit_length()), (1, 1, (5).bit_length())]


def test_a_held_governor_runs_every_forward_at_the_full_count_and_records_none():
    """distill's data is made under held(): a forward's numbers differ in the last bits between
    thread counts, so a probe in the middle of generation would make the same command's data
    differ from run to run. Held, no forward probes, none is recorded, and the governor picks
    up where it was afterwards."""
    now = [0.0]
    applied: list[int] = []
    gov = threads.Governor(2, clock=lambda: now[0], set_threads=applied.append)
    with gov.forward("a"):
        now[0] += 1.0
    assert gov.pick("a") == 1  # a shape seen at 2 threads only: tried at 1 next
    with gov.held() as n:
        assert n == 2
        for shape in ("a", "b", "c"):
            assert gov.pick(shape) == 2
            with gov.forward(shape) as m:
                assert m == 2
                now[0] += 5.0
    assert set(applied) == {2}
    assert (2, "b") not in gov.times and (2, "c") not in gov.times and len(gov.times[(2, "a")]) == 1
    assert gov.pick("a") == 1  # as before the held block


def _pod_cgroup(tmp_path: Path, quota: str, v1: bool = False) -> tuple[Path, Path]:
    """A fake cgroup mount whose limit sits on the process's own, nested cgroup (as a pod's
    does), and the /proc/self/cgroup line that names it."""
    root, path = tmp_path / "cgroup", "kubepods.slice/pod-a/cri-b"
    folder = root / ("cpu,cpuacct" if v1 else "") / path
    folder.mkdir(parents=True)
    if v1:
        (folder / "cpu.cfs_quota_us").write_text(quota)
        (folder / "cpu.cfs_period_us").write_text("100000\n")
    else:
        (folder / "cpu.max").write_text(f"{quota} 100000\n")
        (root / "cpu.max").write_text("max 100000\n")  # the mount's own: unlimited
    proc = tmp_path / "proc-cgroup"
    proc.write_text(f"4:cpu,cpuacct:/{path}\n" if v1 else f"0::/{path}\n")
    return root, proc


def test_the_quota_is_read_from_the_process_own_cgroup_and_its_tightest_ancestor(tmp_path):
    root, proc = _pod_cgroup(tmp_path / "v2", "150000")
    assert threads.quota_cores(root, proc) == 1.5
    (root / "kubepods.slice" / "cpu.max").write_text("100000 100000\n")  # a tighter parent wins
    assert threads.quota_cores(root, proc) == 1.0
    root, proc = _pod_cgroup(tmp_path / "v1", "250000\n", v1=True)
    assert threads.quota_cores(root, proc) == 2.5


def test_the_governor_never_probes_beyond_the_cgroup_quota(tmp_path, monkeypatch):
    root, proc = _pod_cgroup(tmp_path, "150000")  # a pod limited to 1.5 CPUs on a 4-core node
    monkeypatch.setattr(threads, "CGROUP_ROOT", root)
    monkeypatch.setattr(threads, "PROC_CGROUP", proc)
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(threads.torch, "get_num_threads", lambda: 4)
    monkeypatch.delenv(threads.ENV, raising=False)
    monkeypatch.setattr(threads, "_governor", None)
    assert threads.governor().counts == [1]
    (root / "kubepods.slice" / "pod-a" / "cri-b" / "cpu.max").write_text("300000 100000\n")
    monkeypatch.setattr(threads, "_governor", None)
    assert max(threads.governor().counts) == 3


def test_work_in_turn_runs_each_forward_at_that_count_and_records_none():
    """A load compiles its programs at each count (engine.warm_programs): a forward inside
    in_turn must run at the count being warmed, not at the governor's own choice, or the
    other count's program is first compiled in the middle of a request."""
    m = Machine()
    gov = make(m)
    ran = [(count, m.run(gov, key=("warm", count))) for count in gov.in_turn()]
    assert ran == [(2, 2), (1, 1)]
    assert not gov.times and gov.forced is None
    assert m.applied[-1] == 2  # the pool is back at the governor's count (torch.get_num_threads)
    assert m.run(gov) == 2  # afterwards the governor chooses again


def test_a_forward_that_compiled_a_program_is_not_recorded():
    """The first forward of a compiled kind at a count includes its compile (seconds): recorded,
    it would keep that count off for minutes while the median carries it."""
    m = Machine()
    gov = make(m)
    compiled = [0]
    with gov.forward("decode", lambda: compiled[0]):
        m.now += 12.0
        compiled[0] += 1  # this forward compiled its program
    assert (2, "decode") not in gov.times
    for _ in range(3):
        m.run(gov)
    assert gov.current == 2 and gov.switches == 0


def test_a_forward_runs_only_at_the_counts_it_is_allowed():
    """A compiled program exists for the counts it was compiled at: the governor neither tries
    a shape at another count nor probes one (that forward would compile in the middle of a
    request), and with both counts allowed it tries each as before."""
    m = Machine()
    gov = make(m)
    only_two = []
    for _ in range(40):
        with gov.forward("decode", allowed={2}) as n:
            m.now += m.COST[(n, m.neighbour)]
        only_two.append(n)
    assert set(only_two) == {2}
    assert m.run(gov, key="other") == 2 and m.run(gov, key="other") == 1  # unrestricted: tried at each

"""trtspec bench on the tiny pair: report contents, outputs, bad input, interruption."""

from __future__ import annotations

import json

import pytest
from conftest import built_spec, write_spec
from typer.testing import CliRunner

from trtspec.bench import measure as b
from trtspec.bench.plot import write_outputs
from trtspec.bench.render import floor_line, path_lines
from trtspec.cli.app import app
from trtspec.machine import description

runner = CliRunner()
PROMPTS = ["The quick brown fox", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def spec_file(tmp_path_factory, tiny_ckpts):
    return built_spec(tmp_path_factory, tiny_ckpts, "bench", **{"verify.max_tokens": 12})


class _Recorder:
    """A BenchBackend that records each call (prompts, tokens, speculative, concurrency)."""

    def __init__(self):
        self.calls = []

    def run_batch(self, prompts, max_tokens, speculative, k, concurrency):
        self.calls.append((len(prompts), max_tokens, speculative, concurrency))
        return [b.RequestTiming(tokens=max_tokens, ttft=0.01, latency=0.1) for _ in prompts], 0.1


@pytest.mark.parametrize("grid", [False, True])
def test_every_concurrency_is_warmed_on_both_paths_before_it_is_timed(grid):
    """The first batch of several rows compiles the engine's several-row programs: a timed
    concurrency point whose shape no warm-up met would charge that to whichever path ran first."""
    rec = _Recorder()
    report = b.BenchReport("fake", "in-process", "machine", 2, 32, 3)
    b.run_bench(rec, report, PROMPTS, [], [] if grid else [1, 4], None, grid=grid)
    if grid:
        b.run_grid(rec, report, PROMPTS, [2], [4], lambda s: None)
    timed = [i for i, (n, tokens, _, c) in enumerate(rec.calls) if c == 4 and tokens == 32]
    warm = [(spec, n) for n, tokens, spec, c in rec.calls[: timed[0]] if c == 4 and tokens == 8]
    assert sorted(warm) == [(False, 4), (True, 4)]


def test_run_bench_fills_every_section(built, tmp_path):
    dep = built("same")  # draft == target: every draft accepted
    report = b.BenchReport("tiny", "in-process", description(), len(PROMPTS), 12, 3)
    b.run_bench(b.InProcessBench(dep), report, PROMPTS, [1, 2], [1, 2], lambda k: b.measure_engine_costs(dep, PROMPTS[0], k))
    assert report.complete
    assert report.target.tokens == report.speculative.tokens == 24
    assert report.metrics.acceptance_rate == 1.0
    assert report.metrics.per_position_rate == [1.0, 1.0, 1.0]
    assert report.costs.target_step > 0 and report.costs.cost_ratio > 0
    assert report.bound == pytest.approx(4.0 / (3 * report.costs.cost_ratio + report.costs.verify_cost))
    assert [p.k for p in report.sweep] == [1, 2] and report.recommended_k in (1, 2)
    assert [p.concurrency for p in report.concurrency] == [1, 2]
    assert report.concurrency[1].speculative.tokens == 24
    files = write_outputs(report, tmp_path)
    assert {f.name for f in files} == {"bench.json", "sweep.png", "per_position.png", "concurrency.png"}
    for f in files[1:]:
        assert f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["complete"] and data["metrics"]["acceptance_rate"] == 1.0 and data["efficiency"] > 0
    assert data["costs"]["achieved_gbps"] == pytest.approx(report.costs.achieved_gbps)
    assert data["costs"]["bandwidth"]["copy_gbps"] == report.costs.bandwidth.copy_gbps > 0


def test_decode_step_bytes_are_the_weights_and_the_kv_read(built):
    """Counted independently from the checkpoint: every tensor but the embedding table (read
    one row a token), the LM head counted where it is tied to that table; K/V of the context
    and the new position in every layer."""
    from safetensors.torch import load_file

    dep = built("same")
    eng = dep.target
    state = load_file(str(eng.folder / "model.safetensors"))
    weights = sum(t.nbytes for name, t in state.items() if name != "model.embed_tokens.weight")
    if "lm_head.weight" not in state:
        weights += state["model.embed_tokens.weight"].nbytes
    c = eng.config
    costs = b.measure_engine_costs(dep, PROMPTS[0], 2, repeats=1)
    context = len(dep.encode(PROMPTS[0])) + 4
    assert costs.weight_bytes == weights
    assert costs.kv_bytes == 2 * c.num_layers * c.num_kv_heads * c.head_dim * (context + 1) * 4
    assert costs.achieved_gbps == pytest.approx(costs.step_bytes / costs.target_step / 1e9)
    assert costs.bandwidth.copy_gbps > 0 and costs.bandwidth.read_gbps > 0


def test_the_floor_line_holds_the_step_against_the_copy_bandwidth():
    c = b.Costs(0.025, None, 0.03, 3, weight_bytes=500_000_000, kv_bytes=10_000_000, bandwidth=b.Bandwidth(25.0, 30.0, 256, 2))
    assert c.achieved_gbps == pytest.approx(20.4)  # 0.51 GB in 25 ms
    assert c.floor_step == pytest.approx(0.0204)  # 0.51 GB at 25 GB/s
    assert c.of_copy_bandwidth == pytest.approx(0.816)
    line = floor_line(c)
    assert "0.510 GB" in line and "20.4 GB/s" in line and "25.0 GB/s" in line and "20.4 ms: 0.82 of the floor" in line
    assert b.Costs(0.02, None, 0.03, 3).of_copy_bandwidth is None  # measured over gRPC: no bytes


def test_the_paths_lines_say_which_choices_a_busy_machine_measured():
    """A role whose kernel or program choice was measured with others above BUSY of the CPUs
    gets "provisional" on its one paths line, with the figures; bench.json keeps every figure."""
    from types import SimpleNamespace

    from trtspec.engines.torch.compiled import ProgramChoice
    from trtspec.engines.torch.kernels import KernelChoice

    def engine(kernels_busy, programs_busy):
        return SimpleNamespace(
            kernels=KernelChoice("dense", "cached", others_busy=kernels_busy),
            programs=ProgramChoice("compiled", "eager", "cached", others_busy=programs_busy),
        )

    dep = SimpleNamespace(target=engine(0.02, 0.83), draft=engine(None, 0.1))
    c = b.Costs(0.02, 0.01, 0.03, 3, paths=b.step_paths(dep), paths_busy=b.step_busy(dep))
    target, draft = path_lines(c, "steps")
    assert target == (
        "target steps: one row compiled, more rows eager (cached); provisional: measured on a busy machine "
        "(others programs 0.83 of the CPUs); `trtspec choices` shows them, TRTSPEC_REMEASURE=1 measures again"
    )
    assert draft == "draft steps: one row compiled, more rows eager (cached)"
    saved = json.loads(json.dumps(c.to_dict()))
    assert saved["paths_busy"] == {"target": {"kernels": 0.02, "programs": 0.83}, "draft": {"kernels": None, "programs": 0.1}}
    dep.draft = engine(0.5, 0.3)
    c = b.Costs(0.02, 0.01, 0.03, 3, paths=b.step_paths(dep), paths_busy=b.step_busy(dep))
    assert path_lines(c, "steps (context sweep)")[1].startswith(
        "draft steps (context sweep): one row compiled, more rows eager (cached); provisional: measured on a busy "
        "machine (others kernels 0.50, programs 0.30 of the CPUs)"
    )


def test_latency_percentiles():
    t = [b.RequestTiming(tokens=n, ttft=0.1 * n, latency=1.0 * n) for n in (1, 2, 3, 4, 5)]
    s = b.PathStats.of(t, 10.0)
    assert s.tokens == 15 and s.tokens_per_s == 1.5
    assert s.latency_p50 == 3.0 and s.latency_p95 == 5.0
    assert t[1].itl == pytest.approx((2.0 - 0.2) / 1)


def test_cli_bench_writes_report(spec_file, tmp_path):
    r = runner.invoke(app, ["bench", str(spec_file), "--sweep", "1-2", "-c", "1,2", "-o", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert "speedup" in r.stdout and "recommended k" in r.stdout and "efficiency" in r.stdout
    assert "memory floor: a decode step moves" in r.stdout and "of the floor" in r.stdout
    assert json.loads((tmp_path / "bench.json").read_text())["complete"] is True


@pytest.mark.parametrize(
    "args, message",
    [
        (["-k", "9"], "-k/--num-draft-tokens 9 is outside 0..8"),
        (["-k", "0"], "draft length 0 is out of range; use 1..8"),
        (["--sweep", "0-3"], "draft length 0 is out of range"),
        (["-c", "0"], "concurrency 0 is out of range; use 1..256"),
        (["--sweep", "a-b"], "--sweep 'a-b' is not a list"),
    ],
)
def test_cli_bench_bad_arguments_exit_2(spec_file, args, message):
    r = runner.invoke(app, ["bench", str(spec_file), *args])
    assert r.exit_code == 2 and message in r.stderr


def test_cli_bench_unbuilt_exit_2(tmp_path, tiny_ckpts):
    r = runner.invoke(app, ["bench", str(write_spec(tmp_path, tiny_ckpts))])
    assert r.exit_code == 2 and "run `trtspec build SPEC`" in r.stderr


def test_interrupted_bench_keeps_partial_results(spec_file, tmp_path, monkeypatch):
    real = b.run_bench

    def interrupt_in_sweep(backend, report, prompts, ks, levels, costs, progress, rounds, **kw):
        def progress2(msg):
            if "sweep" in msg:
                raise KeyboardInterrupt
            progress(msg)

        return real(backend, report, prompts, ks, levels, costs, progress2, rounds, **kw)

    monkeypatch.setattr(b, "run_bench", interrupt_in_sweep)
    r = runner.invoke(app, ["bench", str(spec_file), "-o", str(tmp_path)])
    assert r.exit_code == 130
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["complete"] is False
    assert data["target"]["tokens"] > 0 and data["speculative"]["tokens"] > 0
    assert data["sweep"] == []


def _cpu_ticks(pid: int) -> int:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def test_busy_neighbours_burn_a_core_each_and_stop_with_the_block():
    import time

    from trtspec.bench.neighbour import busy_neighbours

    with busy_neighbours(2) as procs:
        before = [_cpu_ticks(p.pid) for p in procs]
        time.sleep(0.5)
        assert all(p.poll() is None for p in procs)
        assert all(_cpu_ticks(p.pid) > t for p, t in zip(procs, before))  # each is running, not waiting
    assert all(p.returncode is not None for p in procs)


def test_cli_bench_neighbour_runs_beside_busy_processes_and_says_so(spec_file, tmp_path):
    r = runner.invoke(
        app, ["bench", str(spec_file), "--sweep", "none", "-c", "1", "--neighbour", "1", "--json", "-o", str(tmp_path)]
    )
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "bench.json").read_text())["machine"].endswith("; 1 busy neighbour process")
    r = runner.invoke(app, ["bench", str(spec_file), "--neighbour", "-1"])
    assert r.exit_code == 2

"""`trtspec bench`: measured speedup, acceptance, latency and the analytic bound.

One run measures, on the same prompts and interleaved so machine noise hits both paths:
target-only and speculative tokens/s, time to first token (TTFT), inter-token latency (ITL)
and request latency (p50/p95), acceptance (rate, mean acceptance length, per position), the
cost ratio c = draft step / target step and the cost of verifying k+1 tokens, the analytic
speedup bound (Leviathan et al. 2023) and measured/bound as efficiency, a draft-length sweep
with a recommended k, and throughput at several concurrency levels. Warm-up is excluded.

This module measures and holds the report; render.py prints it, plot.py writes its files.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Protocol

from trtspec.errors import RequestError
from trtspec.speculative.metrics import SpecMetrics, expected_tokens_per_forward, speedup_bound
from trtspec.speculative.schedule import GridPoint, break_even_length, recommend, vllm_shape


@dataclass
class RequestTiming:
    """One request: tokens out, and when they came (seconds from submission)."""

    tokens: int
    ttft: float | None  # None: not observable (a unary call returns all tokens at once)
    latency: float
    metrics: SpecMetrics | None = None

    @property
    def itl(self) -> float | None:
        """Mean inter-token latency after the first token."""
        if self.ttft is None or self.tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.tokens - 1)


class BenchBackend(Protocol):
    """Runs a set of prompts at a concurrency level; in process or over gRPC."""

    def run_batch(
        self, prompts: Sequence[str], max_tokens: int, speculative: bool, k: int, concurrency: int
    ) -> tuple[list[RequestTiming], float]:
        """Timings per request and the wall time of the whole set."""
        ...


@dataclass
class PathStats:
    tokens: int
    seconds: float
    ttft_p50: float | None
    ttft_p95: float | None
    itl_p50: float | None
    itl_p95: float | None
    latency_p50: float
    latency_p95: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @classmethod
    def of(cls, timings: list[RequestTiming], seconds: float) -> PathStats:
        return cls(
            tokens=sum(t.tokens for t in timings),
            seconds=seconds,
            ttft_p50=_pct([t.ttft for t in timings if t.ttft is not None], 50),
            ttft_p95=_pct([t.ttft for t in timings if t.ttft is not None], 95),
            itl_p50=_pct([t.itl for t in timings if t.itl is not None], 50),
            itl_p95=_pct([t.itl for t in timings if t.itl is not None], 95),
            latency_p50=_pct([t.latency for t in timings], 50),
            latency_p95=_pct([t.latency for t in timings], 95),
        )

    def to_dict(self) -> dict:
        return {**asdict(self), "tokens_per_s": self.tokens_per_s}


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    idx = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return xs[idx]


@dataclass
class Bandwidth:
    """Memory bandwidth measured here, GB/s (medians): copy = bytes read + bytes written by a
    tensor copy (STREAM's count), read = bytes of a tensor summed; both over ``megabytes``
    (far larger than any cache) with the threads the engines use."""

    copy_gbps: float
    read_gbps: float
    megabytes: int
    threads: int


def measure_bandwidth(megabytes: int = 256, repeats: int = 5) -> Bandwidth:
    """Copy and read bandwidth of this machine's memory, as torch sees it."""
    import torch

    n = megabytes * 2**20 // 4
    src = torch.ones(n, dtype=torch.float32)  # written: its pages are real, not the zero page
    dst = torch.zeros(n, dtype=torch.float32)
    copies, reads = [], []
    with torch.inference_mode():
        dst.copy_(src)  # warm-up
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            copies.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            src.sum()
            reads.append(time.perf_counter() - t0)
    nbytes = n * 4
    return Bandwidth(
        copy_gbps=2 * nbytes / statistics.median(copies) / 1e9,
        read_gbps=nbytes / statistics.median(reads) / 1e9,
        megabytes=megabytes,
        threads=torch.get_num_threads(),
    )


@dataclass
class Costs:
    """Measured step costs (seconds, medians) and the ratios the bound needs."""

    target_step: float
    draft_step: float | None
    verify_step: float  # one target forward over k+1 tokens
    k: int
    # How close the decode step is to the memory-bandwidth floor (in process only):
    weight_bytes: int | None = None  # the target's weights, all read once per decode step
    kv_bytes: int | None = None  # the K/V the timed decode step reads (its context + itself)
    bandwidth: Bandwidth | None = None  # this machine's measured memory bandwidth
    # Verifying k + 1 tokens, in target decode steps, for k = 1..max_draft_len (str(k) keys).
    verify_by_k: dict[str, float] = field(default_factory=dict)
    # Per engine: which path ran its steps, eager or compiled, by kind (one row | more rows).
    paths: dict[str, str] = field(default_factory=dict)
    # Per engine: how busy other processes kept the CPUs while each of its choices was measured
    # ("kernels", "programs": 0..1; None unknown); above contention.BUSY the choice is provisional.
    paths_busy: dict[str, dict[str, float | None]] = field(default_factory=dict)

    @property
    def step_bytes(self) -> int | None:
        """Bytes a target decode step must move: its weights and the K/V it attends to."""
        return None if self.weight_bytes is None else self.weight_bytes + (self.kv_bytes or 0)

    @property
    def achieved_gbps(self) -> float | None:
        """step_bytes / target_step, in GB/s: the bandwidth the decode step reaches."""
        return None if self.step_bytes is None else self.step_bytes / self.target_step / 1e9

    @property
    def floor_step(self) -> float | None:
        """The shortest decode step this machine allows: step_bytes at the copy bandwidth."""
        if self.step_bytes is None or self.bandwidth is None:
            return None
        return self.step_bytes / (self.bandwidth.copy_gbps * 1e9)

    @property
    def of_copy_bandwidth(self) -> float | None:
        """achieved_gbps / the copy bandwidth (= floor_step / target_step); 1.0 is the floor."""
        if self.achieved_gbps is None or self.bandwidth is None:
            return None
        return self.achieved_gbps / self.bandwidth.copy_gbps

    @property
    def cost_ratio(self) -> float:
        """c = draft step / target step (0 for a drafter with no model, e.g. n-gram)."""
        return (self.draft_step or 0.0) / self.target_step

    @property
    def verify_cost(self) -> float:
        """Verifying k+1 tokens in units of one target decode step."""
        return self.verify_step / self.target_step

    # What the report carries beside the measured fields: the figures derived from them.
    DERIVED = ("cost_ratio", "verify_cost", "step_bytes", "achieved_gbps", "floor_step", "of_copy_bandwidth")

    def to_dict(self) -> dict:
        return asdict(self) | {name: getattr(self, name) for name in self.DERIVED}


@dataclass
class ContextPoint:
    """bench --context-sweep: the step costs with ``context`` tokens already in the KV cache
    (costs.kv_bytes: the K/V a target decode step then reads; no verify_by_k)."""

    context: int
    costs: Costs

    def to_dict(self) -> dict:
        return {"context": self.context, **self.costs.to_dict()}


@dataclass
class SweepPoint:
    k: int
    tokens_per_s: float
    speedup: float
    acceptance_rate: float
    mean_acceptance_length: float


@dataclass
class ConcurrencyPoint:
    concurrency: int
    target: PathStats
    speculative: PathStats


@dataclass
class BenchReport:
    spec_name: str
    mode: str
    machine: str
    prompts: int
    max_tokens: int
    k: int
    target: PathStats | None = None
    speculative: PathStats | None = None
    metrics: SpecMetrics = field(default_factory=SpecMetrics)
    costs: Costs | None = None
    sweep: list[SweepPoint] = field(default_factory=list)
    concurrency: list[ConcurrencyPoint] = field(default_factory=list)
    methods: list[dict] = field(default_factory=list)  # bench --methods: bench/methods.py rows
    grid: list[GridPoint] = field(default_factory=list)  # bench --schedule: k x concurrency
    trees: dict | None = None  # bench --trees: bench/trees.py TreeBench.to_dict()
    context_sweep: list[ContextPoint] = field(default_factory=list)  # bench --context-sweep (bench/context.py)
    max_batch_size: int = 1  # of the deployment (the last range of vLLM's schedule shape)
    complete: bool = False

    @property
    def schedule(self) -> dict | None:
        """The recommended load-aware schedule, in the spec's, TensorRT-LLM's and vLLM's shapes,
        with the break-even acceptance length per concurrency at its k."""
        if not self.grid:
            return None
        sched = recommend(self.grid, self.max_batch_size)
        out: dict = {"spec": {"schedule": sched.to_mapping()}, "break_even": []}
        # measured as one batch in process; served, a batch of max_batch_size with the rest waiting
        out["above_max_batch_size"] = sorted({p.concurrency for p in self.grid if p.concurrency > self.max_batch_size})
        for c in sorted({p.concurrency for p in self.grid}):
            k = sched.k_for(c)
            ks = [p.k for p in self.grid if p.concurrency == c and p.k > 0]
            kk = k or (min(ks) if ks else 0)
            out["break_even"].append(
                {"concurrency": c, "k": k, "at_k": kk, "break_even_acceptance_length": break_even_length(self.grid, c, kk)}
            )
        first = sched.points[0][1]
        if first > 0:
            out["trtllm"] = {"max_draft_len": first, "draft_len_schedule": sched.to_mapping()}
            out["vllm"] = vllm_shape(sched, self.max_batch_size)
        return out

    @property
    def speedup(self) -> float:
        if not self.target or not self.speculative or not self.target.tokens_per_s:
            return 0.0
        return self.speculative.tokens_per_s / self.target.tokens_per_s

    @property
    def bound(self) -> float | None:
        if self.costs is None:
            return None
        return speedup_bound(self.metrics.acceptance_rate, self.k, self.costs.cost_ratio, self.costs.verify_cost)

    @property
    def bound_from_measured_length(self) -> float | None:
        """The same bound with the measured tokens per target forward in place of the i.i.d.
        expectation (acceptance is correlated across positions, so the i.i.d. value is low)."""
        if self.costs is None:
            return None
        c = self.costs
        return self.metrics.mean_acceptance_length / (self.k * c.cost_ratio + c.verify_cost)

    @property
    def efficiency(self) -> float | None:
        b = self.bound
        return self.speedup / b if b else None

    @property
    def recommended_k(self) -> int | None:
        return max(self.sweep, key=lambda p: p.tokens_per_s).k if self.sweep else None

    def to_dict(self) -> dict:
        return {
            "spec": self.spec_name,
            "mode": self.mode,
            "machine": self.machine,
            "complete": self.complete,
            "prompts": self.prompts,
            "max_tokens": self.max_tokens,
            "k": self.k,
            "target": self.target.to_dict() if self.target else None,
            "speculative": self.speculative.to_dict() if self.speculative else None,
            "speedup": self.speedup,
            "metrics": self.metrics.to_dict(),
            "costs": None if self.costs is None else self.costs.to_dict(),
            "expected_tokens_per_forward_iid": expected_tokens_per_forward(self.metrics.acceptance_rate, self.k),
            "bound": self.bound,
            "efficiency": self.efficiency,
            "bound_from_measured_length": self.bound_from_measured_length,
            "sweep": [asdict(p) for p in self.sweep],
            "recommended_k": self.recommended_k,
            "concurrency": [
                {"concurrency": p.concurrency, "target": p.target.to_dict(), "speculative": p.speculative.to_dict()}
                for p in self.concurrency
            ],
            "methods": self.methods,
            "grid": [asdict(p) for p in self.grid],
            "schedule": self.schedule,
            "trees": self.trees,
            "context_sweep": [p.to_dict() for p in self.context_sweep],
        }


def validate_args(k: int | None, ks: Sequence[int], concurrency: Sequence[int], max_k: int) -> None:
    """The draft lengths (k None: not asked yet) in 1..max_k and the concurrencies in 1..256."""
    for value in [*([] if k is None else [k]), *ks]:
        if not 1 <= value <= max_k:
            raise RequestError(f"draft length {value} is out of range; use 1..{max_k} (max_draft_len of the engines)")
    for c in concurrency:
        if not 1 <= c <= 256:
            raise RequestError(f"concurrency {c} is out of range; use 1..256")


Progress = Callable[[str], None]


def run_bench(
    backend: BenchBackend,
    report: BenchReport,
    prompts: Sequence[str],
    sweep_ks: Sequence[int],
    concurrency: Sequence[int],
    measure_costs: Callable[[int], Costs] | None,
    progress: Progress = lambda s: None,
    rounds: int = 1,
    sweep_backend: BenchBackend | None = None,
    grid: bool = False,
) -> BenchReport:
    """Fill ``report`` in place; an interruption leaves what was measured so far in it.
    ``sweep_backend`` runs the k sweep and the grid (in process: one that ignores the
    spec's schedule, so each k is what it says); ``grid``: also the k x concurrency grid."""
    sweeper = sweep_backend or backend
    k, n = report.k, report.max_tokens
    progress("warm-up")
    backend.run_batch(prompts[:1], min(n, 8), False, k, 1)
    backend.run_batch(prompts[:1], min(n, 8), True, k, 1)

    if measure_costs is not None:
        progress("measuring step costs")
        report.costs = measure_costs(k)

    _interleaved(backend, report, prompts, rounds, progress)
    base_tps = report.target.tokens_per_s if report.target else 0.0
    for kk in sweep_ks:  # appended one by one: an interruption keeps the points measured
        report.sweep.append(_sweep_point(sweeper, prompts, n, kk, base_tps, progress))
    for c in concurrency:
        _warm(backend, prompts, c, report, progress)
        progress(f"concurrency {c}")
        batch = [prompts[i % len(prompts)] for i in range(max(c, len(prompts)))]
        t_tim, t_secs_c = backend.run_batch(batch, n, False, k, c)
        s_tim, s_secs_c = backend.run_batch(batch, n, True, k, c)
        report.concurrency.append(ConcurrencyPoint(c, PathStats.of(t_tim, t_secs_c), PathStats.of(s_tim, s_secs_c)))
    if grid:
        run_grid(sweeper, report, prompts, sweep_ks or [k], concurrency, progress)
    report.complete = True
    return report


def _warm(backend: BenchBackend, prompts: Sequence[str], c: int, report: BenchReport, progress: Progress) -> None:
    """Both paths once on a batch of ``c`` prompts, a few tokens each, untimed: the engine's
    first batch of several rows compiles (or loads) the programs of steps with several rows,
    which the one-prompt warm-up never meets. Timed, that cost lands on whichever path runs
    first: in process, the demo pair's first batch of 8 prompts took 50 s, the next 2 s."""
    if c > 1:
        progress(f"warm-up: concurrency {c}")
        group = [prompts[i % len(prompts)] for i in range(c)]
        for speculative in (False, True):
            backend.run_batch(group, min(report.max_tokens, 8), speculative, report.k, c)


def _interleaved(backend: BenchBackend, report: BenchReport, prompts: Sequence[str], rounds: int, progress: Progress) -> None:
    """Target-only and speculative on each prompt, one after the other, the order alternating
    so drift does not favour one of them; the report holds the totals after every prompt."""
    k, n = report.k, report.max_tokens
    target_t: list[RequestTiming] = []
    spec_t: list[RequestTiming] = []
    t_secs = s_secs = 0.0
    for r in range(rounds):
        for i, prompt in enumerate(prompts):
            progress(f"round {r + 1}/{rounds}: prompt {i + 1}/{len(prompts)}")
            order = (False, True) if (i + r) % 2 == 0 else (True, False)
            for speculative in order:
                timings, secs = backend.run_batch([prompt], n, speculative, k, 1)
                if speculative:
                    spec_t += timings
                    s_secs += secs
                else:
                    target_t += timings
                    t_secs += secs
            report.target = PathStats.of(target_t, t_secs)
            report.speculative = PathStats.of(spec_t, s_secs)
            report.metrics = _sum_metrics(spec_t)


def _sweep_point(
    sweeper: BenchBackend, prompts: Sequence[str], n: int, k: int, base_tps: float, progress: Progress
) -> SweepPoint:
    """Speculative at draft length ``k`` over every prompt, against target-only's ``base_tps``."""
    progress(f"draft-length sweep: k={k}")
    timings, secs = [], 0.0
    for prompt in prompts:
        t, s = sweeper.run_batch([prompt], n, True, k, 1)
        timings += t
        secs += s
    stats, m = PathStats.of(timings, secs), _sum_metrics(timings)
    speedup = stats.tokens_per_s / base_tps if base_tps else 0.0
    return SweepPoint(k, stats.tokens_per_s, speedup, m.acceptance_rate, m.mean_acceptance_length)


def run_grid(
    backend: BenchBackend, report: BenchReport, prompts: Sequence[str], ks: Sequence[int], concurrency: Sequence[int], progress
) -> None:
    """tokens/s of target-only (k = 0) and each k at each concurrency: what a load-aware
    schedule should be (speculative/schedule.py recommend). Within one concurrency the k
    values run interleaved with target-only, so drift does not favour one."""
    n = report.max_tokens
    for c in concurrency or [1]:
        _warm(backend, prompts, c, report, progress)
        batch = [prompts[i % len(prompts)] for i in range(max(c, len(prompts)))]
        for kk in [0, *ks]:
            progress(f"schedule grid: concurrency {c}, k={kk}")
            tim, secs = backend.run_batch(batch, n, kk > 0, kk or 1, c)
            stats = PathStats.of(tim, secs)
            length = _sum_metrics(tim).mean_acceptance_length if kk else 1.0
            report.grid.append(GridPoint(c, kk, stats.tokens_per_s, length))


def _sum_metrics(timings: list[RequestTiming]) -> SpecMetrics:
    total = SpecMetrics()
    for t in timings:
        if t.metrics is not None:
            total = total.merge(t.metrics)
    return total


# ------------------------------------------------------------------ in-process backend


class InProcessBench:
    """BenchBackend over a loaded Deployment; concurrency = requests batched together."""

    def __init__(self, deployment, chat_template: bool | None = None, use_schedule: bool = True):
        self.dep = deployment
        self.chat_template = chat_template
        # False: every request drafts a chain of the k asked whatever the load and the spec's
        # draft tree (sweeps measure k itself; bench --trees measures trees)
        self.use_schedule = use_schedule

    def run_batch(self, prompts, max_tokens, speculative, k, concurrency):
        timings: list[RequestTiming] = []
        start_all = time.perf_counter()
        for lo in range(0, len(prompts), concurrency):
            group = prompts[lo : lo + concurrency]
            shape = None if self.use_schedule else "chain"
            reqs = [self.dep.request(self.dep.encode(p, self.chat_template), max_tokens, k, tree=shape) for p in group]
            self.dep.forget_prefixes()  # no run may reuse another run's prefill of a prompt
            start = time.perf_counter()
            first: dict[int, float] = {}
            done: dict[int, float] = {}

            def on_step(i, toks, finished, first=first, done=done, start=start):
                now = time.perf_counter() - start
                if toks and i not in first:
                    first[i] = now
                if finished:
                    done[i] = now

            results = self.dep.generate(reqs, speculative=speculative, on_step=on_step, use_schedule=self.use_schedule)
            for i, res in enumerate(results):
                timings.append(
                    RequestTiming(
                        tokens=len(res.output_ids),
                        ttft=first.get(i, done.get(i, 0.0)),
                        latency=done.get(i, time.perf_counter() - start),
                        metrics=res.metrics if speculative else None,
                    )
                )
        return timings, time.perf_counter() - start_all


# Fresh tokens after the measured context, new each repeat, that forward_seconds and head_step
# run (untimed) before the timed forward, so no repeat reuses the last one's timed positions.
TAIL = 4


def measure_engine_costs(deployment, prompt: str, k: int, repeats: int = 7) -> Costs:
    """Median times of: one target decode step, one draft decode step, one target forward
    over k+1 new tokens — each after a cached context, as in generation."""
    ctx = deployment.encode(prompt)
    target_step = forward_seconds(deployment.target, ctx, 1, repeats)
    verify_step = forward_seconds(deployment.target, ctx, k + 1, repeats)
    draft_step = forward_seconds(deployment.draft, ctx, 1, repeats) if deployment.draft is not None else None
    if getattr(deployment, "head", None) is not None:
        draft_step = head_step(deployment, ctx, k, repeats)
    weights, kv = deployment.target.step_bytes(len(ctx) + TAIL)  # the timed step's context: ctx + its tail
    verify_by_k = {
        str(n): forward_seconds(deployment.target, ctx, n + 1, max(3, repeats // 2)) / target_step
        for n in range(1, getattr(getattr(deployment.target, "manifest", None), "max_draft_len", k) + 1)
    }
    paths, busy = step_paths(deployment), step_busy(deployment)
    return Costs(target_step, draft_step, verify_step, k, weights, kv, measure_bandwidth(), verify_by_k, paths, busy)


def step_paths(deployment) -> dict[str, str]:
    """Per engine role, which path (eager or compiled) runs its one-row and its wider steps."""
    return {role: engine.programs.summary() for role, engine in _chosen(deployment)}


def step_busy(deployment) -> dict[str, dict[str, float | None]]:
    """Per engine role, how busy the machine was when its kernel and its eager-or-compiled
    choices were measured (the choices' ``others_busy``), for the roles step_paths lists."""
    return {
        role: {"kernels": getattr(engine.kernels, "others_busy", None), "programs": engine.programs.others_busy}
        for role, engine in _chosen(deployment)
    }


def _chosen(deployment) -> list[tuple[str, object]]:
    """(role, engine) for each engine of ``deployment`` that chose its paths (the torch engines)."""
    engines = (("target", deployment.target), ("draft", deployment.draft))
    return [(role, engine) for role, engine in engines if engine is not None and hasattr(engine, "programs")]


def forward_seconds(engine, ctx: list[int], n_new: int, repeats: int, tree: bool = False) -> float:
    """Median seconds of one forward over ``n_new`` new tokens after a cached context (a fresh
    tail per repeat). ``tree``: the last n_new - 1 of them are a draft tree, two branches
    side by side (the context's last token, then the nodes), as a tree verify runs."""
    from trtspec.engines.torch.engine import ForwardItem

    times = []
    for r in range(repeats):
        base = ctx + [(7 * r + j) % 100 + 10 for j in range(TAIL)]  # a fresh tail per repeat
        engine.run([ForwardItem(base, 1)])  # context is cached now
        seq = base + [(11 * r + j) % 100 + 10 for j in range(n_new)]
        # Two branches: node i's parent is node i - 2 (the first two are the root's children).
        parents = tuple(max(i - 2, -1) for i in range(n_new - 1)) if tree and n_new > 2 else None
        t0 = time.perf_counter()
        engine.run([ForwardItem(seq, n_new, parents)])
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def head_step(deployment, ctx: list[int], k: int, repeats: int) -> float:
    """Median seconds per drafted token of an EAGLE-3 head (feature fetch included): k chained
    head steps after a context the target and the head have both seen (``ctx`` and a fresh
    tail of TAIL tokens per repeat)."""
    from trtspec.engines.torch.engine import ForwardItem

    drafter = deployment.drafter()
    times = []
    for r in range(repeats):
        base = ctx + [(13 * r + j) % 100 + 10 for j in range(TAIL)]
        deployment.target.run([ForwardItem(base, 1)])  # the target's features for every position
        drafter.propose([base[:-1]], [1])  # the head has caught up on the context
        t0 = time.perf_counter()
        drafter.propose([base], [k])
        times.append((time.perf_counter() - t0) / k)
    return statistics.median(times)

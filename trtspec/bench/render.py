"""`trtspec bench`'s report as text: the results table, costs and the memory-floor line, the
sweep, concurrency, methods and schedule-grid tables (rich)."""

from __future__ import annotations

from trtspec.bench.measure import BenchReport, Costs
from trtspec.engines.torch.contention import contended


def render(report: BenchReport, console) -> None:
    from rich.table import Table

    t = Table(title=f"trtspec bench: {report.spec_name} ({report.mode}; {report.machine})")
    for col in ("path", "tok/s", "TTFT p50/p95 ms", "ITL p50/p95 ms", "latency p50/p95 s"):
        t.add_column(col)
    for name, s in (("target-only", report.target), (f"speculative k={report.k}", report.speculative)):
        if s:
            t.add_row(
                name,
                f"{s.tokens_per_s:.1f}",
                _ms_pair(s.ttft_p50, s.ttft_p95, 0),
                _ms_pair(s.itl_p50, s.itl_p95, 1),
                f"{s.latency_p50:.2f}/{s.latency_p95:.2f}",
            )
    console.print(t)
    m = report.metrics
    console.print(
        f"speedup {report.speedup:.2f}x | acceptance rate {m.acceptance_rate:.3f} | mean acceptance "
        f"length {m.mean_acceptance_length:.2f} | per-position [{', '.join(f'{x:.2f}' for x in m.per_position_rate)}]"
    )
    if report.costs:
        _render_costs(report, console)
    if report.sweep:
        _render_sweep(report, console)
    if report.concurrency:
        _render_concurrency(report, console)
    if report.methods:
        _render_methods(report, console)
    if report.grid:
        _render_grid(report, console)
    if report.trees:
        _render_trees(report.trees, console)
    if report.context_sweep:
        _render_context(report, console)
    if not report.complete:
        console.print("[yellow]interrupted: partial results[/yellow]")


def _render_costs(report: BenchReport, console) -> None:
    c = report.costs
    draft = f"{c.draft_step * 1e3:.1f} ms" if c.draft_step else "none"
    console.print(
        f"costs: target step {c.target_step * 1e3:.1f} ms, draft step {draft}, verify {c.k + 1} tokens "
        f"{c.verify_step * 1e3:.1f} ms | c = {c.cost_ratio:.3f}, verify cost {c.verify_cost:.2f} | "
        f"bound {report.bound:.2f}x | efficiency {report.efficiency:.2f} | bound with the measured "
        f"acceptance length {report.bound_from_measured_length:.2f}x"
    )
    if c.step_bytes is not None and c.bandwidth is not None:
        console.print(floor_line(c))
    for line in path_lines(c, "steps"):
        console.print(line)
    if c.verify_by_k:
        console.print("verify cost by k (target decode steps): " + ", ".join(f"{k}: {v:.2f}" for k, v in c.verify_by_k.items()))


def _render_sweep(report: BenchReport, console) -> None:
    from rich.table import Table

    st = Table(title="draft-length sweep")
    for col in ("k", "tok/s", "speedup", "acceptance", "mean acc. len"):
        st.add_column(col)
    for p in report.sweep:
        mark = " *" if p.k == report.recommended_k else ""
        st.add_row(
            f"{p.k}{mark}",
            f"{p.tokens_per_s:.1f}",
            f"{p.speedup:.2f}x",
            f"{p.acceptance_rate:.3f}",
            f"{p.mean_acceptance_length:.2f}",
        )
    console.print(st)
    console.print(f"recommended k = {report.recommended_k} (highest tokens/s)")


def _render_concurrency(report: BenchReport, console) -> None:
    from rich.table import Table

    ct = Table(title="concurrency")
    for col in ("concurrency", "target tok/s", "spec tok/s", "spec latency p50/p95 s", "spec vs c=1"):
        ct.add_column(col)
    base = report.concurrency[0].speculative.tokens_per_s
    for p in report.concurrency:
        ct.add_row(
            str(p.concurrency),
            f"{p.target.tokens_per_s:.1f}",
            f"{p.speculative.tokens_per_s:.1f}",
            f"{p.speculative.latency_p50:.2f}/{p.speculative.latency_p95:.2f}",
            f"{p.speculative.tokens_per_s / base:.2f}x" if base else "-",
        )
    console.print(ct)


def _render_methods(report: BenchReport, console) -> None:
    from rich.table import Table

    mt = Table(title="drafting methods over the same target (tokens/s incl. prefill)")
    for col in ("prompts", "method", "tok/s", "speedup", "acceptance", "mean acc. len", "draft cost c", "identical"):
        mt.add_column(col)
    for r in report.methods:
        mt.add_row(
            r.get("prompt_set", "-"),
            r["method"],
            f"{r['tokens_per_s']:.1f}",
            f"{r.get('speedup', 1.0):.2f}x",
            f"{r['acceptance_rate']:.3f}" if "acceptance_rate" in r else "-",
            f"{r['mean_acceptance_length']:.2f}" if "mean_acceptance_length" in r else "1.00",
            f"{r['draft_cost_c']:.3f}" if "draft_cost_c" in r else "-",
            "yes" if r["identical_to_target_only"] else f"NO (prompts {r['mismatched_prompts']})",
        )
    console.print(mt)


def _render_context(report: BenchReport, console) -> None:
    """bench --context-sweep: each step's cost with L tokens cached, one row per L."""
    from rich.table import Table

    k = report.context_sweep[0].costs.k
    t = Table(title=f"step costs by context length (tokens in the KV cache; verify of {k + 1} tokens)")
    for col in ("context", "target ms", "draft ms", "c", f"verify {k + 1} ms", "verify (steps)", "MB a step", "of floor"):
        t.add_column(col)
    for p in report.context_sweep:
        c = p.costs
        t.add_row(
            str(p.context),
            f"{c.target_step * 1e3:.1f}",
            "-" if c.draft_step is None else f"{c.draft_step * 1e3:.1f}",
            "-" if c.draft_step is None else f"{c.cost_ratio:.3f}",
            f"{c.verify_step * 1e3:.1f}",
            f"{c.verify_cost:.2f}",
            "-" if c.step_bytes is None else f"{c.step_bytes / 1e6:.1f}",
            "-" if c.of_copy_bandwidth is None else f"{c.of_copy_bandwidth:.2f}",
        )
    console.print(t)
    for line in path_lines(report.context_sweep[-1].costs, "steps (context sweep)"):
        console.print(line)


def _render_trees(trees: dict, console) -> None:
    """bench --trees: the shapes the model compares, what it recommends, and the timed runs."""
    from rich.table import Table

    probe = trees["probe"]
    console.print(
        f"draft trees: probe of {probe['nodes']} nodes over {probe['target_forwards']} target forwards; "
        f"c {trees['cost_ratio']:.3f}; verify of n nodes in decode steps: "
        + ", ".join(f"{n}: {v:.2f}" for n, v in trees["verify_cost"].items() if int(n) in (1, 2, 4, 8, 16, 32, 64))
    )
    t = Table(title="expected per target forward (model: 1 + node acceptance; verify(n) + depth x c)")
    for col in ("shape", "nodes", "depth", "acceptance length", "cost (steps)", "expected speedup"):
        t.add_column(col)
    for name in ("chain_k1", "best_chain", "longest_within_8", "recommended"):
        s = trees[name]
        if s:
            t.add_row(
                name if not (name == "recommended" and s["chain"]) else "recommended (a chain)",
                str(s["nodes"]),
                str(s["depth"]),
                f"{s['expected_length']:.2f}",
                f"{s['cost']:.2f}",
                f"{s['expected_speedup']:.2f}x",
            )
    console.print(t)
    rec = trees["recommended"]
    console.print(
        "recommended: no drafting (nothing beats target-only)"
        if rec is None
        else f"recommended: speculative.tree.choices {rec['choices']}"
        if not rec["chain"]
        else f"recommended: a chain, max_draft_len {rec['nodes']} (no tree)"
    )
    if trees["timed"]:
        tt = Table(title="timed (this run)")
        for col in ("path", "tok/s", "mean acceptance length"):
            tt.add_column(col)
        for name, v in trees["timed"].items():
            tok_s = "-" if v["tokens_per_s"] is None else f"{v['tokens_per_s']:.1f}"
            tt.add_row(name, tok_s, f"{v['mean_acceptance_length']:.2f}")
        console.print(tt)


def _render_grid(report: BenchReport, console) -> None:
    from rich.table import Table

    ks = sorted({p.k for p in report.grid})
    cs = sorted({p.concurrency for p in report.grid})
    tps = {(p.concurrency, p.k): p for p in report.grid}
    gt = Table(title="schedule grid: aggregate tokens/s by concurrency (rows) and k (k=0: target-only)")
    gt.add_column("concurrency")
    for k in ks:
        gt.add_column(f"k={k}" if k else "target-only")
    for c in cs:
        best = max((tps[(c, k)] for k in ks if (c, k) in tps), key=lambda p: p.tokens_per_s)
        cells = []
        for k in ks:
            p = tps.get((c, k))
            text = "-" if p is None else f"{p.tokens_per_s:.1f}" + (f" (len {p.mean_acceptance_length:.2f})" if k else "")
            cells.append(f"[bold]{text}[/bold]" if p is best else text)
        gt.add_row(str(c), *cells)
    console.print(gt)
    sched = report.schedule
    console.print(f"recommended schedule (speculative.schedule): {sched['spec']['schedule']}")
    if sched["above_max_batch_size"]:
        console.print(
            f"  left out: concurrency {', '.join(map(str, sched['above_max_batch_size']))} (above build.max_batch_size "
            f"{report.max_batch_size}: served, a batch of {report.max_batch_size} runs and the rest wait, so no step runs that many)"
        )
    for row in sched["break_even"]:
        be = row["break_even_acceptance_length"]
        console.print(
            f"  concurrency {row['concurrency']}: k={row['k']}; drafting {row['at_k']} pays above an acceptance "
            f"length of {be:.2f}"
            if be is not None
            else f"  concurrency {row['concurrency']}: k={row['k']}"
        )
    if "trtllm" in sched:
        console.print(f"TensorRT-LLM speculative_config: {sched['trtllm']}")
        console.print(f"vLLM speculative_config: {sched['vllm']}")
    else:
        console.print("target-only wins even at concurrency 1: leave speculation off on this machine")


def floor_line(c: Costs) -> str:
    """One line: the decode step's bytes over its time, against the machine's bandwidth."""
    bw = c.bandwidth
    return (
        f"memory floor: a decode step moves {c.step_bytes / 1e9:.3f} GB (weights {c.weight_bytes / 1e9:.3f} + "
        f"KV {(c.kv_bytes or 0) / 1e6:.1f} MB) in {c.target_step * 1e3:.1f} ms = {c.achieved_gbps:.1f} GB/s | this "
        f"machine copies {bw.copy_gbps:.1f} GB/s (reads {bw.read_gbps:.1f}; {bw.threads} threads), so the floor step "
        f"is {c.floor_step * 1e3:.1f} ms: {c.of_copy_bandwidth:.2f} of the floor"
    )


def path_lines(c: Costs, label: str) -> list[str]:
    """One line per engine role: which path (eager or compiled) ran its steps, and whether its
    choices are provisional (measured on a busy machine)."""
    return [f"{role} {label}: {path}{_busy_note(c.paths_busy.get(role))}" for role, path in c.paths.items()]


def _busy_note(busy: dict[str, float | None] | None) -> str:
    """For a role's paths line: which of its choices (kernels, programs) were measured on a busy
    machine, so are provisional and its step times may not be this machine's quiet ones; "" if none."""
    busy = {what: others for what, others in (busy or {}).items() if contended(others)}
    if not busy:
        return ""
    others = ", ".join(f"{what} {value:.2f}" for what, value in busy.items())
    return (
        f"; provisional: measured on a busy machine (others {others} of the CPUs); "
        "`trtspec choices` shows them, TRTSPEC_REMEASURE=1 measures again"
    )


def _ms_pair(a: float | None, b: float | None, digits: int) -> str:
    if a is None or b is None:
        return "-"
    return f"{a * 1e3:.{digits}f}/{b * 1e3:.{digits}f}"

"""What a `trtspec bench` run writes: bench.json and one PNG plot per part of the report that
holds data (matplotlib, Agg)."""

from __future__ import annotations

from pathlib import Path

from trtspec.bench.measure import BenchReport
from trtspec.files import write_json_atomic


def write_outputs(report: BenchReport, out_dir: Path) -> list[Path]:
    """bench.json plus PNG plots; returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / "bench.json"]
    write_json_atomic(written[0], report.to_dict())
    written += plot(report, out_dir)
    return written


def plot(report: BenchReport, out_dir: Path) -> list[Path]:
    """One PNG per part of the report that holds data; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = (
        (report.sweep, _plot_sweep, "sweep.png"),
        (report.metrics.per_position_rate, _plot_per_position, "per_position.png"),
        (report.concurrency, _plot_concurrency, "concurrency.png"),
        (report.methods, _plot_methods, "methods.png"),
        (report.grid, _plot_schedule, "schedule.png"),
        (report.context_sweep, _plot_context, "context.png"),
    )
    files = []
    for data, draw, name in figures:
        if data:
            fig, ax = plt.subplots(figsize=(6, 4))
            draw(report, fig, ax)
            files.append(_save(fig, out_dir / name))
    return files


def _plot_sweep(report: BenchReport, fig, ax) -> None:
    """Speedup (left axis) and acceptance rate (right axis) by draft length."""
    ks = [p.k for p in report.sweep]
    ax.plot(ks, [p.speedup for p in report.sweep], "o-", label="speedup vs target-only")
    ax.set_xlabel("draft length k")
    ax.set_ylabel("speedup (x)")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax2 = ax.twinx()
    ax2.plot(ks, [p.acceptance_rate for p in report.sweep], "s--", color="tab:orange", label="acceptance rate")
    ax2.set_ylabel("acceptance rate")
    ax2.set_ylim(0, 1.05)
    fig.legend(loc="lower right", bbox_to_anchor=(0.86, 0.16), fontsize=8)
    ax.set_title(f"{report.spec_name}: speedup and acceptance vs k")


def _plot_per_position(report: BenchReport, fig, ax) -> None:
    """P(accepted | drafted) at each draft position."""
    rates = report.metrics.per_position_rate
    ax.bar(range(1, len(rates) + 1), rates)
    ax.set_xlabel("draft position")
    ax.set_ylabel("P(accepted | drafted)")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"{report.spec_name}: per-position acceptance (k={report.k})")


def _plot_concurrency(report: BenchReport, fig, ax) -> None:
    """Both paths' aggregate tokens/s (left axis) and the speculative latency (right) by concurrency."""
    cs = [p.concurrency for p in report.concurrency]
    ax.plot(cs, [p.target.tokens_per_s for p in report.concurrency], "o-", label="target-only tok/s")
    ax.plot(cs, [p.speculative.tokens_per_s for p in report.concurrency], "s-", label="speculative tok/s")
    ax.set_xlabel("concurrency")
    ax.set_ylabel("aggregate tokens/s")
    ax2 = ax.twinx()
    ax2.plot(cs, [p.speculative.latency_p50 for p in report.concurrency], "^--", color="tab:red", label="spec latency p50 (s)")
    ax2.set_ylabel("request latency p50 (s)")
    fig.legend(loc="upper left", fontsize=8)
    ax.set_title(f"{report.spec_name}: throughput and latency vs concurrency")


def _plot_methods(report: BenchReport, fig, ax) -> None:
    """Each drafting method's speedup over target-only, labelled with its acceptance length."""
    sets = {r.get("prompt_set") for r in report.methods}
    names = [r["method"] if len(sets) < 2 else f"{r['method']}\n({r['prompt_set']})" for r in report.methods]
    bars = ax.bar(names, [r.get("speedup", 1.0) for r in report.methods], color="tab:blue")
    for bar, r in zip(bars, report.methods):
        label = f"len {r['mean_acceptance_length']:.2f}" if "mean_acceptance_length" in r else ""
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_ylabel("speedup vs target-only (x)")
    ax.set_title(f"{report.spec_name}: drafting methods, one target ({report.machine.split(',')[0]})")
    ax.tick_params(axis="x", labelsize=8)


def _plot_schedule(report: BenchReport, fig, ax) -> None:
    """The schedule grid: aggregate tokens/s by concurrency, one line per k."""
    cs = sorted({p.concurrency for p in report.grid})
    for k in sorted({p.k for p in report.grid}):
        pts = sorted((p for p in report.grid if p.k == k), key=lambda p: p.concurrency)
        style = ("o-", "black") if k == 0 else ("s--", None)
        ax.plot(
            [p.concurrency for p in pts],
            [p.tokens_per_s for p in pts],
            style[0],
            color=style[1],
            label="target-only" if k == 0 else f"k={k}",
        )
    ax.set_xscale("log", base=2)
    ax.set_xticks(cs, [str(c) for c in cs])
    ax.set_xlabel("concurrency (active sequences)")
    ax.set_ylabel("aggregate tokens/s")
    ax.legend(fontsize=8)
    ax.set_title(f"{report.spec_name}: k x concurrency (recommended {report.schedule['spec']['schedule']})", fontsize=9)


def _plot_context(report: BenchReport, fig, ax) -> None:
    """Step ms by context length (left axis): target decode step, verify of k+1 tokens, draft
    step; the cost ratio c (right axis)."""
    points = report.context_sweep
    ns, k = [p.context for p in points], points[0].costs.k
    ax.plot(ns, [p.costs.target_step * 1e3 for p in points], "o-", label="target step")
    ax.plot(ns, [p.costs.verify_step * 1e3 for p in points], "^-", label=f"verify {k + 1} tokens")
    drafted = [p for p in points if p.costs.draft_step is not None]
    if drafted:
        ax.plot([p.context for p in drafted], [p.costs.draft_step * 1e3 for p in drafted], "s-", label="draft step")
        ax2 = ax.twinx()
        ax2.plot([p.context for p in drafted], [p.costs.cost_ratio for p in drafted], "x--", color="tab:red", label="c")
        ax2.set_ylabel("c = draft step / target step")
        ax2.set_ylim(0, max(1.05, max(p.costs.cost_ratio for p in drafted) * 1.1))
    ax.set_xlabel("context (tokens in the KV cache)")
    ax.set_ylabel("step (ms)")
    ax.set_ylim(bottom=0)
    fig.legend(loc="upper left", bbox_to_anchor=(0.12, 0.9), fontsize=8)
    ax.set_title(f"{report.spec_name}: step cost vs context ({report.machine.split(',')[0]})", fontsize=9)


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.tight_layout()
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
    return path

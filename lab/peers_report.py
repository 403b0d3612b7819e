"""The peers bench's report: each path summarised over the prompts every path completed, the
Markdown table with its head-to-head ratios and goals, the JSON and the tokens/s plot
(lab/peers.py measures; definitions are in its docstring)."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

from lab.peers import KINDS, REFERENCE, Measurement
from trtspec.speculative.metrics import SpecMetrics


@dataclass
class PathSummary:
    key: str
    label: str
    tokens: int
    seconds: float
    tokens_per_s: float
    identical: int
    per_kind: dict[str, float]  # kind -> tokens/s
    metrics: dict | None  # merged SpecMetrics (trtspec speculative paths)


def summarise(m: Measurement) -> list[PathSummary]:
    out = []
    kinds = [p.kind for p in m.prompts[: len(m.runs)]]
    for key, label in m.paths:
        runs = [r[key] for r in m.runs]
        tokens = sum(r.tokens for r in runs)
        seconds = sum(r.seconds for r in runs)
        per_kind = {}
        for kind in KINDS:
            sel = [r for r, k in zip(runs, kinds) if k == kind]
            secs = sum(r.seconds for r in sel)
            if sel and secs > 0:
                per_kind[kind] = sum(r.tokens for r in sel) / secs
        metrics = None
        if runs and runs[0].metrics is not None:
            merged = SpecMetrics()
            for r in runs:
                merged = merged.merge(r.metrics)
            metrics = merged.to_dict()
        out.append(
            PathSummary(
                key,
                label,
                tokens,
                seconds,
                tokens / seconds if seconds else 0.0,
                sum(r.identical for r in runs),
                per_kind,
                metrics,
            )
        )
    return out


# Head-to-head ratios reported under the table: (ours, theirs, goal or None).
COMPARISONS = [
    ("ours_draft_target", "hf_assisted", 1.2),
    ("ours_draft_target", "hf_assisted_default", 1.2),
    ("ours_eagle3", "hf_assisted", 1.0),  # the co-designed head ahead of HF's best path (issue 9)
    ("ours_eagle3", "hf_assisted_default", 1.0),
    ("ours_eagle3", "ours_draft_target", 1.15),
    ("ours_ngram", "hf_prompt_lookup", None),
    ("ours_target", "hf_target", None),
    ("ours_target", "vllm_target", 0.9),  # issue 23: our engine near vLLM's on the same CPU
    ("ours_eagle3", "vllm_eagle3", None),
    ("ours_draft_target", "vllm_draft_target", None),
    ("ours_ngram", "vllm_ngram", None),
]
SPECULATIVE_OURS = ("ours_eagle3", "ours_draft_target", "ours_ngram")
SPECULATIVE_VLLM = ("vllm_eagle3", "vllm_draft_target", "vllm_ngram")
BEST_GOAL = 1.2  # issue 23: our best speculative path against vLLM's best, same prompts and head


def ratio(summaries: list[PathSummary], a: str, b: str) -> float | None:
    by = {s.key: s for s in summaries}
    if a not in by or b not in by or not by[b].tokens_per_s:
        return None
    return by[a].tokens_per_s / by[b].tokens_per_s


def best_speculative(summaries: list[PathSummary], keys: tuple[str, ...]) -> PathSummary | None:
    found = [s for s in summaries if s.key in keys]
    return max(found, key=lambda s: s.tokens_per_s) if found else None


def render_markdown(m: Measurement, summaries: list[PathSummary]) -> str:
    n = len(m.runs)
    scope = f"{n} of {len(m.prompts)} prompts" + (" (interrupted)" if m.interrupted else "")
    timing = f", fastest of {m.repeats} runs per prompt and path" if m.repeats > 1 else ""
    get = m.setup.get
    c = m.concurrency
    at = "batch 1" if c == 1 else f"concurrency {c} (groups of {c} prompts sent at once)"
    run = f"{scope}, max_tokens {m.max_tokens}, greedy, {at}, warm-up excluded, paths interleaved per prompt"
    where = f"Machine: {get('machine', '?')}; torch threads {get('torch_threads', '?')}"
    versions = f"torch {get('torch', '?')}, transformers {get('transformers', '?')}"
    keys = {s.key for s in summaries}
    has_vllm = "vllm_target" in keys
    if has_vllm:
        versions += f", vLLM {get('vllm', {}).get('vllm', '?')} (its own torch {get('vllm', {}).get('vllm_torch', '?')})"
    peers = ", ".join(
        name for name, present in (("Hugging Face transformers", "hf_target" in keys), ("vLLM", has_vllm)) if present
    )
    lines = [
        f"# trtspec vs {peers or 'no peer'}: {get('spec', '?')}, concurrency {c}",
        "",
        f"{run}{timing}.",
        f"{where}; {versions}.",
        _load_line(m),
        "",
    ]
    if n == 0:
        return "\n".join(lines + ["Nothing measured: no prompt was completed by every path."]) + "\n"
    vs = [("trtspec target-only", "ours_target")] + [
        (name, key) for name, key in (("HF target-only", "hf_target"), ("vLLM target-only", "vllm_target")) if key in keys
    ]
    lines += [
        "| path | tokens | seconds | tokens/s | "
        + " | ".join(f"vs {name}" for name, _ in vs)
        + " | identical to trtspec target-only | acceptance | mean accepted length |",
        "|---|---:|---:|---:|" + "---:|" * len(vs) + "---:|---:|---:|",
    ]
    for s in summaries:
        same = "reference" if s.key == REFERENCE else f"{s.identical}/{n}"
        rate = f"{s.metrics['acceptance_rate']:.2f}" if s.metrics else ""
        mal = f"{s.metrics['mean_acceptance_length']:.2f}" if s.metrics and s.metrics["target_forwards"] else ""
        ratios = " | ".join(_x(ratio(summaries, s.key, key)) for _, key in vs)
        lines.append(f"| {s.label} | {s.tokens} | {s.seconds:.2f} | {s.tokens_per_s:.1f} | {ratios} | {same} | {rate} | {mal} |")
    lines += ["", "Tokens/s by prompt kind:", ""]
    kinds = [k for k in KINDS if any(k in s.per_kind for s in summaries)]
    lines.append("| path | " + " | ".join(f"{k} ({sum(p.kind == k for p in m.prompts[:n])})" for k in kinds) + " |")
    lines.append("|---|" + "---:|" * len(kinds))
    for s in summaries:
        lines.append(f"| {s.label} | " + " | ".join(f"{s.per_kind.get(k, 0):.1f}" for k in kinds) + " |")
    lines += ["", "Head to head (tokens/s ratio):", ""]
    labels = dict(m.paths)
    for ours, theirs, goal in COMPARISONS:
        r = ratio(summaries, ours, theirs)
        if r is None:
            continue
        verdict = "" if goal is None else f" (goal >= {goal}: {'met' if r >= goal else 'missed'})"
        lines.append(f"- {labels[ours]} / {labels[theirs]}: {r:.2f}x{verdict}")
    ours, theirs = best_speculative(summaries, SPECULATIVE_OURS), best_speculative(summaries, SPECULATIVE_VLLM)
    if ours and theirs and theirs.tokens_per_s:
        r = ours.tokens_per_s / theirs.tokens_per_s
        lines.append(
            f"- best speculative, {ours.label} / {theirs.label}: {r:.2f}x (goal >= {BEST_GOAL}: {'met' if r >= BEST_GOAL else 'missed'})"
        )
    return "\n".join(lines) + "\n"


def _load_line(m: Measurement) -> str:
    if not m.load:
        return ""
    cpus = os.cpu_count() or 1
    typical = sorted(m.load)[len(m.load) // 2]
    line = f"Load average (1 min) during the run: median {typical:.1f}, max {max(m.load):.1f} on {cpus} CPUs."
    # This run alone keeps about torch_threads threads busy (the CPU count by default); a
    # typical load well beyond the CPU count means other processes competed all along.
    if typical > cpus + 0.5:
        line += " **Other processes competed for the CPU: rerun on a quiet machine.**"
    return line


def _x(r: float | None) -> str:
    return "" if r is None else f"{r:.2f}x"


def to_json(m: Measurement, summaries: list[PathSummary]) -> dict:
    return {
        "setup": m.setup,
        "concurrency": m.concurrency,
        "max_tokens": m.max_tokens,
        "repeats": m.repeats,
        "interrupted": m.interrupted,
        "load_average": m.load,
        "paths": [asdict(s) for s in summaries],
        "comparisons": {f"{a}/{b}": ratio(summaries, a, b) for a, b, _ in COMPARISONS if ratio(summaries, a, b) is not None},
        "prompts": [
            {"prompt": p.text, "kind": p.kind, "prompt_tokens": len(p.ids), "runs": {k: r.to_dict() for k, r in runs.items()}}
            for p, runs in zip(m.prompts, m.runs)
        ],
    }


def plot(results: list[tuple[Measurement, list[PathSummary]]], out: Path) -> Path:
    """Tokens/s of every path, one bar per concurrency measured (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(label for m, _ in results for _, label in m.paths))
    fig, ax = plt.subplots(figsize=(11, 0.35 * len(labels) * max(1, len(results)) + 1.5))
    height = 0.8 / len(results)
    for i, (m, summaries) in enumerate(results):
        by = {s.label: s.tokens_per_s for s in summaries}
        ys = [j + i * height for j in range(len(labels))]
        ax.barh(ys, [by.get(label, 0.0) for label in labels], height=height, label=f"concurrency {m.concurrency}")
    ax.set_yticks([j + height * (len(results) - 1) / 2 for j in range(len(labels))], labels)
    ax.invert_yaxis()
    ax.set_xlabel("generated tokens/s (greedy, same prompts)")
    ax.set_title(f"{results[0][0].setup.get('spec', '')}: trtspec and its peers")
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out

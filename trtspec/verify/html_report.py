"""`verify --html`: the verify report as one page people read, and CI keeps as an artifact.

Self-contained: inline CSS, plots as inline SVG (matplotlib), no script and no external asset;
its Content-Security-Policy forbids loading anything, so it looks the same offline, in a CI
artifact viewer or as a mail attachment. Every string that came from a prompt, a model or a
tokenizer is untrusted and HTML-escaped (quotes too) before it reaches the page; plots carry
only numbers and prompt indices.

The page is rendered from the report's JSON (what ``--json-file`` writes), so page and JSON
cannot disagree, plus each token's text, which the JSON does not carry.
"""

from __future__ import annotations

import html
import io
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

from trtspec.files import write_text_atomic
from trtspec.speculative.metrics import node_rates_text

CLASSES = ("numerical", "algorithmic", "unclassified")

# Nothing may load: not a script, not an image from the network, not a font.
_CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"

_CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px auto; max-width: 1140px; color: #1d1f23; }
h1 { font-size: 22px; margin: 0 0 8px; } h2 { font-size: 18px; margin: 28px 0 8px; }
h3 { font-size: 15px; margin: 18px 0 6px; }
.banner { padding: 10px 14px; border-radius: 6px; font-weight: 600; margin: 10px 0 16px; }
.banner.pass { background: #dff3e4; color: #14532d; } .banner.fail { background: #fde2e1; color: #7f1d1d; }
table { border-collapse: collapse; margin: 6px 0; } td, th { border: 1px solid #d0d4da; padding: 3px 8px;
  text-align: left; vertical-align: top; } th { background: #f2f4f7; font-weight: 600; }
.kv th { width: 220px; }
.note { background: #fff7d6; border-left: 4px solid #e0b400; padding: 6px 10px; margin: 8px 0; }
.prompt { border: 1px solid #d0d4da; border-radius: 6px; padding: 8px 14px; margin: 14px 0; }
.prompt.diverged { border-color: #d9534f; }
.text, .out { white-space: pre-wrap; word-break: break-word; font-family: ui-monospace, monospace;
  font-size: 13px; background: #f7f8fa; padding: 6px 8px; border-radius: 4px; margin: 4px 0; }
.t.s0 { background: #e8effd; } .t.s1 { background: #fdf1e3; }
.t.after { opacity: 0.5; }
mark.div { background: #ffd24d; outline: 2px solid #d9534f; color: #000; font-weight: 700; }
.badge { display: inline-block; padding: 1px 8px; border-radius: 10px; font-size: 12px; font-weight: 600; }
.badge.identical { background: #dff3e4; color: #14532d; } .badge.numerical { background: #fff1c2; color: #6b4e00; }
.badge.algorithmic, .badge.unclassified { background: #fde2e1; color: #7f1d1d; }
.plots { display: flex; flex-wrap: wrap; gap: 12px; } .plots figure { margin: 0; width: 540px; }
.plots svg { width: 540px; height: auto; } figcaption { font-size: 12px; color: #555; }
.legend span { margin-right: 12px; }
"""


def render(
    data: dict,
    token_text: Callable[[int], str],
    *,
    machine: str,
    fail_on: str,
    passed: bool,
) -> str:
    """The whole page. ``data``: the verify report's JSON (gates and sampling included when
    they ran); ``token_text(id)``: a token's text; ``passed``: the command's verdict."""
    texts: dict[int, str] = {}

    def text(tok: int) -> str:
        if tok not in texts:
            texts[tok] = token_text(tok)
        return texts[tok]

    title = f"trtspec verify: {data['spec']}"
    body = [
        f"<h1>{_e(title)}</h1>",
        _banner(data, fail_on, passed),
        _summary(data, machine, fail_on),
        _served_note(data),
        _gates(data),
        _divergence_table(data),
        _plots(data),
        '<h2 id="prompts">Prompts</h2>',
        _legend(),
        *(_prompt(r, text, data["mode"]) for r in data["results"]),
    ]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">'
        f"<title>{_e(title)}</title><style>{_CSS}</style></head>\n<body>\n"
        + "\n".join(part for part in body if part)
        + "\n</body></html>\n"
    )


def write(path: Path, data: dict, token_text: Callable[[int], str], *, machine: str, fail_on: str, passed: bool) -> None:
    """Render and write atomically (temp file + rename: never a half-written page)."""
    write_text_atomic(path, render(data, token_text, machine=machine, fail_on=fail_on, passed=passed))


# ----------------------------------------------------------------------- sections


def _banner(data: dict, fail_on: str, passed: bool) -> str:
    n = len(data["results"])
    if data["identical"]:
        what = f"all {n} prompts token-identical"
    else:
        counts = ", ".join(f"{data['verdicts'][c]} {c}" for c in CLASSES if data["verdicts"].get(c))
        what = f"{data['diverged']} of {n} prompts diverged ({counts})"
    gates = [g for g in (data.get("acceptance_gate"), data.get("sampling")) if g is not None]
    if any(not g["passed"] for g in gates):
        what += "; a gate failed (below)"
    word = "PASSED" if passed else "FAILED"
    return f'<div class="banner {"pass" if passed else "fail"}">{word}: {_e(what)} (--fail-on {_e(fail_on)})</div>'


def _summary(data: dict, machine: str, fail_on: str) -> str:
    m = data["metrics"]
    per_pos = ", ".join(f"{x:.2f}" for x in m["per_position_rate"]) or "none reported"
    rows = [
        ("spec", data["spec"]),
        ("mode", data["mode"]),
        ("prompt set", f"{data['prompt_set']} ({data['prompts']} prompts, sha256 {data['prompt_set_sha256'][:16]}…)"),
        ("draft tokens k / max tokens", f"{_opt(data['num_draft_tokens'])} / {data['max_tokens']}"),
        ("identical", f"{len(data['results']) - data['diverged']} of {len(data['results'])}"),
        ("verdicts", ", ".join(f"{data['verdicts'].get(c, 0)} {c}" for c in CLASSES) + f" (--fail-on {fail_on})"),
        ("acceptance rate", f"{m['acceptance_rate']:.3f} ({m['accepted']}/{m['drafted']} drafts accepted)"),
        ("mean acceptance length", f"{m['mean_acceptance_length']:.2f} tokens per target forward"),
        ("acceptance per draft position", per_pos),
        *([("acceptance per tree node", node_rates_text(m["node_rate"], most=64))] if m.get("node_rate") else []),
        (
            "throughput",
            f"target-only {data['target_tokens_per_s']:.1f} tok/s, speculative {data['speculative_tokens_per_s']:.1f} "
            f"tok/s, speedup {data['speedup']:.2f}x",
        ),
        ("machine", machine),
        ("written", datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")),
    ]
    cells = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in rows)
    return f'<h2>Summary</h2><table class="kv">{cells}</table>'


def _served_note(data: dict) -> str:
    if not data["mode"].startswith("grpc://"):
        return ""
    return (
        '<p class="note">Served run (<code>--url</code>): the endpoints return neither the speculative '
        "step boundaries nor the target's logits, so divergences are <b>unclassified</b> and outputs are "
        "not split into steps. Run <code>trtspec verify SPEC</code> in process to class them.</p>"
    )


def _gates(data: dict) -> str:
    parts = []
    gate = data.get("acceptance_gate")
    if gate is not None:
        items = "".join(f"<li>{_e(line)}</li>" for line in gate["checks"])
        parts.append(f"<h2>Acceptance gate: {'passed' if gate['passed'] else 'FAILED'}</h2><ul>{items}</ul>")
    s = data.get("sampling")
    if s is not None:
        rows = [
            ("parameters", f"temperature {s['temperature']:g}, top_k {s['top_k']}, top_p {s['top_p']:g}, seed {s['seed']}"),
            ("samples", f"{s['samples_per_prompt']} per prompt x {s['prompts']} prompts, {s['tokens']} tokens tested"),
            ("test", _sampling_test_line(s)),
            ("PIT counts per bin", ", ".join(str(c) for c in s["bins"])),
            ("result", "consistent with the target's distribution" if s["passed"] else "NOT the target's distribution"),
        ]
        cells = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in rows)
        parts.append(f'<h2>Sampling check: {"passed" if s["passed"] else "FAILED"}</h2><table class="kv">{cells}</table>')
    return "\n".join(parts)


def _sampling_test_line(s: dict) -> str:
    line = f"chi-square {s['chi2']:.2f} on {s['dof']} dof, p = {s['p_value']:.4g}, false-alarm rate {s['false_alarm_rate']:g}"
    return line + (f" ({s['test']})" if s.get("test") else "")


def _divergence_table(data: dict) -> str:
    bad = [r for r in data["results"] if r["divergence"]]
    if not bad:
        return ""
    rows = []
    for r in bad:
        d = r["divergence"]
        v = d.get("verdict") or {}
        cls = v.get("verdict", "unclassified")
        rows.append(
            f'<tr><td><a href="#prompt-{r["index"]}">#{r["index"]}</a></td><td>{d["index"]}</td>'
            f"<td>{_tok_cell(d['target_id'], d['target_text'])}</td><td>{_tok_cell(d['spec_id'], d['spec_text'])}</td>"
            f"<td>{_num(d['target_margin'])}</td>"
            f'<td><span class="badge {cls}">{_e(cls)}</span></td><td>{_e(v.get("reason", ""))}</td></tr>'
        )
    head = (
        "<tr><th>prompt</th><th>position</th><th>target-only token</th><th>speculative token</th>"
        "<th>target top-2 margin</th><th>verdict</th><th>reason</th></tr>"
    )
    return f'<h2 id="divergences">First divergences</h2><table class="divergences">{head}{"".join(rows)}</table>'


def _tok_cell(tok: int | None, text: str) -> str:
    return f'<mark class="div">{_e(_visible(text))}</mark> <small>{"end" if tok is None else f"id {tok}"}</small>'


def _legend() -> str:
    return (
        '<p class="legend"><span><span class="t s0">step</span><span class="t s1">shading</span>: the speculative '
        'step (one target forward) that emitted each token</span><span><mark class="div">token</mark>: first '
        'divergence</span><span><span class="t after">greyed</span>: after it</span></p>'
    )


def _prompt(r: dict, text: Callable[[int], str], mode: str) -> str:
    d = r["divergence"]
    cls = (d.get("verdict") or {}).get("verdict", "unclassified") if d else "identical"
    at = d["index"] if d else None
    m = r["metrics"]
    figures = (
        f"{r['target_tokens']} / {r['spec_tokens']} tokens (target-only / speculative)"
        + (f"; acceptance {m['acceptance_rate']:.3f} ({m['accepted']}/{m['drafted']})" if m else "")
        + (f"; mean acceptance length {m['mean_acceptance_length']:.2f}" if m else "")
    )
    notes = []
    if m and m["drafted"] and not r["spec_steps"]:
        notes.append(f"{mode} reports no step boundaries: the speculative output is not split into steps.")
    if m and m["drafted"] and not m["per_position_rate"]:
        notes.append(f"{mode} reports whole-request acceptance totals only: no per-position counts.")
    parts = [
        f'<section class="prompt {"diverged" if d else "identical"}" id="prompt-{r["index"]}">',
        f'<h3>Prompt #{r["index"]} <span class="badge {cls}">{_e("identical" if not d else cls)}</span></h3>',
        f'<div class="text">{_e(r["prompt"])}</div>',
        f"<p>{_e(figures)}</p>",
        *(f'<p class="note">{_e(n)}</p>' for n in notes),
        "<h3>target-only</h3>",
        f'<div class="out target">{_tokens(r["target_ids"], text, at, [])}</div>',
        "<h3>speculative</h3>",
        f'<div class="out speculative">{_tokens(r["spec_ids"], text, at, r["spec_steps"])}</div>',
    ]
    if d:
        parts.append(_verdict(d))
    parts.append("</section>")
    return "\n".join(parts)


def _tokens(ids: list[int], text: Callable[[int], str], at: int | None, steps: list) -> str:
    """Each token a span; the one at the first divergence a <mark>; a path that ended there
    gets an <end> mark."""
    step_of = _step_index(steps, len(ids))
    spans = []
    for i, tok in enumerate(ids):
        cls = ["t"]
        title = f"output {i}: id {tok}"
        if step_of is not None:
            cls.append(f"s{step_of[i] % 2}")
            title += f", step {step_of[i]} (drafted {steps[step_of[i]][1]})"
        if at is not None and i > at:
            cls.append("after")
        tag = "mark" if i == at else "span"
        if i == at:
            cls.append("div")
        spans.append(f'<{tag} class="{" ".join(cls)}" title="{_e(title)}">{_e(_visible(text(tok)))}</{tag}>')
    if at is not None and at >= len(ids):
        spans.append('<mark class="t div" title="this path ended here">&lt;end&gt;</mark>')
    return "".join(spans)


def _step_index(steps: list, n: int) -> list[int] | None:
    """The step that emitted each output token, from the steps' first output indices."""
    if not steps:
        return None
    owner, j = [], 0
    for i in range(n):
        while j + 1 < len(steps) and steps[j + 1][0] <= i:
            j += 1
        owner.append(j)
    return owner


def _verdict(d: dict) -> str:
    v = d.get("verdict") or {}
    cls = v.get("verdict", "unclassified")
    rows = [
        ("class", cls),
        ("reason", v.get("reason", "")),
        ("position", str(d["index"])),
        ("target-only token", _tok_line(d["target_id"], d["target_text"])),
        ("speculative token", _tok_line(d["spec_id"], d["spec_text"])),
        ("target top-2 margin (target-only run)", _num(d["target_margin"])),
        ("target top-2 margin (speculative run)", _num(d["spec_margin"])),
        ("epsilon", _num(v.get("epsilon"))),
        *((f"evidence: {k}", _num(x) if isinstance(x, float) else str(x)) for k, x in sorted(v.get("evidence", {}).items())),
    ]
    cells = "".join(f"<tr><th>{_e(k)}</th><td>{_e(x)}</td></tr>" for k, x in rows)
    return f'<h3>Verdict: <span class="badge {cls}">{_e(cls)}</span></h3><table class="kv verdict">{cells}</table>'


def _tok_line(tok: int | None, text: str) -> str:
    return "<end> (the path had ended)" if tok is None else f"{_visible(text)!r} (id {tok})"


# ----------------------------------------------------------------------- plots


def _plots(data: dict) -> str:
    figures = []
    with_pos = [r for r in data["results"] if r["metrics"] and r["metrics"]["per_position_rate"]]
    if with_pos:
        figures.append(
            _figure(
                _per_position_svg(data["metrics"]["per_position_rate"], with_pos),
                "Acceptance per draft position: P(draft i accepted | drafted), all prompts (bars) and each prompt (dots).",
            )
        )
    with_metrics = [r for r in data["results"] if r["metrics"]]
    if with_metrics:
        figures.append(
            _figure(
                _per_prompt_svg(with_metrics),
                "Per prompt: acceptance rate (bars; red: diverged) and mean acceptance length (line, right axis).",
            )
        )
    note = ""
    if not with_pos:
        note = f'<p class="note">{_e(data["mode"])} reported no per-position acceptance counts: no per-position plot.</p>'
    if not figures:
        return "<h2>Acceptance</h2>" + note
    return "<h2>Acceptance</h2>" + note + '<div class="plots">' + "".join(figures) + "</div>"


def _figure(svg: str, caption: str) -> str:
    return f"<figure>{svg}<figcaption>{_e(caption)}</figcaption></figure>"


def _per_position_svg(overall: list[float], results: list[dict]) -> str:
    fig, ax = _axes("per-position")
    xs = list(range(1, len(overall) + 1))
    ax.bar(xs, overall, color="#4c78a8", label="all prompts")
    for r in results:
        rates = r["metrics"]["per_position_rate"]
        ax.plot(range(1, len(rates) + 1), rates, "o", color="#f58518", alpha=0.6, markersize=4)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_xticks(xs)
    ax.set_ylim(0, 1.05)
    return _svg(fig, "per-position")


def _per_prompt_svg(results: list[dict]) -> str:
    fig, ax = _axes("per-prompt")
    xs = [r["index"] for r in results]
    colors = ["#d9534f" if r["divergence"] else "#4c78a8" for r in results]
    ax.bar(xs, [r["metrics"]["acceptance_rate"] for r in results], color=colors)
    ax.set_xlabel("prompt #")
    ax.set_ylabel("acceptance rate")
    ax.set_xticks(xs)
    ax.set_ylim(0, 1.05)
    right = ax.twinx()
    right.plot(xs, [r["metrics"]["mean_acceptance_length"] for r in results], "o-", color="#222")
    right.set_ylabel("mean acceptance length")
    right.set_ylim(0, 1.1 * max(r["metrics"]["mean_acceptance_length"] for r in results) + 0.1)
    return _svg(fig, "per-prompt")


def _axes(name: str):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.0, 3.2), dpi=100, layout="constrained")  # no pyplot: no global state
    return fig, fig.subplots()


def _svg(fig, name: str) -> str:
    import matplotlib

    buf = io.StringIO()
    # A fixed salt per plot: reproducible ids that do not collide between the page's plots.
    with matplotlib.rc_context({"svg.hashsalt": f"trtspec-{name}", "svg.fonttype": "path"}):
        fig.savefig(buf, format="svg", metadata={"Date": None})
    text = buf.getvalue()
    return text[text.index("<svg") :]  # drop the XML prolog and DOCTYPE: inline in HTML


# ----------------------------------------------------------------------- text


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _visible(text: str) -> str:
    """A token's text as shown: an empty decode would vanish from the page."""
    return text if text else "\u2205"


def _num(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4g}"


def _opt(x: object) -> str:
    return "default" if x is None else str(x)

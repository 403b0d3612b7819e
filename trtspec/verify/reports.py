"""Verify's reports for people and CI: the terminal table and JUnit XML (the JSON is
VerifyReport.to_dict; the HTML page is verify/html_report.py)."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

from trtspec.files import write_text_atomic
from trtspec.speculative.metrics import node_rates_text
from trtspec.verify.identity import Divergence, PromptResult, VerifyReport


def render_table(report: VerifyReport, console) -> None:
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"trtspec verify: {report.spec_name} ({report.mode}, max_tokens {report.max_tokens})")
    for col in ("#", "prompt", "identical", "tokens", "accepted/drafted", "mean acc. len", "first divergence"):
        table.add_column(col, overflow="fold")
    for r in report.results:
        m = r.metrics
        table.add_row(
            str(r.index),
            Text(_short(r.prompt, 40)),
            "yes" if r.identical else _verdict_cell(r.divergence),
            f"{r.target_tokens}/{r.spec_tokens}",
            f"{m.accepted}/{m.drafted}" if m else "-",
            f"{m.mean_acceptance_length:.2f}" if m else "-",
            Text(r.divergence.describe()) if r.divergence else "",
        )
    console.print(table)
    m = report.metrics
    n_bad = sum(not r.identical for r in report.results)
    verdict = (
        "all identical"
        if report.identical
        else (
            f"[red]{n_bad} of {len(report.results)} diverged[/red] ("
            + ", ".join(f"{report.count(v)} {v}" for v in ("numerical", "algorithmic", "unclassified") if report.count(v))
            + ")"
        )
    )
    console.print(
        f"{len(report.results)} prompts: {verdict} | acceptance rate {m.acceptance_rate:.3f} "
        f"({m.accepted}/{m.drafted}) | mean acceptance length {m.mean_acceptance_length:.2f} "
        f"tokens/target forward | per-position "
        f"[{', '.join(f'{x:.2f}' for x in m.per_position_rate)}]"
    )
    if m.node_drafted:  # draft trees: positions are depths; each node's own acceptance
        console.print(f"per tree node (ranks from the root) [{node_rates_text(m.node_rate)}]")
    console.print(
        f"target-only {report.tokens_per_second('target'):.1f} tok/s | speculative "
        f"{report.tokens_per_second('speculative'):.1f} tok/s | speedup {report.speedup:.2f}x"
    )


def _verdict_cell(div: Divergence) -> str:
    if div.verdict_class == "numerical":
        return "[yellow]NO (numerical)[/yellow]"
    return f"[red]NO ({div.verdict_class})[/red]"


def _short(text: str, n: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"


def write_junit(report: VerifyReport, path: Path, fail_on: str = "any") -> None:
    """One testcase per prompt; a divergence is a failure (type = its verdict class) with its
    description. With ``fail_on="algorithmic"`` a numerical divergence passes and is
    described in the testcase's system-out."""

    def failed(r: PromptResult) -> bool:
        return r.divergence is not None and (fail_on == "any" or r.divergence.verdict_class != "numerical")

    failures = sum(failed(r) for r in report.results)
    suite = ET.Element(
        "testsuite",
        name=f"trtspec.verify.{report.spec_name}",
        tests=str(len(report.results)),
        failures=str(failures),
        errors="0",
        time=f"{sum(r.target_seconds + r.spec_seconds for r in report.results):.3f}",
    )
    for r in report.results:
        case = ET.SubElement(
            suite,
            "testcase",
            classname=f"trtspec.verify.{report.spec_name}",
            name=f"prompt_{r.index}",
            time=f"{r.target_seconds + r.spec_seconds:.3f}",
        )
        if r.divergence:
            props = ET.SubElement(case, "properties")
            ET.SubElement(props, "property", name="verdict", value=r.divergence.verdict_class)
            if r.divergence.verdict:
                for key, value in r.divergence.verdict.evidence.items():
                    ET.SubElement(props, "property", name=key, value=str(value))
        if failed(r):
            fail = ET.SubElement(case, "failure", message=r.divergence.describe(), type=r.divergence.verdict_class)
            fail.text = f"prompt: {r.prompt}\n{r.divergence.describe()}"
        out = ET.SubElement(case, "system-out")
        out.text = f"prompt: {r.prompt}\ntokens: target {r.target_tokens}, speculative {r.spec_tokens}"
        if r.divergence and not failed(r):
            out.text += f"\ntolerated divergence: {r.divergence.describe()}"
    root = ET.Element("testsuites")
    root.append(suite)
    data = ET.tostring(root, encoding="unicode", xml_declaration=True)
    write_text_atomic(path, data + "\n")

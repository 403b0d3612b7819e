"""The documents' figures, generated from the committed result files.

    python -m lab.figures            # rewrite every figure block of README.md, docs/performance.md and lab/RECORDS.md (make figures)
    python -m lab.figures --check    # exit 1 and name each block that differs from what the results give
    python -m lab.figures --record NAME --from .trtspec/bench/SPEC/bench.json --command "trtspec bench ..."
                                       # a run's own JSON as the result file lab/results/NAME.json

A figure block in a document is a marked region:

    <!-- figures: NAME -->
    ...generated: never edit by hand...
    <!-- /figures: NAME -->

Its text is the template of the same NAME in lab/figures.md (same markers), with every
placeholder {{RESULT.PATH:FORMAT}} replaced by a value of lab/results/RESULT.json
(lab/_common.py describes the file):

    {{demo-draft-int4.command}}                    the file's command, machine, time or stale
    {{demo-draft-int4.target.tokens_per_s:.1f}}    a measured value (a path into "values"; list items by index)
    {{demo-draft-int4.costs.target_step*1e3:.1f}}  the same, times a factor (seconds to ms)
    {{demo-draft-int4.target.tokens_per_s / neighbour-busy.target.tokens_per_s:.2f}}  the ratio of two values
    {{xeon-break-even.costs.verify_cost + xeon-break-even.costs.cost_ratio*3:.2f}}    the sum of two (a factor each)
    {{demo-draft-int4.metrics.per_position_rate:.2f}}  a list: each item formatted, joined by ", "
    {{peers-hf.table:table}}                       {"columns": [...], "rows": [[...]]} as a Markdown table
    {{run.a / run.b:met>=2}}                       a goal's verdict: "met" when the value is >= 2, else "missed"
                                                   (met<=X: met when <= X)

A block that uses a stale result file ends with a line saying so. Adding a figure: get the
result file (the bench scripts write one with --out/--json; `trtspec bench`'s bench.json goes
through --record; a figure measured by hand: the same four keys written by hand), add its
template to lab/figures.md and an empty region with its name where the document shows it,
then run `make figures`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

from lab._common import RESULTS, ROOT, Result
from trtspec.files import write_json_atomic

DOCUMENTS = (ROOT / "README.md", ROOT / "docs" / "performance.md", ROOT / "lab" / "RECORDS.md")
TEMPLATES = ROOT / "lab" / "figures.md"
EXIT_DIFFERS = 1
EXIT_USAGE = 2

REGION = re.compile(r"<!-- figures: (?P<name>[\w.-]+) -->\n(?P<body>.*?)<!-- /figures: (?P=name) -->", re.S)
PLACEHOLDER = re.compile(r"\{\{(?P<expr>[^{}:]+?)(?::(?P<fmt>[^{}]*))?\}\}")
REFERENCE = re.compile(r"(?P<file>[\w-]+)\.(?P<path>[^*]+?)(?:\*(?P<factor>[0-9.e+-]+))?")
TOP_LEVEL = ("command", "machine", "time", "stale")


class FigureError(Exception):
    """A template, region or result file that cannot give a figure; the message says which."""


def regions(text: str) -> dict[str, str]:
    """NAME -> body of every marked region in ``text``; a name twice is an error."""
    found: dict[str, str] = {}
    for m in REGION.finditer(text):
        if m["name"] in found:
            raise FigureError(f"figure block {m['name']!r} is marked twice; give each block its own name")
        found[m["name"]] = m["body"]
    return found


class Results:
    """The result files a rendering reads, each read once."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.cache: dict[str, Result] = {}

    def get(self, name: str) -> Result:
        if name not in self.cache:
            path = self.folder / f"{name}.json"
            if not path.is_file():
                raise FigureError(f"no result file {path}; write it (lab/_common.py: write_result) or fix the name")
            try:
                self.cache[name] = Result.read(path)
            except (ValueError, json.JSONDecodeError) as e:
                raise FigureError(str(e)) from None
        return self.cache[name]

    def value(self, name: str, path: str):
        result = self.get(name)
        parts = path.split(".")
        if parts[0] in TOP_LEVEL:
            node, rest = getattr(result, parts[0]), parts[1:]
        else:
            node, rest = result.values, parts
        for i, part in enumerate(rest):
            try:
                node = node[int(part)] if isinstance(node, list) else node[part]
            except (KeyError, IndexError, ValueError, TypeError):
                where = ".".join(rest[: i + 1])
                raise FigureError(f"{name}.json has no value {where!r}; fix the template's path or the result file") from None
        if node is None:
            raise FigureError(f"{name}.json: {path!r} is empty (null); a figure needs a value")
        return node


VERDICT = re.compile(r"met(?P<op>>=|<=)(?P<goal>[0-9.]+)")


def _format(value, fmt: str | None) -> str:
    if fmt == "table":
        return markdown_table(value)
    verdict = VERDICT.fullmatch(fmt or "")
    if verdict:
        goal = float(verdict["goal"])
        return "met" if (value >= goal if verdict["op"] == ">=" else value <= goal) else "missed"
    if isinstance(value, list):
        return ", ".join(_format(v, fmt) for v in value)
    return format(value, fmt or "")


def markdown_table(table: dict) -> str:
    """{"columns": [...], "rows": [[...], ...], "align": "lrr..." (optional)} as Markdown."""
    columns, rows = table["columns"], table["rows"]
    align = table.get("align", "l" * len(columns))
    rule = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join(rule) + "|"]
    for row in rows:
        if len(row) != len(columns):
            raise FigureError(f"table row {row!r} has {len(row)} cells for {len(columns)} columns")
        lines.append("| " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(lines)


def evaluate(expr: str, results: Results, used: list[str]):
    """One reference (RESULT.PATH, optionally *FACTOR), the ratio of two (A / B) or their sum (A + B)."""
    op = " + " if " + " in expr else " / "
    refs = expr.split(op)
    if len(refs) > 2 or (op == " + " and " / " in expr):
        raise FigureError(f"{{{{{expr}}}}}: a placeholder holds one value, the ratio of two or the sum of two")
    values = []
    for ref in refs:
        m = REFERENCE.fullmatch(ref.strip())
        if m is None:
            raise FigureError(f"{{{{{expr}}}}} is no placeholder; write {{{{RESULT.PATH:FORMAT}}}} or {{{{A / B:FORMAT}}}}")
        if m["file"] not in used:
            used.append(m["file"])
        value = results.value(m["file"], m["path"])
        values.append(value * float(m["factor"]) if m["factor"] else value)
    if len(values) == 1:
        return values[0]
    return values[0] + values[1] if op == " + " else values[0] / values[1]


def render(template: str, results: Results) -> str:
    """The template with every placeholder filled, plus a line per stale result file it uses."""
    used: list[str] = []
    text = PLACEHOLDER.sub(lambda m: _format(evaluate(m["expr"], results, used), m["fmt"]), template).rstrip("\n")
    if "{{" in text:
        raise FigureError(f"unfilled placeholder near {text[text.index('{{') :][:60]!r}; write it as {{{{RESULT.PATH:FORMAT}}}}")
    for name in used:
        if results.get(name).stale:
            text += f"\n\n*Stale ({name}.json): {results.get(name).stale}; to be measured again with its command.*"
    return text + "\n"


def generate(documents=DOCUMENTS, templates: Path = TEMPLATES, results_dir: Path = RESULTS) -> dict[Path, str]:
    """Each document's text with its figure blocks as the results give them."""
    tmpl = regions(templates.read_text(encoding="utf-8"))
    results = Results(results_dir)
    out, shown = {}, set()
    for doc in documents:
        text = doc.read_text(encoding="utf-8")

        def fill(m: re.Match, doc=doc) -> str:
            name = m["name"]
            if name not in tmpl:
                raise FigureError(f"{doc.name}: figure block {name!r} has no template in {templates.name}; add one")
            try:
                body = render(tmpl[name], results)
            except FigureError as e:
                raise FigureError(f"{doc.name}, figure block {name!r}: {e}") from None
            shown.add(name)
            return f"<!-- figures: {name} -->\n{body}<!-- /figures: {name} -->"

        out[doc] = REGION.sub(fill, text)
    unused = sorted(set(tmpl) - shown)
    if unused:
        raise FigureError(f"templates no document shows: {', '.join(unused)}; add their regions or remove them")
    return out


def differing(documents=DOCUMENTS, templates: Path = TEMPLATES, results_dir: Path = RESULTS) -> list[str]:
    """'document: block' for each figure block whose text is not what the results give."""
    out = []
    for doc, text in generate(documents, templates, results_dir).items():
        want, have = regions(text), regions(doc.read_text(encoding="utf-8"))
        out += [f"{doc.name}: {name}" for name in want if have[name] != want[name]]
    return out


def record(name: str, source: Path, command: str, machine: str | None = None, results_dir: Path = RESULTS) -> Path:
    """lab/results/NAME.json from a run's own JSON (trtspec bench's bench.json, say): its values
    as they are, the command given, the machine line it carries (or ``machine``), its file time."""
    try:
        values = json.loads(source.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise FigureError(f"cannot read {source} as JSON ({e}); point --from at the run's JSON output") from None
    machine = machine or (values.get("machine") if isinstance(values, dict) else None)
    if not isinstance(machine, str) or not machine:
        raise FigureError(f"{source} carries no machine line; pass --machine '...' (trtspec.machine.description() where it ran)")
    when = time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime(source.stat().st_mtime))
    out = results_dir / f"{name}.json"
    write_json_atomic(out, Result(command, machine, when, values).to_dict())
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a block differs from the results")
    ap.add_argument("--record", metavar="NAME", help="write lab/results/NAME.json from --from's JSON, then stop")
    ap.add_argument(
        "--from", dest="source", type=Path, help="with --record: the run's JSON (e.g. .trtspec/bench/SPEC/bench.json)"
    )
    ap.add_argument("--command", help="with --record: the command that produced it")
    ap.add_argument("--machine", help="with --record: the machine line, where the JSON carries none")
    ap.add_argument("--results", type=Path, default=RESULTS, help="with --record: the folder to write NAME.json in")
    args = ap.parse_args(argv)
    try:
        if args.record:
            if not (args.source and args.command):
                raise FigureError("--record needs --from FILE and --command '...'")
            print(f"wrote {record(args.record, args.source, args.command, args.machine, args.results)}")
            return 0
        if args.check:
            stale = differing()
            for line in stale:
                print(f"differs from the results: {line} (run `make figures`)", file=sys.stderr)
            return EXIT_DIFFERS if stale else 0
        for doc, text in generate().items():
            if doc.read_text(encoding="utf-8") != text:
                doc.write_text(text, encoding="utf-8")
                print(f"wrote {doc.relative_to(ROOT)}")
    except FigureError as e:
        print(f"Error: {e}", file=sys.stderr)
        return EXIT_USAGE
    return 0


if __name__ == "__main__":
    sys.exit(main())

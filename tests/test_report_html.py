"""`verify --html`: the page, opened in a real headless browser (Debian's chromium).

The browser loads the file as a user would (file://), takes a screenshot, and dumps the DOM
it built; the tests read that DOM, not the page's source: the divergence must be a <mark>
at the right token in both outputs, its verdict and evidence in the page, model text must
stay text (no element made from it), and nothing may be loaded from anywhere.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
from conftest import built_spec
from test_verdict_mutations import LOOP_MUTANTS, mutate
from test_verify_gates import near_tie_flips
from typer.testing import CliRunner

import trtspec.runtime as runtime
import trtspec.speculative.loop as loop
from trtspec.cli.app import app
from trtspec.speculative.loop import PathRun
from trtspec.speculative.metrics import SpecMetrics
from trtspec.verify import html_report
from trtspec.verify.backends import InProcessBackend
from trtspec.verify.identity import run_verify

runner = CliRunner()
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_browser = pytest.mark.skipif(
    CHROMIUM is None,
    reason="no headless browser: install Debian's chromium (`apt-get install -y chromium`; .ci/run does it)",
)
HOSTILE = "<script>alert(1)</script> <img src=x onerror=alert(2)> & \"quoted\" 'x'"
HIGHLIGHT = (255, 210, 77)  # mark.div's background in html_report's CSS


# ----------------------------------------------------------------------- the browser


def chromium(page: Path, profile: Path, *args: str) -> str:
    """Run headless chromium on ``page``; its stdout. No network: loopback-free flags, a
    throw-away profile, and the page's own CSP forbids loading anything."""
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        *args,
        page.resolve().as_uri(),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def screenshot(page: Path, tmp: Path):
    """The page as the browser drew it: an [h, w, 3] uint8 array from a real PNG."""
    import numpy as np
    from PIL import Image

    png = tmp / "page.png"
    chromium(page, tmp / "profile-shot", f"--screenshot={png}", "--window-size=1200,2000")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(png) as im:
        assert im.size == (1200, 2000)
        return np.asarray(im.convert("RGB"))


class Node:
    def __init__(self, tag: str, attrs: dict, parent: Node | None):
        self.tag, self.attrs, self.parent, self.children, self.parts = tag, attrs, parent, [], []

    @property
    def classes(self) -> set[str]:
        return set((self.attrs.get("class") or "").split())

    def text(self) -> str:
        return "".join(p if isinstance(p, str) else p.text() for p in self.parts)

    def find_all(self, tag: str, cls: str | None = None) -> list[Node]:
        out = []
        for c in self.children:
            if c.tag == tag and (cls is None or cls in c.classes):
                out.append(c)
            out += c.find_all(tag, cls)
        return out

    def by_id(self, ident: str) -> Node | None:
        for c in self.children:
            if c.attrs.get("id") == ident:
                return c
            found = c.by_id(ident)
            if found:
                return found
        return None


class Dom(HTMLParser):
    """The browser's serialized DOM back as a tree (text with entities decoded)."""

    VOID = {"meta", "br", "img", "input", "link", "hr", "col", "source", "area", "base", "wbr", "embed"}

    def __init__(self, markup: str):
        super().__init__(convert_charrefs=True)
        self.root = self.cur = Node("#root", {}, None)
        self.feed(markup)
        self.close()

    def handle_starttag(self, tag, attrs):
        node = Node(tag, dict(attrs), self.cur)
        self.cur.children.append(node)
        self.cur.parts.append(node)
        if tag not in self.VOID:
            self.cur = node

    def handle_startendtag(self, tag, attrs):
        node = Node(tag, dict(attrs), self.cur)
        self.cur.children.append(node)
        self.cur.parts.append(node)

    def handle_endtag(self, tag):
        node = self.cur
        while node is not self.root and node.tag != tag:
            node = node.parent
        if node is not self.root:
            self.cur = node.parent

    def handle_data(self, data):
        self.cur.parts.append(data)


def dom_of(page: Path, tmp: Path) -> Node:
    return Dom(chromium(page, tmp / "profile-dom", "--dump-dom")).root


def assert_divergences_marked(root: Node, data: dict) -> None:
    """Each diverged prompt: one <mark> per output, at the divergence, with the token's text,
    and its verdict with class and evidence; identical prompts: no mark."""
    assert root.find_all("script") == [] and root.find_all("img") == [] and root.find_all("link") == []
    for r in data["results"]:
        section = root.by_id(f"prompt-{r['index']}")
        assert section is not None, r["index"]
        marks = section.find_all("mark", "div")
        d = r["divergence"]
        if d is None:
            assert marks == [] and "identical" in section.classes
            continue
        (target_out,) = section.find_all("div", "target")
        (spec_out,) = section.find_all("div", "speculative")
        for out, tok, text in ((target_out, d["target_id"], d["target_text"]), (spec_out, d["spec_id"], d["spec_text"])):
            (mark,) = out.find_all("mark", "div")
            assert mark.text() == (text or "\u2205")
            if tok is not None:
                assert mark.attrs["title"].startswith(f"output {d['index']}: id {tok}")
                spans = out.find_all("span", "t")
                assert len(spans) + 1 == len(r["target_ids"] if out is target_out else r["spec_ids"])
                assert all("after" in s.classes for s in spans[d["index"] :])  # greyed after it
        verdict = d["verdict"]
        (table,) = section.find_all("table", "verdict")
        rows = {tr.find_all("th")[0].text(): tr.find_all("td")[0].text() for tr in table.find_all("tr")}
        assert rows["class"] == verdict["verdict"] and rows["reason"] == verdict["reason"]
        assert rows["position"] == str(d["index"])
        for key, value in verdict["evidence"].items():
            shown = rows[f"evidence: {key}"]
            assert shown == (f"{value:.4g}" if isinstance(value, float) else str(value))
        badge = section.find_all("h3")[0].find_all("span", "badge")[0]
        assert badge.text() == verdict["verdict"]


def assert_drawn(pixels) -> None:
    """A real rendering: not one flat colour, and the divergence highlight is on screen."""
    assert pixels.std() > 20
    highlight = (abs(pixels.astype(int) - HIGHLIGHT).sum(axis=-1) < 12).sum()
    assert highlight > 100, "no highlighted divergence visible in the screenshot"


# ----------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def spec_file(tmp_path_factory, tiny_ckpts):
    return built_spec(tmp_path_factory, tiny_ckpts, "html", **{"verify.max_tokens": 12})


@needs_browser
def test_numerical_divergences_in_the_browser_beside_json_and_junit(spec_file, tmp_path, monkeypatch):
    near_tie_flips(monkeypatch, delta=2.0)
    page, j, x = tmp_path / "out" / "report.html", tmp_path / "out" / "r.json", tmp_path / "out" / "r.xml"
    args = ["verify", str(spec_file), "--tie-epsilon", "4", "--max-tokens", "12", "-p", HOSTILE, "-p", "The quick brown fox"]
    r = runner.invoke(app, [*args, "--json-file", str(j), "--junit", str(x), "--html", str(page)])
    assert r.exit_code == 1, r.output
    assert sorted(p.name for p in page.parent.iterdir()) == ["r.json", "r.xml", "report.html"]  # no temp left
    data = json.loads(j.read_text())
    assert data["verdicts"]["numerical"] == data["diverged"] > 0
    root = dom_of(page, tmp_path)
    assert_divergences_marked(root, data)
    banner = root.find_all("div", "banner")[0]
    assert "fail" in banner.classes and banner.text().startswith("FAILED")
    # The hostile prompt is text on the page, exactly as given, and made no element.
    assert root.by_id("prompt-0").find_all("div", "text")[0].text() == HOSTILE
    assert len(root.find_all("svg")) == 2  # acceptance per position, per prompt
    assert_drawn(screenshot(page, tmp_path))

    # --fail-on algorithmic tolerates them: the page says PASSED, and still shows them.
    r = runner.invoke(app, [*args, "--fail-on", "algorithmic", "--html", str(page)])
    assert r.exit_code == 0, r.output
    root = dom_of(page, tmp_path)
    assert root.find_all("div", "banner")[0].text().startswith("PASSED")
    assert len(root.find_all("mark", "div")) >= 2


@needs_browser
def test_algorithmic_bug_in_the_browser(built, tmp_path, monkeypatch):
    dep = built()
    mutant = mutate(loop, *LOOP_MUTANTS["draft_token_emitted_unverified"])
    monkeypatch.setattr(runtime, "generate", mutant.generate)
    backend = InProcessBackend(dep)
    report = run_verify(backend, ["The quick brown fox", "def fibonacci(n):"], 12, "tiny")
    data = report.to_dict()
    assert data["verdicts"]["algorithmic"] == data["diverged"] > 0
    page = tmp_path / "report.html"
    html_report.write(page, data, backend.token_text, machine="test", fail_on="any", passed=report.passes("any"))
    root = dom_of(page, tmp_path)
    assert_divergences_marked(root, data)
    steps = data["results"][0]["spec_steps"]
    assert steps, "in-process runs record their steps"
    spec_spans = root.by_id("prompt-0").find_all("div", "speculative")[0].find_all("span", "t")
    assert "step 1 " in spec_spans[steps[1][0]].attrs["title"]  # tokens carry their step
    assert_drawn(screenshot(page, tmp_path))


class ServedLike:
    """A backend like the gRPC one: no classify, no step boundaries, no margins."""

    def __init__(self, backend):
        self.inner = backend

    def run(self, prompt, max_tokens, speculative):
        res = self.inner.run(prompt, max_tokens, speculative)
        return PathRun(res.output_ids, [None] * len(res.output_ids), res.metrics, res.seconds)

    def token_text(self, tok):
        return self.inner.token_text(tok)

    def decided_draft_tokens(self):
        return self.inner.decided_draft_tokens()


@needs_browser
def test_served_run_is_unclassified_and_says_what_is_missing(built, tmp_path, monkeypatch):
    dep = built()
    mutant = mutate(loop, *LOOP_MUTANTS["draft_token_emitted_unverified"])
    monkeypatch.setattr(runtime, "generate", mutant.generate)
    backend = ServedLike(InProcessBackend(dep))
    report = run_verify(backend, ["The quick brown fox", "def fibonacci(n):"], 12, "tiny", mode="grpc://127.0.0.1:8001")
    data = report.to_dict()
    assert data["verdicts"]["unclassified"] == data["diverged"] > 0
    page = tmp_path / "report.html"
    html_report.write(page, data, backend.token_text, machine="test", fail_on="algorithmic", passed=False)
    root = dom_of(page, tmp_path)
    assert_divergences_marked(root, data)
    notes = " ".join(n.text() for n in root.find_all("p", "note"))
    assert "divergences are unclassified" in notes and "reports no step boundaries" in notes
    for r in data["results"]:  # no step shading
        assert root.by_id(f"prompt-{r['index']}").find_all("div", "speculative")[0].find_all("span", "s0") == []


def test_page_is_self_contained_and_escapes_model_text(tmp_path):
    data = _report_dict(token_text_of_divergence="<img src=x onerror=alert(1)>")
    evil = {7: "<script>alert(3)</script>", 8: '"><iframe src=//x>'}
    page = html_report.render(data, lambda t: evil.get(t, f"tok{t}"), machine="m & <n>", fail_on="any", passed=False)
    tags = re.findall(r"<[a-zA-Z][^>]*>", page)
    assert {t.split()[0].strip("<>").lower() for t in tags}.isdisjoint({"<script", "script", "img", "iframe", "link", "object"})
    # References only within the page (the plots' own clip paths and glyphs).
    refs = [v for t in tags for v in re.findall(r'(?:src|href)\s*=\s*"([^"]*)"', t)] + re.findall(r"url\(([^)]*)\)", page)
    assert refs and all(v.startswith("#") for v in refs), [v for v in refs if not v.startswith("#")]
    assert "@import" not in page
    assert "&lt;script&gt;alert(3)&lt;/script&gt;" in page and "&quot;&gt;&lt;iframe src=//x&gt;" in page
    assert "m &amp; &lt;n&gt;" in page
    assert "Content-Security-Policy" in page and "default-src 'none'" in page


def test_sampling_and_gate_sections(tmp_path):
    from trtspec.speculative.sampling import SamplingParams
    from trtspec.verify.sampling import SamplingCheck

    data = _report_dict()
    data["sampling"] = SamplingCheck(SamplingParams(0.8, top_p=0.9), 10, 5, [5] * 10, 0.0, 1.0).to_dict()
    data["acceptance_gate"] = {"passed": False, "checks": ["FAILED: acceptance rate on <set>: baseline 0.5 -> now 0.2"]}
    page = tmp_path / "r.html"
    html_report.write(page, data, str, machine="m", fail_on="any", passed=False)
    text = page.read_text()
    assert "Sampling check: passed" in text and "temperature 0.8, top_k 0, top_p 0.9" in text
    assert "Acceptance gate: FAILED" in text and "acceptance rate on &lt;set&gt;" in text


def test_html_path_that_is_a_folder_exit_2(spec_file, tmp_path):
    r = runner.invoke(app, ["verify", str(spec_file), "--html", str(tmp_path)])
    assert r.exit_code == 2 and "is a folder; give a file path" in r.output


def _report_dict(token_text_of_divergence: str = "b") -> dict:
    """A verify report's JSON for one diverged prompt (as run_verify would write it)."""
    m = SpecMetrics()
    m.record_step(3, 2)
    m.record_step(3, 0)
    return {
        "spec": "s",
        "max_tokens": 4,
        "num_draft_tokens": 3,
        "prompt_set": "--prompt",
        "prompt_set_sha256": "0" * 64,
        "prompts": 1,
        "mode": "in-process",
        "identical": False,
        "diverged": 1,
        "verdicts": {"numerical": 0, "algorithmic": 1, "unclassified": 0},
        "target_tokens_per_s": 1.0,
        "speculative_tokens_per_s": 1.0,
        "speedup": 1.0,
        "metrics": m.to_dict(),
        "results": [
            {
                "index": 0,
                "prompt": "<b>hi</b>",
                "identical": False,
                "target_tokens": 4,
                "spec_tokens": 4,
                "target_seconds": 1.0,
                "spec_seconds": 1.0,
                "divergence": {
                    "index": 3,
                    "target_id": 7,
                    "target_text": "<script>alert(3)</script>",
                    "spec_id": 8,
                    "spec_text": token_text_of_divergence,
                    "target_margin": 0.5,
                    "spec_margin": None,
                    "verdict": {"verdict": "algorithmic", "reason": "<because>", "epsilon": 0.01, "evidence": {"gap": 1.0}},
                },
                "metrics": m.to_dict(),
                "target_ids": [1, 2, 3, 7],
                "spec_ids": [1, 2, 3, 8],
                "spec_steps": [[0, 3], [3, 3]],
            }
        ],
    }

"""The documents' figures come from the committed result files (lab/figures.py): README.md's
and docs/performance.md's figure blocks must be exactly what lab/results/*.json give, and
the generator must catch a figure typed by hand, a missing value and a stale result."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT

from lab import figures

TEMPLATE = """<!-- figures: speed -->
```bash
{{run.command}}
```

Machine: {{run.machine}}. {{run.target.tokens_per_s:.1f}} vs {{run.speculative.tokens_per_s:.1f}} tok/s
({{run.speculative.tokens_per_s / run.target.tokens_per_s:.2f}}x); step {{run.costs.step*1e3:.1f}} ms; per position {{run.rates:.2f}}.

{{run.table:table}}
<!-- /figures: speed -->
"""


def _result(folder, name="run", stale=None, **values):
    data = {"command": "trtspec bench x.yaml", "machine": "x86_64 2 cores", "time": "2026-12-01T21:47Z", "values": values}
    if stale:
        data["stale"] = stale
    (folder / f"{name}.json").write_text(json.dumps(data))


@pytest.fixture
def site(tmp_path):
    """A document with one empty figure block, its template and its result file."""
    (tmp_path / "results").mkdir()
    _result(
        tmp_path / "results",
        target={"tokens_per_s": 23.04},
        speculative={"tokens_per_s": 30.13},
        costs={"step": 0.04209},
        rates=[0.98, 0.9],
        table={"columns": ["a", "b"], "rows": [["x", "1.00x"]], "align": "lr"},
    )
    (tmp_path / "figures.md").write_text(TEMPLATE)
    doc = tmp_path / "doc.md"
    doc.write_text("# Doc\n\n<!-- figures: speed -->\n<!-- /figures: speed -->\n\nAfter.\n")
    return tmp_path, doc


def _generate(tmp_path, doc):
    return figures.generate((doc,), tmp_path / "figures.md", tmp_path / "results")[doc]


def test_documents_match_their_result_files():
    """What CI checks: every figure block of README.md and docs/performance.md is what
    lab/results/*.json give (`make figures` rewrites them)."""
    assert figures.differing() == []


def test_check_command_exits_0_on_the_repository():
    out = subprocess.run([sys.executable, "-m", "lab.figures", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_a_block_is_filled_from_its_result_file(site):
    tmp_path, doc = site
    text = _generate(tmp_path, doc)
    assert "Machine: x86_64 2 cores. 23.0 vs 30.1 tok/s\n(1.31x); step 42.1 ms; per position 0.98, 0.90." in text
    assert "```bash\ntrtspec bench x.yaml\n```" in text
    assert "| a | b |\n|---|---:|\n| x | 1.00x |" in text
    assert text.startswith("# Doc\n\n<!-- figures: speed -->\n") and text.endswith("<!-- /figures: speed -->\n\nAfter.\n")
    assert "Stale" not in text


def test_a_figure_typed_by_hand_is_caught(site):
    tmp_path, doc = site
    doc.write_text(_generate(tmp_path, doc))
    assert figures.differing((doc,), tmp_path / "figures.md", tmp_path / "results") == []
    doc.write_text(doc.read_text().replace("30.1 tok/s", "31.0 tok/s"))
    assert figures.differing((doc,), tmp_path / "figures.md", tmp_path / "results") == ["doc.md: speed"]


def test_a_stale_result_says_so_in_every_block_that_uses_it(site):
    tmp_path, doc = site
    data = json.loads((tmp_path / "results" / "run.json").read_text())
    _result(tmp_path / "results", stale="measured before the engine got faster", **data["values"])
    text = _generate(tmp_path, doc)
    assert "*Stale (run.json): measured before the engine got faster; to be measured again with its command.*" in text


@pytest.mark.parametrize(
    "template, message",
    [
        ("{{run.target.tokens:.1f}}", "run.json has no value 'target.tokens'"),
        ("{{gone.x}}", "no result file"),
        ("{{run.target.tokens_per_s / run.costs.step / run.rates}}", "one value, the ratio of two or the sum of two"),
        ("{{run.costs.step + run.costs.step / run.rates}}", "one value, the ratio of two or the sum of two"),
        ("{{not a placeholder!}}", "is no placeholder"),
    ],
)
def test_a_template_that_cannot_be_filled_is_an_error_naming_the_block(site, template, message):
    tmp_path, doc = site
    (tmp_path / "figures.md").write_text(f"<!-- figures: speed -->\n{template}\n<!-- /figures: speed -->\n")
    with pytest.raises(figures.FigureError) as info:
        _generate(tmp_path, doc)
    assert "doc.md, figure block 'speed'" in str(info.value) and message in str(info.value)


def test_a_result_file_without_its_command_machine_or_time_is_refused(site):
    tmp_path, doc = site
    (tmp_path / "results" / "run.json").write_text(json.dumps({"values": {}}))
    with pytest.raises(figures.FigureError, match="no command, machine, time"):
        _generate(tmp_path, doc)


def test_a_block_without_a_template_and_a_template_without_a_block_are_errors(site):
    tmp_path, doc = site
    doc.write_text("<!-- figures: other -->\n<!-- /figures: other -->\n")
    with pytest.raises(figures.FigureError, match="'other' has no template"):
        _generate(tmp_path, doc)
    doc.write_text("no blocks\n")
    with pytest.raises(figures.FigureError, match="templates no document shows: speed"):
        _generate(tmp_path, doc)


def test_record_wraps_a_runs_own_json_as_a_result_file(tmp_path):
    run = tmp_path / "bench.json"
    run.write_text(json.dumps({"machine": "x86_64 2 cores", "speedup": 1.31}))
    out = figures.record("demo", run, "trtspec bench x.yaml --sweep none", results_dir=tmp_path)
    result = figures.Result.read(out)
    assert (result.command, result.machine, result.values) == (
        "trtspec bench x.yaml --sweep none",
        "x86_64 2 cores",
        {"machine": "x86_64 2 cores", "speedup": 1.31},
    )
    assert result.time.endswith("Z") and result.stale is None
    run.write_text(json.dumps({"speedup": 1.31}))
    with pytest.raises(figures.FigureError, match="carries no machine line; pass --machine"):
        figures.record("demo", run, "trtspec bench x.yaml", results_dir=tmp_path)
    assert figures.main(["--record", "demo"]) == figures.EXIT_USAGE


def test_a_goals_verdict_follows_the_measured_value(site):
    """A goal's met / missed is derived from the value it judges, so a re-measurement that
    crosses the goal changes the word with the number."""
    tmp_path, doc = site
    (tmp_path / "figures.md").write_text(
        "<!-- figures: speed -->\n"
        "{{run.speculative.tokens_per_s / run.target.tokens_per_s:met>=1.3}} "
        "{{run.speculative.tokens_per_s / run.target.tokens_per_s:met>=1.4}} "
        "{{run.costs.step:met<=0.05}} {{run.costs.step:met<=0.04}}\n"
        "<!-- /figures: speed -->\n"
    )
    assert "<!-- figures: speed -->\nmet missed met missed\n" in _generate(tmp_path, doc)


def test_a_sum_of_two_values_each_with_its_factor(site):
    tmp_path, doc = site
    (tmp_path / "figures.md").write_text(
        "<!-- figures: speed -->\n{{run.speculative.tokens_per_s + run.costs.step*1e3:.2f}}\n<!-- /figures: speed -->\n"
    )
    assert "<!-- figures: speed -->\n72.22\n" in _generate(tmp_path, doc)


def test_record_writes_into_the_folder_given(tmp_path):
    run = tmp_path / "bench.json"
    run.write_text(json.dumps({"machine": "x86_64 2 cores", "speedup": 1.31}))
    args = ["--record", "demo", "--from", str(run), "--command", "trtspec bench x.yaml", "--results", str(tmp_path / "r")]
    (tmp_path / "r").mkdir()
    assert figures.main(args) == 0
    assert figures.Result.read(tmp_path / "r" / "demo.json").values == {"machine": "x86_64 2 cores", "speedup": 1.31}


def test_the_heads_plot_is_drawn_from_the_committed_results(tmp_path):
    """lab/plot_heads.py reads every head's per-position acceptance from the result files
    (trtspec's ablation rows and the peer trainers' trtspec-scored rows) and draws them."""
    from lab import plot_heads

    data = plot_heads.heads()
    assert len(data) >= 4 and all(len(a) == 3 and all(0 <= x <= 1 for x in a) for a in data.values())
    assert any(label.startswith("speculators") for label in data)
    assert plot_heads.expected_lengths([0.5, 0.5]) == [1.5, 1.75]
    out = plot_heads.plot(data, tmp_path / "heads.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

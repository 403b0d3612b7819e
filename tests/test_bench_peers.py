"""The peers harness (trtspec/peers.py, bench/peers.py) on the tiny pair: every path runs,
the table lists them all, and greedy outputs agree token for token where they must."""

from __future__ import annotations

import importlib.util
import json

import pytest
from conftest import ROOT, write_spec

from trtspec.bench.peers import (
    Generation,
    PeerPath,
    Prompt,
    encode_prompts,
    measure,
    peer_paths,
    render_markdown,
    summarise,
)

ROWS = [("The quick brown fox", "chat"), ("Rewrite: Triton serves models over HTTP and gRPC.", "rewrite")]


@pytest.fixture(scope="module")
def tiny_measurement(built):
    dep = built("draft")
    paths, _ = peer_paths(dep)
    return measure(paths, encode_prompts(dep, ROWS), max_tokens=8)


def test_every_path_is_in_the_table(tiny_measurement):
    m = tiny_measurement
    keys = [key for key, _ in m.paths]
    assert keys == [
        "ours_target",
        "ours_draft_target",
        "ours_ngram",
        "hf_target",
        "hf_assisted",
        "hf_assisted_default",
        "hf_prompt_lookup",
    ]
    table = render_markdown(m, summarise(m))
    for _, label in m.paths:
        assert f"| {label} |" in table
    assert "HF assisted k=4: " in table  # the head-to-head line of the goal


def test_greedy_outputs_are_token_identical_to_ours(tiny_measurement):
    m = tiny_measurement
    assert len(m.runs) == len(ROWS) and not m.interrupted
    for runs in m.runs:
        assert runs["ours_target"].tokens == 8
        # Our speculative paths must match exactly; HF target-only on the float32 tiny model
        # is the same arithmetic, so it must match too.
        for key in ("ours_draft_target", "ours_ngram", "hf_target"):
            assert runs[key].identical, (key, runs[key].first_difference)
    by = {s.key: s for s in summarise(m)}
    assert by["ours_draft_target"].metrics["drafted"] > 0


def _fake(key: str, calls: list[str], interrupt_on: int | None = None) -> PeerPath:
    def run(ids, max_tokens):
        calls.append(key)
        if interrupt_on is not None and calls.count(key) == interrupt_on:
            raise KeyboardInterrupt
        return Generation(list(ids[:max_tokens]))

    return PeerPath(key, key, run)


def _prompts(n: int) -> list[Prompt]:
    return [Prompt(f"p{i}", "chat", [1, 2, 3]) for i in range(n)]


def test_order_rotates_per_prompt_after_one_warm_up_each():
    calls: list[str] = []
    paths = [_fake(k, calls) for k in ("ours_target", "b", "c")]
    measure(paths, _prompts(3), max_tokens=2)
    assert calls == ["ours_target", "b", "c"] + ["ours_target", "b", "c"] + ["b", "c", "ours_target"] + ["c", "ours_target", "b"]


def test_interrupt_keeps_the_prompts_every_path_completed():
    calls: list[str] = []
    # warm-up is call 1, prompt 1 is call 2: interrupt during the second prompt
    paths = [_fake("ours_target", calls), _fake("b", calls, interrupt_on=3)]
    m = measure(paths, _prompts(4), max_tokens=2, clock=iter(range(100)).__next__)
    assert m.interrupted and len(m.runs) == 1
    assert "1 of 4 prompts (interrupted)" in render_markdown(m, summarise(m))


def _load_cli():
    spec = importlib.util.spec_from_file_location("bench_peers", ROOT / "bench" / "peers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_writes_table_and_json(tmp_path, tiny_ckpts, built, capsys):
    dep = built("draft")  # builds the engines the spec below points at
    spec = write_spec(tmp_path, tiny_ckpts, "draft", output_dir=str(dep.target.folder.parent))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t, "kind": k}) + "\n" for t, k in ROWS))
    out = tmp_path / "results" / "peers.md"
    code = _load_cli().main(
        ["--spec", str(spec), "--prompts", str(prompts), "--max-tokens", "4", "--limit", "1", "--out", str(out)]
    )
    assert code == 0
    assert out.read_text() == capsys.readouterr().out
    data = json.loads(out.with_suffix(".json").read_text())
    assert len(data["prompts"]) == 1 and len(data["paths"]) == 7


def test_cli_rejects_a_bad_prompt_kind(tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi", "kind": "poetry"}) + "\n")
    code = _load_cli().main(["--spec", str(ROOT / "engine_specs" / "tiny-llama.yaml"), "--prompts", str(prompts)])
    assert code == 2
    assert "kind must be one of chat, code, rewrite (got 'poetry')" in capsys.readouterr().err


def test_interrupt_during_warm_up_reports_nothing_measured():
    calls: list[str] = []
    paths = [_fake("ours_target", calls, interrupt_on=1)]
    m = measure(paths, _prompts(2), max_tokens=2)
    assert m.interrupted and m.runs == []
    assert "Nothing measured" in render_markdown(m, summarise(m))


def test_repeats_keep_the_fastest_run():
    calls: list[str] = []
    ticks = iter([0, 5, 10, 12, 20, 27])  # three runs of one prompt: 5 s, 2 s, 7 s
    m = measure([_fake("ours_target", calls)], _prompts(1), max_tokens=2, repeats=3, clock=ticks.__next__)
    assert len(calls) == 1 + 3 and m.runs[0]["ours_target"].seconds == 2

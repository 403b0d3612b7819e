"""The peers harness (lab/peers.py, lab/peers_report.py, lab/peers_bench.py) on the tiny pair: every path runs,
the table lists them all, and greedy outputs agree token for token where they must."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
from conftest import ROOT, write_spec

from lab._common import Result
from lab.peers import (
    Generation,
    PeerPath,
    Prompt,
    _vllm_run,
    encode_prompts,
    measure,
    peer_paths,
    vllm_metrics,
)
from lab.peers_report import render_markdown, summarise
from trtspec.errors import EngineError
from trtspec.testing.vllm_worker import VllmWorker

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
    spec = importlib.util.spec_from_file_location("bench_peers", ROOT / "lab" / "peers_bench.py")
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
    (data,) = json.loads(out.with_suffix(".json").read_text())["values"]["results"]
    assert data["concurrency"] == 1 and len(data["prompts"]) == 1 and len(data["paths"]) == 7
    assert out.with_suffix(".png").read_bytes().startswith(b"\x89PNG")
    result = Result.read(out.with_suffix(".json"))  # a result file the documents' figures can cite
    assert result.command.startswith("python -m lab.peers_bench --spec ") and result.machine and result.time


def _cli_setup(tmp_path, tiny_ckpts, built) -> tuple[list[str], Path]:
    """Arguments naming a built tiny spec and the ROWS prompts, and the --out table path."""
    dep = built("draft")
    spec = write_spec(tmp_path, tiny_ckpts, "draft", output_dir=str(dep.target.folder.parent))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t, "kind": k}) + "\n" for t, k in ROWS))
    out = tmp_path / "peers.md"
    return ["--spec", str(spec), "--prompts", str(prompts), "--out", str(out)], out


def test_cli_measures_each_concurrency(tmp_path, tiny_ckpts, built, capsys):
    args, out = _cli_setup(tmp_path, tiny_ckpts, built)
    assert _load_cli().main([*args, "--max-tokens", "6", "-c", "1,2"]) == 0
    one, two = json.loads(out.with_suffix(".json").read_text())["values"]["results"]
    assert (one["concurrency"], two["concurrency"]) == (1, 2)
    # HF paths run one request at a time only; ours run batched, token-identical to batch 1.
    assert [p["key"] for p in two["paths"]] == ["ours_target", "ours_draft_target", "ours_ngram"]
    for p1, p2 in zip(one["prompts"], two["prompts"]):
        assert p2["runs"]["ours_draft_target"]["identical"] and p2["runs"]["ours_ngram"]["identical"]
        assert p1["runs"]["ours_target"]["tokens"] == p2["runs"]["ours_target"]["tokens"] == 6
    table = capsys.readouterr().out
    assert "concurrency 2 (groups of 2 prompts sent at once)" in table and "| HF target-only |" in table


def test_cli_measures_only_the_paths_asked_for(tmp_path, tiny_ckpts, built, capsys):
    args, out = _cli_setup(tmp_path, tiny_ckpts, built)
    args += ["--max-tokens", "4", "--limit", "1"]
    assert _load_cli().main([*args, "--paths", "ours_ngram,hf_target"]) == 0
    (data,) = json.loads(out.with_suffix(".json").read_text())["values"]["results"]
    assert [p["key"] for p in data["paths"]] == ["ours_target", "ours_ngram", "hf_target"]  # the reference stays
    capsys.readouterr()
    assert _load_cli().main([*args, "--paths", "ours_eagle9"]) == 2
    assert "--paths ours_eagle9: no such path here" in capsys.readouterr().err


def test_cli_refuses_concurrency_beyond_the_build(tmp_path, tiny_ckpts, built, capsys):
    dep = built("draft")
    spec = write_spec(tmp_path, tiny_ckpts, "draft", output_dir=str(dep.target.folder.parent))
    assert _load_cli().main(["--spec", str(spec), "-c", "1,8", "--out", str(tmp_path / "p.md")]) == 2
    assert "--concurrency 8 exceeds the spec's build.max_batch_size (4)" in capsys.readouterr().err


def test_groups_share_their_wall_time():
    calls: list[tuple[str, int]] = []

    def batch(key):
        def run_batch(prompts, max_tokens):
            calls.append((key, len(prompts)))
            return [Generation(list(ids[:max_tokens])) for ids in prompts]

        return PeerPath(key, key, lambda ids, n: batch_only(key), run_batch)

    def batch_only(key):
        raise AssertionError(f"{key}: run() called at concurrency 2")

    one_at_a_time = PeerPath("hf", "hf", lambda ids, n: Generation(ids[:n]))
    ticks = iter([0, 4, 4, 10] * 3)  # per group: ours 4 s, b 6 s (warm-up is not timed)
    m = measure([batch("ours_target"), one_at_a_time, batch("b")], _prompts(3), 2, clock=ticks.__next__, concurrency=2)
    assert [key for key, _ in m.paths] == ["ours_target", "b"]  # no run_batch: not measured at c > 1
    # warm-up on the first group, then the groups [p0, p1] and [p2], the order rotated per group
    assert calls == [("ours_target", 2), ("b", 2), ("ours_target", 2), ("b", 2), ("b", 1), ("ours_target", 1)]
    assert len(m.runs) == 3
    by = {s.key: s for s in summarise(m)}
    assert [r["ours_target"].seconds for r in m.runs] == [2, 2, 6]  # 4 s shared by two prompts
    assert by["ours_target"].tokens == 6


def test_vllm_counters_become_our_metrics():
    # 3 drafts of k=2: 6 drafted, 4 accepted (3 at position 0, 1 at position 1)
    spec = {"num_drafts": 3, "num_draft_tokens": 6, "num_accepted_tokens": 4, "accepted_per_pos": [3, 1]}
    m = vllm_metrics(spec, k=2)
    assert (m.drafted, m.accepted) == (6, 4) and m.acceptance_rate == 4 / 6
    assert m.per_position_rate == [1.0, 1 / 3]
    # vLLM's counters see only the steps that drafted: no target forwards, no mean length made up
    assert m.target_forwards == 0 and m.mean_acceptance_length == 0.0
    # ngram drafts may be shorter than k: per-position rates are then unknown, not made up
    short = vllm_metrics({"num_drafts": 3, "num_draft_tokens": 4, "num_accepted_tokens": 1, "accepted_per_pos": [1, 0]}, 2)
    assert short.per_position_rate == [] and short.acceptance_rate == 0.25


def test_table_leaves_vllm_mean_accepted_length_blank():
    calls: list[str] = []
    vllm = PeerPath(
        "vllm_ngram",
        "vLLM ngram k=2",
        lambda ids, n: Generation(
            ids[:n],
            vllm_metrics({"num_drafts": 1, "num_draft_tokens": 2, "num_accepted_tokens": 1, "accepted_per_pos": [1, 0]}, 2),
        ),
    )
    m = measure([_fake("ours_target", calls), vllm], _prompts(1), max_tokens=2)
    assert "| vLLM ngram k=2 | 2 |" in render_markdown(m, summarise(m))
    row = next(line for line in render_markdown(m, summarise(m)).splitlines() if line.startswith("| vLLM ngram"))
    assert row.endswith("| 1/1 | 0.50 |  |")


FAKE_PEER = """
import json, sys
for line in sys.stdin:
    req = json.loads(line)
    if req["op"] == "quit":
        print(json.dumps({"ok": True}), flush=True)
        break
    if req["op"] == "load":
        print(json.dumps({"ok": True, "vllm": "fake", "torch": "fake", "seconds": 0.0}), flush=True)
    elif req["max_tokens"] > 5:
        print(json.dumps({"ok": False, "error": "ValueError: too many"}), flush=True)
    else:
        outs = [ids[: req["max_tokens"]] + req["stop_token_ids"] for ids in req["prompts"]]
        spec = {"num_drafts": 1, "num_draft_tokens": 2, "num_accepted_tokens": 1, "accepted_per_pos": [1, 0]}
        print(json.dumps({"ok": True, "outputs": outs, "seconds": 0.1, "spec": spec}), flush=True)
"""


def test_vllm_worker_protocol(tmp_path):
    script = tmp_path / "fake_peer.py"
    script.write_text(FAKE_PEER)
    worker = VllmWorker(Path(sys.executable), script, {"model": "x"}, dict(os.environ), tmp_path / "log")
    try:
        assert worker.info["vllm"] == "fake"
        run, run_batch = _vllm_run(worker, [2], frozenset({2}), k=2)
        gens = run_batch([[5, 6, 7], [8, 9]], 2)
        assert [g.output_ids for g in gens] == [[5, 6], [8, 9]]  # vLLM's EOS id cut, as HF's
        assert gens[0].metrics.drafted == 2 and gens[1].metrics.drafted == 0  # the group's counts, once
        with pytest.raises(EngineError, match="vLLM peer: ValueError: too many; see its log"):
            run([1], 9)
    finally:
        worker.close()
    assert worker.proc.returncode == 0


def test_vllm_worker_that_dies_is_an_error(tmp_path):
    script = tmp_path / "dies.py"
    script.write_text("import sys; sys.exit(4)\n")
    with pytest.raises(EngineError, match=r"the vLLM peer exited \(code 4\)"):
        VllmWorker(Path(sys.executable), script, {"model": "x"}, dict(os.environ), tmp_path / "log")


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

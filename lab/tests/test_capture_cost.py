"""lab.capture_cost: every round runs the three arms (capture allowed, opted out, serve.capture
off) in a rotating order, the third with no writer and no label store, and its result file
fills lab/figures.md's capture-cost block."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import torch

from lab import capture_cost, figures
from lab._common import write_result


class FakeWriter:
    dropped = 0

    def __init__(self):
        self.flushes = 0

    def flush(self):
        self.flushes += 1


class FakeDeployment:
    """Answers every request with 4 tokens; notes each generate's setting (arm)."""

    def __init__(self):
        self.capture = FakeWriter()
        self.target = SimpleNamespace(labels=SimpleNamespace(ids=torch.zeros(2, 3, dtype=torch.int32)))
        self.seen: list[str] = []

    def request(self, ids, max_tokens):
        return ids

    def encode(self, prompt):
        return [1, 2]

    def forget_prefixes(self):
        pass

    def generate(self, reqs, tags):
        if self.capture is None:
            assert self.target.labels is None  # no label store while serve.capture is off
            self.seen.append("none")
        else:
            self.seen.append("on" if tags[0].allowed else "off")
        return [SimpleNamespace(output_ids=[5, 6, 7, 8]) for _ in reqs]


def test_each_round_runs_the_three_arms_in_a_rotating_order_and_restores_capture(tmp_path):
    dep = FakeDeployment()
    writer, store = dep.capture, dep.target.labels
    args = argparse.Namespace(concurrency="2", rounds=3, max_tokens=4)
    values = capture_cost.measure(dep, ["a", "b", "c", "d"], args, tmp_path)
    timed = dep.seen[3:]  # after one warm-up group per arm
    rounds = [timed[i : i + 6 : 2] for i in range(0, 18, 6)]  # 2 groups of 2 requests per set
    assert rounds == [["on", "off", "none"], ["off", "none", "on"], ["none", "on", "off"]]
    assert dep.capture is writer and dep.target.labels is store and bool((store.ids == -1).all())
    assert set(values["2"]) == {"on_tok_s", "off_tok_s", "ratio", "no_capture_tok_s", "goal_ratio"}
    assert values["captured"] == {"parts": 0, "bytes": 0, "dropped": 0}


def test_its_result_fills_the_capture_cost_figure(tmp_path):
    values = {
        c: {"on_tok_s": 40.0, "off_tok_s": 41.0, "ratio": 0.9756, "no_capture_tok_s": 41.5, "goal_ratio": 0.964}
        for c in ("1", "4")
    }
    values |= {"captured": {"parts": 3, "bytes": 10, "dropped": 0}, "prompts": 16, "max_tokens": 64, "rounds": 3, "sample": 1.0}
    write_result(tmp_path / "capture-cost-sample1.json", "python -m lab.capture_cost", values)
    template = figures.regions(figures.TEMPLATES.read_text(encoding="utf-8"))["capture-cost"]
    text = figures.render(template, figures.Results(tmp_path))
    assert "| 1 | 40.0 | 41.0 | 41.5 | 0.964 | 0.976x |" in text

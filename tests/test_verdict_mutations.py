"""Mutation proof of the verify gate.

Each known class of speculative-decoding bug is injected into the real code (a one-line
source mutation of the loop or the engine, applied to a fresh copy of the module), and the
gate — run_verify on a tiny deployment, in process — must catch it and class it
`algorithmic`. A pure-numerics perturbation (near-ties flipped only in multi-row forwards)
must be caught and classed `numerical`. A mutation whose original line is gone fails loudly:
the test then names the line to update, it never passes vacuously.
"""

from __future__ import annotations

import inspect
import sys
import types

import pytest
import torch

import trtspec.engines.torch.model as model
import trtspec.runtime as runtime
import trtspec.speculative.loop as loop
from trtspec.verify.backends import InProcessBackend
from trtspec.verify.identity import run_verify

PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):",
    "Triton serves models over HTTP and gRPC.",
]
MAX_TOKENS = 32


def mutate(module, original: str, mutant: str) -> types.ModuleType:
    """A fresh copy of ``module`` with ``original`` (exactly once in its source) replaced."""
    source = inspect.getsource(module)
    assert source.count(original) == 1, f"mutation site not found once in {module.__name__}: {original!r}"
    copy = types.ModuleType(module.__name__ + "_mutant")
    copy.__dict__["__file__"] = module.__file__
    sys.modules[copy.__name__] = copy  # dataclasses look their module up while being made
    try:
        exec(compile(source.replace(original, mutant), module.__file__, "exec"), copy.__dict__)
    finally:
        del sys.modules[copy.__name__]
    return copy


LOOP_MUTANTS = {
    # Accepts the first disagreeing draft token too.
    "off_by_one_accepted_prefix": (
        "        path = accepted_path(tree, verdict.target_ids)\n",
        "        path = accepted_path(tree, verdict.target_ids)\n"
        "        path = path + tree.children(path[-1] if path else -1)[:1]\n",
    ),
    # After a fully accepted draft, emits the last draft token again instead of the target's.
    "wrong_bonus_token": (
        "        new = [tree.tokens[c] for c in path] + [verdict.target_ids[rows[-1]]]\n",
        "        new = [tree.tokens[c] for c in path] + [verdict.target_ids[rows[-1]]]\n"
        "        if draft and len(path) == len(draft):\n"
        "            new = new[:-1] + [draft[-1]]\n",
    ),
    # At a rejection, emits the draft's token instead of the target's correction.
    "draft_token_emitted_unverified": (
        "        new = [tree.tokens[c] for c in path] + [verdict.target_ids[rows[-1]]]\n",
        "        new = [tree.tokens[c] for c in path] + [verdict.target_ids[rows[-1]]]\n"
        "        if len(path) < len(draft):\n"
        "            new = new[:-1] + [draft[len(path)]]\n",
    ),
    # Checks for EOS only at the step's last token: an EOS inside accepted drafts is emitted.
    "eos_inside_drafts_ignored": (
        "        if tok in req.end_ids:\n",
        "        if tok in req.end_ids and pos == len(new) - 1:\n",
    ),
}


@pytest.fixture(scope="module")
def dep(built):
    return built()


def gate(dep, epsilon=None):
    return run_verify(InProcessBackend(dep, epsilon=epsilon), PROMPTS, MAX_TOKENS, "tiny")


def assert_caught(report, verdict: str):
    bad = [r for r in report.results if not r.identical]
    assert bad, "the gate did not catch the injected change"
    classes = [r.divergence.verdict_class for r in bad]
    assert classes == [verdict] * len(bad), [r.divergence.describe() for r in bad]
    assert not report.passes("any")
    assert report.passes("algorithmic") == (verdict == "numerical")


def test_unmutated_code_passes(dep):
    report = gate(dep)
    assert report.identical and report.passes("any")
    assert report.metrics.accepted < report.metrics.drafted  # rejections occur: mutants can bite
    assert report.metrics.histogram[-1] > 0  # so do fully accepted drafts


@pytest.mark.parametrize("name", ["off_by_one_accepted_prefix", "wrong_bonus_token", "draft_token_emitted_unverified"])
def test_loop_bug_is_caught_as_algorithmic(dep, monkeypatch, name):
    mutant = mutate(loop, *LOOP_MUTANTS[name])
    monkeypatch.setattr(runtime, "generate", mutant.generate)
    assert_caught(gate(dep), "algorithmic")


def test_eos_inside_drafts_ignored_is_caught_as_algorithmic(dep, monkeypatch):
    # Make an id the target emits mid-output (inside an accepted draft) the end id, so the
    # correct loop stops there on both paths.
    ids = dep.encode(PROMPTS[0])
    (res,) = dep.generate([dep.request(ids, MAX_TOKENS)], speculative=True)
    starts = [s for s, _ in res.steps] + [len(res.output_ids)]
    # A step that emitted two or more tokens, whose first token is new to the output: that
    # token was an accepted draft with more tokens after it in the same step.
    eos = next(
        res.output_ids[a] for a, b in zip(starts, starts[1:]) if b - a >= 2 and res.output_ids.index(res.output_ids[a]) == a
    )
    monkeypatch.setattr(dep, "end_ids", frozenset({eos}))
    assert gate(dep).results[0].identical  # the correct loop ends both paths alike
    mutant = mutate(loop, *LOOP_MUTANTS["eos_inside_drafts_ignored"])
    monkeypatch.setattr(runtime, "generate", mutant.generate)
    report = gate(dep)
    assert_caught(report, "algorithmic")
    assert report.results[0].divergence.target_id is None  # target-only ended; speculative went on


def test_stale_kv_cache_is_caught_as_algorithmic(dep, monkeypatch):
    # A verify forward starts at the rollback position (the context's last token, where a
    # rejected draft or nothing sat before). The mutant keeps that position's cached K/V
    # instead of rewriting it: the rejected draft's K/V stays in use.
    mutant = mutate(
        model,
        "            k_cache[slot, :, start : start + n] = xk[0, :, :n]\n"
        "            v_cache[slot, :, start : start + n] = xv[0, :, :n]\n",
        "            skip = 1 if n > 1 and start > 0 else 0\n"
        "            k_cache[slot, :, start + skip : start + n] = xk[0, :, skip:n]\n"
        "            v_cache[slot, :, start + skip : start + n] = xv[0, :, skip:n]\n",
    )
    monkeypatch.setattr(model.Attention, "forward", mutant.Attention.forward)
    assert_caught(gate(dep), "algorithmic")


def test_near_tie_flips_in_batched_forwards_are_numerical(dep, monkeypatch):
    """Pure numerics: in forwards scoring more than one row, every row whose top-2 margin is
    below delta gets its runner-up raised by delta (a logit change of at most delta that
    depends only on the forward's shape), as a different kernel's rounding could."""
    control = gate(dep)
    margins = sorted(m for r in control.results for m in _margins(dep, r) if m is not None)
    delta = margins[2] * 1.01  # flips the three tightest near-ties
    real_run = dep.target.run

    def shape_dependent(items):
        out = [logits.clone() for logits in real_run(items)]  # inference tensors are read-only
        for it, logits in zip(items, out):  # [n_logits, vocab]
            if it.n_logits > 1:
                top = torch.topk(logits, 2, dim=-1)
                near = (top.values[:, 0] - top.values[:, 1]) < delta
                rows = near.nonzero().flatten()
                logits[rows, top.indices[rows, 1]] += delta
        return out

    monkeypatch.setattr(dep.target, "run", shape_dependent)
    report = gate(dep, epsilon=2 * delta)
    assert_caught(report, "numerical")
    # The same flips with an epsilon below their margins are not ties: algorithmic.
    strict = gate(dep, epsilon=margins[0] / 2)
    assert_caught(strict, "algorithmic")


def _margins(dep, result):
    ids = dep.encode(result.prompt)
    (res,) = dep.generate([dep.request(ids, MAX_TOKENS)], speculative=False)
    return res.margins

"""The speculative loop against a scripted target: outputs never depend on the drafter."""

from __future__ import annotations

import random

import pytest
import torch

from trtspec.speculative.capabilities import Drafter
from trtspec.speculative.drafters import NgramDrafter
from trtspec.speculative.loop import (
    Batch,
    GenerationRequest,
    NoDrafter,
    Verdict,
    accepted_prefix,
    generate,
)
from trtspec.speculative.metrics import SpecMetrics, expected_tokens_per_forward, speedup_bound

VOCAB = 50


def oracle(ctx: list[int]) -> int:
    """A deterministic 'target model': next token from the last three tokens."""
    a, b, c = (ctx + [0, 0, 0])[-3:] if len(ctx) < 3 else ctx[-3:]
    return (a * 7 + b * 13 + c * 31 + len(ctx)) % VOCAB


class OracleVerifier:
    def __init__(self):
        self.calls = 0

    def verify(self, contexts, drafts, context_phase=None):
        self.calls += 1
        out = []
        for ctx, d in zip(contexts, drafts):
            seq = list(ctx)
            ids = []
            for tok in list(d) + [None]:
                ids.append(oracle(seq))
                if tok is None:
                    break
                seq.append(tok)
            out.append(Verdict(ids, [1.0] * len(ids)))
        return out


class PerfectDrafter(Drafter):
    def propose(self, contexts, ks):
        out = []
        for ctx, k in zip(contexts, ks):
            seq, d = list(ctx), []
            for _ in range(k):
                d.append(oracle(seq))
                seq.append(d[-1])
            out.append(d)
        return out


class NoisyDrafter(PerfectDrafter):
    """Right with probability p at each position (seeded)."""

    def __init__(self, p: float, seed: int = 0):
        self.p, self.rng = p, random.Random(seed)

    def propose(self, contexts, ks):
        return [[t if self.rng.random() < self.p else (t + 1) % VOCAB for t in d] for d in super().propose(contexts, ks)]


def run(drafter, k, max_tokens=40, end_ids=frozenset(), stops=(), prompt=(1, 2, 3)):
    req = GenerationRequest(list(prompt), max_tokens, k, frozenset(end_ids), tuple(stops))
    return generate([req], drafter, OracleVerifier())[0]


def reference(max_tokens=40, prompt=(1, 2, 3), target=oracle):
    """The greedy output of ``target`` (a context's next token) after ``prompt``."""
    seq, out = list(prompt), []
    for _ in range(max_tokens):
        out.append(target(seq))
        seq.append(out[-1])
    return out


@pytest.mark.parametrize("k", range(1, 9))
@pytest.mark.parametrize("drafter", [PerfectDrafter(), NoisyDrafter(0.7), NoisyDrafter(0.0)], ids=["perfect", "noisy", "wrong"])
def test_output_is_target_greedy_whatever_the_drafter(k, drafter):
    assert run(drafter, k).output_ids == reference()


def test_target_only_is_reference():
    res = run(NoDrafter(), 4)
    assert res.output_ids == reference()
    assert res.metrics.drafted == 0 and res.metrics.target_forwards == 40


def test_perfect_drafter_accepts_everything():
    res = run(PerfectDrafter(), 4, max_tokens=40)
    m = res.metrics
    assert m.acceptance_rate == 1.0
    # The prefill step (no drafts, 1 token), 7 steps of 4 drafts + bonus (35 tokens), and a
    # last step of 3 drafts + bonus for the 4 tokens left.
    assert m.target_forwards == 9
    assert m.mean_acceptance_length == 40 / 9
    assert m.histogram == [1, 0, 0, 1, 7]
    assert m.per_position_rate == [1.0, 1.0, 1.0, 1.0]
    assert res.steps[:3] == [(0, 0), (1, 4), (6, 4)]


def test_first_step_drafts_nothing_so_the_first_token_is_the_prefills():
    calls = []

    class Recording(PerfectDrafter):
        def propose(self, contexts, ks):
            calls.append(list(ks))
            return super().propose(contexts, ks)

    verifier = OracleVerifier()
    batch = Batch(Recording(), verifier)
    batch.add(GenerationRequest([1, 2, 3], 10, 4))
    report = batch.step()
    assert calls == [] and verifier.calls == 1  # one target forward, no draft call
    assert (report.sequences, report.drafted, report.draft_len) == (1, 0, 0)
    assert report.emitted == {0: reference(1)}
    batch.step()
    assert calls == [[4]]  # the drafter joins on the second step


def test_max_tokens_smaller_than_k():
    res = run(PerfectDrafter(), 8, max_tokens=3)
    assert res.output_ids == reference(3)
    assert res.finish_reason == "length"
    # Prefill step (1 token), then 1 draft + bonus: never drafts beyond the budget
    # (k <= remaining - 1).
    assert res.metrics.drafted == 1


def test_eos_inside_a_draft_stops_where_target_only_would():
    ref = reference(40)
    eos = ref[10]
    first = ref.index(eos)
    for drafter in (PerfectDrafter(), NoisyDrafter(0.5), NoDrafter()):
        res = run(drafter, 6, end_ids={eos})
        assert res.output_ids == ref[:first]
        assert res.finish_reason == "eos"


def test_stop_sequence_is_emitted_then_ends():
    ref = reference(40)
    stop = tuple(ref[12:14])
    expected = None
    for i in range(1, len(ref) + 1):
        if tuple(ref[:i][-2:]) == stop:
            expected = ref[:i]
            break
    for drafter in (PerfectDrafter(), NoDrafter()):
        res = run(drafter, 5, stops=[stop])
        assert res.output_ids == expected and res.finish_reason == "stop"


def test_batch_of_requests_each_own_acceptance():
    reqs = [GenerationRequest([i, i + 1], 25, k) for i, k in [(1, 1), (5, 4), (9, 8), (3, 0)]]
    results = generate(reqs, NoisyDrafter(0.6, seed=3), OracleVerifier())
    for req, res in zip(reqs, results):
        assert res.output_ids == reference(25, prompt=req.prompt_ids)


def test_streaming_callback_sees_every_token_once():
    seen: list[int] = []
    finals = []
    req = GenerationRequest([1, 2, 3], 30, 4)
    generate([req], NoisyDrafter(0.8), OracleVerifier(), on_step=lambda i, toks, done: (seen.extend(toks), finals.append(done)))
    assert seen == reference(30)
    assert finals[-1] is True and finals.count(True) == 1


def test_zero_max_tokens_finishes_immediately():
    (res,) = generate([GenerationRequest([1], 0, 4)], PerfectDrafter(), OracleVerifier())
    assert res.output_ids == [] and res.finish_reason == "length"


def test_verdict_without_next_token_is_rejected():
    with pytest.raises(ValueError, match="must include the target's next token"):
        accepted_prefix([1, 2], Verdict([1, 2]))
    assert accepted_prefix([1, 2, 3], Verdict([1, 5])) == 1  # TensorRT-LLM style verdict
    assert accepted_prefix([], Verdict([7])) == 0


def test_ngram_drafter_copies_latest_longest_match():
    d = NgramDrafter(max_ngram=3, min_ngram=1)
    ctx = [5, 6, 7, 8, 9, 1, 5, 6, 7, 2, 3, 5, 6, 7]
    # suffix [5,6,7] occurs at 0 and 6; the latest (6) continues with [2, 3, 5]
    assert d.propose([ctx], [3]) == [[2, 3, 5]]
    assert d.propose([[1, 2, 3, 4]], [3]) == [[]]  # no earlier match
    assert d.propose([[4, 1, 2, 9, 1, 2]], [5]) == [[9, 1, 2]]  # continuation shorter than k


def test_ngram_output_identical():
    assert run(NgramDrafter(3, 1), 5).output_ids == reference()


def test_metrics_definitions():
    m = SpecMetrics()
    m.record_step(4, 2)
    m.record_step(4, 4)
    m.record_step(0, 0)
    assert (m.drafted, m.accepted, m.target_forwards, m.tokens) == (8, 6, 3, 9)
    assert m.acceptance_rate == 0.75
    assert m.mean_acceptance_length == 3.0
    assert m.per_position_rate == [1.0, 1.0, 0.5, 0.5]
    assert m.histogram == [1, 0, 1, 0, 1]
    total = m.merge(m)
    assert total.drafted == 16 and total.histogram == [2, 0, 2, 0, 2]
    with pytest.raises(ValueError):
        m.record_step(2, 3)


def test_analytic_bound():
    assert expected_tokens_per_forward(1.0, 4) == 5.0
    assert expected_tokens_per_forward(0.0, 4) == 1.0
    assert abs(expected_tokens_per_forward(0.5, 2) - 1.75) < 1e-12
    assert abs(speedup_bound(0.5, 2, 0.5, 1.0) - 1.75 / 2.0) < 1e-12


def test_a_late_request_joins_a_running_batch_and_each_leaves_when_done():
    verifier = OracleVerifier()
    batch = Batch(NoisyDrafter(0.7, seed=1), verifier)
    long = batch.add(GenerationRequest([1, 2, 3], 30, 4))
    for _ in range(3):
        batch.step()
    short = batch.add(GenerationRequest([4, 5], 6, 2))  # joins between steps
    report = batch.step()
    assert report.sequences == 2 and set(report.emitted) == {long, short}
    assert report.emitted[short] == reference(1, prompt=[4, 5])  # its prefill token
    while short not in report.finished:
        report = batch.step()
    assert batch.active == [long]  # the short one ended first; the long one runs on
    assert batch.pop(short).output_ids == reference(6, prompt=[4, 5])
    while batch.active:
        batch.step()
    assert batch.pop(long).output_ids == reference(30)
    assert batch.results == {}


def test_a_cancelled_sequence_leaves_the_next_step():
    batch = Batch(NoisyDrafter(0.7), OracleVerifier())
    a = batch.add(GenerationRequest([1, 2, 3], 30, 4))
    b = batch.add(GenerationRequest([7, 8], 30, 4))
    batch.step()
    partial = batch.cancel(a)
    assert partial.output_ids == reference(1) and not partial.done
    assert batch.step().sequences == 1 and batch.active == [b]
    with pytest.raises(ValueError, match="has not finished"):
        batch.pop(b)


class LogitsOracleVerifier(OracleVerifier):
    """The oracle's verdicts with logits, each row a view into one array for the whole
    step ([rows, k + 1, vocab]), as engines return them."""

    def verify(self, contexts, drafts, want_logits=None, context_phase=None):
        verdicts = super().verify(contexts, drafts)
        width = max(len(d) for d in drafts) + 1
        step = torch.zeros(len(contexts), width, VOCAB)  # [rows, k+1, vocab]
        for r, v in enumerate(verdicts):
            step[r, torch.arange(len(v.target_ids)), v.target_ids] = 1.0
            v.logits = step[r, : len(v.target_ids)]
        return verdicts


def test_generation_logits_rows_hold_only_their_own_memory():
    """Each kept row owns a storage of one vocab row: a view would pin the whole step's
    [rows, k + 1, vocab] array for as long as the request lives."""
    reqs = [GenerationRequest([i, i + 1], 20, 4, generation_logits=True) for i in (1, 5, 9)]
    results = generate(reqs, NoisyDrafter(0.7, seed=1), LogitsOracleVerifier())
    for req, res in zip(reqs, results):
        assert res.output_ids == reference(20, prompt=req.prompt_ids)
        assert len(res.generation_logits) == len(res.output_ids)
        for tok, row in zip(res.output_ids, res.generation_logits):
            assert int(row.argmax()) == tok
            assert row.untyped_storage().nbytes() == row.numel() * row.element_size() == VOCAB * 4

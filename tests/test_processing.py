"""Logits processing (penalties, min_tokens, bad words, embedding bias) and log probs: the
formulas on hand-made logits, then on tiny engines — speculative output identical to
target-only and to an independent token-by-token reference that runs one full forward per
token, for every draft source; drafts mirror the processing (a draft equal to the target
is still fully accepted)."""

from __future__ import annotations

import pytest
import torch

from trtspec.engines.torch.engine import ForwardItem
from trtspec.errors import RequestError
from trtspec.speculative.processing import Processing
from trtspec.speculative.sampling import SamplingParams

PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Triton Triton Triton"]


# ----------------------------------------------------------------------------- formulas


def test_repetition_presence_frequency_formulas():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    p = Processing(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    out = p.apply(logits, tokens=[0, 1, 1], generated=0)
    # token 0 seen once: 2/2 - 0.5 - 0.25; token 1 seen twice: -2*2 - 0.5 - 0.5; 2, 3 unseen
    assert out.tolist() == [[1.0 - 0.75, -4.0 - 1.0, 1.0, 0.5]]


def test_penalties_count_each_draft_token_before_its_position():
    logits = torch.zeros(3, 4)
    p = Processing(frequency_penalty=1.0)
    out = p.apply(logits, tokens=[2], generated=0, draft=[3, 3])
    assert out[0].tolist() == [0, 0, -1, 0]
    assert out[1].tolist() == [0, 0, -1, -1]
    assert out[2].tolist() == [0, 0, -1, -2]


def test_bias_then_temperature_then_penalty_as_upstream():
    logits = torch.tensor([[1.0, 3.0]])
    p = Processing(presence_penalty=1.0, bias=((0, 1.0), (0, 1.0)), temperature=0.5)
    out = p.apply(logits, tokens=[0], generated=0)
    # (1 + 2) / 0.5 - 1 (present); 3 / 0.5 (not present)
    assert torch.allclose(out, torch.tensor([[5.0, 6.0]]), atol=1e-4)


def test_min_tokens_bans_end_ids_until_reached():
    logits = torch.zeros(3, 5)
    p = Processing(min_tokens=3)
    out = p.apply(logits, tokens=[1, 2], generated=1, draft=[4, 4], end_ids=frozenset({0, 3}))
    # positions generate tokens number 2, 3, 4 (1 generated before): banned for 2 and 3
    assert out[0, 0] == out[0, 3] == out[1, 0] == float("-inf")
    assert out[2, 0] == out[2, 3] == 0


def test_bad_words_ban_the_last_token_after_the_others_even_across_the_prompt():
    logits = torch.zeros(3, 6)
    p = Processing(bad_words=((5,), (1, 2), (3, 4, 2)))
    out = p.apply(logits, tokens=[3], generated=0, draft=[4, 1])
    assert out[0, 5] == float("-inf") and out[0, 2] == 0  # single-token word: always
    assert out[1, 2] == float("-inf")  # ... 3, 4 -> 2 banned (3 is in the prompt)
    assert out[2, 2] == float("-inf")  # ... 1 -> 2 banned


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
        ({"presence_penalty": float("nan")}, "presence_penalty must be a finite"),
        ({"min_tokens": -1}, "min_tokens must be >= 0"),
        ({"bad_words": ((),)}, "tokenized to nothing"),
        ({"bias": ((1, float("inf")),)}, "must be finite"),
    ],
)
def test_bad_processing_values_are_named(kwargs, message):
    with pytest.raises(RequestError, match=message):
        Processing(**kwargs)


def test_ids_outside_the_vocabulary_are_named():
    with pytest.raises(RequestError, match="token id 99"):
        Processing(bad_words=((99,),)).check_ids(50)


# ----------------------------------------------------------------------------- engines


raw: list[torch.Tensor] = []  # the reference's unprocessed logits per token (last call)


def reference(dep, prompt_ids, max_tokens, proc: Processing | None):
    """Token-by-token greedy decoding, one full forward per token (no cache reuse across
    shapes matters here), processing applied to the last position: tokens and log probs."""
    ids, out, lps = list(prompt_ids), [], []
    raw.clear()
    for _ in range(max_tokens):
        (logits,) = dep.target.run([ForwardItem(ids, 1)])
        logits = logits[-1:, : dep.target.vocab_size].float()
        raw.append(logits[0])
        if proc is not None:
            logits = proc.apply(logits, ids, len(out), (), dep.end_ids)
        tok = int(torch.argmax(logits[0]))
        if tok in dep.end_ids:
            break
        lps.append(float(torch.log_softmax(logits[0].double(), -1)[tok]))
        out.append(tok)
        ids.append(tok)
    return out, lps


CASES = {
    "repetition": Processing(repetition_penalty=1.8),
    "presence+frequency": Processing(presence_penalty=0.8, frequency_penalty=0.6),
    "bias": Processing(bias=((5, 4.0), (17, -3.0))),
    "all": Processing(repetition_penalty=1.3, frequency_penalty=0.3, min_tokens=12, temperature=0.7),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("draft", ["draft", "unrelated"])
def test_processed_speculative_equals_target_only_and_the_reference(built, name, draft):
    dep = built(draft)
    proc = CASES[name]
    for prompt in PROMPTS:
        ids = dep.encode(prompt)
        plain = dep.generate([dep.request(ids, 24, 4)], speculative=False)[0]
        ref, ref_lp = reference(dep, ids, 24, proc)
        req = dep.request(ids, 24, 4, processing=proc, log_probs=True)
        req.generation_logits = True
        (target,) = dep.generate([req], speculative=False)
        (spec,) = dep.generate([req], speculative=True)
        assert target.output_ids == ref
        assert spec.output_ids == ref
        assert spec.metrics.drafted > 0
        assert spec.log_probs == pytest.approx(ref_lp, abs=1e-4)
        assert target.log_probs == pytest.approx(ref_lp, abs=1e-4)
        assert len(spec.generation_logits) == len(ref)
        for got, want in zip(spec.generation_logits, raw):  # the target's own, unprocessed
            assert torch.allclose(got, want, atol=1e-4)
    assert ref != plain.output_ids  # the processing changed something (last prompt at least)


def test_bad_words_never_appear_and_outputs_stay_identical(built):
    dep = built("draft")
    ids = dep.encode(PROMPTS[0])
    plain = dep.generate([dep.request(ids, 24, 4)], speculative=False)[0].output_ids
    # ban the plain output's 3rd token after its 2nd, and its 5th token anywhere
    proc = Processing(bad_words=((plain[1], plain[2]), (plain[4],)))
    req = dep.request(ids, 24, 4, processing=proc)
    (target,) = dep.generate([req], speculative=False)
    (spec,) = dep.generate([req], speculative=True)
    assert spec.output_ids == target.output_ids == reference(dep, ids, 24, proc)[0]
    assert plain[4] not in spec.output_ids
    assert all(spec.output_ids[i : i + 2] != [plain[1], plain[2]] for i in range(len(spec.output_ids)))


def test_ngram_drafts_with_processing_stay_identical(built):
    dep = built(None, **{"speculative.method": "ngram"})
    proc = CASES["all"]
    ids = dep.encode(PROMPTS[2])
    req = dep.request(ids, 24, 3, processing=proc)
    (spec,) = dep.generate([req], speculative=True)
    assert spec.output_ids == reference(dep, ids, 24, proc)[0]


def test_drafts_mirror_the_processing(built):
    """A draft equal to the target, processed the same way, is accepted every time: without
    the mirror it would propose the unpenalized token and be rejected."""
    dep = built("same")
    proc = Processing(repetition_penalty=2.0, presence_penalty=1.0)
    ids = dep.encode(PROMPTS[2])
    (spec,) = dep.generate([dep.request(ids, 24, 4, processing=proc)], speculative=True)
    assert spec.metrics.drafted > 0
    assert spec.metrics.accepted == spec.metrics.drafted


def test_min_tokens_holds_back_the_end(built):
    dep = built("draft")
    ids = dep.encode(PROMPTS[1])
    (plain,) = dep.generate([dep.request(ids, 30, 4)], speculative=False)
    end = plain.output_ids[3]  # pretend the 4th token ends the answer
    dep_ends, dep.end_ids = dep.end_ids, frozenset({end})
    try:
        early = dep.generate([dep.request(ids, 30, 4)], speculative=True)[0]
        assert early.finish_reason == "eos" and len(early.output_ids) == 3
        proc = Processing(min_tokens=10)
        (spec,) = dep.generate([dep.request(ids, 30, 4, processing=proc)], speculative=True)
        assert len(spec.output_ids) >= 10
        assert end not in spec.output_ids[:10]
        assert spec.output_ids == reference(dep, ids, 30, proc)[0]
    finally:
        dep.end_ids = dep_ends


def test_sampling_with_processing_is_seeded_and_respects_bans(built):
    dep = built("draft")
    ids = dep.encode(PROMPTS[0])
    plain = dep.generate([dep.request(ids, 16, 4)], speculative=False)[0].output_ids
    proc = Processing(bad_words=((plain[0],), (plain[1],)), presence_penalty=0.5, temperature=0.8)
    runs = []
    for _ in range(2):
        req = dep.request(ids, 16, 4, sampling=SamplingParams(temperature=0.8, seed=7), processing=proc, log_probs=True)
        runs.append(dep.generate([req], speculative=True)[0])
    assert runs[0].output_ids == runs[1].output_ids
    assert plain[0] not in runs[0].output_ids and plain[1] not in runs[0].output_ids
    assert len(runs[0].log_probs) == len(runs[0].output_ids)
    assert all(lp <= 0 for lp in runs[0].log_probs)


def test_min_tokens_one_is_off_whatever_else_is_on():
    logits = torch.zeros(1, 4)
    out = Processing(min_tokens=1, presence_penalty=0.5).apply(logits, tokens=[1], generated=0, end_ids=frozenset({0}))
    assert out[0, 0] == 0


def test_a_negative_end_id_bans_nothing():
    logits = torch.zeros(1, 4)
    out = Processing(min_tokens=5).apply(logits, tokens=[1], generated=0, end_ids=frozenset({-1}))
    assert torch.isfinite(out).all()


def test_sampled_log_probs_are_read_at_the_request_temperature(built):
    """Without other processing, log probs still follow the temperature the token was drawn at."""
    dep = built("draft")
    ids = dep.encode(PROMPTS[0])
    req = dep.request(ids, 12, 4, sampling=SamplingParams(temperature=0.5, seed=3), log_probs=True)
    req.generation_logits = True
    (res,) = dep.generate([req], speculative=True)
    for tok, raw, lp in zip(res.output_ids, res.generation_logits, res.log_probs):
        want = float(torch.log_softmax(raw.double() * (1.0 / (0.5 + 1e-6)), -1)[tok])
        assert lp == pytest.approx(want, abs=1e-5)

"""Speculative vs target-only on tiny engines: token-identical in every configuration."""

from __future__ import annotations

import pytest

from trtspec.errors import RequestError

PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):",
    "Summarise the following text in one sentence. Speculative decoding makes inference faster.",
    "Triton",
]


def _both(dep, prompt, max_tokens=40, k=None, **kw):
    ids = dep.encode(prompt)
    req = dep.request(ids, max_tokens, k)
    if kw:
        req.end_ids = frozenset(kw["end_ids"])
    (target,) = dep.generate([req], speculative=False)
    (spec,) = dep.generate([req], speculative=True)
    return target, spec


@pytest.mark.parametrize("prompt", PROMPTS)
def test_draft_equals_target_accepts_every_draft(built, prompt):
    dep = built("same")
    target, spec = _both(dep, prompt, k=4)
    assert spec.output_ids == target.output_ids
    assert spec.metrics.accepted == spec.metrics.drafted > 0
    assert spec.metrics.acceptance_rate == 1.0


@pytest.mark.parametrize("prompt", PROMPTS)
def test_unrelated_draft_output_still_identical(built, prompt):
    dep = built("unrelated")
    target, spec = _both(dep, prompt, k=4)
    assert spec.output_ids == target.output_ids
    assert len(target.output_ids) == 40
    assert spec.metrics.acceptance_rate < 0.5


@pytest.mark.parametrize("k", range(1, 9))
def test_every_draft_length(built, k):
    dep = built("draft")
    for prompt in PROMPTS[:2]:
        target, spec = _both(dep, prompt, k=k)
        assert spec.output_ids == target.output_ids
        assert len(spec.metrics.histogram) <= k + 1  # never more than k drafts accepted


def test_noisy_draft_partially_accepted(built):
    dep = built("draft")
    target, spec = _both(dep, PROMPTS[2], k=4)
    assert spec.output_ids == target.output_ids
    assert 0 < spec.metrics.accepted < spec.metrics.drafted
    assert spec.metrics.target_forwards < target.metrics.target_forwards


def test_eos_inside_a_draft(built):
    dep = built("same")
    target, _ = _both(dep, PROMPTS[0], k=6)
    eos = target.output_ids[9]
    cut = target.output_ids.index(eos)
    t2, s2 = _both(dep, PROMPTS[0], k=6, end_ids={eos})
    assert t2.output_ids == s2.output_ids == target.output_ids[:cut]
    assert t2.finish_reason == s2.finish_reason == "eos"


def test_max_tokens_smaller_than_k(built):
    dep = built("same")
    for n in (1, 2, 3):
        target, spec = _both(dep, PROMPTS[1], max_tokens=n, k=8)
        assert spec.output_ids == target.output_ids and len(spec.output_ids) == n


def test_prompt_at_max_input_len(built):
    dep = built("draft")
    limit = dep.limits.max_input_len
    ids = (dep.encode(PROMPTS[2], chat_template=False) * 100)[:limit]
    req = dep.request(ids, 16, 4)
    (target,) = dep.generate([req], speculative=False)
    (spec,) = dep.generate([req], speculative=True)
    assert spec.output_ids == target.output_ids and len(spec.output_ids) == 16
    with pytest.raises(RequestError, match=f"prompt has {limit + 1} tokens, more than max_input_len {limit}"):
        dep.request(ids + [5], 16, 4)


def test_ngram_method(built):
    dep = built(None, **{"speculative.method": "ngram"})
    prompt = "Rewrite: the cat sat on the mat. the cat sat on the mat. the cat"
    target, spec = _both(dep, prompt, k=4)
    assert spec.output_ids == target.output_ids
    assert spec.metrics.drafted > 0


def test_batched_generation_identical_to_single(built):
    dep = built("draft")
    reqs = [dep.request(dep.encode(p), 30, 4) for p in PROMPTS]
    singles = [dep.generate([r], speculative=False)[0].output_ids for r in reqs]
    batched = dep.generate(reqs, speculative=True)
    assert [r.output_ids for r in batched] == singles


@pytest.mark.parametrize(
    "args, message",
    [
        (([], 8, 2), "the prompt is empty"),
        (([1, 2], 0, 2), "max_tokens must be at least 1 (got 0)"),
        (([1, 2], 10_000, 2), "exceeds max_seq_len 512; lower max_tokens to 510 or less"),
        (([1, 2], 8, 9), "num_draft_tokens must be in 0..8"),
        (([1, 99_999], 8, 2), "token id 99999 is outside the vocabulary"),
    ],
)
def test_bad_requests(built, args, message):
    dep = built("draft")
    with pytest.raises(RequestError) as e:
        dep.request(*args)
    assert message in str(e.value)

"""Suffix decoding: proposals scored by match length and frequency, the bounded cache of
earlier responses, requests kept apart, the layered drafter and its per-source counts;
greedy outputs token-identical and sampling lossless through the one loop."""

from __future__ import annotations

import tracemalloc

import pytest
import torch
from test_sampling import joint_p_value

from trtspec.spec import SuffixSpec
from trtspec.speculative.capabilities import Capabilities, Drafter
from trtspec.speculative.drafters import LayeredDrafter, make_drafter, response_cache
from trtspec.speculative.loop import Batch, GenerationRequest, NoDrafter, Verdict, generate
from trtspec.speculative.metrics import SourceCounts
from trtspec.speculative.sampling import SamplingParams
from trtspec.speculative.suffix import BYTES_PER_SCOPE, BYTES_PER_TOKEN, ResponseCache, SuffixDrafter

PERIOD = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]


def periodic(ctx: list[int]) -> int:
    """A 'target' whose text repeats: the next token of PERIOD after the last one, else its start."""
    last = ctx[-1] if ctx else None
    return PERIOD[(PERIOD.index(last) + 1) % len(PERIOD)] if last in PERIOD else PERIOD[0]


class PeriodicVerifier:
    def verify(self, contexts, drafts, want_logits=None, context_phase=None):
        out = []
        for ctx, d in zip(contexts, drafts):
            seq, ids = list(ctx), []
            for tok in list(d) + [None]:
                ids.append(periodic(seq))
                if tok is None:
                    break
                seq.append(tok)
            out.append(Verdict(ids))
        return out


def greedy(drafter, prompt, max_tokens=40, k=8):
    (res,) = generate([GenerationRequest(list(prompt), max_tokens, k)], drafter, PeriodicVerifier())
    return res


# ---------------------------------------------------------------- proposals and their score


def test_longest_match_drafts_its_continuation_up_to_spec_factor_times_its_length():
    d = SuffixDrafter(SuffixSpec())
    ctx = [1, 2, 3, 4, 5, 6, 7, 8, 9, 50, 1, 2, 3]
    (draft,) = d.drafts([ctx], [8])
    assert (draft.tokens, draft.match) == ([4, 5, 6], 3)  # 3 tokens matched: at most 1.0 x 3 drafted
    (longer,) = d.drafts([ctx + [4, 5]], [8])
    assert (longer.tokens, longer.match) == ([6, 7, 8, 9, 50], 5)
    assert d.drafts([ctx + [4, 5]], [2])[0].tokens == [6, 7]  # never more than k
    wide = SuffixDrafter(SuffixSpec(spec_factor=3.0))
    assert wide.drafts([ctx], [8])[0].tokens == [4, 5, 6, 7, 8, 9, 50, 1]


def test_frequency_picks_the_majority_continuation_and_min_token_prob_cuts_the_draft():
    # "7 8" is followed by 1 twice and by 2 once: the majority wins with probability 2/3.
    ctx = [7, 8, 1, 9, 7, 8, 2, 9, 7, 8, 1, 9, 30, 7, 8]
    d = SuffixDrafter(SuffixSpec(spec_factor=2.0))
    (draft,) = d.drafts([ctx], [4])
    # 1 (2 of 3 matches), 9 (both of those), then a tie (30 or 7) that halves the estimate:
    # the latest occurrence's 30, then its 7. Score = 2/3 + 2/3 + 1/3 + 1/3.
    assert (draft.tokens, draft.match) == ([1, 9, 30, 7], 2)
    assert draft.score == pytest.approx(2.0)
    strict = SuffixDrafter(SuffixSpec(spec_factor=2.0, min_token_prob=0.7))
    assert strict.drafts([ctx], [4])[0].tokens == []  # 2/3 < 0.7: nothing is confident enough


def test_a_lone_last_token_matches_where_its_pair_never_occurred():
    d = SuffixDrafter(SuffixSpec())
    # 7 followed 0 and 5 before; the pair (6, 7) never occurred, so the two 7s vote: a tie,
    # won by the latest (9). Token 0 before a token must not count as that token's own entry.
    (draft,) = d.drafts([[0, 7, 8, 5, 7, 9, 6, 7]], [4])
    assert (draft.tokens, draft.match, draft.score) == ([9], 1, 0.5)


def test_no_match_no_draft():
    d = SuffixDrafter(SuffixSpec())
    assert d.propose([[1, 2, 3, 4, 5]], [4]) == [[]]
    assert d.propose([[5]], [4]) == [[]]
    assert d.propose([[1, 2, 1, 2]], [0]) == [[]]


def test_max_depth_bounds_match_plus_draft():
    ctx = list(range(100, 130)) + [1] + list(range(100, 130))
    d = SuffixDrafter(SuffixSpec(max_depth=10, spec_factor=4.0))
    (draft,) = d.drafts([ctx[:-20]], [16])  # the context ends inside the second copy
    assert draft.match + len(draft.tokens) <= 10 and draft.tokens


# ---------------------------------------------------------------- the cache of earlier responses


def test_a_later_request_drafts_from_an_earlier_response_and_cache_zero_keeps_them_apart():
    out = [40, 41, 42, 43, 44, 45, 46, 47]
    shared = make_drafter("suffix", suffix=SuffixSpec(), cache=response_cache(SuffixSpec()))
    shared.propose([[1, 2, 40]], [4])
    shared.release([1, 2], out)  # the first request leaves: its output is cached
    assert shared.propose([[9, 9, 41, 42]], [4]) == [[43, 44]]  # 2 tokens matched: 2 drafted
    apart = SuffixSpec(cache_responses=0)
    assert response_cache(apart) is None
    alone = make_drafter("suffix", suffix=apart, cache=response_cache(apart))
    alone.propose([[1, 2, 40]], [4])
    alone.release([1, 2], out)
    assert alone.propose([[9, 9, 41, 42]], [4]) == [[]]


def test_cache_stays_within_its_caps_and_evicts_oldest_first():
    cache = ResponseCache(max_responses=3, max_tokens=50)
    for r in range(40):
        cache.add([1000 + r] * 5 + [r, r + 1, r + 2])
        assert cache.live_tokens <= 50 and len(cache.sizes) <= 3
        assert cache.held_tokens <= 2 * 50  # evicted tokens wait for a compaction, never more
    # The newest response is found; the oldest ones are gone.
    assert cache.candidates([0, 39, 40], 24) and not cache.candidates([0, 1, 2], 24)
    big = ResponseCache(max_responses=10, max_tokens=20)
    big.add(list(range(100)))  # longer than the cap: its last tokens are kept
    assert big.live_tokens <= 20 and big.parts[""].index.tokens[-2] == 99


def _run_scoped(drafter, *scopes, prompt=(1, 2)):
    """One request per scope, in one batch, on the periodic target: (drafted, accepted) each.
    8 tokens after a prompt of no PERIOD token never repeat, so a request alone drafts nothing:
    every draft comes from the response cache."""
    reqs = [GenerationRequest(list(prompt), 8, 4, suffix_scope=sc) for sc in scopes]
    results = generate(reqs, drafter, PeriodicVerifier())
    assert all(r.output_ids == PERIOD[:8] for r in results)  # drafts never change outputs
    return [(r.metrics.drafted, r.metrics.accepted) for r in results]


@pytest.mark.parametrize("layered", [False, True])
def test_scopes_never_see_each_others_responses(layered):
    cache = ResponseCache(max_responses=100, max_tokens=1000)
    d = (
        make_drafter("eagle3", draft_model=NoDrafter(), suffix=SuffixSpec(threshold=2), cache=cache)
        if layered
        else (SuffixDrafter(SuffixSpec(), cache))
    )
    assert _run_scoped(d, "tenant-a") == [(0, 0)]  # cold: nothing to draft from
    # Tenant a's response is in its scope only: b, the shared scope and an opted-out request
    # draft nothing from it, in the same batch as a request of a that does.
    (a, b, shared, private) = _run_scoped(d, "tenant-a", "tenant-b", "", None)
    assert a[0] > 0 and a[1] == a[0]  # the cached continuation is the target's
    assert b == shared == private == (0, 0)
    assert set(cache.parts) == {"tenant-a", "tenant-b", ""}  # the opted-out request fed nothing
    assert d.sources.drafted["suffix"] == a[0]


def test_an_opted_out_request_neither_reads_nor_feeds_the_cache():
    cache = ResponseCache(max_responses=100, max_tokens=1000)
    d = SuffixDrafter(SuffixSpec(), cache)
    assert _run_scoped(d, None) == [(0, 0)] and cache.live_tokens == 0 and not cache.parts
    assert _run_scoped(d, "") == [(0, 0)]  # nothing was kept for the shared scope either
    assert _run_scoped(d, None) == [(0, 0)]  # the shared response is there, but not read
    assert _run_scoped(d, "")[0][0] > 0  # as a shared request shows
    assert len(cache.sizes) == 2  # the two shared requests' responses, nothing else


def test_the_caps_hold_for_all_scopes_together_oldest_evicted_first():
    cache = ResponseCache(max_responses=4, max_tokens=60)
    for r in range(30):
        cache.add([1000 + r] * 6 + [r, r + 1], scope=f"tenant-{r % 7}")
        assert cache.live_tokens <= 60 and len(cache.sizes) <= 4
        assert cache.held_tokens <= 2 * 60 and len(cache.parts) <= 4  # scopes with no live response go
    # The four newest responses are live, whatever their scopes; the older ones are gone.
    assert [part.scope for part in cache.owners] == [f"tenant-{r % 7}" for r in range(26, 30)]
    assert cache.candidates([1029, 29, 30], 24, "tenant-1")  # response 29 is tenant 1's ...
    assert not cache.candidates([1029, 29, 30], 24, "tenant-0")  # ... and no other scope's
    assert not cache.candidates([1029, 29, 30], 24, None)
    assert not cache.candidates([1025, 25, 26], 24, "tenant-4")  # evicted (the oldest first)
    cache.clear()
    assert cache.live_tokens == cache.held_tokens == 0 and not cache.parts


def test_each_tenant_has_its_own_share_and_evicts_only_its_own_responses():
    cache = ResponseCache(max_responses=4, max_tokens=60, tenants=2)
    assert (cache.share_responses, cache.share_tokens) == (2, 30)
    cache.add([500, 501, 502], scope="b")  # tenant b's one response
    for r in range(30):  # tenant a floods, under two of its users' scopes
        cache.add([1000 + r] * 6 + [r, r + 1], scope=f"a/user-{r % 2}")
        assert cache.shares["a"].live_tokens <= 30 and len(cache.shares["a"].sizes) <= 2
    assert cache.candidates([9, 500, 501], 24, "b")  # a's flood evicted none of b's
    assert [part.scope for part in cache.shares["a"].owners] == ["a/user-0", "a/user-1"]  # a's newest two
    assert not cache.candidates([1027, 27, 28], 24, "a/user-1")  # a's older ones: evicted, oldest first
    cache.add([700, 701, 702], scope="c/x")  # a third tenant: both shares are held, nothing kept
    assert "c/x" not in cache.parts and set(cache.shares) == {"a", "b"}
    assert not cache.candidates([9, 500, 501], 24, "a/user-0")  # scopes still never see each other


def test_cache_memory_per_token_is_what_the_docs_say():
    """BYTES_PER_TOKEN is the documented cost of a cached token (spec cache_tokens x it)."""
    gen = torch.Generator().manual_seed(0)
    responses = [torch.randint(0, 49152, (200,), generator=gen).tolist() for _ in range(100)]
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    cache = ResponseCache(max_responses=1000, max_tokens=1 << 20)
    for r in responses:
        cache.add(r)
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    per_token = used / cache.live_tokens
    assert per_token <= BYTES_PER_TOKEN, per_token


def test_cache_memory_per_scope_is_what_the_docs_say():
    """Scopes of one short response each, under the longest keys: every scope costs at most
    BYTES_PER_SCOPE beyond BYTES_PER_TOKEN per token (docs/suffix.md's bound)."""
    gen = torch.Generator().manual_seed(0)
    responses = torch.randint(0, 49152, (1000, 1), generator=gen).tolist()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    cache = ResponseCache(max_responses=1000, max_tokens=1 << 20)
    for i, r in enumerate(responses):
        cache.add(r, scope=f"{i:04d}" + "\U0001f600" * 63)  # 256 UTF-8 bytes, 4 bytes a character in memory
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert len(cache.parts) == 1000
    per_scope = (used - cache.live_tokens * BYTES_PER_TOKEN) / len(cache.parts)
    assert per_scope <= BYTES_PER_SCOPE, per_scope


def test_released_requests_leave_no_index_behind():
    d = SuffixDrafter(SuffixSpec(), response_cache(SuffixSpec()))
    res = greedy(d, [1, 2, 3], max_tokens=30)
    assert res.output_ids and not d.sessions  # generate pops every result: release dropped it


def test_batch_cancel_releases_the_sequence():
    calls = []

    class Recording(NoDrafter):
        capabilities = Capabilities(releases=True)

        def release(self, prompt_ids, output_ids):
            calls.append((list(prompt_ids), list(output_ids)))

    batch = Batch(Recording(), PeriodicVerifier())
    key = batch.add(GenerationRequest([5, 6], 10, 2))
    batch.step()
    res = batch.cancel(key)
    assert calls == [([5, 6], res.output_ids)] and res.output_ids == [11]


# ---------------------------------------------------------------- through the loop


def test_greedy_output_identical_and_repeats_accepted():
    target = greedy(NoDrafter(), [1, 2, 3], max_tokens=60)
    d = SuffixDrafter(SuffixSpec())
    spec = greedy(d, [1, 2, 3], max_tokens=60)
    assert spec.output_ids == target.output_ids
    assert spec.metrics.accepted > 0.8 * spec.metrics.drafted > 0
    assert spec.metrics.target_forwards < target.metrics.target_forwards / 3
    assert d.sources.drafted["suffix"] == spec.metrics.drafted
    assert d.sources.accepted["suffix"] == spec.metrics.accepted


class Unrelated(Drafter):
    """A model draft that is always wrong."""

    def propose(self, contexts, ks):
        return [[3] * k for k in ks]


def test_layered_uses_suffix_where_the_match_is_long_and_counts_per_source():
    sx = SuffixSpec(threshold=4)
    d = make_drafter("eagle3", draft_model=Unrelated(), suffix=sx)
    assert isinstance(d, LayeredDrafter)
    target = greedy(NoDrafter(), [1, 2, 3], max_tokens=60)
    res = greedy(d, [1, 2, 3], max_tokens=60)
    assert res.output_ids == target.output_ids
    src = d.sources
    assert src.drafted["model"] > 0 and src.accepted.get("model", 0) == 0  # the first period: no match yet
    assert src.drafted["suffix"] > 0 and src.acceptance_rate("suffix") > 0.8
    assert src.drafted["model"] + src.drafted["suffix"] == res.metrics.drafted
    assert src.accepted.get("model", 0) + src.accepted["suffix"] == res.metrics.accepted


def test_source_counts_refuse_impossible_counts():
    c = SourceCounts()
    c.record("suffix", 4, 3)
    assert c.to_dict() == {"suffix": {"drafted": 4, "accepted": 3}} and c.acceptance_rate("model") == 0.0
    with pytest.raises(ValueError):
        c.record("suffix", 2, 3)


# ---------------------------------------------------------------- sampling stays lossless

V = 6


def _markov():
    g = torch.Generator().manual_seed(0)
    return torch.randn((V, V), generator=g, dtype=torch.float64)


TARGET = _markov()


class MarkovVerifier:
    def verify(self, contexts, drafts, want_logits=None, context_phase=None):
        out = []
        for ctx, d in zip(contexts, drafts):
            logits = TARGET[[ctx[-1]] + list(d)]
            out.append(Verdict(torch.argmax(logits, -1).tolist(), None, logits))
        return out


class SampledModel(Drafter):
    """A model draft with distributions (uniform q), to exercise the layered sampled path."""

    capabilities = Capabilities(samples=True)

    def propose(self, contexts, ks):
        return [[0] * k for k in ks]

    def propose_sampled(self, contexts, ks, params, gens):
        q = torch.full((V,), 1.0 / V, dtype=torch.float64)
        return [([int(torch.multinomial(q, 1, generator=g)) for _ in range(k)], q.repeat(k, 1)) for k, g in zip(ks, gens)]


def _joint_p_value(drafter_factory, n=2000, t=4) -> tuple[float, int]:
    """(p-value of the outputs against the target's exact joint, drafts accepted)."""
    params = SamplingParams(1.0, seed=5)
    # Every pair of tokens occurs in the prompt, so the suffix drafter proposes at every step.
    prompt = [x for a in range(V) for b in range(V) for x in (a, b)]
    accepted = 0
    reqs = [GenerationRequest(prompt, t, 3, sampling=SamplingParams(1.0, seed=params.seed + i)) for i in range(n)]
    counts = torch.zeros((V,) * t, dtype=torch.float64)
    drafter = drafter_factory()  # one drafter (and cache) for every batch of 100
    for first in range(0, n, 100):
        for res in generate(reqs[first : first + 100], drafter, MarkovVerifier()):
            counts[tuple(res.output_ids)] += 1
            accepted += res.metrics.accepted
    p = torch.softmax(TARGET, -1)
    probs = p[prompt[-1]]
    for _ in range(t - 1):
        probs = probs.unsqueeze(-1) * p[torch.arange(V)].view(*([1] * (probs.dim() - 1)), V, V)
    return joint_p_value(counts, probs), accepted


@pytest.mark.parametrize(
    "factory",
    [
        lambda: SuffixDrafter(SuffixSpec(min_token_prob=0.0), response_cache(SuffixSpec())),
        lambda: make_drafter("eagle3", draft_model=SampledModel(), suffix=SuffixSpec(threshold=2, min_token_prob=0.0)),
    ],
    ids=["suffix", "layered"],
)
def test_sampling_draws_the_target_joint(factory):
    # Seeded, so deterministic; at level 0.001 a correct sampler fails 1 seed in 1000.
    p_value, accepted = _joint_p_value(factory)
    # Drafts were proposed and accepted throughout: the tally over 2,000 requests of 4 tokens is
    # the seeds' (965 for the layered drafter at these); the p-value is the test.
    assert p_value > 1e-3 and accepted > 500


def test_sampling_check_catches_accept_all_with_suffix_drafts(monkeypatch):
    """The same test has power here: a sampler that skips the rejection step fails it."""
    from trtspec.speculative import loop
    from trtspec.testing.markov_pair import accept_all

    monkeypatch.setattr(loop, "accept_or_resample", accept_all)
    assert _joint_p_value(lambda: SuffixDrafter(SuffixSpec(min_token_prob=0.0)))[0] < 1e-3


# ---------------------------------------------------------------- tiny models, in process

TINY_PROMPTS = [
    "The quick brown fox",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(",
    '{"id": 1, "name": "a"}\n{"id": 2, "name": "b"}\n{"id": 3, "name": "',
]


@pytest.mark.parametrize("prompt", TINY_PROMPTS)
def test_tiny_suffix_output_identical_to_target_only(built, prompt):
    dep = built(None, **{"speculative.method": "suffix", "speculative.max_draft_len": 8})
    req = dep.request(dep.encode(prompt), 48)
    (target,) = dep.generate([req], speculative=False)
    (spec,) = dep.generate([req], speculative=True)
    assert spec.output_ids == target.output_ids


def test_tiny_layered_output_identical_and_both_sources_draft(built):
    dep = built("draft", **{"speculative.suffix.threshold": 2})
    drafter = dep.drafter()
    assert isinstance(drafter, LayeredDrafter)
    from trtspec.speculative.loop import generate as run_loop

    for prompt in TINY_PROMPTS:
        req = dep.request(dep.encode(prompt), 48)
        (target,) = dep.generate([req], speculative=False)
        (spec,) = run_loop([req], drafter, dep.verifier())
        assert spec.output_ids == target.output_ids
    assert drafter.sources.drafted.get("model", 0) > 0 and drafter.sources.drafted.get("suffix", 0) > 0


def test_tiny_deployment_keeps_one_bounded_cache_across_calls(built):
    dep = built(
        None,
        **{"speculative.method": "suffix", "speculative.suffix.cache_responses": 2, "speculative.suffix.cache_tokens": 64},
    )
    assert dep.suffix_cache is not None
    for prompt in TINY_PROMPTS * 2:
        dep.generate([dep.request(dep.encode(prompt), 40)])
        assert dep.suffix_cache.live_tokens <= 64 and len(dep.suffix_cache.sizes) <= 2
    assert dep.suffix_cache.live_tokens > 0  # outputs of earlier calls are there for later ones
    # Comparisons (verify, bench) start cold: no prompt drafts from its own earlier run.
    dep.forget_prefixes()
    assert dep.suffix_cache.live_tokens == 0 and not dep.suffix_cache.sizes
    apart = built(None, **{"speculative.method": "suffix", "speculative.suffix.cache_responses": 0})
    assert apart.suffix_cache is None


def test_tiny_scoped_requests_output_identical_to_target_only(built):
    dep = built(None, **{"speculative.method": "suffix"})
    dep.forget_prefixes()
    for scope in ("tenant-a", "tenant-b", "tenant-a", None, ""):
        for prompt in TINY_PROMPTS:
            req = dep.request(dep.encode(prompt), 40, suffix_scope=scope)
            (target,) = dep.generate([req], speculative=False)
            (spec,) = dep.generate([req])
            assert spec.output_ids == target.output_ids
    assert set(dep.suffix_cache.parts) == {"tenant-a", "tenant-b", ""}


@pytest.mark.parametrize(
    "scope, needle",
    [
        ("x" * 257, "suffix_scope is 257 bytes, more than 256"),
        ("a\nb", "suffix_scope holds a control character"),
        ("\ud800", "suffix_scope is not valid UTF-8"),
        (7, "suffix_scope must be text"),
    ],
)
def test_malformed_scope_is_refused_by_name(scope, needle):
    from trtspec.errors import RequestError
    from trtspec.speculative.requests import Limits, make_request

    with pytest.raises(RequestError, match=needle):
        make_request([1, 2], 4, 2, Limits(vocab_size=100, max_seq_len=64, max_draft_len=4), suffix_scope=scope)
    assert make_request([1, 2], 4, 2, Limits(100, 64, 4), suffix_scope="é" * 128).suffix_scope == "é" * 128  # 256 bytes


def test_tiny_sampling_check_passes_with_suffix_drafts(built):
    """verify --sampling's check on a suffix deployment: the samples follow the target's
    exact conditionals (seeded: deterministic)."""
    from trtspec.verify.sampling import check_deployment

    dep = built(None, **{"speculative.method": "suffix", "speculative.max_draft_len": 8})
    params = SamplingParams(temperature=1.0, seed=7)
    check = check_deployment(dep, TINY_PROMPTS, 20, 12, params)
    assert check.values >= 60 and check.passed, check.describe()


# ---------------------------------------------------------------- the spec and its exports

from conftest import write_spec  # noqa: E402

from trtspec.engines.trtllm import llmapi  # noqa: E402
from trtspec.errors import SpecError  # noqa: E402
from trtspec.spec import load_spec  # noqa: E402
from trtspec.trtllm_lines.fields import DECODING_TYPES, SA_ENHANCER, unknown_keys  # noqa: E402

LLMAPI_13 = {"backend": "trtllm", "speculative.default_draft_tokens": None, "trtllm.line": "1.3+"}


def _spec_error(tmp_path, tiny_ckpts, draft=None, **overrides) -> str:
    with pytest.raises(SpecError) as info:
        load_spec(write_spec(tmp_path, tiny_ckpts, draft, **overrides))
    assert info.value.exit_code == 2
    return str(info.value)


@pytest.mark.parametrize(
    "draft, overrides, needle",
    [
        ("draft", {"speculative.method": "suffix"}, "method suffix uses no draft model; remove `draft`"),
        (None, {"speculative.method": "ngram", "speculative.suffix.max_depth": 8}, "method ngram takes no suffix settings"),
        (None, {"speculative.method": "suffix", "speculative.suffix.threshold": 3}, "method suffix has no model draft"),
        (None, {"speculative.method": "suffix", "speculative.suffix.max_depth": 2}, "speculative.suffix.max_depth"),
        (None, {"speculative.method": "suffix", "speculative.suffix.min_token_prob": 1.5}, "min_token_prob"),
        (None, {"speculative.method": "suffix", "speculative.suffix.cache_size": 5}, "cache_size: unknown key"),
        (None, {"speculative.method": "suffix", **LLMAPI_13, "trtllm.line": "1.2"}, "TensorRT-LLM 1.2 has no suffix automaton"),
        ("draft", {"speculative.suffix.threshold": 3, **LLMAPI_13}, "Draft_Target config has no sa_config"),
        (None, {"speculative.method": "suffix", **LLMAPI_13, "speculative.suffix.min_token_prob": 0.3}, "keeps no frequencies"),
        (None, {"speculative.method": "suffix", **LLMAPI_13, "speculative.suffix.cache_responses": 2}, "global_pool_size"),
        ("draft", {"speculative.suffix.threshold": 3, "backend": "trtllm", "trtllm.runtime": "engine"}, "no suffix drafting"),
    ],
)
def test_spec_refusals(tmp_path, tiny_ckpts, draft, overrides, needle):
    assert needle in _spec_error(tmp_path, tiny_ckpts, draft, **overrides)


def test_suffix_drafting_of_each_method(tmp_path, tiny_ckpts):
    suffix = load_spec(write_spec(tmp_path / "s", tiny_ckpts, None, **{"speculative.method": "suffix"})).spec
    assert suffix.speculative.suffix_drafting == SuffixSpec()
    plain = load_spec(write_spec(tmp_path / "p", tiny_ckpts)).spec
    assert plain.speculative.suffix_drafting is None
    layered = load_spec(write_spec(tmp_path / "l", tiny_ckpts, **{"speculative.suffix.threshold": 6})).spec
    assert layered.speculative.suffix_drafting.threshold == 6


def test_llmapi_sa_config_standalone_and_layered_against_the_inventory(tmp_path, tiny_ckpts):
    sa = load_spec(write_spec(tmp_path / "sa", tiny_ckpts, None, **{"speculative.method": "suffix", **LLMAPI_13})).spec
    cfg = llmapi.speculative_config(sa, None, "1.3+")
    assert cfg == {
        "decoding_type": "SA",
        "max_draft_len": 8,
        "max_matching_ngram_size": -1,
        "enable_global_pool": True,
        "global_pool_size": 1000,
    }
    assert unknown_keys({"speculative_config": cfg}, "1.3+") == []
    eagle = load_spec(
        write_spec(tmp_path / "e", tiny_ckpts, **{"speculative.method": "eagle3", "speculative.suffix.threshold": 5, **LLMAPI_13})
    ).spec
    cfg = llmapi.speculative_config(eagle, tmp_path / "head", "1.3+")
    assert cfg["decoding_type"] == "Eagle3" and cfg["sa_config"] == {"threshold": 5, "enable_global_pool": True}
    assert unknown_keys({"speculative_config": cfg}, "1.3+") == []
    # The inventory catches a wrong name inside sa_config, and SA is absent from 1.2.
    bad = cfg | {"sa_config": {"threshold": 5, "global_pool_size": 64}}
    assert [str(u) for u in unknown_keys({"speculative_config": bad}, "1.3+")] == [
        "speculative_config.sa_config.global_pool_size (TensorRT-LLM 1.3+)"
    ]
    assert "SA" not in DECODING_TYPES["1.2"] and "1.2" not in SA_ENHANCER
    with pytest.raises(Exception, match="decoding_type for method suffix"):
        llmapi.check_keys({"speculative_config": llmapi.speculative_config(sa, None, "1.3+")}, "test")


def test_llmapi_build_and_double_run_suffix(tmp_path, tiny_ckpts):
    """The SA arguments a build writes load in the LLM API's conformance double and decode
    the same tokens as its control configuration."""
    from trtspec.engines.build import build
    from trtspec.speculative.llmapi import DOUBLE, load_api, make_llm

    loaded = load_spec(write_spec(tmp_path, tiny_ckpts, None, **{"speculative.method": "suffix", **LLMAPI_13}))
    build(loaded, loaded.output_dir())
    api = load_api(DOUBLE, "1.3+")
    outs = {}
    for name in ("speculative", "control"):
        llm = make_llm(api, loaded.output_dir() / "llmapi" / f"{name}.yaml")
        try:
            params = api.SamplingParams(max_tokens=24, top_k=1, return_perf_metrics=True)
            # The same prompt twice: the second request drafts from the first one's output
            # (the global pool, enable_global_pool), so its drafts are accepted.
            outs[name] = [llm.generate([[1, 2, 3, 4]], params)[0].outputs[0] for _ in range(2)]
        finally:
            llm.shutdown()
    assert [o.token_ids for o in outs["speculative"]] == [o.token_ids for o in outs["control"]]
    second = outs["speculative"][1].request_perf_metrics.speculative_decoding
    assert second.total_accepted_draft_tokens > 0


# ---------------------------------------------------------------- bench --methods, two prompt sets


def test_bench_methods_reports_each_prompt_set_with_suffix_and_layered_rows(built, tmp_path):
    import json

    from typer.testing import CliRunner

    from trtspec.cli.app import app

    dep = built("draft")  # a draft_target spec: suffix and draft_target+suffix over its target
    chat, repeat = tmp_path / "chat.jsonl", tmp_path / "repeat.jsonl"
    chat.write_text(json.dumps({"prompt": "The quick brown fox"}) + "\n")
    repeat.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in TINY_PROMPTS[1:]))
    out = tmp_path / "bench.json"
    args = ["bench", str(dep.loaded.path), "--max-tokens", "16", "--sweep", "none", "-c", "1", "-o", str(tmp_path / "o")]
    args += ["--methods", "suffix,draft_target,draft_target+suffix,ngram", "--json-file", str(out)]
    r = CliRunner().invoke(app, [*args, "--methods-prompts", str(chat), "--methods-prompts", str(repeat)])
    assert r.exit_code == 0, r.output
    rows = json.loads(out.read_text())["methods"]
    assert [(row["prompt_set"], row["method"].split()[0]) for row in rows] == [
        (s, m) for s in ("chat", "repeat") for m in ("target-only", "suffix", "draft_target", "draft_target+suffix", "ngram")
    ]
    assert [row["prompts"] for row in rows] == [1] * 5 + [2] * 5
    assert all(row["identical_to_target_only"] for row in rows)
    layered = [row for row in rows if row["method"].startswith("draft_target+suffix")]
    assert all(set(row["by_source"]) <= {"model", "suffix"} and row["by_source"] for row in layered)
    assert sum(row["by_source"].get("model", {}).get("drafted", 0) for row in layered) > 0
    r = CliRunner().invoke(app, [*args[:-4], "--methods-prompts", str(chat)])
    assert r.exit_code == 2 and "--methods-prompts chooses the prompts --methods compares on" in r.output


def test_load_aware_schedule_caps_suffix_drafts():
    from trtspec.speculative.schedule import LoadPolicy

    d = SuffixDrafter(SuffixSpec(spec_factor=4.0))
    batch = Batch(d, PeriodicVerifier(), policy=LoadPolicy.of({1: 8, 2: 2}, None))
    keys = [batch.add(GenerationRequest([1, 2, 3], 40, 8)) for _ in range(2)]
    longest = 0
    while batch.active:
        report = batch.step()
        longest = max(longest, report.draft_len)
    results = [batch.pop(k) for k in keys]
    assert longest == 2  # two sequences at once: the schedule's k
    assert all(r.output_ids == greedy(NoDrafter(), [1, 2, 3], 40).output_ids for r in results)
    assert max(len(h) for h in [r.metrics.histogram for r in results]) <= 3 and results[0].metrics.accepted > 0

"""The adaptive speculation policy alone (speculative/adaptive.py): fake clocks, fake costs and
fake acceptance streams, so every choice here is deterministic."""

from __future__ import annotations

import pytest

from trtspec.speculative.adaptive import (
    OFF,
    Acceptance,
    AdaptivePolicy,
    AdaptiveSettings,
    Choice,
    CostModel,
    choice_key,
    expected_tokens,
    parse_choice_key,
)

FREE = frozenset({"ngram", "suffix"})


def policy(methods=("draft_target", "suffix", "ngram"), **kw) -> AdaptivePolicy:
    return AdaptivePolicy(AdaptiveSettings(tuple(methods), FREE & set(methods), kw.pop("max_draft_len", 5), **kw))


def costs(p: AdaptivePolicy, base: float, per_token: float, spread=(1, 2, 4, 6)) -> None:
    """Target forwards measured as base + per_token * tokens scored."""
    for t in spread * 4:
        p.costs.verified(t, base + per_token * t)


def feed(p, state, drafter, drafted, accepted, times=1):
    for _ in range(times):
        p.observe(state, drafter, drafted, accepted)


def test_expected_tokens_is_the_geometric_sum():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert choice_key("suffix", 3) == "suffix:3" and parse_choice_key("draft_target:2") == ("draft_target", 2)


def test_acceptance_counts_positions_tried_up_to_the_first_rejection():
    a = Acceptance()
    a.add(4, 4, 1.0)  # all four accepted: four tried, four accepted
    a.add(4, 1, 1.0)  # one accepted then a rejection: two tried
    assert (a.accepted, a.tried) == (5, 6)
    a.add(4, 0, 0.5)  # decayed, then one rejection tried
    assert (a.accepted, a.tried) == (2.5, 4.0)


def test_the_verify_cost_is_fitted_from_the_forwards_timings():
    clock = iter(range(100)).__next__
    m = CostModel(FREE, window=8, clock=clock)
    for t in (1, 3, 5, 9):
        m.verified(t, 0.02 + 0.001 * t)
    base, per = m.fit()
    assert base == pytest.approx(0.02) and per == pytest.approx(0.001)
    flat = CostModel(FREE)
    for _ in range(4):
        flat.verified(1, 0.03)
    assert flat.fit() == (0.03, 0.0)  # one token count: no per-token cost measured yet
    m.drafted("ngram", 3, 2, 1.0)
    m.drafted("draft_target", 2, 2, 0.04)
    assert m.draft_cost("ngram") == 0.0 and m.draft_cost("draft_target") == pytest.approx(0.01)
    assert m.clock() == 0  # the injected clock


def test_good_acceptance_on_a_memory_bound_target_drafts_the_most_it_can():
    p = policy()
    costs(p, base=0.030, per_token=0.0005)
    s = p.new_request()
    feed(p, s, "draft_target", 5, 5, times=6)
    assert p.choose(s, {"draft_target": 5}, ceiling=5, active=1) == Choice("draft_target", 5)
    assert p.choose(s, {"draft_target": 5}, ceiling=3, active=1) == Choice("draft_target", 3)  # the load cap applies


def test_poor_acceptance_on_a_compute_bound_target_turns_speculation_off():
    p = policy()
    costs(p, base=0.001, per_token=0.010)
    s = p.new_request()
    feed(p, s, "draft_target", 4, 0, times=6)
    assert p.choose(s, {"draft_target": 5}, ceiling=5, active=1) == Choice(OFF, 0)


def test_the_model_drafts_cost_is_weighed_against_its_tokens():
    """Same acceptance: a free drafter's k = 5 wins; a model whose draft step costs as much as
    the verify drafts less, or not at all."""
    p = policy()
    costs(p, base=0.030, per_token=0.0005)
    s = p.new_request()
    feed(p, s, "draft_target", 5, 3, times=6)
    feed(p, s, "ngram", 5, 3, times=6)
    cheap = p.choose(s, {"draft_target": 5}, ceiling=5, active=1).k
    p.costs.drafted("draft_target", 1, 1, 0.040)
    dear = p.choose(s, {"draft_target": 5}, ceiling=5, active=1)
    assert dear.k < cheap
    assert p.choose(s, {"draft_target": 5, "ngram": 5}, ceiling=5, active=1) == Choice("ngram", 5)


def test_speculation_that_is_off_re_probes_and_comes_back():
    p = policy(methods=("ngram",), probe_every=4)
    costs(p, base=0.030, per_token=0.0005)
    s = p.new_request()
    feed(p, s, "ngram", 3, 0, times=12)  # free text: every draft rejected
    choices = [p.choose(s, {"ngram": 3}, ceiling=3, active=1) for _ in range(8)]
    assert [c.k for c in choices] == [0, 0, 0, 1, 0, 0, 0, 1]  # off, with a one-token probe every 4 steps
    assert all(c.probe for c in choices if c.k)
    feed(p, s, "ngram", 1, 1, times=3)  # the text became predictable: probes accepted
    assert p.choose(s, {"ngram": 3}, ceiling=3, active=1).k > 0


def test_nothing_stale_survives_a_load_drop():
    """Off at 8 active sequences on a compute-bound target (the costs, not the acceptance,
    turn it off), back at once when the load falls: no state remembers the high load."""
    p = policy(methods=("draft_target",))
    costs(p, base=0.080, per_token=0.010)
    s = p.new_request()
    for _ in range(4):
        feed(p, s, "draft_target", 4, 1)
        feed(p, s, "draft_target", 4, 0)
    assert p.choose(s, {"draft_target": 5}, ceiling=5, active=8).k == 0
    assert p.choose(s, {"draft_target": 5}, ceiling=5, active=1).k > 0


def test_free_drafters_are_used_where_they_propose_and_the_model_elsewhere():
    """One request whose text switches from repetitive (n-gram drafts and is accepted) to free
    (n-gram finds nothing): the choice follows within the request."""
    p = policy()
    costs(p, base=0.030, per_token=0.0005)
    p.costs.drafted("draft_target", 1, 1, 0.004)
    s = p.new_request()
    seen = []
    for step in range(24):
        repetitive = step < 12
        offers = {"draft_target": 5, "ngram": 5 if repetitive else 0, "suffix": 0}
        c = p.choose(s, offers, ceiling=5, active=1)
        seen.append(c.drafter)
        p.observe(s, c.drafter, c.k, c.k if c.drafter == "ngram" else c.k // 2)
    assert seen[2:12].count("ngram") >= 9
    assert seen[14:] == ["draft_target"] * 10


def test_a_drafter_left_untried_is_measured_again():
    p = policy(methods=("draft_target", "ngram"), probe_every=5)
    costs(p, base=0.030, per_token=0.0005)
    s = p.new_request()
    feed(p, s, "draft_target", 5, 5, times=6)
    feed(p, s, "ngram", 5, 0, times=6)
    picks = [p.choose(s, {"draft_target": 5, "ngram": 5}, ceiling=5, active=1) for _ in range(12)]
    ngram = [i for i, c in enumerate(picks) if c.drafter == "ngram"]
    assert ngram == [5, 11] and all(picks[i].probe for i in ngram)  # after 5 steps untried, not every step


def test_a_free_drafters_offer_is_measured_against_the_steps_tokens_without_being_sent():
    """shadow: the step's tokens (accepted drafts, then the target's own) are the target's, so
    an unsent free offer is checked as far as they reach; a model draft never is (it was not drafted)."""
    p = policy()
    s = p.new_request()
    p.shadow(s, "ngram", [7, 8, 9, 4], known=[7, 8, 1])  # two agree, the third is the target's other token
    assert (s.acceptance["ngram"].accepted, s.acceptance["ngram"].tried) == (2, 3)
    p.shadow(s, "suffix", [7, 8, 9, 4], known=[7, 8])  # agrees as far as known: no rejection counted
    assert (s.acceptance["suffix"].accepted, s.acceptance["suffix"].tried) == (2, 2)
    p.shadow(s, "draft_target", [7, 8], known=[7, 8])
    assert s.acceptance["draft_target"].tried == 0
    assert p.deployment["ngram"].tried == 3 and p.deployment["suffix"].tried == 2


def test_a_free_drafter_measured_every_step_is_never_probed():
    """The stale-drafter and off re-probes are for drafters nothing measured: a free drafter
    checked on every step (shadow) keeps losing to the model without a probe step."""
    p = policy(methods=("draft_target", "ngram"), probe_every=5)
    costs(p, base=0.030, per_token=0.0005)
    s = p.new_request()
    feed(p, s, "draft_target", 5, 5, times=6)
    picks = []
    for _ in range(12):
        picks.append(p.choose(s, {"draft_target": 5, "ngram": 5}, ceiling=5, active=1))
        p.observe(s, "draft_target", 5, 5)
        p.shadow(s, "ngram", [1, 2, 3, 4, 5], known=[9, 9, 9, 9, 9, 9])
    assert [c.drafter for c in picks] == ["draft_target"] * 12 and not any(c.probe for c in picks)


def test_off_re_probes_only_a_drafter_nothing_measured():
    """Off with the model and n-gram offering: the n-gram's offers are measured each step (and
    rejected), so the re-probe after probe_every steps off tries the model, not the n-gram."""
    p = policy(methods=("draft_target", "ngram"), probe_every=4)
    costs(p, base=0.010, per_token=0.004)  # compute-bound: poor drafts lose
    p.costs.drafted("draft_target", 1, 1, 0.004)
    s = p.new_request()
    feed(p, s, "draft_target", 5, 0, times=8)
    picks = []
    for _ in range(8):
        picks.append(p.choose(s, {"draft_target": 5, "ngram": 5}, ceiling=5, active=1))
        p.shadow(s, "ngram", [1, 2, 3, 4, 5], known=[9])
    probes = [c for c in picks if c.probe]
    assert [c.k for c in picks].count(0) >= 6 and probes
    assert all(c.drafter == "draft_target" for c in probes)


def test_a_draft_call_that_caught_up_on_a_prompt_does_not_read_as_the_draft_cost():
    # a request's first model draft also forwards its prompt: one call ~20x a step's time per
    # step; the cost the policy weighs k against stays the steps' own (a running mean read 0.0575)
    m = CostModel(FREE)
    for _ in range(10):
        m.drafted("draft_target", 5, 1, 0.05)
    m.drafted("draft_target", 1, 1, 0.2)
    assert m.draft_cost("draft_target") == pytest.approx(0.01)
    for _ in range(20):  # a lasting change in the step's cost is followed within the window
        m.drafted("draft_target", 5, 1, 0.1)
    assert m.draft_cost("draft_target") == pytest.approx(0.02)

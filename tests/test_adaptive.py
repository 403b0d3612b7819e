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


# ---------------------------------------------------------------- what the batch gets per second

# A verify of 8 x (k + 1) tokens at k = 1 costs 1.6x a one-token-per-row step of 8 rows
# (base + 16 x per_token = 1.6 x (base + 8 x per_token)); a draft step costs the same at 1 and 8 rows.
BASE, PER_TOKEN, STEP = 0.030, 0.005625, 0.012


def batch_costs(p: AdaptivePolicy, base=BASE, per_token=PER_TOKEN, step=STEP, rows=(1, 8)) -> None:
    costs(p, base, per_token, spread=(1, 2, 8, 16))
    for n in rows:
        for _ in range(3):
            p.costs.drafted("draft_target", 1, n, step)


def accepting(p: AdaptivePolicy, s, a: float, drafter="draft_target") -> None:
    """The request's (and the deployment's) acceptance of ``drafter`` is ``a``."""
    s.acceptance[drafter] = Acceptance(1000 * a, 1000)
    p.deployment[drafter] = Acceptance(1000 * a, 1000)


def step(p: AdaptivePolicy, states, offers=None, ceiling=5) -> list[Choice]:
    """One step of the loop's choices: per row, then settled for the batch."""
    n = len(states)
    per_row = [p.choose(s, offers or {"draft_target": ceiling}, ceiling, n) for s in states]
    return p.settle(states, per_row)


def test_a_draft_step_is_kept_by_rows_drafted_median_per_entry_interpolated_between():
    m = CostModel(FREE)
    m.drafted("draft_target", 2, 1, 0.020)  # 0.010 a step over 1 row
    m.drafted("draft_target", 1, 1, 0.500)  # a prompt catch-up: one call, not the median
    m.drafted("draft_target", 1, 1, 0.010)
    m.drafted("draft_target", 4, 8, 0.080)  # 0.020 a step over 8 rows
    assert m.draft_step("draft_target", 1) == pytest.approx(0.010)
    assert m.draft_step("draft_target", 8) == pytest.approx(0.020)
    assert m.draft_step("draft_target", 4) == pytest.approx(0.010 + 0.010 * 3 / 7)  # between 1 and 8 rows
    assert m.draft_step("draft_target", 16) == pytest.approx(0.020)  # beyond the largest measured: the nearest
    assert m.draft_cost("draft_target", 8) == pytest.approx(0.0025)  # shared by 8 rows
    assert m.draft_step("ngram", 8) == 0.0 and CostModel(FREE).draft_step("draft_target", 2) == 0.0


def test_eight_rows_whose_drafts_do_not_pay_for_the_batchs_wait_draft_nothing():
    """Acceptance 0.7 on every row: at 8 rows a draft step and the wider verify cost the batch
    more than the drafts it accepts (off); the same request alone drafts (next test)."""
    p = policy(methods=("draft_target",))
    batch_costs(p)
    states = [p.new_request() for _ in range(8)]
    for s in states:
        accepting(p, s, 0.7)
    assert step(p, states) == [Choice(OFF, 0)] * 8


def test_the_same_costs_at_one_row_draft():
    p = policy(methods=("draft_target",))
    batch_costs(p)
    s = p.new_request()
    accepting(p, s, 0.7)
    (c,) = step(p, [s])
    assert c.drafter == "draft_target" and c.k >= 1


def test_a_model_draft_step_measured_on_lone_calls_is_shared_when_eight_rows_draft():
    """The draft step was only measured over 1 row (lone probes): 8 rows drafting together wait
    for ONE call of that cost, not 8 (a per-row price read it as 8x and turned drafting off)."""
    p = policy(methods=("draft_target",))
    batch_costs(p, per_token=0.000511, step=0.005, rows=(1,))
    states = [p.new_request() for _ in range(8)]
    for s in states:
        accepting(p, s, 0.7)
    choices = step(p, states)
    assert all(c.drafter == "draft_target" and c.k >= 1 for c in choices), choices


def lone_drafter(p: AdaptivePolicy, rows: int):
    """Row 0's drafts are good (0.9), every other row's are always rejected (0)."""
    states = [p.new_request() for _ in range(rows)]
    accepting(p, states[0], 0.9)
    for s in states[1:]:
        s.acceptance["draft_target"] = Acceptance(0, 1000)
    return states


def test_one_row_drafting_among_eight_is_charged_the_whole_batchs_wait():
    """Its own share of a step says drafting pays (the step measured over 8 rows, 1/8 each),
    but the draft call it alone needs delays all 8 rows: the batch turns it off."""
    p = policy(methods=("draft_target",))
    batch_costs(p, per_token=0.000511, step=0.020, rows=(8,))
    states = lone_drafter(p, 8)
    assert p.choose(states[0], {"draft_target": 5}, 5, 8).k > 0  # priced alone, it drafts
    states = lone_drafter(p, 8)
    assert step(p, states) == [Choice(OFF, 0)] * 8
    assert states[0].off_steps == 1  # counted as off for its request


def test_a_request_the_batch_turned_off_drafts_again_once_the_load_falls():
    p = policy(methods=("draft_target",), probe_every=4)
    batch_costs(p, per_token=0.000511, step=0.020, rows=(8,))
    states = lone_drafter(p, 8)
    at_eight = [step(p, states) for _ in range(12)]
    assert [c[0].k for c in at_eight].count(0) >= 8
    assert all(any(c.probe for c in cs[1:]) for cs in at_eight if cs[0].k)  # only in a call that runs anyway
    first = step(p, states[:1])  # the other 7 finished
    assert first[0].drafter == "draft_target" and first[0].k >= 1
    assert all(step(p, states[:1])[0].k >= 1 for _ in range(4))


def test_a_probe_is_kept_and_a_row_that_pays_shares_its_call():
    """Row 1 re-probes (k = 1, kept whatever it costs); the call runs anyway, so row 0's good
    draft rides along, capped at the probe's one step where a longer one would not pay."""
    p = policy(methods=("draft_target",), probe_every=2)
    batch_costs(p, per_token=0.000511, step=0.020, rows=(8,))
    states = lone_drafter(p, 8)
    first = step(p, states)
    assert first == [Choice(OFF, 0)] * 8
    second = step(p, states)  # every row but row 0 is due a probe (2 steps off)
    assert all(c == Choice("draft_target", 1, probe=True) for c in second[1:]), second
    assert second[0] == Choice("draft_target", 1)


def test_the_batchs_re_probes_of_the_model_draft_share_one_call_per_probe_period():
    """8 requests off, due for a re-probe at different steps: each probe alone would make all 8
    rows wait for a draft call on most steps; they wait for one call per ``probe_every`` steps
    instead, and every request is still probed within twice that."""
    p = policy(methods=("draft_target",), probe_every=8)
    batch_costs(p)
    states = [p.new_request() for _ in range(8)]
    for j, s in enumerate(states):
        s.acceptance["draft_target"] = Acceptance(0, 1000)
        s.off_steps, s.since_tried["draft_target"] = j, j + 1
    steps = [step(p, states) for _ in range(32)]
    calls = [t for t, cs in enumerate(steps) if any(c.k for c in cs)]
    assert all(c.k == 0 or c == Choice("draft_target", 1, probe=True) for cs in steps for c in cs)
    assert len(calls) <= 32 // 8 + 1 and all(b - a >= 8 for a, b in zip(calls, calls[1:])), calls
    for j in range(8):
        probed = [t for t, cs in enumerate(steps) if cs[j].k]
        assert probed and probed[0] < 16 and all(b - a <= 16 for a, b in zip(probed, probed[1:])), (j, probed)


def test_a_deferred_probe_of_the_model_leaves_the_free_drafter_its_request_chose():
    """A request drafting with the n-gram whose model draft is due a re-probe: when the batch's
    model call is not due, the row keeps its n-gram draft rather than drafting nothing."""
    p = policy(methods=("draft_target", "ngram"), probe_every=4)
    batch_costs(p, step=0.050)
    states = [p.new_request() for _ in range(8)]
    for s in states:
        accepting(p, s, 0.9, "ngram")
        accepting(p, s, 0.2)
    p.since_call["draft_target"] = 0  # the model just drafted for the batch
    states[0].since_tried["draft_target"] = 4  # row 0's model draft is due a re-probe
    first = step(p, states, offers={"draft_target": 5, "ngram": 3})
    assert all(c.drafter == "ngram" and c.k >= 1 and not c.probe for c in first), first
    assert states[0].since_tried["draft_target"] == 5  # still due: not measured


def test_a_probe_not_due_for_the_batch_does_not_run_the_call_for_a_row_that_would_ride_along():
    """Row 0's draft pays only in a call that runs anyway; row 1's re-probe is due but the
    batch's model call is not: the probe waits, so no call runs for the two of them."""
    p = policy(methods=("draft_target",), probe_every=4)
    batch_costs(p, per_token=0.000511, step=0.020, rows=(8,))
    states = lone_drafter(p, 8)
    p.since_call["draft_target"] = 0  # the model just drafted for the batch
    states[1].off_steps, states[1].since_tried["draft_target"] = 3, 4  # due on this step
    assert step(p, states) == [Choice(OFF, 0)] * 8
    assert states[1].off_steps == 4  # still due
    p.since_call["draft_target"] = 3  # the batch's call is due now: the probe runs, row 0 rides along
    choices = step(p, states)
    assert choices[1] == Choice("draft_target", 1, probe=True) and choices[0].k == 1


def test_a_model_draft_the_batch_drops_leaves_the_rows_their_free_drafters_draft():
    """Each row's own share of a step with all 8 drafting picks the model draft, whose one call
    the rows' few choices of it do not pay for; dropped, a row sends its n-gram draft (which pays
    on its own price: no call, only its verify positions), not nothing."""
    p = policy(methods=("draft_target", "ngram"))
    batch_costs(p, per_token=0.000511, step=0.012, rows=(8,))
    states = [p.new_request() for _ in range(8)]
    for s in states[:2]:
        accepting(p, s, 0.95)
        accepting(p, s, 0.3, "ngram")
    for s in states[2:]:
        s.acceptance["draft_target"] = Acceptance(0, 1000)
        accepting(p, s, 0.3, "ngram")
    per_row = [p.choose(s, {"draft_target": 5, "ngram": 3}, 5, 8) for s in states]
    assert [c.drafter for c in per_row[:2]] == ["draft_target"] * 2
    sent = p.settle(states, per_row)
    assert all(c.drafter == "ngram" and c.k >= 1 for c in sent), sent
    assert states[0].since_tried["draft_target"] == 1 and states[0].off_steps == 0  # the model was not tried

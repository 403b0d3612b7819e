"""lab/auto_replay.py's modelled clock: what each call the loop makes costs, and the draft
model's memoised drafts (no engines: a recorded run and a fake draft model)."""

from __future__ import annotations

import pytest

from lab.auto_replay import Costs, ModelClock, replay_method, summarise
from trtspec.speculative.capabilities import Drafter
from trtspec.speculative.loop import NoDrafter

RUN = {"prompt_ids": [1, 2, 3], "output_ids": [5, 6, 7, 8, 9, 10], "end": None, "max_tokens": 6}
COSTS = Costs(target_step=1.0, c=0.5, prefill=2.0, verify_by_k={1: 1.0, 2: 1.2})


class Perfect(Drafter):
    """A draft model that always drafts the recorded output; ``calls`` counts its calls."""

    def __init__(self):
        self.calls = 0

    def propose(self, contexts, draft_lens):
        self.calls += 1
        return [[t for t in RUN["output_ids"][len(c) - 3 :]][:k] for c, k in zip(contexts, draft_lens)]


def test_target_only_costs_the_prefill_then_one_step_a_token():
    clock = ModelClock()
    row = replay_method("target-only", [RUN], lambda counts: NoDrafter(), 0, COSTS, clock)
    assert row["modelled_seconds"] == pytest.approx(2.0 + 5 * 1.0) and row["tokens"] == 6
    assert row["verify_widths"] == {"1": 5} and row["draft_steps"] == 0


def test_a_draft_costs_c_a_step_and_its_verify_the_cost_of_its_width_and_drafts_are_memoised():
    from lab.auto_replay import MemoDraft

    clock, memo, model = ModelClock(), {}, Perfect()
    make = lambda counts: MemoDraft(model, memo, COSTS, clock, counts)  # noqa: E731
    row = replay_method("draft", [RUN], make, 2, COSTS, clock)
    # prefill (token 5); drafts 6 7 accepted + 8; then one token left to draft: 9 accepted + 10
    assert row["modelled_seconds"] == pytest.approx(2.0 + (2 * 0.5 + 1.2) + (1 * 0.5 + 1.0))
    assert row["verify_widths"] == {"3": 1, "2": 1} and row["draft_steps"] == 3
    calls = model.calls
    again = replay_method("draft", [RUN], make, 2, COSTS, clock)
    assert model.calls == calls and again["modelled_seconds"] == row["modelled_seconds"]  # from the memo, same cost
    rows = {"target-only": {"modelled_tokens_per_s": 1.0}, "a k=2": {"modelled_tokens_per_s": 2.0}}
    rows["auto k<=2"] = {"modelled_tokens_per_s": 1.5}
    summarise(rows)
    assert rows["auto k<=2"]["of_best_fixed"] == 0.75 and rows["a k=2"]["speedup"] == 2.0


def test_a_recording_too_short_for_the_request_is_an_error_and_past_an_eos_the_end_is_answered():
    short = RUN | {"max_tokens": 8}  # 6 tokens recorded, no end: the loop asks past them
    with pytest.raises(ValueError, match="record more tokens"):
        replay_method("target-only", [short], lambda counts: NoDrafter(), 0, COSTS, ModelClock())
    ended = RUN | {"end": 0, "max_tokens": 16}  # stopped at EOS: drafts past it are answered with the end
    row = replay_method("draft", [ended], lambda counts: Perfect(), 5, COSTS, ModelClock())
    assert row["tokens"] == 6


def test_a_synthetic_draft_is_right_with_its_probability_the_same_on_every_replay():
    from lab.auto_replay import SyntheticDraft

    ctx = [1, 2, 3, 5]  # one token out: the draft continues with 6 7 8 ...
    assert SyntheticDraft([RUN], 1.0).propose([ctx], [4]) == [[6, 7, 8, 9]]
    assert all(a != b for a, b in zip(SyntheticDraft([RUN], 0.0).propose([ctx], [4])[0], [6, 7, 8, 9]))
    half = SyntheticDraft([RUN], 0.5)
    assert half.propose([ctx], [5]) == half.propose([ctx], [5])

"""lab/acceptance_replay.py against the loop it replays."""

from __future__ import annotations

from test_suffix import greedy

from trtspec.spec import SuffixSpec
from trtspec.speculative.loop import NoDrafter
from trtspec.speculative.suffix import SuffixDrafter


def test_acceptance_replay_counts_what_the_loop_counts_against_the_target():
    """lab/acceptance_replay.py answers drafts from recorded target-only outputs: its counts
    equal those of the loop run against the target itself."""
    from lab import acceptance_replay as mod

    prompts = [[1, 2, 3], [5, 11, 12, 13, 9]]
    runs = [
        {"prompt_ids": p, "output_ids": greedy(NoDrafter(), p, 40).output_ids, "end": None, "finish": "length"} for p in prompts
    ]
    row = mod.replay(runs, lambda: SuffixDrafter(SuffixSpec()), 8)
    real = [greedy(SuffixDrafter(SuffixSpec()), p, 40, k=8).metrics for p in prompts]
    assert (row["drafted"], row["accepted"]) == (sum(m.drafted for m in real), sum(m.accepted for m in real)) != (0, 0)
    assert row["tokens_per_forward"] == round(sum(m.tokens for m in real) / sum(m.target_forwards for m in real), 3)

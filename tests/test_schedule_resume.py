"""Load-aware speculation comes back whole: after the spec's schedule turns drafting off under
load (speculative.schedule, speculative/schedule.py) and the load falls back below its
threshold, a sequence drafts again from its whole context, and a request's acceptance is the
one it had at low load before. No draft state goes stale while drafting is off (the upstream
defect this guards against: TensorRT-LLM #16888, acceptance collapsing after a schedule turned
drafting off and on again). The same Batch, engines and drafter serve every phase, as a served
endpoint's scheduler keeps one Batch for its lifetime (triton/backend/scheduler.py)."""

from __future__ import annotations

import json

import pytest
from conftest import ROOT, write_spec

from trtspec.speculative.loop import Batch

SCHEDULE = {1: 4, 2: 0}  # drafting off from two active sequences


def test_the_demo_spec_ships_the_schedule_its_committed_bench_grid_recommends():
    from trtspec.spec import load_spec

    result = json.loads((ROOT / "lab" / "results" / "xeon-schedule-grid.json").read_text())
    assert result["values"]["spec"] == "smollm2-135m-cpu"
    recommended = {int(n): k for n, k in result["values"]["schedule"]["spec"]["schedule"].items()}
    assert load_spec(ROOT / "engine_specs" / "smollm2-135m-cpu.yaml").spec.speculative.schedule == recommended


def _run(batch: Batch, requests) -> list:
    """Add ``requests`` to ``batch`` together and step it until they are all done."""
    keys = [batch.add(r) for r in requests]
    while batch.active:
        batch.step()
    return [batch.pop(key) for key in keys]


@pytest.fixture(scope="module")
def scheduled(tmp_path_factory, tiny_ckpts):
    """The tiny pair built with SCHEDULE, loaded in process."""
    from trtspec.engines.build import build
    from trtspec.runtime import Deployment
    from trtspec.spec import load_spec

    loaded = load_spec(write_spec(tmp_path_factory.mktemp("scheduled"), tiny_ckpts, **{"speculative.schedule": SCHEDULE}))
    build(loaded, loaded.output_dir())
    return Deployment(loaded, loaded.output_dir())


def _deployment(dep):
    assert dep.policy is not None and dep.policy.schedule.to_mapping() == SCHEDULE
    prompts = [dep.encode(p) for p in dep.loaded.verify_prompts()[:3]]
    assert len(prompts) == 3 and len({tuple(p) for p in prompts}) == 3
    return dep, prompts


def _counts(result) -> tuple:
    m = result.metrics
    return m.drafted, m.accepted, m.target_forwards, m.mean_acceptance_length


def test_after_a_high_load_a_request_drafts_and_accepts_as_it_did_at_low_load(scheduled):
    dep, prompts = _deployment(scheduled)
    batch = Batch(dep.drafter(), dep.verifier(), policy=dep.policy)
    (low,) = _run(batch, [dep.request(prompts[0], 32)])
    assert low.metrics.drafted > 0 and low.metrics.accepted > 0  # low load: it drafts, and some is kept
    high = _run(batch, [dep.request(p, 32) for p in prompts])
    assert [r.metrics.drafted for r in high] == [0, 0, 0]  # three active: the schedule's 0
    assert high[0].output_ids == low.output_ids  # the target decides every token
    (again,) = _run(batch, [dep.request(prompts[0], 32)])
    assert again.output_ids == low.output_ids
    assert _counts(again) == _counts(low)  # drafting resumed, with the acceptance it had


def test_a_sequence_that_drafted_then_ran_undrafted_under_load_drafts_from_its_whole_context_again(scheduled):
    """One long request drafts alone, then two short ones join (no drafts while two or three
    run), and once it is alone again it drafts again: every draft it gets, before and after,
    is what a fresh draft model with no state of its own proposes from that context, so
    nothing of the undrafted steps is missing or stale."""
    dep, prompts = _deployment(scheduled)
    drafter = dep.drafter()
    seen: list[tuple[list[int], int, list[int]]] = []
    propose = drafter.propose

    def spy(contexts, ks, **kw):
        drafts = propose(contexts, ks, **kw)
        seen.extend((list(c), k, list(d)) for c, k, d in zip(contexts, ks, drafts))
        return drafts

    drafter.propose = spy
    batch = Batch(drafter, dep.verifier(), policy=dep.policy)
    key = batch.add(dep.request(prompts[0], 48))
    for _ in range(3):
        batch.step()
    before = len(seen)
    short = [batch.add(dep.request(p, 8)) for p in prompts[1:]]
    while batch.active:
        batch.step()
    assert [batch.pop(k).metrics.drafted for k in short] == [0, 0]
    long = batch.pop(key)
    assert before >= 2 and len(seen) > before  # it drafted alone, and again once alone again
    assert all(c[: len(prompts[0])] == prompts[0] for c, _, _ in seen)  # only the long one drafted
    assert len(seen[before][0]) - len(seen[before - 1][0]) >= 7  # the undrafted steps between
    (alone,) = _run(Batch(dep.drafter(), dep.verifier()), [dep.request(prompts[0], 48)])
    assert long.output_ids == alone.output_ids
    fresh = dep.drafter()
    for context, k, draft in seen:
        dep.forget_prefixes()
        assert fresh.propose([context], [k]) == [draft], len(context)

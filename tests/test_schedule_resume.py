"""Load-aware speculation comes back whole: after the spec's schedule turns drafting off under
load (speculative.schedule, speculative/schedule.py) and the load falls back below its
threshold, a sequence drafts again from its whole context, and a request's acceptance is the
one it had at low load before. No draft state goes stale while drafting is off (the upstream
defect this guards against: TensorRT-LLM #16888, acceptance collapsing after a schedule turned
drafting off and on again). The same Batch, engines and drafter serve every phase, as a served
endpoint's scheduler keeps one Batch for its lifetime (triton/backend/scheduler.py)."""

from __future__ import annotations

import pytest
from conftest import ROOT, write_spec

from trtspec.speculative.loop import Batch

SCHEDULE = {1: 4, 2: 0}  # drafting off from two active sequences


def test_every_shipped_schedule_threshold_can_fire():
    """A step runs at most build.max_batch_size sequences (served, requests beyond them wait
    uncounted), so a threshold above it would never turn drafting down."""
    from trtspec.spec import load_spec

    scheduled = 0
    for path in sorted((ROOT / "engine_specs").glob("*.yaml")):
        spec = load_spec(path).spec
        if spec.speculative.schedule:
            scheduled += 1
            assert max(spec.speculative.schedule) <= spec.limits("target").max_batch_size, path.name
    assert scheduled > 0


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


# -- served: the speculative endpoint's scheduler over the engine models (as test_scheduler) --


def _served(dep, schedule: dict[int, int], log: list | None = None):
    from test_triton_cores import _call, _cores, settings_for

    from trtspec.triton.backend.orchestrator_core import Orchestrator
    from trtspec.triton.backend.scheduler import Scheduler

    settings = settings_for(dep, decoupled=False, schedule=tuple(sorted(schedule.items())))
    orch = Orchestrator(settings, _call(_cores(dep), log), dep.tokenizer, dep.end_ids)
    return Scheduler(orch, max_active=dep.limits.max_batch_size, max_queue=16)


def _alone(scheduler, prompt: str, max_tokens: int) -> tuple[list[int], tuple]:
    """One request with nothing else running: its output ids and acceptance counts."""
    from test_scheduler import ListReply
    from test_triton_cores import _request

    from trtspec.speculative.metrics import metrics_from_json

    reply = ListReply()
    scheduler.submit(_request(prompt, max_tokens=max_tokens), reply)
    while scheduler.busy:
        assert scheduler.step().sequences == 1
    m = metrics_from_json(reply.sent[-1][0]["perf_metrics_json"][0, 0].decode())
    return reply.ids(), (m.drafted, m.accepted, m.target_forwards, m.mean_acceptance_length)


def _burst(scheduler, prompts: list[str], log: list | None = None) -> list:
    """Submit every prompt at once, each for its own number of tokens (MAX_TOKENS8: a batch
    runs, the rest wait, and the last ones end apart) and step until all are answered; per
    step its StepStats and, with ``log``, the engine models it called."""
    from test_scheduler import ListReply
    from test_triton_cores import _request

    replies = [ListReply() for _ in prompts]
    for prompt, reply, n in zip(prompts, replies, MAX_TOKENS8):
        scheduler.submit(_request(prompt, max_tokens=n), reply)
    steps = []
    while scheduler.busy:
        if log is not None:
            log.clear()
        stats = scheduler.step()
        steps.append((stats, [model for model, _ in log] if log is not None else None))
    assert all(r.finished and r.error is None for r in replies)
    return steps


PROMPTS8 = [f"{p} {i}" for i, p in enumerate(["The quick brown fox", "def fibonacci(n):"] * 4)]
MAX_TOKENS8 = [24, 12, 20, 16, 28, 36, 44, 52]


def test_served_a_full_batch_drafts_nothing_and_each_step_is_one_target_call(built):
    """Eight requests on a batch of 4 under {1: 4, 4: 0}: while four run (four more waiting,
    then being admitted) no step drafts, and such a step calls the target engine once and the
    draft never, as target-only's decode step does; with fewer running, drafting comes back."""
    dep = built()
    assert dep.limits.max_batch_size == 4
    log: list = []
    steps = _burst(_served(dep, {1: 4, 4: 0}, log), PROMPTS8, log)
    full = [(s, called) for s, called in steps if s.sequences == 4]
    assert full and any(s.queued > 0 for s, _ in full)  # requests waited behind a full batch
    for s, called in full:
        assert (s.drafted, s.draft_len, called) == (0, 0, ["tensorrt_llm"])
    assert any(s.drafted > 0 for s, _ in steps if s.sequences < 4)  # the tail drafts again


def test_served_waiting_requests_do_not_count_as_load(built):
    """A threshold above the batch never fires, however many wait: {1: 4, 5: 0} drafts at a
    full batch with four more requests queued behind it."""
    dep = built()
    steps = _burst(_served(dep, {1: 4, 5: 0}), PROMPTS8)
    assert any(s.drafted > 0 and s.sequences == 4 and s.queued > 0 for s, _ in steps)


def test_served_after_a_full_batch_a_request_drafts_and_accepts_as_it_did_at_low_load(built):
    """The served endpoint, one scheduler (one Batch, the same engine models) throughout: a
    request alone, then a burst under which the schedule ({1: 4, 2: 0}) turns drafting off,
    then the same request alone again drafts and accepts exactly as it did before, and as on
    a fresh endpoint."""
    dep = built()
    scheduler = _served(dep, {1: 4, 2: 0})
    low_ids, low = _alone(scheduler, PROMPTS8[0], 32)
    assert low[0] > 0 and low[1] > 0  # alone, it drafts and some is kept
    steps = _burst(scheduler, PROMPTS8)
    loaded = [s for s, _ in steps if s.sequences >= 2]
    assert any(s.sequences == 4 for s in loaded) and all(s.drafted == 0 for s in loaded)
    again_ids, again = _alone(scheduler, PROMPTS8[0], 32)
    assert (again_ids, again) == (low_ids, low)
    assert _alone(_served(dep, {1: 4, 2: 0}), PROMPTS8[0], 32) == (low_ids, low)

"""A speculative endpoint's steps that draft nothing decode a chunk per engine request.

When no running sequence drafts (the schedule's cap 0 at a full batch, a request's own
num_draft_tokens 0), the served scheduler's loop asks the target engine model for up to
loop.DECODE_CHUNK tokens per sequence in ONE request (the target-only endpoint's decode,
bls.BlsDecoder) instead of one request per token, and runs its usual EOS / stop / max_tokens
rules over them: outputs stay the target-only ones, a load change is seen within a chunk, and a
request cancelled while a chunk runs is answered once. While the batch is saturated (full, with
a request waiting for a place) a chunk runs up to loop.SATURATED_CHUNK tokens instead. The
scheduler runs over the tiny engines in process (as tests/test_schedule_resume.py)."""

from __future__ import annotations

import numpy as np
from test_scheduler import ListReply, _target_only
from test_triton_cores import PROMPTS, _request

from trtspec.speculative.loop import DECODE_CHUNK, SATURATED_CHUNK
from trtspec.speculative.metrics import metrics_from_json
from trtspec.triton.backend.scheduler import Cancelled

FULL = {1: 4, 4: 0}  # drafting off at the tiny engines' full batch of 4


def _is_chunk(inputs: dict) -> bool:
    """A target request that decodes several tokens with no drafts."""
    return "draft_input_ids" not in inputs and int(np.asarray(inputs["request_output_len"]).max()) > 1


def _logged(dep, schedule: dict[int, int], on_target=None, sampling: bool = False):
    """The served (decoupled) speculative endpoint's scheduler, and its engine calls as
    (model, inputs); ``on_target(inputs)`` runs inside each target engine request (mid-step,
    as a concurrent client would act)."""
    from test_triton_cores import _call, _cores, settings_for

    from trtspec.triton.backend.orchestrator_core import Orchestrator
    from trtspec.triton.backend.scheduler import Scheduler

    calls: list[tuple[str, dict]] = []
    call = _call(_cores(dep))

    def spy(model, inputs, names):
        calls.append((model, dict(inputs)))
        if model == "tensorrt_llm" and on_target is not None:
            on_target(inputs)
        return call(model, inputs, names)

    settings = settings_for(dep, decoupled=True, sampling_supported=sampling, schedule=tuple(sorted(schedule.items())))
    orch = Orchestrator(settings, spy, dep.tokenizer, dep.end_ids)
    return Scheduler(orch, max_active=dep.limits.max_batch_size, max_queue=16), calls


def _stop_word(dep, ids: list[int], lo: int, hi: int) -> tuple[str, int]:
    """A stop word whose tokens are exactly ids[p], first seen at a position p in lo..hi-1."""
    for p in range(lo, hi):
        word = dep.tokenizer.decode([ids[p]])
        if ids[p] not in ids[:p] and dep.tokenizer(word, add_special_tokens=False)["input_ids"] == [ids[p]]:
            return word, p
    raise AssertionError(f"no single-token stop word first seen at positions {lo}..{hi - 1} of {ids}")


def _metrics(reply: ListReply):
    return metrics_from_json(reply.sent[-1][0]["perf_metrics_json"][0, 0].decode())


def _step_all(scheduler, calls) -> list[tuple]:
    """Step until idle; per step its StepStats and the target engine requests it made."""
    steps = []
    while scheduler.busy:
        calls.clear()
        stats = scheduler.step()
        steps.append((stats, [inputs for model, inputs in calls if model == "tensorrt_llm"], [m for m, _ in calls]))
    return steps


def test_a_full_batch_decodes_chunks_in_one_target_request_each_and_answers_as_target_only(built):
    """Four requests fill the batch under {1: 4, 4: 0}: after their first step (the prefill's
    token) each step is ONE target request that decodes DECODE_CHUNK tokens per sequence, and
    the draft is never asked. A stop word mid-chunk, max_tokens, and a stream all answer as
    target-only; every forward is counted."""
    dep = built()
    assert DECODE_CHUNK == 8 and dep.limits.max_batch_size == 4
    plain = _target_only(dep, PROMPTS[1], 40)
    assert len(plain) == 40  # no EOS: the stop word ends it
    word, at = _stop_word(dep, plain, 10, 15)  # inside the second chunk (tokens 9..16)
    scheduler, calls = _logged(dep, FULL)
    replies = [ListReply() for _ in range(4)]
    scheduler.submit(_request(PROMPTS[0], max_tokens=17), replies[0])  # ends with the second chunk
    scheduler.submit(_request(PROMPTS[1], max_tokens=40, stop_words=word.encode()), replies[1])
    scheduler.submit(_request(PROMPTS[2], max_tokens=45, stream=True), replies[2])
    scheduler.submit(_request(PROMPTS[0] + " again", max_tokens=41), replies[3])
    steps = _step_all(scheduler, calls)
    assert [r.error for r in replies] == [None] * 4 and all(r.refused == 0 for r in replies)
    full = [(s, target, models) for s, target, models in steps if s.sequences == 4]
    first, chunks = full[0], full[1:]
    assert first[0].extra_forwards == 0 and not any(_is_chunk(x) for x in first[1])  # the prefill: one token each
    assert chunks and all(models == ["tensorrt_llm"] and _is_chunk(target[0]) for _, target, models in chunks)
    # two steps of eight tokens per sequence, one target request each (one per token before)
    assert [s.extra_forwards for s, _, _ in chunks] == [4 * (DECODE_CHUNK - 1)] * 2
    assert replies[0].ids() == _target_only(dep, PROMPTS[0], 17)  # ends at max_tokens
    assert replies[1].ids() == plain[: at + 1]  # ends at the stop word, mid-chunk
    assert replies[1].sent[-1][0]["finish_reason"][0, 0] == b"stop"
    assert replies[2].ids() == _target_only(dep, PROMPTS[2], 45)  # streamed in order ...
    assert any(t["output_ids"].shape[1] == DECODE_CHUNK for t, _ in replies[2].sent)  # ... a chunk per response
    assert [f for _, f in replies[2].sent] == [False] * (len(replies[2].sent) - 1) + [True]
    assert replies[3].ids() == _target_only(dep, PROMPTS[0] + " again", 41)
    m = _metrics(replies[0])  # it ran at a full batch throughout: no drafts, a forward per token
    assert (m.drafted, m.target_forwards, m.tokens) == (0, 17, 17)
    m = _metrics(replies[1])  # the chunk's tokens past the stop word were computed: counted
    assert m.drafted == 0 and m.target_forwards == 1 + DECODE_CHUNK * -(-at // DECODE_CHUNK) > at + 1


def test_a_request_that_asks_for_no_drafts_decodes_in_chunks_alone(built):
    """num_draft_tokens 0 at low load: the same chunks; its neighbour at k = 4 would draft, so a
    batch holding both decodes one token per step for each."""
    dep = built()
    scheduler, calls = _logged(dep, FULL)
    alone = ListReply()
    scheduler.submit(_request(PROMPTS[0], max_tokens=30, num_draft_tokens=0), alone)
    steps = _step_all(scheduler, calls)
    assert len(steps) == 1 + -(-29 // DECODE_CHUNK) and all(models == ["tensorrt_llm"] for _, _, models in steps)
    assert alone.ids() == _target_only(dep, PROMPTS[0], 30)
    off, on = ListReply(), ListReply()
    scheduler.submit(_request(PROMPTS[0], max_tokens=30, num_draft_tokens=0), off)
    scheduler.submit(_request(PROMPTS[1], max_tokens=30), on)
    steps = _step_all(scheduler, calls)
    both = [target for s, target, _ in steps if s.sequences == 2]
    assert both and not any(_is_chunk(x) for target in both for x in target)
    assert off.ids() == alone.ids() and on.ids() == _target_only(dep, PROMPTS[1], 30)


def test_sampled_requests_keep_one_token_per_target_request(built):
    """The engine decodes greedily: a batch with a sampled request never asks for a chunk."""
    dep = built()
    scheduler, calls = _logged(dep, FULL, sampling=True)
    replies = [ListReply() for _ in range(4)]
    for i, reply in enumerate(replies):
        extra = {"top_p": np.float32(0.95), "temperature": np.float32(1.0), "seed": np.uint64(9)} if i == 0 else {}
        scheduler.submit(_request(PROMPTS[i % 3], max_tokens=20, **extra), reply)
    steps = _step_all(scheduler, calls)
    assert all(r.error is None and r.finished for r in replies)
    assert not any(_is_chunk(x) for _, target, _ in steps for x in target)
    assert all(s.extra_forwards == 0 for s, _, _ in steps)


def test_a_request_that_arrives_during_a_chunk_drafts_once_the_load_falls_within_a_chunk(built):
    """A fifth request arrives while a full batch's chunk runs; it waits for a place, takes the
    place of the first to end, and when the next ends at a stop word in the middle of a chunk,
    the very next step (after that one chunk) drafts for every sequence left, the newcomer too."""
    dep = built()
    plain = _target_only(dep, PROMPTS[1], 40)
    assert len(plain) == 40
    # inside the chunk of tokens 18..25 (first steps: 0 and, once the newcomer joins, 9)
    word, at = _stop_word(dep, plain, 19, 24)
    late = ListReply()
    arrived: list[int] = []

    def arrive(inputs):
        if _is_chunk(inputs) and not arrived:
            arrived.append(1)
            scheduler.submit(_request(PROMPTS[2], max_tokens=40), late)

    scheduler, calls = _logged(dep, FULL, arrive)
    replies = [ListReply() for _ in range(4)]
    scheduler.submit(_request(PROMPTS[0], max_tokens=9), replies[0])  # ends with the first chunk
    scheduler.submit(_request(PROMPTS[1], max_tokens=40, stop_words=word.encode()), replies[1])
    scheduler.submit(_request(PROMPTS[0] + " again", max_tokens=48), replies[2])
    scheduler.submit(_request(PROMPTS[2] + " again", max_tokens=48), replies[3])
    steps = _step_all(scheduler, calls)
    assert arrived and late.error is None
    stopped = next(n for n, (s, _, _) in enumerate(steps) if ("stop", at + 1) in s.ended)
    assert steps[stopped][0].sequences == 4 and steps[stopped][0].extra_forwards > 0  # it ended inside a chunk
    after = steps[stopped + 1][0]
    assert (after.sequences, after.extra_forwards) == (3, 0) and after.accepted_each and len(after.accepted_each) == 3
    assert _metrics(late).drafted > 0
    assert late.ids() == _target_only(dep, PROMPTS[2], 40)
    assert replies[1].ids() == plain[: at + 1]
    assert replies[2].ids() == _target_only(dep, PROMPTS[0] + " again", 48)


def test_a_request_cancelled_during_a_chunk_is_answered_once(built):
    """A streamed request cancelled while a chunk's target request runs gets one answer,
    Cancelled, at the next step; the others end as target-only."""
    dep = built()
    gone = ListReply()

    def cancel(inputs):
        if _is_chunk(inputs):
            gone.cancel()

    scheduler, calls = _logged(dep, FULL, cancel)
    others = [ListReply() for _ in range(3)]
    scheduler.submit(_request(PROMPTS[0], max_tokens=40, stream=True), gone)
    for i, reply in enumerate(others):
        scheduler.submit(_request(PROMPTS[(i + 1) % 3], max_tokens=24), reply)
    steps = _step_all(scheduler, calls)
    assert isinstance(gone.error, Cancelled) and gone.refused == 0
    assert not any(final for _, final in gone.sent)
    assert sum(s.cancelled for s, _, _ in steps) == 1
    assert [r.ids() for r in others] == [_target_only(dep, PROMPTS[(i + 1) % 3], 24) for i in range(3)]


def _shape(steps) -> list[tuple[int, int, int]]:
    """Per step (sequences, tokens each sequence got from the target, target requests)."""
    return [(s.sequences, 1 + s.extra_forwards // max(s.sequences, 1), len(target)) for s, target, _ in steps]


def test_a_saturated_batch_decodes_up_to_the_fewest_tokens_left_in_one_target_request(built):
    """A full batch with a fifth request waiting for a place: nobody can join until one ends,
    and whoever ends is replaced, so each step that drafts nothing decodes up to the fewest
    tokens any sequence has left, at most SATURATED_CHUNK, in ONE target request (64 then 15
    here, not 8s). Once nobody waits, chunks are DECODE_CHUNK again. A stream gets a chunk's
    tokens in one response; every answer is target-only's and every forward is counted."""
    dep = built()
    assert (DECODE_CHUNK, SATURATED_CHUNK, dep.limits.max_batch_size) == (8, 64, 4)
    plan = [(PROMPTS[0], 80), (PROMPTS[1], 90), (PROMPTS[2], 100), (PROMPTS[0] + " again", 100), (PROMPTS[1] + " again", 20)]
    plain = [_target_only(dep, prompt, n) for prompt, n in plan]
    assert [len(ids) for ids in plain] == [n for _, n in plan]  # no EOS: max_tokens ends each
    scheduler, calls = _logged(dep, FULL)
    replies = [ListReply() for _ in plan]
    for i, ((prompt, n), reply) in enumerate(zip(plan, replies)):
        scheduler.submit(_request(prompt, max_tokens=n, **({"stream": True} if i == 1 else {})), reply)
    steps = _step_all(scheduler, calls)
    assert [r.error for r in replies] == [None] * 5 and all(r.refused == 0 for r in replies)
    # prefill; 64 (the bound); 15 (the first to end ends with it); the fifth's first token; 8 (nobody waits)
    assert _shape(steps)[:5] == [(4, 1, 1), (4, SATURATED_CHUNK, 1), (4, 15, 1), (4, 1, 1), (4, DECODE_CHUNK, 1)]
    assert [s.queued for s, _, _ in steps[:3]] == [1, 1, 1] and steps[3][0].queued == 0
    saturated = steps[1][1][0]
    assert _is_chunk(saturated) and int(np.asarray(saturated["request_output_len"]).max()) == SATURATED_CHUNK
    assert all(models == ["tensorrt_llm"] for _, _, models in steps[:5])  # the draft is never asked
    assert [r.ids() for r in replies] == plain
    assert [t["output_ids"].shape[1] for t, _ in replies[1].sent[:3]] == [1, SATURATED_CHUNK, 15]
    m = _metrics(replies[0])
    assert (m.drafted, m.target_forwards, m.tokens) == (0, 80, 80)


def test_a_stop_word_inside_a_saturated_chunk_is_seen_at_its_end_and_the_waiting_request_joins_next(built):
    """A request ends at a stop word in the middle of a saturated chunk: its answer is cut
    there (target-only's, finish_reason stop) when the chunk ends, the chunk's tokens past the
    stop are counted, and the request waiting for its place joins at the very next step."""
    dep = built()
    plain = _target_only(dep, PROMPTS[1], 60)
    assert len(plain) == 60
    word, at = _stop_word(dep, plain, 10, 30)  # inside the saturated chunk of tokens 1..59
    scheduler, calls = _logged(dep, FULL)
    first = ListReply()
    scheduler.submit(_request(PROMPTS[1], max_tokens=60, stop_words=word.encode()), first)
    others = [ListReply() for _ in range(3)]
    for i, reply in enumerate(others):
        scheduler.submit(_request(PROMPTS[(i + 2) % 3] + f" {i}", max_tokens=100), reply)
    late = ListReply()
    scheduler.submit(_request(PROMPTS[2], max_tokens=24), late)
    steps = _step_all(scheduler, calls)
    stopped = next(n for n, (s, _, _) in enumerate(steps) if ("stop", at + 1) in s.ended)
    assert stopped == 1 and _shape(steps)[1] == (4, 59, 1)  # one chunk to the fewest left (59)
    assert steps[2][0].sequences == 4 and steps[2][0].queued == 0  # the fifth joined next
    assert first.ids() == plain[: at + 1] and first.sent[-1][0]["finish_reason"][0, 0] == b"stop"
    m = _metrics(first)
    assert m.drafted == 0 and m.target_forwards == 60 > at + 1
    assert late.ids() == _target_only(dep, PROMPTS[2], 24)
    assert [r.ids() for r in others] == [_target_only(dep, PROMPTS[(i + 2) % 3] + f" {i}", 100) for i in range(3)]


def test_a_request_cancelled_during_a_saturated_chunk_is_answered_once_at_its_end(built):
    """A streamed request cancelled while a saturated chunk runs gets one answer, Cancelled,
    at the next step (within SATURATED_CHUNK forwards), and the request waiting for a place
    takes its place there; everyone else answers as target-only."""
    dep = built()
    gone = ListReply()
    long_chunks: list[int] = []

    def cancel(inputs):
        if _is_chunk(inputs) and int(np.asarray(inputs["request_output_len"]).max()) > DECODE_CHUNK:
            long_chunks.append(int(np.asarray(inputs["request_output_len"]).max()))
            gone.cancel()

    scheduler, calls = _logged(dep, FULL, cancel)
    scheduler.submit(_request(PROMPTS[0], max_tokens=100, stream=True), gone)
    others = [ListReply() for _ in range(3)]
    for i, reply in enumerate(others):
        scheduler.submit(_request(PROMPTS[(i + 1) % 3], max_tokens=40), reply)
    late = ListReply()
    scheduler.submit(_request(PROMPTS[1] + " again", max_tokens=24), late)
    steps = _step_all(scheduler, calls)
    assert long_chunks[0] == 39  # the fewest tokens left (the others' 39), under SATURATED_CHUNK
    assert isinstance(gone.error, Cancelled) and gone.refused == 0 and not any(final for _, final in gone.sent)
    assert [s.cancelled for s, _, _ in steps[:3]] == [0, 0, 1]  # dropped when the chunk ended
    assert steps[2][0].sequences == 1 and late.error is None  # the others ended with the chunk; it joined
    assert [r.ids() for r in others] == [_target_only(dep, PROMPTS[(i + 1) % 3], 40) for i in range(3)]
    assert late.ids() == _target_only(dep, PROMPTS[1] + " again", 24)


def test_a_batch_is_saturated_only_while_a_waiting_request_cannot_fit_and_may_join_later():
    """The scheduler's word to the loop (Batch.saturated), for rows of a batch of 4: full with
    one waiting, or one place free with a two-row request first in line: saturated. Nobody
    waiting, a waiting request that fits (it joins at the next admission), or a renewal due
    (nobody joins, the batch drains): not."""
    from collections import deque
    from types import SimpleNamespace

    from trtspec.triton.backend.scheduler import Scheduler, _Job

    class Due:
        def __init__(self, due):
            self.is_due = due

        def due(self):
            return self.is_due

        def apply(self):
            pass

    def saturated(running: int, waiting: list[int], due: bool = False) -> bool:
        scheduler = Scheduler(SimpleNamespace(new_batch=lambda: None), max_active=4, max_queue=8, renewal=Due(due))
        scheduler.active = [_Job([None] * running, ListReply(), keys=list(range(running)))] if running else []
        scheduler.waiting = deque(_Job([None] * rows, ListReply()) for rows in waiting)
        return scheduler._saturated()

    assert saturated(4, [1]) and saturated(4, [1, 2]) and saturated(3, [2])
    assert not saturated(4, []) and not saturated(3, [1]) and not saturated(2, [2])
    assert not saturated(4, [1], due=True)

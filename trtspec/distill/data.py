"""Distillation data: the target's own responses to a prompt set, with the features an
EAGLE-3 head reads and the target's greedy label (and top-k logits) at every response position.

Responses come from the one loop (target-only: the same greedy tokens `verify` compares), in
batches of the engine's slots, a prompt's requests in one batch (its prefill computed once).
Generating IS capturing: the engine keeps the features of every position it computes (capture_features) and a LabelRecorder keeps the target's top-k logits at
every position it scores, so a finished response already holds its features and labels — no
second forward. Sequences that were not generated in this process (a resumed run's logged
responses, a user's conversations: distill/corpus.py) are captured by teacher-forced forwards,
many sequences per forward.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch

from trtspec.distill.sample import SOFT_TOP_K, FeatureRows, Sample
from trtspec.distill.ttt import Batch
from trtspec.engines.torch.engine import ForwardItem, TorchEngine
from trtspec.errors import RuntimeFailure, SpecError
from trtspec.speculative.loop import NoDrafter, generate
from trtspec.speculative.parts import read_part, teacher_forced, write_part
from trtspec.speculative.requests import GenerationRequest
from trtspec.speculative.verifier import LogitsVerifier

SHIPPED_PROMPTS = Path(__file__).with_name("prompts.jsonl")


def distill_prompts(path: Path) -> list[str]:
    """The prompts of a --prompts / --eval-prompts file (spec.read_prompts), at least 2: one is held out."""
    from trtspec.spec import read_prompts

    prompts = read_prompts(Path(path), "--prompts")
    if len(prompts) < 2:
        raise SpecError(
            f"--prompts: {path} holds {len(prompts)} prompt(s); distill needs at least 2 (one is held out), "
            'one {"prompt": "..."} object per line'
        )
    return prompts


class LabelRecorder:
    """The target's run() that also keeps, per KV slot and position, its top-k logits at every
    position it computes logits for: the labels of a sequence generated through it (greedy
    label = top-1). Each item's slot is the one the engine ran it in (two rows of a batch may
    hold the same tokens for a while: a prompt's greedy and sampled responses)."""

    def __init__(self, target: TorchEngine, k: int = SOFT_TOP_K):
        self.target = target
        self.k = min(k, target.vocab_size)
        shape = (target.max_batch_size, target.max_seq_len, self.k)
        self.top_ids = torch.full(shape, -1, dtype=torch.int32)
        self.top_logits = torch.zeros(shape, dtype=torch.float32)

    def run(self, items: list[ForwardItem]) -> list[torch.Tensor]:
        out = self.target.run(items)
        for it, logits, slot in zip(items, out, self.target.last_slots):  # logits [n, vocab] of the last n positions
            top = torch.topk(logits.float(), self.k, dim=-1)
            p = len(it.tokens) - logits.shape[0]
            self.top_ids[slot, p : len(it.tokens)] = top.indices.to(torch.int32)
            self.top_logits[slot, p : len(it.tokens)] = top.values
        return out

    def slot_of(self, tokens: list[int], n: int) -> int:
        """The slot holding the first ``n`` of ``tokens``."""
        head = tokens if n == len(tokens) else tokens[:n]
        for slot, cached in enumerate(self.target.pool.tokens):  # a slot holds exactly what it last ran
            if len(cached) == n and cached == head:
                return slot
        for slot, cached in enumerate(self.target.pool.tokens):
            if len(cached) > n and cached[:n] == head:
                return slot
        raise RuntimeError("the target holds no slot with this sequence (it was evicted); generate fewer at once")

    def sample(self, prompt_ids: list[int], output_ids: list[int], response_from: int | None = None) -> Sample:
        """A generated sequence as captured while it was generated: every position up to the
        one before its last token (the last token was never fed back)."""
        tokens = list(prompt_ids) + list(output_ids)
        n = len(tokens) - 1
        slot = self.slot_of(tokens, n)
        feats = self.target.features_of(tokens, 0, n).cpu()  # [n, n_layers * hidden]; the store is on disk
        top_ids = self.top_ids[slot, :n].long()
        top_ids[: len(prompt_ids) - 1] = -1  # the prompt's positions got no logits here (stale rows)
        return Sample(
            torch.tensor(tokens[:n], dtype=torch.long),
            len(prompt_ids) if response_from is None else response_from,
            feats,
            top_ids[:, 0].clone(),  # -1 where no logits were computed (the prompt before its last token)
            top_ids=top_ids.clone(),
            top_logits=self.top_logits[slot, :n].clone(),
        )


def generated(
    target: TorchEngine,
    requests: list[GenerationRequest],
    parts: Path | None = None,
    on_batch=None,
    response_from: list[int] | None = None,
) -> Iterator[Sample]:
    """One captured Sample per request, in request order, batched over the engine's slots
    (``batch_order``: the requests of one prompt side by side, so its prefill is computed once).

    With ``parts`` (a folder), every finished batch is written there whole, features included
    (store.write_part, atomically, named by the batch's requests), and a later call reads the
    batches it finds instead of generating them: an interrupted generation loses at most the
    batch in flight, and a resumed one yields exactly what an uninterrupted one would. A
    sample whose turn comes after its batch has left memory is read back from its part; without
    ``parts`` finished batches stay in memory until yielded. ``on_batch(done, total)`` is called
    before the first batch (done: the requests whose batch was found) and after each generated
    one. ``response_from``: per request, the first position whose token is response text
    (default: its prompt's length)."""
    starts = response_from or [len(r.prompt_ids) for r in requests]
    batches = batch_order(requests, target.max_batch_size)
    paths = (
        [parts / f"part-{b:05d}-{_batch_digest(requests, starts, batch)}.safetensors" for b, batch in enumerate(batches)]
        if parts
        else []
    )
    order = _InOrder(batches, paths)
    if parts is not None:
        parts.mkdir(parents=True, exist_ok=True)
        for b, batch in enumerate(batches):
            got = read_part(paths[b]) if paths[b].is_file() else None
            if got is not None and len(got) == len(batch):
                order.finish(b)  # read again when its samples' turn comes
    done = sum(len(batches[b]) for b in order.finished)
    if on_batch:
        on_batch(done, len(requests))
    recorder = LabelRecorder(target)
    for b, batch in enumerate(batches):
        if b in order.finished:
            yield from order.ready()
            continue
        # A fresh pool: the batch takes slots 0..b-1 in order, so its decode steps attend to a
        # view of the KV cache instead of gathering every row's keys (engines/torch/model.py);
        # what its prompts share (the chat template's system prompt, about half of a prompt;
        # a prompt answered more than once) is computed once, not once a row.
        target.prefill_shared([requests[i].prompt_ids for i in batch])
        results = generate([requests[i] for i in batch], NoDrafter(), LogitsVerifier(recorder.run))
        samples = [recorder.sample(requests[i].prompt_ids, r.output_ids, starts[i]) for i, r in zip(batch, results)]
        if parts is not None:
            write_part(paths[b], samples)
        order.finish(b, samples)
        done += len(batch)
        if on_batch:
            on_batch(done, len(requests))
        yield from order.ready()


class _InOrder:
    """Samples of batches finished in any order, handed out in request order. With ``paths``
    (the batches' parts on disk) it holds at most the batch just generated and one read back;
    without, each finished batch until its last sample is handed out."""

    def __init__(self, batches: list[list[int]], paths: list[Path]):
        self.batches, self.paths = batches, paths
        self.where = {i: (b, j) for b, batch in enumerate(batches) for j, i in enumerate(batch)}
        self.left = [len(batch) for batch in batches]  # per batch, its samples not handed out yet
        self.finished: set[int] = set()
        self.held: dict[int, list[Sample]] = {}
        self.turn = 0  # the next request

    def finish(self, b: int, samples: list[Sample] | None = None) -> None:
        """Batch ``b`` is done: ``samples`` in memory, or (None) in its part."""
        self.finished.add(b)
        if samples is not None:
            if self.paths:
                self.held.clear()
            self.held[b] = samples

    def ready(self) -> Iterator[Sample]:
        """Every sample whose turn has come, its batch finished."""
        while self.turn < len(self.where) and self.where[self.turn][0] in self.finished:
            b, j = self.where[self.turn]
            if b not in self.held:  # only with parts: without, a batch is held until handed out
                self.held.clear()
                self.held[b] = self._read(b)
            yield self.held[b][j]
            self.turn += 1
            self.left[b] -= 1
            if not self.left[b]:
                self.held.pop(b)

    def _read(self, b: int) -> list[Sample]:
        got = read_part(self.paths[b])
        if got is None or len(got) != len(self.batches[b]):
            raise RuntimeFailure(
                f"{self.paths[b]}, a batch generated in this run, was removed or damaged before it was stored; "
                "run distill again (the batches left in its folder are reused)"
            )
        return got


def batch_order(requests: list[GenerationRequest], size: int) -> list[list[int]]:
    """The request indices of each generation batch (at most ``size``): the requests of one
    prompt side by side (a prompt's greedy and sampled responses share a batch, and so one
    prefill), prompts in the order of their first request."""
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for i, r in enumerate(requests):
        by_prompt.setdefault(tuple(r.prompt_ids), []).append(i)
    order = [i for group in by_prompt.values() for i in group]
    return [order[n : n + size] for n in range(0, len(order), size)]


def _batch_digest(requests: list[GenerationRequest], starts: list[int], batch: list[int]) -> str:
    """What the part of ``batch`` (request indices) depends on, short: another batching or
    request never reads it."""
    rs = [(requests[i], starts[i]) for i in batch]
    key = [(r.prompt_ids, r.max_tokens, sorted(r.end_ids), repr(r.sampling), start) for r, start in rs]
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:12]


def capture_batch(
    target: TorchEngine, seqs: list[list[int]], response_from: list[int] | list[torch.Tensor], tokens_per_forward: int = 4096
) -> list[Sample]:
    """Teacher-forced capture: features and labels at every position of each sequence, as
    many sequences per forward as the engine's slots and ``tokens_per_forward`` allow (the
    logits of a forward are [tokens, vocab] floats). ``response_from``: per sequence, its
    first response position, or a [T] bool mask of its response positions."""
    out: list[Sample] = []
    i = 0
    while i < len(seqs):
        group = [seqs[i]]
        while (
            i + len(group) < len(seqs)
            and len(group) < target.max_batch_size
            and sum(map(len, group)) + len(seqs[i + len(group)]) <= tokens_per_forward
        ):
            group.append(seqs[i + len(group)])
        logits = target.run([ForwardItem(list(s), len(s)) for s in group])  # each [T, vocab]
        for s, lg, r in zip(group, logits, response_from[i : i + len(group)]):
            feats = target.features_of(s, 0, len(s)).cpu()  # [T, n_layers * hidden]; the store is on disk
            mask = r if isinstance(r, torch.Tensor) else None
            plen = int(r) if mask is None else int(mask.long().argmax()) if bool(mask.any()) else len(s)
            out.append(teacher_forced(list(s), plen, feats, lg, mask))
        i += len(group)
    return out


def capture(target: TorchEngine, prompt_ids: list[int], output_ids: list[int]) -> Sample:
    """Teacher-forced forward over prompt + response: features and greedy labels per position."""
    return capture_batch(target, [list(prompt_ids) + list(output_ids)], [len(prompt_ids)])[0]


def collate(samples: list[Sample], max_len: int, store: FeatureRows | None = None, soft: bool = False) -> Batch:
    """Right-padded batch of the first max_len positions of each sample; features come from
    the samples themselves or, for samples captured to disk, from ``store``. ``soft``: also
    the target's top-k ids and logits (soft labels; only training with them needs them)."""
    t = min(max_len, max(len(s.tokens) for s in samples))
    b = len(samples)
    width, dtype = (store.width, store.dtype) if store is not None else (samples[0].features.shape[-1], samples[0].features.dtype)
    tokens = torch.zeros((b, t), dtype=torch.long)
    feats = torch.zeros((b, t, width), dtype=dtype)
    labels = torch.full((b, t), -1, dtype=torch.long)
    if soft and any(s.top_ids is None for s in samples):
        raise ValueError("collate: soft labels need every sample's top-k logits (captured by capture())")
    k = samples[0].top_ids.shape[-1] if soft else 0
    top_ids = torch.full((b, t, k), -1, dtype=torch.long)
    top_logits = torch.zeros((b, t, k), dtype=torch.float32)
    resp = torch.zeros((b, t), dtype=torch.bool)
    for i, s in enumerate(samples):
        n = min(t, len(s.tokens))
        tokens[i, :n] = s.tokens[:n]
        if s.features is not None:
            feats[i, :n] = s.features[:n]
        elif store is not None:
            store.read_into(feats[i, :n], s.row)
        else:
            raise ValueError("collate: a sample's features are on disk; pass its FeatureStore")
        labels[i, :n] = s.labels[:n]
        if soft:
            top_ids[i, :n] = s.top_ids[:n]
            top_logits[i, :n] = s.top_logits[:n]
        resp[i, :n] = s.response_mask()[:n]
    return Batch(tokens, feats, labels, resp, top_ids if soft else None, top_logits if soft else None)


def draft_vocabulary(samples: list[Sample], size: int, vocab: int) -> list[int]:
    """The ``size`` target ids the target outputs most often in responses (ties: lower id),
    ascending; topped up with the lowest unused ids when the data shows fewer distinct tokens.
    Only labels the head is trained on count: the next token after a response position or the
    prompt's last one (template and prompt tokens are never drafted)."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for s in samples:
        resp = s.response_mask()
        drafted = torch.cat([resp[1:], resp[-1:]])  # the label at t is the token at t + 1
        labels = s.labels[drafted & (s.labels >= 0)]
        counts += torch.bincount(labels, minlength=vocab)[:vocab]
    order = sorted(range(vocab), key=lambda i: (-int(counts[i]), i))
    return sorted(order[: min(size, vocab)])

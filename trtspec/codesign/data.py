"""Distillation data: the target's own greedy responses to a prompt set, captured with the
features an EAGLE-3 head reads and the target's greedy label at every position.

Responses come from the one loop (target-only: the same greedy tokens `verify` compares), in
batches of the engine's slots. Capture is one teacher-forced target forward per sequence.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from trtspec.codesign.train import Batch
from trtspec.engines.torch.engine import ForwardItem, TorchEngine
from trtspec.errors import SpecError
from trtspec.speculative.loop import NoDrafter, generate
from trtspec.speculative.requests import GenerationRequest
from trtspec.speculative.verifier import LogitsVerifier

SHIPPED_PROMPTS = Path(__file__).with_name("prompts.jsonl")
# The target's top SOFT_TOP_K logits at each position are kept with the greedy label: soft
# labels (--labels soft) train the head on the target's distribution, not only its argmax.
SOFT_TOP_K = 32


@dataclass
class Sample:
    tokens: torch.Tensor  # [T] int64: prompt + the target's response
    prompt_len: int
    features: torch.Tensor | None  # [T, n_layers * hidden]; None: rows row..row+T-1 of a FeatureStore
    labels: torch.Tensor  # [T] int64: the target's greedy next token after each position
    row: int = -1
    top_ids: torch.Tensor | None = None  # [T, SOFT_TOP_K] int: the target's most likely next tokens
    top_logits: torch.Tensor | None = None  # [T, SOFT_TOP_K] float32: their logits


class FeatureRows(Protocol):
    """Where samples captured to disk keep their features (codesign/store.py's FeatureStore)."""

    width: int
    dtype: torch.dtype

    def read_into(self, out: torch.Tensor, row: int) -> None: ...  # out [n, width] <- rows row..row+n-1


def read_prompts(path: Path) -> list[str]:
    """Prompts of a JSONL file ({"prompt": ...} per line); SpecError when empty or unreadable."""
    from trtspec.spec import read_prompt_rows

    try:
        rows = read_prompt_rows(Path(path), "--prompts")
    except UnicodeDecodeError as e:
        raise SpecError(f"--prompts: {path} is not UTF-8 text ({e.reason}); pass a JSONL file") from e
    except OSError as e:
        raise SpecError(f"--prompts: cannot read {path} ({e.strerror}); fix the path or permissions") from e
    if len(rows) < 2:
        raise SpecError(
            f"--prompts: {path} holds {len(rows)} prompt(s); distill needs at least 2 (one is held out), "
            'one {"prompt": "..."} object per line'
        )
    return [r["prompt"] for r in rows]


def responses(target: TorchEngine, requests: list[GenerationRequest], on_batch=None, log: Path | None = None) -> list[list[int]]:
    """The target's greedy output ids for each request, batched over the engine's slots.

    With ``log``, every finished batch is appended there (one JSON line per response, flushed
    and synced) and a later call continues after the responses it holds: an interrupted
    generation loses at most the batch in flight. A torn last line is ignored. ``on_batch(done,
    total)`` is called before the first batch (done: what the log held) and after each one."""
    done = _read_log(log, len(requests)) if log is not None else {}
    todo = [i for i in range(len(requests)) if i not in done]
    size = target.max_batch_size
    if on_batch:
        on_batch(len(done), len(requests))  # before any batch: what the log already held
    sink = open(log, "a", encoding="utf-8") if log is not None else None  # noqa: SIM115
    try:
        for n in range(0, len(todo), size):
            batch = todo[n : n + size]
            results = generate([requests[i] for i in batch], NoDrafter(), LogitsVerifier(target.run))
            for i, r in zip(batch, results):
                done[i] = r.output_ids
                if sink is not None:
                    sink.write(json.dumps({"i": i, "ids": r.output_ids}) + "\n")
            if sink is not None:
                sink.flush()
                os.fsync(sink.fileno())
            if on_batch:
                on_batch(len(done), len(requests))
    finally:
        if sink is not None:
            sink.close()
    return [done[i] for i in range(len(requests))]


def _read_log(path: Path, n: int) -> dict[int, list[int]]:
    done: dict[int, list[int]] = {}
    if not path.is_file():
        return done
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
            i, ids = int(row["i"]), [int(t) for t in row["ids"]]
        except (ValueError, KeyError, TypeError):
            continue  # a line torn by an interrupted write
        if 0 <= i < n:
            done[i] = ids
    return done


def capture(target: TorchEngine, prompt_ids: list[int], output_ids: list[int]) -> Sample:
    """Teacher-forced forward over prompt + response: features and greedy labels per position."""
    tokens = list(prompt_ids) + list(output_ids)
    target.forget_prefixes()  # every position computed now, with its features
    logits = target.run([ForwardItem(tokens, len(tokens))])[0]  # [T, vocab]
    feats = target.features_of(tokens, 0, len(tokens))  # [T, n_layers * hidden]
    top = torch.topk(logits.float(), min(SOFT_TOP_K, logits.shape[-1]), dim=-1)
    return Sample(
        torch.tensor(tokens, dtype=torch.long),
        len(prompt_ids),
        feats,
        torch.argmax(logits, dim=-1),
        top_ids=top.indices,
        top_logits=top.values,
    )


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
    resp = torch.zeros(b, dtype=torch.long)
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
        resp[i] = s.prompt_len
    return Batch(tokens, feats, labels, resp, top_ids if soft else None, top_logits if soft else None)


def draft_vocabulary(samples: list[Sample], size: int, vocab: int) -> list[int]:
    """The ``size`` target ids the target outputs most often (ties: lower id), ascending;
    topped up with the lowest unused ids when the data shows fewer distinct tokens."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for s in samples:
        counts += torch.bincount(s.labels, minlength=vocab)[:vocab]
    order = sorted(range(vocab), key=lambda i: (-int(counts[i]), i))
    return sorted(order[: min(size, vocab)])

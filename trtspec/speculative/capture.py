"""Serving's capture: the requests an EAGLE-3 head should learn from, kept where the target's
features already are (the engine serving method eagle3), in distill's part format
(speculative/parts.py), for `trtspec distill --from-capture` (docs/capture.md).

Which requests: off unless the spec sets serve.capture; then the sampled share, chosen by a
hash of the request id (the same id is always chosen or always not, whatever process sees
it), never one that opted out, never one of an excluded tenant. What: prompt + response
tokens, the feature layers at every position and the target's top-k labels after the prompt's
last position and every response position, all read from what the engine kept while it served
the request (no second forward). Where: one part per request, named
capture-<ns since epoch>-<digest>.safetensors, written to a temp name, fsynced, renamed; the
folder is kept under max_gb by removing the oldest parts first. When: the serving thread only
copies the request's features and labels out of the engine (its slot may serve another
sequence next); a writer thread of its own serializes, hashes, writes and bounds, from a bounded
queue (full: that request is not kept, and counted), drained by close().
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from trtspec import console
from trtspec.engines.torch.engine import TorchEngine
from trtspec.spec import CaptureSpec
from trtspec.speculative.parts import SOFT_TOP_K, Sample, part_record, read_part, write_part

PATTERN = "capture-*.safetensors"
QUEUE = 16  # parts a writer holds waiting for its thread; a request kept past them is dropped


def chosen(request_id: str, share: float) -> bool:
    """Whether the request ``request_id`` is in the sampled ``share`` (0 < share <= 1): the
    first 8 bytes of its sha256 as a fraction of 2**64, below ``share``."""
    h = int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:8], "big")
    return h < share * 2**64


def tenant_of(scope: str | None) -> str:
    """A suffix scope's tenant: its text before the first "/" ("" for the shared scope)."""
    return (scope or "").split("/", 1)[0]


def wanted(spec: CaptureSpec, request_id: str, scope: str | None, allowed: bool = True) -> bool:
    """Whether serve.capture keeps this request: allowed by it (its capture flag), not of an
    excluded tenant, and chosen by its id. A request in no scope (suffix cache off: None) has
    no known tenant, so it is never kept while any tenant is excluded."""
    if not allowed or (scope is None and spec.exclude_tenants):
        return False
    return tenant_of(scope) not in spec.exclude_tenants and chosen(request_id, spec.sample)


@dataclass(frozen=True)
class CaptureTag:
    """What capture needs of a served request beyond its tokens: its id (which decides whether
    it is sampled) and whether it allows capture (its opt-out)."""

    request_id: str
    allowed: bool = True


@dataclass
class Captured:
    """One captured request read back: its sample and the record it was written with."""

    path: Path
    sample: Sample
    record: dict


class CaptureWriter:
    """Keeps chosen requests in ``folder``; one per deployment (or Triton engine model), over
    the target ``engine`` that serves them: it keeps their features (capture_features, turned
    on by whoever loads the head) and, from now on, the top SOFT_TOP_K logits of the positions
    it scores (capture_labels: of every sequence, or with ``every_row`` False only of those
    whose prompt the caller wants, engine.want_labels). Parts are written by a thread of its
    own from a queue of ``queue_size``; ``dropped`` counts the requests a full queue lost,
    ``failed`` the writes that failed."""

    def __init__(
        self,
        spec: CaptureSpec,
        folder: Path,
        engine: TorchEngine,
        clock=time.time_ns,
        every_row: bool = True,
        queue_size: int = QUEUE,
    ):
        self.spec = spec
        self.folder = Path(folder)
        self.max_bytes = int(spec.max_gb * 1e9)
        engine.capture_labels(SOFT_TOP_K, every_row)
        self.features_of, self.labels_of, self.clock = engine.features_of, engine.labels_of, clock
        self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)  # users' text: the owner's only
        self.dropped = self.failed = 0
        self.closed = False
        self.lock = threading.Lock()
        self.pending: queue.Queue = queue.Queue(maxsize=queue_size)
        self.thread = threading.Thread(target=self._write_loop, name="trtspec-capture-writer", daemon=True)
        self.thread.start()

    def wants(self, request_id: str, scope: str | None, allowed: bool = True) -> bool:
        return wanted(self.spec, request_id, scope, allowed)

    def record(self, request_id: str, prompt_ids: list[int], output_ids: list[int], scope: str | None) -> Path | None:
        """Keep prompt + response as one part, from what the engine kept while serving it: the
        part this request will be written to by the writer thread; None when the engine no
        longer holds it or the writer's queue is full (then nothing is written)."""
        sample = self.sample_of(list(prompt_ids), list(output_ids))  # copied out now: the slot may be reused
        if sample is None:
            return None
        now = self.clock()
        digest = hashlib.sha256(f"{request_id}:{now}:{os.getpid()}".encode()).hexdigest()[:12]
        path = self.folder / f"capture-{now:020d}-{digest}.safetensors"
        meta = {"request_id": request_id, "tenant": tenant_of(scope), "scope": scope or "", "time_ns": now}
        with self.lock:
            try:
                if self.closed:
                    raise queue.Full
                self.pending.put_nowait((path, sample, meta))
            except queue.Full:  # serving never waits for a write: this request is not kept
                self.dropped += 1
                return None
        return path

    def flush(self) -> None:
        """Wait until every part queued so far is written (or failed)."""
        self.pending.join()

    def close(self) -> None:
        """Write what is queued, then stop the writer thread; later requests are not kept."""
        with self.lock:
            if self.closed:
                return
            self.closed = True  # no record() queues after this: the stop below is the last item
        self.pending.put((None, None, None))
        self.thread.join()

    def _write_loop(self) -> None:
        while True:
            path, sample, meta = self.pending.get()
            try:
                if path is None:
                    return
                write_part(path, [sample], meta)
                bound(self.folder, self.max_bytes)
            except Exception as err:  # the answer is out; a write that fails loses only its part
                self.failed += 1
                console.info(f"serve.capture could not write {path.name}: {type(err).__name__}: {err}")
            finally:
                self.pending.task_done()

    def sample_of(self, prompt_ids: list[int], output_ids: list[int]) -> Sample | None:
        """The request as distill reads it: every fed position's features, and the target's
        labels where serving computed them: after the prompt's last position (the prefill) and
        after each response position (a decode or verify step); the prompt's other positions
        are never trained on and get none (-1). None when a slot no longer holds the request,
        or one of those positions has no label (its slot was computed again without logits)."""
        tokens = prompt_ids + output_ids[:-1]  # the last token was never fed back
        if len(tokens) < 2 or not output_ids or not prompt_ids:
            return None
        feats = self.features_of(tokens, 0, len(tokens))  # [T, n_layers * hidden]
        labels = self.labels_of(tokens, 0, len(tokens))  # ([T, k], [T, k])
        if feats is None or labels is None:
            return None
        top_ids, top_logits = labels
        top_ids[: len(prompt_ids) - 1] = -1
        top_logits[: len(prompt_ids) - 1] = 0.0
        if bool((top_ids[len(prompt_ids) - 1 :, 0] < 0).any()):
            return None
        return Sample(
            torch.tensor(tokens, dtype=torch.long),
            len(prompt_ids),
            feats.cpu(),
            top_ids[:, 0].clone(),  # the target's greedy next token; -1 on the prompt before its last position
            top_ids=top_ids,
            top_logits=top_logits,
        )


def parts(folder: Path) -> list[Path]:
    """The finished parts of a capture folder, oldest first (temp names never match)."""
    return sorted(Path(folder).glob(PATTERN), key=lambda p: p.name)


def bound(folder: Path, max_bytes: int) -> list[Path]:
    """Remove the oldest parts until the folder's parts hold at most ``max_bytes``; the removed."""
    found = []
    for p in parts(folder):
        try:
            found.append((p, p.stat().st_size))
        except FileNotFoundError:  # another writer removed it
            continue
    total = sum(size for _, size in found)
    removed = []
    for p, size in found:
        if total <= max_bytes:
            break
        p.unlink(missing_ok=True)
        total -= size
        removed.append(p)
    return removed


def read_capture(folder: Path) -> list[Captured]:
    """Every whole part of ``folder``, oldest first; a torn, altered or foreign part is skipped."""
    out = []
    for p in parts(folder):
        samples, record = read_part(p), part_record(p)
        if samples is None or record is None or len(samples) != 1:
            continue
        out.append(Captured(p, samples[0], record))
    return out

"""One captured training sequence, and a batch of them in one file: the format that distill's
generation (distill/data.py) and serving's capture (speculative/capture.py) both write and
distill reads. It lives below both so a served engine writes exactly what training reads.

A part is one safetensors file, written atomically (temp name, fsynced, renamed): token ids,
labels, the target's top-k ids and logits, which tokens are response text, each sequence's
start and prompt length, and the features. Its metadata may carry a JSON record of where the
sequences came from (a served request's id and tenant) and the sha256 of the tensors, so an
altered part is refused like a torn one: read_part answers None for either.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from trtspec.files import write_bytes_atomic

# The target's top SOFT_TOP_K logits at each position are kept with the greedy label: soft
# labels (--labels soft) train the head on the target's distribution, not only its argmax.
SOFT_TOP_K = 32
_META = "trtspec-part"  # the safetensors metadata key of a part's record


@dataclass
class Sample:
    tokens: torch.Tensor  # [T] int64: prompt + the target's response
    prompt_len: int
    features: torch.Tensor | None  # [T, n_layers * hidden]; None: rows row..row+T-1 of a FeatureStore
    labels: torch.Tensor  # [T] int64: the target's greedy next token after each position (-1: not known)
    row: int = -1
    top_ids: torch.Tensor | None = None  # [T, SOFT_TOP_K] int: the target's most likely next tokens
    top_logits: torch.Tensor | None = None  # [T, SOFT_TOP_K] float32: their logits
    response: torch.Tensor | None = None  # [T] bool: response text (None: positions >= prompt_len)

    def response_mask(self) -> torch.Tensor:
        """[T] bool: the positions whose token is response text (what the runtime drafts after)."""
        if self.response is not None:
            return self.response
        return torch.arange(len(self.tokens)) >= self.prompt_len


class FeatureRows(Protocol):
    """Where samples captured to disk keep their features (distill/store.py's FeatureStore)."""

    width: int
    dtype: torch.dtype

    def read_into(self, out: torch.Tensor, row: int) -> None: ...  # out [n, width] <- rows row..row+n-1


def teacher_forced(tokens: list[int], prompt_len: int, feats: torch.Tensor, logits: torch.Tensor, mask=None) -> Sample:
    """The Sample of a sequence scored whole by the target: ``feats`` [T, width] and ``logits``
    [T, vocab] at every position; labels are the target's top-1, with its top SOFT_TOP_K kept."""
    top = torch.topk(logits.float(), min(SOFT_TOP_K, logits.shape[-1]), dim=-1)
    return Sample(
        torch.tensor(tokens, dtype=torch.long),
        prompt_len,
        feats,
        top.indices[:, 0].clone(),
        top_ids=top.indices,
        top_logits=top.values,
        response=mask,
    )


def tensors_of(samples: list[Sample]) -> dict[str, torch.Tensor]:
    """Every field of ``samples`` but the features, concatenated over sequences."""
    starts = [0]
    for s in samples:
        starts.append(starts[-1] + len(s.tokens))
    return {
        "tokens": torch.cat([s.tokens for s in samples]),  # [rows] int64
        "labels": torch.cat([s.labels for s in samples]),  # [rows] int64
        "top_ids": torch.cat([s.top_ids.to(torch.int32) for s in samples]),  # [rows, k] int32
        "top_logits": torch.cat([s.top_logits.float() for s in samples]),  # [rows, k] float32
        "starts": torch.tensor(starts, dtype=torch.long),  # [sequences + 1]
        "prompt_len": torch.tensor([s.prompt_len for s in samples], dtype=torch.long),  # [sequences]
        "response": torch.cat([s.response_mask().to(torch.uint8) for s in samples]),  # [rows] 1: response text
    }


def write_part(path: Path, samples: list[Sample], record: dict | None = None) -> None:
    """``samples``, features included, in one safetensors file written atomically and durably:
    an interrupted writer leaves the old state or the whole part, never a torn one. ``record``
    (JSON): what the part came from, read back by part_record."""
    from safetensors.torch import save

    t = tensors_of(samples)
    t["features"] = torch.cat([s.features.contiguous() for s in samples])
    meta = {"record": record or {}, "sha256": _digest(t)}
    write_bytes_atomic(path, save(t, metadata={_META: json.dumps(meta, sort_keys=True)}), durable=True)


def read_part(path: Path) -> list[Sample] | None:
    """The samples of a part (features in memory); None if it is torn, altered or foreign."""
    t = _load(path)
    if t is None:
        return None
    starts = t["starts"].tolist()
    return [
        Sample(
            t["tokens"][a:b],
            p,
            t["features"][a:b],
            t["labels"][a:b],
            top_ids=t["top_ids"][a:b].long(),
            top_logits=t["top_logits"][a:b],
            response=t["response"][a:b].bool(),
        )
        for a, b, p in zip(starts[:-1], starts[1:], t["prompt_len"].tolist())
    ]


def part_record(path: Path) -> dict | None:
    """The record a part was written with (write_part's ``record``); None if it is unreadable."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as st:
            return json.loads((st.metadata() or {})[_META])["record"]
    except Exception:  # noqa: BLE001 - a torn or foreign file has no record
        return None


def _load(path: Path) -> dict[str, torch.Tensor] | None:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as st:
            meta = json.loads((st.metadata() or {}).get(_META, "null"))
            t = {k: st.get_tensor(k) for k in st.keys()}
        if meta is not None and meta.get("sha256") != _digest(t):
            return None  # altered after it was written
        starts = t["starts"].tolist()
        rows = t["tokens"].shape[0]
        if len(starts) != len(t["prompt_len"]) + 1 or starts[-1] != rows or t["features"].shape[0] != rows:
            return None
        return t
    except Exception:  # noqa: BLE001 - a torn or foreign file: never read
        return None


def _digest(t: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(t):
        h.update(name.encode())
        h.update(t[name].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()

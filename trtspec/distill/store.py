"""Captured features on disk: written once during capture, read per batch during training.

The features of every training token (the outputs of three target layers) outgrow RAM long
before the rest of the data does: 156k SmolLM2 tokens hold 1.1 GB of float32 features, next to
2.5 MB of token ids and labels. So a capture streams each sequence's features to a flat file
as it goes, and training reads the rows of the sequences it batches (plain reads, never a
mapping of the whole file, so the resident set does not grow with the data).

Two files per capture, in the distill work folder:
  features-<key>.bin       rows [tokens, width] of one dtype, row-major, nothing else
  data-<key>.safetensors   token ids, labels, the target's top-32 ids and logits per token
                           (soft labels: 256 bytes a token), which tokens are response text,
                           each sequence's first row and prompt length;
                           its metadata is the manifest: key, the inputs the key hashes, and
                           the features file's size, dtype, shape and sha256
The features file is written under a temp name and renamed when complete; the index is
written last (atomically), so an index means the capture finished. Opening checks the
features file against the manifest (size first, then sha256): a truncated or altered file is
never trained on.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from trtspec.distill.sample import Sample
from trtspec.errors import TrtspecError
from trtspec.files import write_bytes_atomic
from trtspec.speculative.parts import tensors_of

FORMAT = 4  # 1: one torch.save of every sample, features included, held in RAM; 2: no top-k logits; 3: no response mask
_CHUNK = 1 << 24  # bytes hashed at a time


class CorruptStore(TrtspecError):
    """The features file does not match its manifest (truncated, altered or missing)."""


@dataclass
class FeatureStore:
    features: Path  # features-<key>.bin
    dtype: torch.dtype
    rows: int
    width: int
    samples: list[Sample]  # features None; row = first row of each sequence

    def read_into(self, out: torch.Tensor, row: int) -> None:
        """Fill ``out`` [n, width] with rows row..row+n-1 of the features file."""
        # Reading into the batch tensor's own memory: one copy, from the page cache.
        view = out.view(torch.uint8).numpy()  # [n, width * itemsize] bytes, shares out's memory
        with open(self.features, "rb") as f:
            f.seek(row * self.width * self.dtype.itemsize)
            got = f.readinto(memoryview(view).cast("B"))
        if got != view.nbytes:
            raise CorruptStore(f"{self.features} shrank while training; run distill again (it captures again)")


def paths(work: Path, key: str) -> tuple[Path, Path]:
    """(index, features file) of the capture ``key`` in ``work``."""
    return work / f"data-{key}.safetensors", work / f"features-{key}.bin"


def write_store(work: Path, key: str, inputs: dict, samples: Iterable[Sample]) -> FeatureStore:
    """Stream ``samples`` (features in memory, one at a time) to disk and return the store.

    Interrupted anywhere, no index exists: the next run captures again."""
    from safetensors.torch import save

    index, feat_path = paths(work, key)
    work.mkdir(parents=True, exist_ok=True)
    index.unlink(missing_ok=True)  # the index is the commit: none until the new capture is whole
    tmp = feat_path.with_name(f".{feat_path.name}.partial")
    sha = hashlib.sha256()
    rows, width, dtype = 0, None, None
    kept: list[Sample] = []  # without their features
    try:
        with open(tmp, "wb") as f:
            for s in samples:
                feats = s.features.contiguous()  # [T, width]
                if width is None:
                    width, dtype = feats.shape[1], feats.dtype
                raw = feats.view(torch.uint8).numpy().tobytes()
                f.write(raw)
                sha.update(raw)
                rows += feats.shape[0]
                kept.append(replace(s, features=None))
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(feat_path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if not kept:
        raise TrtspecError("distill captured no sequences; check the prompts file")
    manifest = {
        "format": FORMAT,
        "key": key,
        "inputs": inputs,
        "sequences": len(kept),
        "features": {
            "file": feat_path.name,
            "dtype": str(dtype).removeprefix("torch."),
            "shape": [rows, width],
            "bytes": rows * width * dtype.itemsize,
            "byteorder": sys.byteorder,
            "sha256": sha.hexdigest(),
        },
    }
    tensors = tensors_of(kept)
    write_bytes_atomic(index, save(tensors, metadata={"trtspec": json.dumps(manifest, sort_keys=True)}))
    return _store(index, feat_path, manifest, tensors)


def open_store(work: Path, key: str) -> FeatureStore | None:
    """The finished capture ``key`` in ``work``; None when there is none; CorruptStore when
    its features file does not match the manifest."""
    from safetensors import safe_open

    index, feat_path = paths(work, key)
    if not index.is_file():
        return None
    try:
        with safe_open(str(index), framework="pt") as st:
            manifest = json.loads(st.metadata()["trtspec"])
            tensors = {k: st.get_tensor(k) for k in st.keys()}
    except Exception as e:  # noqa: BLE001 - any unreadable index is a corrupt capture
        raise CorruptStore(f"{index} is unreadable ({e})") from e
    meta = manifest.get("features", {})
    if manifest.get("format") != FORMAT or manifest.get("key") != key or meta.get("file") != feat_path.name:
        raise CorruptStore(f"{index} is not a format-{FORMAT} index of capture {key}")
    if meta.get("byteorder") != sys.byteorder:
        raise CorruptStore(f"{feat_path} was written {meta.get('byteorder')}-endian; this machine is {sys.byteorder}-endian")
    if not feat_path.is_file():
        raise CorruptStore(f"{feat_path} is missing")
    size = feat_path.stat().st_size
    if size != meta["bytes"]:
        raise CorruptStore(f"{feat_path} holds {size} bytes, its manifest {meta['bytes']} (truncated or overwritten)")
    if _sha256(feat_path) != meta["sha256"]:
        raise CorruptStore(f"{feat_path} does not match its manifest's sha256 (altered)")
    return _store(index, feat_path, manifest, tensors)


def remove_store(work: Path, key: str) -> None:
    for p in paths(work, key):
        p.unlink(missing_ok=True)


def _store(index: Path, feat_path: Path, manifest: dict, t: dict[str, torch.Tensor]) -> FeatureStore:
    meta = manifest["features"]
    rows, width = meta["shape"]
    starts, plen = t["starts"].tolist(), t["prompt_len"].tolist()
    if (
        len(starts) != len(plen) + 1
        or starts[-1] != rows
        or any(t[name].shape[0] != rows for name in ("tokens", "labels", "top_ids", "top_logits", "response"))
    ):
        raise CorruptStore(f"{index} disagrees with itself (sequence starts vs rows); capture again")
    samples = [
        Sample(
            t["tokens"][a:b],
            p,
            None,
            t["labels"][a:b],
            row=a,
            top_ids=t["top_ids"][a:b],
            top_logits=t["top_logits"][a:b],
            response=t["response"][a:b].bool(),
        )
        for a, b, p in zip(starts[:-1], starts[1:], plen)
    ]
    return FeatureStore(feat_path, getattr(torch, meta["dtype"]), rows, width, samples)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()

"""A GGUF file checked before anything loads it: its header, every tensor's name, type and bytes.

transformers and gguf's reader stop on a damaged file with whatever error the damage causes
first (a struct error on a header cut short, a ValueError from numpy on a tensor whose bytes end
early) and load a tensor they do not know without a word. Here the header is read on its own
terms (GGUF v2/v3: magic, version, counts, key/values, tensor infos, alignment), and every tensor
is checked against the file: a name the format defines for the file's architecture, a known
type, whole blocks, and data that ends within the file. Any problem is one CheckpointError
(exit 2) naming the file and, where there is one, the tensor.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from trtspec.errors import CheckpointError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# GGUF value types with a fixed size -> struct format (little-endian); 8 string, 9 array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_SUFFIXES = ("", ".weight", ".bias")  # what a tensor's name adds to the format's own


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # fastest-varying first, as GGUF lists them
    type_id: int
    offset: int  # from the start of the data section


class _Cursor:
    """Reads a GGUF header; a read past the end names what it was reading."""

    def __init__(self, data: mmap.mmap | bytes):
        self.data, self.pos = data, 0

    def take(self, fmt: str, what: str):
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.data):
            raise _Damaged(f"the header ends inside {what} (byte {self.pos} of {len(self.data)})")
        values = struct.unpack_from("<" + fmt, self.data, self.pos)
        self.pos += size
        return values[0] if len(values) == 1 else values

    def string(self, what: str) -> str:
        n = self.take("Q", what)
        if self.pos + n > len(self.data):
            raise _Damaged(f"the header ends inside {what} (byte {self.pos} of {len(self.data)})")
        raw = bytes(self.data[self.pos : self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise _Damaged(f"{what} is not UTF-8") from None

    def value(self, type_id: int, what: str):
        if type_id in _SCALARS:
            return self.take(_SCALARS[type_id], what)
        if type_id == _STRING:
            return self.string(what)
        if type_id == _ARRAY:
            item, count = self.take("I", what), self.take("Q", what)
            if item in _SCALARS:  # skipped whole: token scores and types run to 100k entries
                size = struct.calcsize("<" + _SCALARS[item]) * count
                if self.pos + size > len(self.data):
                    raise _Damaged(f"the header ends inside {what} (byte {self.pos} of {len(self.data)})")
                self.pos += size
                return None
            return [self.value(item, what) for _ in range(count)]
        raise _Damaged(f"{what} has an unknown value type {type_id}")


class _Damaged(Exception):
    """What is wrong with the header, without the file's name (added by check_gguf)."""


def read_header(data: mmap.mmap | bytes) -> tuple[dict, list[TensorInfo], int]:
    """(key/values, tensor infos, data section offset) of a GGUF held in ``data``."""
    cur = _Cursor(data)
    if bytes(data[:4]) != MAGIC:
        raise _Damaged(f"it does not start with the GGUF magic bytes (found {bytes(data[:4])!r})")
    cur.pos = 4
    version = cur.take("I", "the version")
    if version not in VERSIONS:
        raise _Damaged(f"GGUF version {version} is not one of {', '.join(map(str, VERSIONS))}")
    n_tensors, n_kv = cur.take("QQ", "the tensor and key counts")
    fields: dict = {}
    for i in range(n_kv):
        key = cur.string(f"key {i}")
        fields[key] = cur.value(cur.take("I", f"the type of {key}"), key)
    tensors = []
    for i in range(n_tensors):
        name = cur.string(f"the name of tensor {i}")
        n_dims = cur.take("I", f"tensor {name}")
        dims = tuple(cur.take("Q", f"tensor {name}") for _ in range(n_dims))
        type_id, offset = cur.take("I", f"tensor {name}"), cur.take("Q", f"tensor {name}")
        tensors.append(TensorInfo(name, dims, type_id, offset))
    align = fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise _Damaged(f"general.alignment {align!r} is not a power of two")
    return fields, tensors, -(-cur.pos // align) * align


def _known_names(fields: dict) -> set[str]:
    """Every tensor name the GGUF format defines for the file's architecture and block count."""
    import gguf

    arch_name = fields.get("general.architecture")
    archs = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}
    if arch_name not in archs:
        raise _Damaged(f"general.architecture {arch_name!r} is not an architecture GGUF defines")
    blocks = fields.get(f"{arch_name}.block_count", 0)
    names = set()
    for kind in gguf.MODEL_TENSORS[archs[arch_name]]:
        pattern = gguf.TENSOR_NAMES[kind]
        bids = range(blocks if isinstance(blocks, int) else 0) if "{bid}" in pattern else [None]
        names |= {pattern.format(bid=b) + s for b in bids for s in _SUFFIXES}
    return names


def _tensor_problem(t: TensorInfo, known: set[str], data_start: int, size: int) -> str | None:
    import gguf

    if t.name not in known:
        return "is not a tensor of this architecture (a file of another model, or an edited one)"
    try:
        block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(t.type_id)]
    except (ValueError, KeyError):
        return f"has an unknown type {t.type_id}"
    if not t.dims or any(d <= 0 for d in t.dims) or t.dims[0] % block:
        return f"has shape {list(t.dims)}, not whole blocks of {block}"
    elements = 1
    for d in t.dims:
        elements *= d
    end = data_start + t.offset + elements // block * block_bytes
    if end > size:
        return f"needs bytes up to {end} but the file ends at {size} (a download or copy cut short)"
    return None


def check_gguf(role: str, path: Path) -> None:
    """CheckpointError naming ``path`` (and the tensor) when the file is not a whole GGUF whose
    every tensor its architecture defines; returns quietly otherwise."""
    fix = "download or convert the file again"
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            fields, tensors, data_start = read_header(data)
            known = _known_names(fields)
            for t in tensors:
                problem = _tensor_problem(t, known, data_start, len(data))
                if problem:
                    raise CheckpointError(f"{role}.gguf_file: tensor {t.name} in {path} {problem}; {fix}")
    except _Damaged as e:
        raise CheckpointError(f"{role}.gguf_file: {path} is not a readable GGUF: {e}; {fix}") from None
    except ValueError as e:  # mmap of an empty file
        raise CheckpointError(f"{role}.gguf_file: {path} is not a readable GGUF ({e}); {fix}") from None

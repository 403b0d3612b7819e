"""trtspec's own CPU kernel for float32 Linears, compiled for this machine at first use.

Why: a decode or verify step of a small model reads every weight once and does little
arithmetic on it, so a step's Linears can run at the memory's speed whatever the number of
rows up to a dozen. PyTorch's dense kernel reads a weight once per row, oneDNN's re-laid
weights pay a fixed cost per call that dominates small matrices, and inductor's generated
loops read the weight once per row. The panel kernel (csrc/panels.cpp) streams each weight
once per call: the weight is re-laid at load into panels of 32 outputs by all inputs, and
every input row's products are added in the same order, so a row's result is bit-identical
whether it runs alone or in a verify step.

The source is compiled with the machine's own instruction set (``-march=native``) by
torch.utils.cpp_extension into ``$TRTSPEC_CACHE/native/<key>``, the key made of the source, the
CPU's flags and the torch version; a second process loads the built library in milliseconds.
Where no C++ compiler exists or the build fails, ``panel_kernel()`` returns None and the
kernel choice (kernels.py) measures the other layouts, saying why once.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

from trtspec.cache import cache_root
from trtspec.files import exclusive_lock, sha256_file, write_text_atomic

SOURCE = Path(__file__).with_name("csrc") / "panels.cpp"
DISABLE_ENV = "TRTSPEC_NATIVE"  # 0: never build or use the panel kernel
PAIRED = 32  # bytes a k pair of int4 codes takes in a panel (pair_q4), against 16 a k unpaired


def _flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "flags":
                return " ".join(sorted(value.split()))
    except OSError:
        pass
    return ""


def build_key() -> str:
    """What the built library depends on: its source, this CPU's flags, torch's version."""
    parts = [SOURCE.read_bytes(), _flags().encode(), torch.__version__.encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


_LOADED: dict[str, ModuleType] = {}  # build key -> the library, loaded once a process (its operators with it)


@functools.cache
def panel_kernel() -> ModuleType | None:
    """The compiled panel kernel, built here the first time; None where it cannot be (said once)."""
    if os.environ.get(DISABLE_ENV, "").strip() == "0":
        return None
    key = build_key()
    if key in _LOADED:
        return _LOADED[key]
    folder = cache_root() / "native" / key
    name = f"trtspec_panels_{key}"
    try:
        with exclusive_lock(folder / "trtspec.lock"):  # one builder a machine; released if it dies
            module = _import_or_build(name, folder)
        _register_shapes()
        _LOADED[key] = module
        return module
    except Exception as err:  # no compiler, no headers, a read-only cache: the other layouts remain
        print(
            f"trtspec: the panel kernel is unavailable ({type(err).__name__}: {_first_line(err)}); "
            "measuring PyTorch's and oneDNN's kernels only",
            file=sys.stderr,
        )
        return None


def _import_or_build(name: str, folder: Path) -> ModuleType:
    """The library built before (its folder is named by its source, CPU and torch, so it is
    current), or built now. A library is imported only when its digest is the one recorded when
    its build finished: a build killed while linking leaves a torn file, which would crash
    the process that maps it, and is built again."""
    library, record = folder / f"{name}.so", folder / "built.sha256"
    if library.is_file() and record.is_file() and record.read_text().strip() == sha256_file(library):
        return _import(name, library)
    record.unlink(missing_ok=True)
    library.unlink(missing_ok=True)
    module = _build(name, folder)
    write_text_atomic(record, sha256_file(library) + "\n")
    return module


def _build(name: str, folder: Path) -> ModuleType:
    """Compile the source into ``folder`` and import it (torch's cpp_extension, with ninja)."""
    from torch.utils.cpp_extension import load

    # torch's own lock file, left behind by a build that was killed: every later build would
    # wait on it for ever. Under our lock no other trtspec process is building here.
    (folder / "lock").unlink(missing_ok=True)
    return load(
        name=name,
        sources=[str(SOURCE)],
        # -fopenmp: ATen's parallel_for is OpenMP inlined here (without it, one thread)
        extra_cflags=["-O3", "-march=native", "-std=c++20", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        build_directory=str(folder),
        verbose=False,
    )


def _import(name: str, library: Path) -> ModuleType:
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _register_shapes() -> None:
    """What the operators return, for torch.compile's tracing (the library defines them in C++)."""
    names = ("linear", "linear_q8", "linear_q4", "linear_q4_bf16")
    for name in names if hasattr(torch.ops.trtspec_native, "linear_q4_bf16") else names[:-1]:

        def fake(x: torch.Tensor, *args) -> torch.Tensor:
            return x.new_empty((x.shape[0], args[-1]), dtype=torch.float32)  # [rows, n]

        torch.library.register_fake(f"trtspec_native::{name}")(fake)


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0][:200] if text else ""


class PanelLinear(nn.Module):
    """A float32 Linear run by the panel kernel: its weight re-laid once into panels (the dense
    weight is not kept), its bias as it is."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        kernel = panel_kernel()
        if kernel is None:
            raise RuntimeError("the panel kernel is not available on this machine")
        w = linear.weight.detach()
        self.panels = kernel.pack(w.float().contiguous())  # [ceil(out / 32), in, 32]
        self.bias = linear.bias.detach() if linear.bias is not None else None
        self.in_features, self.out_features = w.shape[1], w.shape[0]
        self._dtype = str(w.dtype).removeprefix("torch.")  # by name, not a torch.dtype: see saved.py

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self._dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [rows, in]
        out = torch.ops.trtspec_native.linear(flat, self.panels, self.bias, self.out_features)  # [rows, out]
        return out.view(*x.shape[:-1], self.out_features)


class QuantPanelLinear(nn.Module):
    """A weight-only quantized Linear (quant.WeightOnlyLinear's stored codes) run by the panel
    kernel: int8 codes with a scale per output, or int4 codes with a scale and a min per
    output and group of 32 inputs (kept in bfloat16 when stored so, else float32). Activations
    run in float32 inside; the output comes back in the engine's dtype. A bfloat16 engine's int4
    codes on a CPU with AVX512-BF16 are kept in k pairs (``pair_q4``) and run by
    ``linear_q4_bf16`` on the bfloat16 activations as they are: the same products, half the
    instructions (csrc/panels.cpp)."""

    def __init__(self, linear: nn.Module):
        super().__init__()
        kernel = panel_kernel()
        if kernel is None:
            raise RuntimeError("the panel kernel is not available on this machine")
        from trtspec.engines.torch.quant import unpack_int4

        stored = linear.stored()
        self.scheme, self._dtype = stored.scheme, str(linear.dtype).removeprefix("torch.")  # by name: see saved.py
        self.out_features, self.in_features = stored.shape
        self.bias = linear.bias.detach().float() if linear.bias is not None else None
        if stored.scheme == "int8_wo":
            self.codes, self.scales = kernel.pack_q8(stored.qweight, stored.scales)
            self.mins = None
        else:
            codes, self.scales, self.mins = kernel.pack_q4(unpack_int4(stored.qweight), stored.scales, stored.mins)
            paired = linear.dtype == torch.bfloat16 and kernel.has_q4_bf16()
            self.codes = kernel.pair_q4(codes) if paired else codes  # [panels, in / 2, 32] or [panels, in, 16]

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self._dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = torch.ops.trtspec_native
        if self.mins is not None and self.codes.shape[-1] == PAIRED:  # a bfloat16 engine's activations
            flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)  # [rows, in]
            out = ops.linear_q4_bf16(flat, self.codes, self.scales, self.mins, self.bias, self.out_features)
            return out.to(x.dtype).view(*x.shape[:-1], self.out_features)
        flat = x.reshape(-1, x.shape[-1]).float()  # [rows, in]
        if self.mins is None:
            out = ops.linear_q8(flat, self.codes, self.scales, self.bias, self.out_features)  # [rows, out] float32
        else:
            out = ops.linear_q4(flat, self.codes, self.scales, self.mins, self.bias, self.out_features)
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)

"""Where the torch backend runs: one place that turns a device name into a torch.device and
says what follows from it.

Names (the spec's ``device``, or ``--device`` on build, verify, bench and distill):
    cpu      the default: everything runs as it always has
    cuda     the current CUDA GPU (cuda:0 unless CUDA_VISIBLE_DEVICES says otherwise)
    cuda:N   GPU N
    auto     cuda when this torch sees a GPU, else cpu

Rules decided here and nowhere else:
  - ``cuda`` without a usable GPU is refused (exit 2) naming the fix: a CUDA build of torch,
    or device: cpu. ``auto`` never refuses.
  - dtypes: on CPU float32, bfloat16 and float16 all run as before (float16 on PyTorch's dense
    kernels, slow: the CPU kernel choice measures only float32 and bfloat16); on CUDA float16
    and bfloat16 are the serving dtypes and float32 runs too; bfloat16 on a GPU older than
    compute capability 8.0 (no bfloat16 tensor cores) is refused naming float16.
  - the CPU kernel choice (engines/torch/kernels.py: oneDNN layouts, measured at load)
    applies on CPU only; on CUDA the engine runs PyTorch's CUDA kernels.
  - engine folders do not depend on the device (the build hash leaves it out): the same
    built folder loads on CPU or on a GPU.

torch is imported only when a name is resolved, so reading a spec does not load it.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from trtspec.errors import TrtspecError

if TYPE_CHECKING:
    import torch

DEFAULT = "cpu"
NAMES = "cpu, cuda, cuda:N or auto"
_NAME = re.compile(r"cpu|auto|cuda(:\d{1,3})?")
CUDA_TORCH = "install a CUDA build of torch (https://pytorch.org/get-started/locally/, e.g. pip install torch --index-url https://download.pytorch.org/whl/cu128)"
BF16_MIN_CAPABILITY = (8, 0)  # Ampere: the first GPUs with bfloat16 tensor cores


def check_name(name: str) -> str:
    """``name`` if it is a device name (ValueError naming the choices otherwise)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name.strip().lower()):
        raise ValueError(f"device {name!r} is not one of {NAMES}")
    return name.strip().lower()


def resolve(name: str | None) -> torch.device:
    """The torch.device of a device name (None: cpu). TrtspecError (exit 2) when it names a GPU
    this process cannot use."""
    import torch

    try:
        name = check_name(name or DEFAULT)
    except ValueError as e:
        raise TrtspecError(f"{e}; set device: cpu in the spec or pass --device cpu") from None
    if name == "cpu":
        return torch.device("cpu")
    if name == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if _cuda_count() else torch.device("cpu")
    count = _cuda_count()
    if not count:
        built = torch.version.cuda
        why = (
            f"torch {torch.__version__} is a CPU-only build"
            if built is None
            else f"torch {torch.__version__} (CUDA {built}) sees no GPU (check the driver and CUDA_VISIBLE_DEVICES)"
        )
        raise TrtspecError(f"device {name}: {why}; {CUDA_TORCH}, or use device: cpu (--device cpu)")
    index = int(name.split(":")[1]) if ":" in name else torch.cuda.current_device()
    if index >= count:
        raise TrtspecError(
            f"device {name}: this machine has {count} GPU(s), cuda:0 to cuda:{count - 1}; pick one of those or use device: auto"
        )
    return torch.device("cuda", index)


def check_dtype(device: torch.device, dtype: str, what: str = "engine") -> None:
    """Refuse (exit 2) a dtype the device cannot run well; see the module doc for the rules."""
    if device.type != "cuda" or dtype != "bfloat16":
        return
    cap = _capability(device)
    if cap < BF16_MIN_CAPABILITY:
        raise TrtspecError(
            f"{what}: bfloat16 needs a GPU of compute capability {BF16_MIN_CAPABILITY[0]}.{BF16_MIN_CAPABILITY[1]} or "
            f"newer; {device} is {cap[0]}.{cap[1]}: set dtype: float16 and rebuild, or use device: cpu"
        )


def place(name: str | None, dtypes: dict[str, str]) -> torch.device:
    """resolve(name), with every engine's dtype ({what: dtype}) checked against it."""
    device = resolve(name)
    for what, dtype in dtypes.items():
        check_dtype(device, dtype, what)
    return device


def uses_cpu_kernels(device: torch.device) -> bool:
    """Whether the CPU kernel choice (engines/torch/kernels.py) applies on ``device``."""
    return device.type == "cpu"


def free_bytes(device: torch.device) -> int | None:
    """Free memory on a CUDA device (bytes); None on CPU (RAM is not sized from here)."""
    if device.type != "cuda":
        return None
    import torch

    free, _total = torch.cuda.mem_get_info(device)
    return int(free)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously: timings need it)."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def describe(device: torch.device) -> str:
    """One line for reports: the device and, on CUDA, the GPU's name."""
    if device.type != "cuda":
        return str(device)
    import torch

    return f"{device} ({torch.cuda.get_device_name(device)})"


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _capability(device: torch.device) -> tuple[int, int]:
    import torch

    return tuple(torch.cuda.get_device_capability(device))

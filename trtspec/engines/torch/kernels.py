"""Which kernels run a float32 or bfloat16 engine's Linear layers on this CPU, chosen by measurement.

Candidates (the weights and the arithmetic are the same; the greedy tokens are identical, tested):
  dense    PyTorch's own linear on the row-major weight (what transformers runs)
  onednn   the weight re-laid once in oneDNN's blocked format, run by mkldnn_linear
  head     only the LM head re-laid for oneDNN; the layers' Linears stay dense

Which is faster depends on the CPU, and on the shape: on a 2-core AVX-512 EPYC onednn made a SmolLM2 decode
step 38 -> 31 ms; on an AVX2-only CPU the engine with onednn was slower than transformers
(8.0 vs 8.6 tok/s). The LM head is the odd one out: one [vocab, hidden] matrix, a quarter of
SmolLM2's weights, where PyTorch's dense kernel for 2+ rows is slow on such a CPU. On a 2-core
AVX2 EPYC (2026-12-01) `head` made a decode step 59 -> 51 ms, a 2-token verify 95 -> 78 ms
and a 16-row batched decode 297 -> 219 ms, while `onednn` (every Linear) was slower than dense
at 1 token (82 ms). So the engine measures instead of assuming: at load, a decode step
(1 token) and a verify step (max_draft_len + 1 tokens) at a short context, each candidate
up to ``ROUNDS`` times in alternating order (3 when one is faster in every sample), the
median of each; the lower sum wins (a tie keeps dense). When one layout is fastest for the
decode step and another for the verify step, and the two together beat the best single
layout by ``SPLIT_GAIN``, the engine keeps both forms of the Linears where they differ and
runs one-row inputs on the first, larger ones on the second (the choice ``"head|onednn"``:
one row | more rows), if the copies those Linears then need fit in ``MAX_SPLIT_BYTES``. On a
2-core Xeon with AMX a float32 SmolLM2 decode step ran 37 ms dense and 44 ms onednn while its
9-token verify ran 76 ms dense and 58 ms onednn: no single layout is best at both. The choice is cached per machine in ``$TRTSPEC_CACHE/kernels.json`` under a key made
of the CPU (model name, ISA flags, ATen's CPU capability, ISA caps set in the environment),
the thread count, the torch version and the model's shape, so each machine measures each
model shape once; engines loading at the same time (Triton's stubs) measure one after another
under a file lock, not on top of each other.

bfloat16 engines (the demo's draft) choose the same way: on a CPU with AMX the reordered bf16
weights ran a 576x1536 Linear in 35 us against 87 us for PyTorch's dense bf16 (49 us float32).

``TRTSPEC_ONEDNN=0`` forces dense, ``=1`` onednn and ``=head`` head (no measurement). float16, other dtypes,
a torch without oneDNN, or a failed measurement use dense, the transformers kernels.

A weight-only quantized engine (the spec's ``quantization: int8_wo | int4_wo``) has one kernel
per Linear, PyTorch's weight-only matmul (quant.py): nothing to choose; its codes are re-laid
for that kernel here, at load, and the choice says so (layout = the quantization).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from trtspec.cache import cache_root
from trtspec.engines.torch.model import PACKABLE, ByRows, DecoderLM, KVCache, OneDnnLinear, StepInputs
from trtspec.engines.torch.quant import WeightOnlyLinear
from trtspec.files import write_json_atomic
from trtspec.machine import cpu_name

LAYOUTS = ("dense", "onednn", "head")
# What the layouts run; bumped when that changes, so cached choices are measured again.
# 2: q/k/v and gate/up fused; onednn = weights reordered without a batch hint, run by
# _linear_pointwise (1: float32 as mkldnn tensors through mkldnn_linear).
# 3: a layout per shape (one row | more rows) when that is faster; seconds per step kind.
KERNELS_VERSION = "3"
ROUNDS = 7
SPLIT_GAIN = 0.95  # a split choice must save 5% of the best single layout's decode + verify
MAX_SPLIT_BYTES = 1 << 30  # ... and its second copy of the Linears that differ fit in 1 GiB
MIN_ROUNDS = 3  # fewer when every sample of one layout beats every sample of the other
PREFILL = 32  # context before the timed steps: a short prompt, as in decoding
CACHE_FILE = "kernels.json"
FORCED = {"0": "dense", "1": "onednn", "head": "head"}  # TRTSPEC_ONEDNN values
# Environment variables that cap the instruction sets the kernels may use: part of the key.
ISA_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR")


@dataclass
class KernelChoice:
    # dense | onednn | head | int8_wo | int4_wo (weight-only: every Linear quantized), or "A|B":
    # layout A for one-row forwards, B for larger ones (a split choice)
    layout: str
    source: str  # measured | cached | forced | fallback | quantized
    seconds: dict[str, float] = field(default_factory=dict)  # per layout: decode + verify step
    key: str = ""
    reason: str = ""  # for forced / fallback
    steps: dict[str, list[float]] = field(default_factory=dict)  # per layout: [decode, verify] seconds


def cpu_signature() -> dict[str, str]:
    """What identifies this CPU's kernels: model name and ISA flags, as the OS reports them."""
    flags = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "flags":
                flags = " ".join(sorted(value.split()))
                break
    return {
        "cpu": cpu_name(),
        "flags": hashlib.sha256(flags.encode()).hexdigest()[:16],
        "capability": str(torch.backends.cpu.get_cpu_capability()),
        "isa_env": ",".join(f"{k}={os.environ[k]}" for k in ISA_ENV if k in os.environ),
    }


def choice_key(model: DecoderLM, verify_tokens: int) -> str:
    cfg = model.cfg
    parts = cpu_signature() | {
        "threads": str(torch.get_num_threads()),
        "torch": torch.__version__,
        "shape": f"{cfg.hidden_size}x{cfg.intermediate_size}x{cfg.num_layers}x{cfg.vocab_size}"
        f"/{cfg.num_heads}/{cfg.num_kv_heads}/{cfg.head_dim}",
        "dtype": str(model.model.embed_tokens.weight.dtype),
        "verify_tokens": str(verify_tokens),
        "layouts": ",".join(LAYOUTS),  # a choice made among fewer candidates is measured again
        "kernels": KERNELS_VERSION,  # a choice made with other kernels behind a layout, too
    }
    return json.dumps(parts, sort_keys=True)


# -- switching layouts ----------------------------------------------------------------------------


def split(choice: str) -> tuple[str, str]:
    """A choice's layouts for one-row and for larger forwards ("head|onednn" -> head, onednn)."""
    one, _, many = choice.partition("|")
    return one, many or one


def _packs(layout: str, is_head: bool) -> bool:
    return layout == "onednn" or (layout == "head" and is_head)


class _Layouts:
    """Both forms of every Linear, so measurement can switch between the layouts; ``keep``
    leaves the model on one choice and drops the weights it does not use."""

    def __init__(self, model: DecoderLM):
        self.places = [
            (module, name, child)
            for module in list(model.modules())
            for name, child in list(module.named_children())
            if isinstance(child, nn.Linear)
        ]
        self.packed = [OneDnnLinear(child) for _, _, child in self.places]
        self.head = model.lm_head

    def use(self, choice: str) -> None:
        one, many = split(choice)
        for (module, name, dense), packed in zip(self.places, self.packed):
            is_head = dense is self.head
            first = packed if _packs(one, is_head) else dense
            second = packed if _packs(many, is_head) else dense
            setattr(module, name, first if first is second else ByRows(first, second))

    def extra_bytes(self, choice: str) -> int:
        """Weight bytes held twice under ``choice`` (the Linears kept in both forms)."""
        one, many = split(choice)
        return sum(
            dense.weight.nbytes
            for _, _, dense in self.places
            if _packs(one, dense is self.head) != _packs(many, dense is self.head)
        )

    def keep(self, choice: str) -> None:
        self.use(choice)
        self.places, self.packed = [], []


# -- measuring --------------------------------------------------------------------------------


def _step(tokens: int, start: int, vocab: int) -> StepInputs:
    positions = torch.arange(start, start + tokens).view(1, tokens)  # [1, q]
    span = start + tokens
    mask = None
    if tokens > 1:  # causal within the new tokens, as the engine masks a verify step
        mask = (torch.arange(span).view(1, 1, span) <= positions.unsqueeze(-1)).unsqueeze(1)  # [1, 1, q, S]
    ids = (torch.arange(tokens) * 7 + start) % vocab  # any valid ids; the timing does not depend on them
    return StepInputs(ids.view(1, tokens), positions, torch.zeros(1, dtype=torch.long), mask, [(0, start, tokens)], span)


def step_timer(model: DecoderLM, cos: torch.Tensor, sin: torch.Tensor, verify_tokens: int) -> Callable[[], tuple[float, float]]:
    """A function that times one decode step and one verify step (seconds each) at position
    PREFILL of a private one-slot cache. The keys before it are never written (zeros): the
    work, and so the time, does not depend on their values."""
    cache = KVCache(model.cfg, 1, PREFILL + verify_tokens + 1, model.model.embed_tokens.weight.dtype)
    vocab = model.cfg.vocab_size
    decode, verify = _step(1, PREFILL, vocab), _step(verify_tokens, PREFILL, vocab)

    def run(step: StepInputs) -> None:
        hidden = model.hidden_states(step, cos, sin, cache)  # [1, q, hidden]
        model.logits(hidden[:, -step.rows[0][2] :])

    def timed() -> tuple[float, float]:
        t0 = time.perf_counter()
        run(decode)
        t1 = time.perf_counter()
        if verify_tokens > 1:
            run(verify)
        return t1 - t0, time.perf_counter() - t1

    return timed


def measure_layouts(
    model: DecoderLM, cos: torch.Tensor, sin: torch.Tensor, verify_tokens: int
) -> tuple[str, dict[str, float], dict[str, list[float]]]:
    """Time every layout on this model, interleaved; returns (the choice, median decode + verify
    seconds per layout, median [decode, verify] seconds per layout)."""
    layouts = _Layouts(model)
    timed = step_timer(model, cos, sin, verify_tokens)
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in LAYOUTS}
    try:
        for layout in LAYOUTS:  # warm-up: first calls pay for allocation and kernel setup
            layouts.use(layout)
            timed()
        for r in range(ROUNDS):
            for layout in LAYOUTS[r % len(LAYOUTS) :] + LAYOUTS[: r % len(LAYOUTS)]:  # rotated each round
                layouts.use(layout)
                samples[layout].append(timed())
            if r + 1 >= MIN_ROUNDS and _separated(samples):
                break
    except BaseException:
        layouts.keep("dense")
        raise
    steps = {name: [statistics.median(d for d, _ in s), statistics.median(v for _, v in s)] for name, s in samples.items()}
    seconds = {name: statistics.median(d + v for d, v in s) for name, s in samples.items()}

    def fastest(cost) -> str:
        return min(LAYOUTS, key=lambda name: (cost(name), name != "dense"))  # a tie keeps dense

    best = fastest(seconds.get)
    one, many = fastest(lambda n: steps[n][0]), fastest(lambda n: steps[n][1])
    if (
        one != many
        and steps[one][0] + steps[many][1] < SPLIT_GAIN * seconds[best]
        and layouts.extra_bytes(f"{one}|{many}") <= MAX_SPLIT_BYTES
    ):
        best = f"{one}|{many}"
    layouts.keep(best)
    return best, seconds, steps


def _separated(samples: dict[str, list[tuple[float, float]]]) -> bool:
    """One layout's every sample (decode + verify) beats every sample of each other layout."""
    sums = {name: [d + v for d, v in s] for name, s in samples.items()}
    return any(all(max(s) < min(o) for n, o in sums.items() if n != name) for name, s in sums.items())


# -- choosing (cache, lock, overrides) ---------------------------------------------------------------


def choose_kernels(
    model: DecoderLM,
    cos: torch.Tensor,
    sin: torch.Tensor,
    verify_tokens: int,
    cache_dir: Path | None = None,
) -> KernelChoice:
    """Put ``model`` on the faster layout for this machine and say how it was chosen."""
    quantized = weight_only_linears(model)
    if quantized:
        for linear in quantized:
            linear.pack()
        schemes = sorted({linear.scheme for linear in quantized})
        return KernelChoice(
            # under int4_wo the LM head is int8_wo (quant.scheme_of): the layers' scheme names the engine
            "int4_wo" if "int4_wo" in schemes else schemes[0],
            "quantized",
            reason=f"weight-only quantized Linears ({', '.join(schemes)}): PyTorch's weight-only CPU kernels",
        )
    forced = os.environ.get("TRTSPEC_ONEDNN", "").strip()
    if forced in FORCED:
        layout = FORCED[forced]
        if layout != "dense" and not _onednn_possible(model):
            return KernelChoice("dense", "fallback", reason=f"TRTSPEC_ONEDNN={forced} but oneDNN cannot run this model")
        _apply(model, layout)
        return KernelChoice(layout, "forced", reason=f"TRTSPEC_ONEDNN={forced}")
    if not _onednn_possible(model):
        return KernelChoice(
            "dense",
            "fallback",
            reason="oneDNN cannot run this model here (float32 needs oneDNN; bfloat16 also its bf16 reorder, "
            "which needs avx512bw/vl/dq or avx_ne_convert)",
        )
    key = choice_key(model, verify_tokens)
    path = (cache_dir or cache_root()) / CACHE_FILE
    try:
        with _locked(path):
            cached = _read(path).get(key)
            if cached is not None and all(part in LAYOUTS for part in split(str(cached.get("layout")))):
                _apply(model, cached["layout"])
                return KernelChoice(
                    cached["layout"], "cached", dict(cached.get("seconds", {})), key, steps=dict(cached.get("steps", {}))
                )
            best, seconds, steps = measure_layouts(model, cos, sin, verify_tokens)
            choice = KernelChoice(best, "measured", seconds, key, steps=steps)
            entries = _read(path)
            entries[key] = {
                "layout": best,
                "seconds": seconds,
                "steps": steps,
                "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
            with contextlib.suppress(OSError):  # a read-only cache: measure again next time
                write_json_atomic(path, entries)
            return choice
    except Exception as err:  # never fail a load over a speed choice: transformers' kernels
        # (measure_layouts has put the model back on dense before raising)
        print(f"trtspec: kernel measurement failed ({type(err).__name__}: {err}); using dense", file=sys.stderr)
        return KernelChoice("dense", "fallback", reason=f"measurement failed: {err}")


def weight_only_linears(model: DecoderLM) -> list[WeightOnlyLinear]:
    return [m for m in model.modules() if isinstance(m, WeightOnlyLinear)]


def _apply(model: DecoderLM, layout: str) -> None:
    """Put a freshly loaded (dense) model on ``layout`` without measuring."""
    if "|" in layout:
        _Layouts(model).keep(layout)
    elif layout != "dense":
        model.pack_linears_for_onednn(head_only=layout == "head")


def _onednn_possible(model: DecoderLM) -> bool:
    weight = getattr(model.lm_head, "weight", None)
    if not torch.backends.mkldnn.is_available() or weight is None or weight.dtype not in PACKABLE:
        return False
    return weight.dtype != torch.bfloat16 or _bf16_reorder_works()


@functools.cache
def _bf16_reorder_works() -> bool:
    """oneDNN's bf16 weight reorder needs avx512bw/vl/dq or avx_ne_convert: an AVX2-only CPU
    refuses it (RuntimeError), so a bfloat16 engine there has only the dense layout."""
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16))
    except RuntimeError:
        return False
    return True


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # missing or damaged: measured again and rewritten
    return data if isinstance(data, dict) else {}


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock beside the cache file (POSIX); without one, measure unlocked."""
    try:
        import fcntl

        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path.with_suffix(".lock"), "a")  # noqa: SIM115 (held across the yield)
    except (ImportError, OSError):
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield

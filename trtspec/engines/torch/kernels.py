"""Which kernels run a float32 or bfloat16 engine's Linear layers on this CPU, chosen by measurement.

Candidates (the weights and the arithmetic are the same; the greedy tokens are identical, tested):
  dense    PyTorch's own linear on the row-major weight (what transformers runs)
  onednn   the weight re-laid once in oneDNN's blocked format, run by mkldnn_linear
  head     only the LM head re-laid for oneDNN; the layers' Linears stay dense
  panel    float32 weights re-laid in panels for trtspec's own kernel (native.py), compiled for
           this CPU at first use: it streams each weight once per call for up to a dozen rows
           and adds each row's products in the same order however many rows run, so a decode
           step's and a verify step's Linears agree bit for bit. Where it cannot be built it is
           not a candidate.

Which is faster depends on the CPU, and on the shape: on a 2-core AVX-512 EPYC onednn made a SmolLM2 decode
step 38 -> 31 ms; on an AVX2-only CPU the engine with onednn was slower than transformers
(8.0 vs 8.6 tok/s). The LM head is the odd one out: one [vocab, hidden] matrix, a quarter of
SmolLM2's weights, where PyTorch's dense kernel for 2+ rows is slow on such a CPU. On a 2-core
AVX2 EPYC (2026-12-01) `head` made a decode step 59 -> 51 ms, a 2-token verify 95 -> 78 ms
and a 16-row batched decode 297 -> 219 ms, while `onednn` (every Linear) was slower than dense
at 1 token (82 ms). So the engine measures instead of assuming: at load, a step of each size in
``timed_sizes`` (1 token: a decode step; 2 .. max_draft_len + 1: verify steps) at a short
context, each candidate up to ``ROUNDS`` times in alternating order (3 when one is faster in
every sample), the median of each; the lowest sum wins (a tie keeps dense). When one layout
is fastest for the small steps and another for the large ones, and the two together beat the
best single layout by ``SPLIT_GAIN``, the engine keeps both forms of the Linears where they
differ and runs inputs of fewer than ``t`` rows on the first, larger ones on the second (the
choice ``"head|onednn"``: one row | more rows; ``"dense|onednn@4"``: 1-3 rows | 4 or more),
``t`` the measured size that makes the sum lowest, if the copies those Linears then need fit
in ``MAX_SPLIT_BYTES``. On a 2-core Xeon with AMX a float32 SmolLM2 step of 1 / 2 / 3 / 4 / 9
tokens ran 37 / 44 / 49 / 67 / 82 ms dense and 56 / 53 / 60 / 52 / 61 ms onednn: dense is
best up to 3 rows, onednn from 4 (a split at 2 rows would make k=1's 2-token verify 20% dearer). The choice is cached per machine in ``$TRTSPEC_CACHE/kernels.json`` under a key made
of the CPU (model name, ISA flags, ATen's CPU capability, ISA caps set in the environment),
the thread count, the torch version and the model's shape, so each machine measures each
model shape once (once quiet: a choice measured while other processes kept the cores busy is
provisional and measured again at a quiet load, contention.py; ``TRTSPEC_REMEASURE=1`` measures
again at any load); engines loading at the same time (Triton's stubs) measure one after another
under a file lock, not on top of each other.

bfloat16 engines (the demo's draft) choose the same way: on a CPU with AMX the reordered bf16
weights ran a 576x1536 Linear in 35 us against 87 us for PyTorch's dense bf16 (49 us float32).

An EAGLE-3 head's Linears are chosen the same way (choose_layout, with the head's own draft
step timed and its own key: eagle3_head.choose_head_kernels); what each layout costs a head
step: lab/head_step.py, lab/RECORDS.md#the-demos-co-designed-pair-quiet.

``TRTSPEC_ONEDNN=0`` forces dense, ``=1`` onednn, ``=head`` head and ``=panel`` panel (no measurement). float16, other dtypes,
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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from trtspec.cache import cache_root
from trtspec.engines.torch import contention
from trtspec.engines.torch.model import PACKABLE, ByRows, DecoderLM, KVCache, OneDnnLinear, StepInputs
from trtspec.engines.torch.native import PanelLinear, QuantPanelLinear, panel_kernel
from trtspec.engines.torch.quant import WeightOnlyLinear
from trtspec.files import exclusive_lock
from trtspec.machine import cpu_name

LAYOUTS = ("dense", "onednn", "head", "panel")
# What the layouts run; bumped when that changes, so cached choices are measured again.
# 2: q/k/v and gate/up fused; onednn = weights reordered without a batch hint, run by
# _linear_pointwise (1: float32 as mkldnn tensors through mkldnn_linear).
# 3: a layout per shape (one row | more rows) when that is faster; seconds per step kind.
# 4: every step size of timed_sizes timed; the split's row threshold measured, not fixed at 2.
# 5: the panel layout.
KERNELS_VERSION = "5"
ROUNDS = 7
SPLIT_GAIN = 0.95  # a split choice must save 5% of the best single layout's decode + verify
MAX_SPLIT_BYTES = 1 << 30  # ... and its second copy of the Linears that differ fit in 1 GiB
MIN_ROUNDS = 3  # fewer when every sample of one layout beats every sample of the other
PREFILL = 32  # context before the timed steps: a short prompt, as in decoding
CACHE_FILE = "kernels.json"
FORCED = {"0": "dense", "1": "onednn", "head": "head", "panel": "panel"}  # TRTSPEC_ONEDNN values
# Environment variables that cap the instruction sets the kernels may use: part of the key.
ISA_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR")


@dataclass
class KernelChoice:
    # dense | onednn | head | int8_wo | int4_wo (weight-only: every Linear quantized), or "A|B"
    # (layout A for one-row forwards, B for larger ones) or "A|B@t" (A below t rows): a split
    layout: str
    source: str  # measured | cached | forced | fallback | quantized
    seconds: dict[str, float] = field(default_factory=dict)  # per layout: its steps' medians, summed
    key: str = ""
    reason: str = ""  # for forced / fallback
    steps: dict[str, list[float]] = field(default_factory=dict)  # per layout: seconds of a step of each size
    sizes: tuple[int, ...] = ()  # the step sizes (tokens) ``steps`` lists
    # other processes' share of the cores while it was measured (contention.py); None: unknown
    others_busy: float | None = None


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


def machine_key() -> str:
    """What every cached choice depends on besides its model: this CPU, its threads, torch,
    and the candidates and kernels behind them."""
    parts = cpu_signature() | {
        "threads": str(torch.get_num_threads()),
        "torch": torch.__version__,
        # a choice made among fewer candidates is measured again
        "layouts": ",".join(LAYOUTS) + ("" if panel_kernel() is not None else " (no panel kernel)"),
        "kernels": KERNELS_VERSION,  # a choice made with other kernels behind a layout, too
    }
    return json.dumps(parts, sort_keys=True)


def choice_key(model: DecoderLM, verify_tokens: int) -> str:
    cfg = model.cfg
    parts = json.loads(machine_key()) | {
        "shape": f"{cfg.hidden_size}x{cfg.intermediate_size}x{cfg.num_layers}x{cfg.vocab_size}"
        f"/{cfg.num_heads}/{cfg.num_kv_heads}/{cfg.head_dim}",
        "dtype": str(model.model.embed_tokens.weight.dtype),
        "verify_tokens": str(verify_tokens),
    }
    return json.dumps(parts, sort_keys=True)


# -- switching layouts ----------------------------------------------------------------------------


def split(choice: str) -> tuple[str, str, int]:
    """A choice's layout below its row threshold, its layout from there on, and the threshold
    ("head|onednn" -> head, onednn, 2; "dense|onednn@4" -> dense, onednn, 4; "dense" -> dense,
    dense, 2). ValueError for a threshold that is not a number of rows above 1."""
    one, _, rest = choice.partition("|")
    many, _, threshold = rest.partition("@")
    t = int(threshold) if threshold else 2
    if t < 2:
        raise ValueError(f"row threshold {t} in kernel choice {choice!r}: must be 2 or more")
    return one, many or one, t


def join(one: str, many: str, threshold: int) -> str:
    """The choice string of ``split``'s parts."""
    if one == many:
        return one
    return f"{one}|{many}" if threshold == 2 else f"{one}|{many}@{threshold}"


def timed_sizes(verify_tokens: int) -> tuple[int, ...]:
    """The step sizes (tokens) timed for a model verifying up to ``verify_tokens`` tokens: a
    decode step, the short verify steps of small k one by one, and the longest."""
    return tuple(n for n in sorted({1, 2, 3, 4, 6, verify_tokens}) if n <= max(verify_tokens, 1))


def _form(layout: str, is_head: bool) -> str:
    """Which form of a Linear ``layout`` runs: dense, packed (oneDNN) or panel."""
    if layout == "onednn" or (layout == "head" and is_head):
        return "packed"
    return "panel" if layout == "panel" else "dense"


def candidates(model: nn.Module) -> tuple[str, ...]:
    """The layouts that can run ``model`` here: the panel kernel takes float32 weights and
    weight-only quantized ones, where it could be built; a quantized model has no oneDNN form
    ("dense" then means PyTorch's weight-only kernels)."""
    quantized = any(isinstance(m, WeightOnlyLinear) for m in model.modules())
    weight = getattr(model.lm_head, "weight", None)
    panel = (quantized or (weight is not None and weight.dtype == torch.float32)) and panel_kernel() is not None
    if quantized:
        return ("dense", "panel") if panel else ("dense",)
    onednn = _onednn_possible(model)
    return tuple(name for name in LAYOUTS if (name != "panel" or panel) and (name in ("dense", "panel") or onednn))


def _panel_form(linear: nn.Module) -> nn.Module:
    return QuantPanelLinear(linear) if isinstance(linear, WeightOnlyLinear) else PanelLinear(linear)


def _nbytes(linear: nn.Module) -> int:
    return sum(t.nbytes for t in linear.parameters())


class _Layouts:
    """Every form of every Linear the ``layouts`` need, so measurement can switch between
    them; ``keep`` leaves the model on one choice and drops the weights it does not use."""

    def __init__(self, model: nn.Module, layouts: tuple[str, ...]):
        self.places = [
            (module, name, child)
            for module in list(model.modules())
            for name, child in list(module.named_children())
            if isinstance(child, nn.Linear | WeightOnlyLinear)
        ]
        self.head = model.lm_head
        needed = {_form(layout, is_head) for layout in layouts for is_head in (False, True)}
        self.forms: dict[str, list[nn.Module]] = {"dense": [child for _, _, child in self.places]}
        if "packed" in needed:
            self.forms["packed"] = [OneDnnLinear(child) for _, _, child in self.places]
        if "panel" in needed:
            self.forms["panel"] = [_panel_form(child) for _, _, child in self.places]
        for linear in self.forms["dense"]:  # PyTorch's weight-only kernels re-lay their codes now
            if isinstance(linear, WeightOnlyLinear):
                linear.pack()

    def use(self, choice: str) -> None:
        one, many, threshold = split(choice)
        for i, (module, name, dense) in enumerate(self.places):
            is_head = dense is self.head
            first = self.forms[_form(one, is_head)][i]
            second = self.forms[_form(many, is_head)][i]
            setattr(module, name, first if first is second else ByRows(first, second, threshold))

    def extra_bytes(self, choice: str) -> int:
        """Weight bytes held twice under ``choice`` (the Linears kept in both forms)."""
        one, many, _ = split(choice)
        return sum(
            _nbytes(dense) for _, _, dense in self.places if _form(one, dense is self.head) != _form(many, dense is self.head)
        )

    def keep(self, choice: str) -> None:
        self.use(choice)
        self.places, self.forms = [], {}


# -- measuring --------------------------------------------------------------------------------


def timing_step(tokens: int, start: int, vocab: int) -> StepInputs:
    """One slot's step of ``tokens`` new tokens after ``start`` cached ones, as a timed step runs it."""
    positions = torch.arange(start, start + tokens).view(1, tokens)  # [1, q]
    span = start + tokens
    mask = None
    if tokens > 1:  # causal within the new tokens, as the engine masks a verify step
        mask = (torch.arange(span).view(1, 1, span) <= positions.unsqueeze(-1)).unsqueeze(1)  # [1, 1, q, S]
    ids = (torch.arange(tokens) * 7 + start) % vocab  # any valid ids; the timing does not depend on them
    return StepInputs(ids.view(1, tokens), positions, torch.zeros(1, dtype=torch.long), mask, [(0, start, tokens)], span)


def step_timer(model: DecoderLM, cos: torch.Tensor, sin: torch.Tensor, sizes: tuple[int, ...]) -> Callable[[], list[float]]:
    """A function that times one step of each of ``sizes`` tokens (seconds each, in that
    order) at position PREFILL of a private one-slot cache (earlier when the engine's RoPE
    table, sized to its max_seq_len, is shorter). The keys before it are never written
    (zeros): the work, and so the time, does not depend on their values."""
    start = max(0, min(PREFILL, cos.shape[0] - max(sizes)))
    cache = KVCache(model.cfg, 1, start + max(sizes) + 1, model.model.embed_tokens.weight.dtype)
    steps = [timing_step(n, start, model.cfg.vocab_size) for n in sizes]

    def run(step: StepInputs) -> float:
        t = time.perf_counter()
        hidden = model.hidden_states(step, cos, sin, cache)  # [1, q, hidden]
        model.logits(hidden[:, -step.rows[0][2] :])
        return time.perf_counter() - t

    return lambda: [run(step) for step in steps]


def measure_layouts(
    model: nn.Module, timed: Callable[[], list[float]], sizes: tuple[int, ...]
) -> tuple[str, dict[str, float], dict[str, list[float]]]:
    """Time every layout on ``model`` (a module with Linears and an ``lm_head``) with
    ``timed`` (seconds of a step of each of ``sizes`` tokens), interleaved; returns (the
    choice, summed median seconds per layout, median seconds per layout and size)."""
    names = candidates(model)
    layouts = _Layouts(model, names)
    samples: dict[str, list[list[float]]] = {name: [] for name in names}
    try:
        for layout in names:  # warm-up: first calls pay for allocation and kernel setup
            layouts.use(layout)
            timed()
        for r in range(ROUNDS):
            for layout in names[r % len(names) :] + names[: r % len(names)]:  # rotated each round
                layouts.use(layout)
                samples[layout].append(timed())
            if r + 1 >= MIN_ROUNDS and _separated(samples):
                break
    except BaseException:
        layouts.keep("dense")
        raise
    # Per size the median of its samples (a spike in one step does not move the others), and
    # every layout and split judged by the sum of those medians.
    steps = {name: [statistics.median(col) for col in zip(*s)] for name, s in samples.items()}
    seconds = {name: sum(medians) for name, medians in steps.items()}
    best = min(names, key=lambda name: (seconds[name], name != "dense"))  # a tie keeps dense
    split_choice, cost = _best_split(steps, sizes)
    if split_choice and cost < SPLIT_GAIN * seconds[best] and layouts.extra_bytes(split_choice) <= MAX_SPLIT_BYTES:
        best = split_choice
    layouts.keep(best)
    return best, seconds, steps


def _best_split(steps: dict[str, list[float]], sizes: tuple[int, ...]) -> tuple[str | None, float]:
    """The split (one layout below a row threshold, another from it) whose steps of ``sizes``
    sum lowest, and that sum; (None, inf) when there is only one size."""
    best: tuple[str | None, float] = (None, float("inf"))
    for one in steps:
        for many in steps:
            for t in sizes[1:] if one != many else ():
                cost = sum(steps[one if n < t else many][i] for i, n in enumerate(sizes))
                if cost < best[1]:
                    best = (join(one, many, t), cost)
    return best


def _separated(samples: dict[str, list[list[float]]]) -> bool:
    """One layout's every sample (its steps summed) beats every sample of each other layout."""
    sums = {name: [sum(row) for row in s] for name, s in samples.items()}
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
        return _choose_quantized(model, quantized, cos, sin, verify_tokens, cache_dir)
    sizes = timed_sizes(verify_tokens)
    return choose_layout(
        model, choice_key(model, verify_tokens), sizes, lambda: step_timer(model, cos, sin, sizes), _apply, cache_dir
    )


def _choose_quantized(
    model: DecoderLM, quantized: list[WeightOnlyLinear], cos, sin, verify_tokens: int, cache_dir: Path | None
) -> KernelChoice:
    """A weight-only quantized engine: PyTorch's weight-only kernels, or the panel kernel's
    where it is built and measures faster (TRTSPEC_ONEDNN=panel forces it, any other value
    PyTorch's)."""
    schemes = sorted({linear.scheme for linear in quantized})
    # under int4_wo the LM head is int8_wo (quant.scheme_of): the layers' scheme names the engine
    scheme = "int4_wo" if "int4_wo" in schemes else schemes[0]
    forced = os.environ.get("TRTSPEC_ONEDNN", "").strip()
    if "panel" not in candidates(model) or (forced in FORCED and forced != "panel"):
        for linear in quantized:
            linear.pack()
        why = f"TRTSPEC_ONEDNN={forced}" if forced in FORCED else "the panel kernel is not built here"
        return KernelChoice(
            scheme, "quantized", reason=f"weight-only quantized Linears ({', '.join(schemes)}): PyTorch's kernels ({why})"
        )
    sizes = timed_sizes(verify_tokens)
    choice = choose_layout(
        model,
        quantized_key(model, verify_tokens, schemes),
        sizes,
        lambda: step_timer(model, cos, sin, sizes),
        apply_layout,
        cache_dir,
    )
    choice.reason = choice.reason or f"weight-only quantized Linears ({', '.join(schemes)})"
    choice.layout = scheme if choice.layout == "dense" else f"{scheme}:{choice.layout}"
    return choice


def quantized_key(model: DecoderLM, verify_tokens: int, schemes: list[str]) -> str:
    """choice_key with the schemes: a float model of the same shape has other layouts."""
    return json.dumps(json.loads(choice_key(model, verify_tokens)) | {"quantization": "+".join(schemes)}, sort_keys=True)


def one_row_form(choice: KernelChoice) -> str:
    """The layout a one-row step runs under ``choice`` (a quantized engine's ``int4_wo:panel``: panel)."""
    layout = choice.layout.partition(":")[2] or choice.layout
    try:
        return split(layout)[0]
    except ValueError:
        return layout


def choose_layout(
    model: nn.Module,
    key: str,
    sizes: tuple[int, ...],
    make_timer: Callable[[], Callable[[], list[float]]],
    apply: Callable[[nn.Module, str], None],
    cache_dir: Path | None = None,
) -> KernelChoice:
    """Put ``model`` (a module with Linears and an ``lm_head``: a target, an EAGLE-3 head) on
    the layout TRTSPEC_ONEDNN forces, or on this machine's cached choice under ``key``, or on
    the fastest measured now (``make_timer()``: seconds of a step of each of ``sizes`` tokens)
    and cached. ``apply`` puts a freshly loaded (dense) model on a layout without measuring."""
    forced = os.environ.get("TRTSPEC_ONEDNN", "").strip()
    if forced in FORCED:
        layout = FORCED[forced]
        if layout == "panel" and layout not in candidates(model):
            return KernelChoice("dense", "fallback", reason=f"TRTSPEC_ONEDNN={forced} but the panel kernel cannot run this model")
        if layout not in ("dense", "panel") and not _onednn_possible(model):
            return KernelChoice("dense", "fallback", reason=f"TRTSPEC_ONEDNN={forced} but oneDNN cannot run this model")
        apply(model, layout)
        return KernelChoice(layout, "forced", reason=f"TRTSPEC_ONEDNN={forced}")
    if candidates(model) == ("dense",):
        return KernelChoice(
            "dense",
            "fallback",
            reason="oneDNN cannot run this model here (float32 needs oneDNN; bfloat16 also its bf16 reorder, "
            "which needs avx512bw/vl/dq or avx_ne_convert)",
        )
    try:
        return _measured_or_cached(model, key, sizes, make_timer, apply, (cache_dir or cache_root()) / CACHE_FILE)
    except Exception as err:  # never fail a load over a speed choice: transformers' kernels
        # (measure_layouts has put the model back on dense before raising)
        print(f"trtspec: kernel measurement failed ({type(err).__name__}: {err}); using dense", file=sys.stderr)
        return KernelChoice("dense", "fallback", reason=f"measurement failed: {err}")


def _measured_or_cached(model: nn.Module, key: str, sizes: tuple[int, ...], make_timer, apply, path: Path) -> KernelChoice:
    """This machine's cached choice for ``key`` applied, or one measured now and cached."""
    what = f"the kernel choice for {contention.describe(key)}"
    with exclusive_lock(path.with_suffix(".lock")):
        cached = contention.records(path).get(key)
        if not (isinstance(cached, dict) and _valid(str(cached.get("layout")), candidates(model))):
            cached = None
        if cached is not None and contention.stands(cached, what):
            apply(model, cached["layout"])
            seconds, steps = dict(cached.get("seconds", {})), dict(cached.get("steps", {}))
            others = cached.get("others_busy")
            return KernelChoice(cached["layout"], "cached", seconds, key, steps=steps, sizes=sizes, others_busy=others)
        with contention.Watch() as watch:  # how busy the other processes kept the cores meanwhile
            best, seconds, steps = measure_layouts(model, make_timer(), sizes)
        if contention.replaces(cached, watch.others, what):
            record = {"layout": best, "seconds": seconds, "steps": steps, "sizes": list(sizes)}
            contention.store(path, key, record, watch.others)
        return KernelChoice(best, "measured", seconds, key, steps=steps, sizes=sizes, others_busy=watch.others)


def _valid(choice: str, layouts: tuple[str, ...]) -> bool:
    """A cached choice this code can apply to a model with these candidate ``layouts`` (a
    hand-edited or foreign cache is measured again)."""
    try:
        return all(part in layouts for part in split(choice)[:2])
    except ValueError:
        return False


def weight_only_linears(model: DecoderLM) -> list[WeightOnlyLinear]:
    return [m for m in model.modules() if isinstance(m, WeightOnlyLinear)]


def _apply(model: DecoderLM, layout: str) -> None:
    """Put a freshly loaded (dense) model on ``layout`` without measuring (a single layout
    packs only the Linears it runs: no transient second copy of the others)."""
    if layout in ("onednn", "head"):
        model.pack_linears_for_onednn(head_only=layout == "head")
    elif layout != "dense":
        apply_layout(model, layout)


def apply_layout(model: nn.Module, layout: str) -> None:
    """Put any module with Linears and an ``lm_head`` (dense) on ``layout`` without measuring."""
    one, many, _ = split(layout)
    _Layouts(model, (one, many)).keep(layout)


def _onednn_possible(model: nn.Module) -> bool:
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

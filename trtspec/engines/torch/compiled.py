"""A decoder's whole forward step as one compiled program (torch.compile, fullgraph).

Why: run op by op, a SmolLM2 step makes thousands of small kernel calls, each through Python
and the dispatcher. Compiled as one graph (the gpt-fast design), a layer's norms, RoPE,
residuals, activation and K/V writes fuse into a few generated C++ loops, and a step costs one
guard check instead of a Python call per op.

The Linear layers, two ways:
  streamed  a one-row step (a decode step) computes each dense weight's matrix-vector product
            as a multiply-and-sum that inductor generates as one vectorised loop streaming the
            weight once. oneDNN's and MKL's kernels for one row read the weight well below the
            memory bandwidth (the all-Linears pass of the demo target: 24.7 ms oneDNN, 18.8 ms
            streamed, on a 2-core AVX-512 EPYC); for two or more rows the generated loops read
            the weight once per row, so they are used for one row only.
  kernel    every other step calls the engine's own Linear module (kernels.py's measured choice:
            oneDNN's blocked layout, PyTorch's weight-only int4/int8 kernels) through one opaque
            op, ``trtspec::linear``. The graph then holds no packed weight, which inductor could
            not cache on disk, so the next process reuses the compiled code.

Arithmetic: the same formulas as DecoderLM.hidden_states on the same weights, so logits agree
to float rounding (the fused loops and the streamed sums add in another order); verify's
verdicts class any token that rounding flips as numerical.

Programs: one per kind of step, compiled the first time it is met: one row or several, one new
token or several, with or without captured layers, and a prompt's first chunk (one row from
position 0, whose attention is causal: the kernel skips the masked half). Tokens per row, rows (from two), keys
attended and K/V written are dynamic sizes, so a growing context never compiles again.
Each program is saved when compiled (saved.py, under ``$TRTSPEC_CACHE/programs``) and a process
that meets that kind again on the same machine, torch, code and weights loads it in about a
second instead of tracing the step again (inductor's own cache, ``$TRTSPEC_CACHE/inductor``,
spares only the C++ compile); a program torch cannot save is compiled in process as before.

Chosen by measurement (``choose_program``): eager against compiled for a one-row step and for
the verify steps, per machine, cached like the kernel choice (provisional when measured on a
busy machine, contention.py); where compiling fails (no C++
compiler, an unsupported op) the engine runs eager and says so in one line.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from trtspec.cache import cache_root
from trtspec.engines.torch import contention, saved
from trtspec.engines.torch.model import ByRows, DecoderLM, KVCache, StepInputs
from trtspec.engines.torch.native import PanelLinear, QuantPanelLinear
from trtspec.engines.torch.quant import WeightOnlyLinear
from trtspec.engines.torch.saved import SavedPrograms, unmark

# Inductor's code cache under trtspec's, set before anything imports inductor's config: that
# import writes its own default (a folder under /tmp, gone at the next boot or pod restart)
# into the environment. A user's own TORCHINDUCTOR_CACHE_DIR wins.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root() / "inductor"))

COMPILE_ENV = "TRTSPEC_COMPILE"  # auto (default): measured | 1: compiled, unmeasured | 0: eager
CACHE_FILE = "programs.json"
PROGRAMS_VERSION = "5"  # bumped when what a program runs changes: cached choices are measured again
ROUNDS = 5
STREAMED_DTYPES = (torch.float32, torch.bfloat16)

# name -> (module, out_features): the Linears compiled programs call through trtspec::linear
_LINEARS: dict[str, tuple[nn.Module, int]] = {}
_created: dict[str, int] = {}  # programs made in this process, per role


@torch.library.custom_op("trtspec::linear", mutates_args=())
def _linear(x: torch.Tensor, name: str) -> torch.Tensor:
    """[rows, in] -> [rows, out] through the engine's Linear registered as ``name``."""
    return _LINEARS[name][0](x)


@_linear.register_fake
def _(x: torch.Tensor, name: str) -> torch.Tensor:
    return x.new_empty((x.shape[0], _LINEARS[name][1]))


def _out_features(module: nn.Module) -> int:
    return _out_features(module.one) if isinstance(module, ByRows) else int(module.out_features)


def _layer_linears(model: DecoderLM) -> list[dict[str, nn.Module]]:
    """Per layer, its four fused Linears by role."""
    out = []
    for layer in model.model.layers:
        a, mlp = layer.self_attn, layer.mlp
        if a.qkv_proj is None or mlp.gate_up_proj is None:
            raise ValueError("a compiled step needs fused projections (DecoderLM.fuse_projections)")
        out.append({"qkv": a.qkv_proj, "o": a.o_proj, "gate_up": mlp.gate_up_proj, "down": mlp.down_proj})
    return out


def streamed_weights(model: DecoderLM) -> dict[str, nn.Module]:
    """The Linears a one-row step streams, by program name ("3.qkv", "lm_head"): float32 and
    bfloat16 dense ones as they are before the kernel choice re-lays them (copies of their
    weights are kept), and int8 weight-only ones (their kernel's own codes). int4 weight-only
    Linears keep their kernel: a generated loop that unpacks nibbles ran slower than it."""
    out: dict[str, nn.Module] = {}
    named = [(f"{i}.{role}", m) for i, parts in enumerate(_layer_linears(model)) for role, m in parts.items()]
    for name, m in [*named, ("lm_head", model.lm_head)]:
        weight = getattr(m, "weight", None)
        if isinstance(m, WeightOnlyLinear) and m.scheme == "int8_wo":
            out[name] = m
        elif isinstance(weight, torch.Tensor) and weight.dtype in STREAMED_DTYPES and not weight.is_mkldnn:
            with torch.device("meta"):
                copy = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, dtype=weight.dtype)
            copy.weight, copy.bias = m.weight, m.bias  # the same tensors: kept when the choice re-lays m
            out[name] = copy
    return out


@dataclass(frozen=True)
class StepTensors:
    """A step's inputs as tensors only (a compiled program guards on no Python value)."""

    tokens: torch.Tensor  # [b, q] int64
    positions: torch.Tensor  # [b, q] int64
    mask: torch.Tensor  # [b, 1, q, S] bool: True = may attend; S = keys attended
    slots: torch.Tensor  # [b] int64: each row's cache slot
    write_slot: torch.Tensor  # [n] int64: where each real token's K/V goes (slot, position) ...
    write_pos: torch.Tensor  # [n]
    write_row: torch.Tensor  # [n] ... and where it comes from (row, token)
    write_tok: torch.Tensor  # [n]

    @classmethod
    def of(cls, step: StepInputs) -> StepTensors:
        b, q = step.tokens.shape
        dev = step.tokens.device
        mask = step.mask
        if mask is None:  # one row decoding one token: every cached key
            mask = torch.ones((b, 1, q, step.span), dtype=torch.bool, device=dev)
        if step.writes is not None:
            writes = step.writes
        else:  # one row: a contiguous run of positions
            slot, start, n = step.rows[0]
            pos = torch.arange(start, start + n)
            writes = (torch.full_like(pos, slot), pos, torch.zeros_like(pos), torch.arange(n))
        return cls(step.tokens, step.positions, mask, step.slots, *(t.to(dev) for t in writes))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (
            self.tokens,
            self.positions,
            self.mask,
            self.slots,
            self.write_slot,
            self.write_pos,
            self.write_row,
            self.write_tok,
        )

    def normalised(self) -> StepTensors:
        """Every tensor an inference tensor, whether the caller built it inside inference mode
        or not: a program's guards tell the two apart, and a server's callers do both (the
        EAGLE-3 drafter steps inside inference mode), so each would compile the step again."""
        return StepTensors(*(_inference(t) for t in self.tensors()))

    def mark_dynamic(self) -> None:
        """Sizes that vary from step to step, marked dynamic so that they never recompile (a
        size of 1 stays a kind of its own: one row, one new token)."""
        dims = {0: (self.tokens, self.positions, self.mask, self.slots), 1: (self.tokens, self.positions)}
        for dim, tensors in dims.items():
            for t in tensors:
                if t.shape[dim] > 1:
                    torch._dynamo.maybe_mark_dynamic(t, dim)
        for dim in (2, 3):
            if self.mask.shape[dim] > 1:
                torch._dynamo.maybe_mark_dynamic(self.mask, dim)
        for t in (self.write_slot, self.write_pos, self.write_row, self.write_tok):
            if t.shape[0] > 1:
                torch._dynamo.maybe_mark_dynamic(t, 0)


def _inference(t: torch.Tensor) -> torch.Tensor:
    if t.is_inference():
        return t
    with torch.inference_mode():
        return t.clone()


def _streamed(x: torch.Tensor, linear: nn.Module) -> torch.Tensor:
    """One row through a Linear as one generated loop that reads its weight once:
    [1, in] -> [1, out], summed in float32."""
    if isinstance(linear, WeightOnlyLinear):  # int8 codes [out, in], a scale per output row
        codes, scales = linear.kernel_tensors()
        out = (x.float() * codes.float()).sum(-1) * scales.float()  # [out]
    else:
        out = (x.float() * linear.weight.float()).sum(-1)
    out = out.to(x.dtype).unsqueeze(0)  # [1, out]
    return out if linear.bias is None else out + linear.bias


class StepProgram:
    """DecoderLM.hidden_states as compiled programs: ``hidden_states`` takes the same StepInputs
    and cache and returns the same final-norm hidden states (and captured layers)."""

    def __init__(self, model: DecoderLM, role: str, streamed: dict[str, nn.Module] | None = None, saved_in: Path | None = None):
        self.model = model
        # The names its Linears are called by: the same in every process that loads the same
        # engines in the same order, so inductor's cache finds the compiled code again.
        self.key = f"{role}-{_created.setdefault(role, 0)}"
        _created[role] += 1
        self.streamed = dict(streamed or {})  # program name -> the Linear a one-row step streams
        # rotate_half's signs as an input of the program, not made inside it: a tensor made in
        # inference mode within the traced code puts the mode switch into the graph, and AOT
        # autograd's cache refuses such a graph (every process then lowered it again)
        d, device = model.cfg.head_dim, model.model.embed_tokens.weight.device
        with torch.inference_mode():  # as every input (StepTensors.normalised)
            self.signs = torch.cat((-torch.ones(d // 2), torch.ones(d - d // 2))).to(device)
        self.register()
        self._compiled = torch.compile(self._hidden, fullgraph=True, dynamic=False)
        self._compiled_head = torch.compile(self._head, fullgraph=True, dynamic=False)
        self.compiled_kinds: dict[tuple[bool, bool, bool, bool], float] = {}  # kind -> seconds its first call took
        # programs saved for the next process (saved.py), under saved_in; None: torch.compile only
        self.saved = SavedPrograms(saved_in, self._external) if saved_in is not None else None
        self.counts: set[int] = set()  # the thread counts its programs have run at (each compiled for one)

    def register(self) -> None:
        """Point this program's Linear names at the model's current modules."""
        named = [(f"{i}.{role}", m) for i, parts in enumerate(_layer_linears(self.model)) for role, m in parts.items()]
        # read by the traced code through self, not through the process-wide table: a saved
        # program keeps the globals it reads, and the table holds every engine's modules
        self.linears = dict([*named, ("lm_head", self.model.lm_head)])
        for name, m in self.linears.items():
            _LINEARS[f"{self.key}/{name}"] = (m, _out_features(m))

    def __getstate__(self) -> dict[str, object]:
        """What a saved program's guards keep of its program (torch pickles the traced code's
        locals with them): the attributes the traced code reads, not the compiled programs."""
        return {k: self.__dict__[k] for k in ("model", "key", "streamed", "signs", "linears")}

    def _external(self) -> dict[str, object]:
        """What a saved program refers to by name, bound to this process's objects on loading."""
        modules = {f"module:{n}": m for n, m in self.model.named_modules()}
        return modules | {f"streamed:{n}": m for n, m in self.streamed.items()} | {"program": self}

    def _call(self, name: str, fn: Callable, compiled: Callable, args: tuple, mark: Callable[[], None]):
        """``fn(*args)`` as a compiled program: the saved one (loaded, or compiled now and saved),
        else torch.compile's ``compiled``. ``mark`` marks the sizes of ``args`` that are dynamic."""
        name = f"{self.key}.{name}-t{torch.get_num_threads()}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # inductor's notes on the code it traces are not the user's concern
            program = self.saved.find(name, fn.__func__, (self, *args), mark) if self.saved is not None else None
            if program is not None:
                return program(self, *args)
            mark()
            try:
                out = compiled(*args)
            finally:  # marks only while tracing: a saved program refuses marked inputs
                unmark(args)
            if self.saved is not None:
                self.saved.said(name)
            return out

    def close(self) -> None:
        for name in [n for n in _LINEARS if n.startswith(f"{self.key}/")]:
            del _LINEARS[name]

    def _lin(self, x: torch.Tensor, name: str) -> torch.Tensor:
        if x.shape[0] == 1 and name in self.streamed:  # a static size inside a program
            return _streamed(x, self.streamed[name])
        module = self.linears[name]
        if isinstance(module, WeightOnlyLinear | PanelLinear | QuantPanelLinear):
            return module(x)  # an operator (PyTorch's, the panel kernel's): called from the program, no Python
        return torch.ops.trtspec.linear(x, f"{self.key}/{name}")

    def _hidden(
        self,
        tokens,
        positions,
        mask,
        slots,
        write_slot,
        write_pos,
        write_row,
        write_tok,
        k_cache,
        v_cache,
        cos_table,
        sin_table,
        capture,
        causal,
    ):
        cfg = self.model.cfg
        h, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        b, q = tokens.shape
        span = mask.shape[-1]
        x = self.model.model.embed_tokens(tokens)  # [b, q, hidden]
        cos = cos_table[positions].to(x.dtype).unsqueeze(1)  # [b, 1, q, head_dim]
        sin = sin_table[positions].to(x.dtype).unsqueeze(1)
        captured = []
        for i, layer in enumerate(self.model.model.layers):
            qkv = self._lin(layer.input_layernorm(x).reshape(b * q, -1), f"{i}.qkv").view(b, q, h + 2 * kv, d).transpose(1, 2)
            qk = qkv[:, : h + kv]  # [b, h + kv, q, d]: queries and keys rotated together
            qk = qk * cos + qk.roll(d // 2, -1) * self.signs.to(qk.dtype) * sin  # model.py's _rotate_half
            xq, xk, xv = qk[:, :h], qk[:, h:], qkv[:, h + kv :]
            # only the real tokens' K/V is written (padding never clobbers a position)
            k_cache[i][write_slot, :, write_pos] = xk.transpose(1, 2)[write_row, write_tok]  # [n, kv, d]
            v_cache[i][write_slot, :, write_pos] = xv.transpose(1, 2)[write_row, write_tok]
            keys = k_cache[i][:, :, :span].index_select(0, slots)  # [b, kv, S, d]
            values = v_cache[i][:, :, :span].index_select(0, slots)
            # in float32 whatever the cache holds (the gather widens as it copies): the CPU's
            # bfloat16 attention kernel cost the demo's 4-bit draft more than its weights at a
            # 900-token context (a one-row step 41 -> 17 ms)
            # causal (StepInputs.causal: the mask is exactly causal): the kernel skips the masked half
            out = F.scaled_dot_product_attention(
                xq.float(), keys.float(), values.float(), attn_mask=None if causal else mask, is_causal=causal, enable_gqa=h != kv
            )
            out = out.to(x.dtype)  # [b, h, q, d]
            x = x + self._lin(out.transpose(1, 2).reshape(b * q, h * d), f"{i}.o").view(b, q, -1)
            gate, up = self._lin(layer.post_attention_layernorm(x).reshape(b * q, -1), f"{i}.gate_up").chunk(2, -1)
            x = x + self._lin(F.silu(gate) * up, f"{i}.down").view(b, q, -1)
            if i in capture:
                captured.append(x)
        return self.model.model.norm(x), captured

    @torch.inference_mode()
    def hidden_states(
        self,
        step: StepInputs,
        cos_table: torch.Tensor,
        sin_table: torch.Tensor,
        cache: KVCache,
        capture: tuple[int, ...] = (),
        captured: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """As DecoderLM.hidden_states, through the compiled program of the step's kind."""
        t = StepTensors.of(step).normalised()
        kind = (t.tokens.shape[0] > 1, t.tokens.shape[1] > 1, bool(capture), step.causal)

        def mark() -> None:
            t.mark_dynamic()
            for layer in (*cache.k, *cache.v):  # any slot count from 2 up is one program: a
                if layer.shape[0] > 1:  # server's engines hold more slots than a one-shot command's
                    torch._dynamo.maybe_mark_dynamic(layer, 0)

        slots = int(cache.k[0].shape[0] > 1)  # a one-slot cache (a timing's) is a program of its own
        name = f"hidden-{int(kind[0])}{int(kind[1])}{slots}-c{'.'.join(map(str, capture)) or 'none'}{'-causal' * step.causal}"
        args = (*t.tensors(), cache.k, cache.v, cos_table, sin_table, tuple(capture), step.causal)
        started = time.perf_counter()
        hidden, layers = self._call(name, self._hidden, self._compiled, args, mark)
        if kind not in self.compiled_kinds:
            self.compiled_kinds[kind] = time.perf_counter() - started
        self.counts.add(torch.get_num_threads())
        if captured is not None:
            captured.extend(layers)
        return hidden

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._lin(hidden, "lm_head").float()

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """As DecoderLM.logits: float32 logits [rows, vocab] of final hidden states [rows, hidden]."""
        hidden = _inference(hidden)  # rows joined outside inference mode are not (see normalised)
        rows = hidden.shape[0] > 1

        def mark() -> None:
            if rows:
                torch._dynamo.maybe_mark_dynamic(hidden, 0)

        return self._call(f"head-{int(rows)}", self._head, self._compiled_head, (hidden,), mark)


def compiles() -> int:
    """How many programs this process has compiled or loaded from disk so far (each guarded
    variant counts): a forward that made one took seconds longer than a step."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"] + saved.loads


def _configure() -> None:
    """Room for every program of the engines in one process (each StepProgram instance and kind
    is a guarded entry of the same code), and inductor's code cache under trtspec's cache."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 512)
    import torch._inductor.config as inductor_config

    _utf8_files()

    # Compile in this process: no pool of compile workers forked from a server's model process.
    inductor_config.compile_threads = 1


# -- choosing: eager or compiled, per machine -----------------------------------------------------


@dataclass
class ProgramChoice:
    """Which path runs each kind of step: ``one`` (a one-row step: a decode step) and ``many``
    (two or more rows: verify, tree, prefill and batched steps), each "compiled" or "eager"."""

    one: str
    many: str
    source: str  # measured | cached | forced | fallback
    reason: str = ""
    seconds: dict[str, dict[str, float]] = field(default_factory=dict)  # path -> step kind -> median seconds
    others_busy: float | None = None  # other processes' share of the cores while measured (contention.py)

    def path(self, rows: int) -> str:
        return self.one if rows == 1 else self.many

    @property
    def any_compiled(self) -> bool:
        return "compiled" in (self.one, self.many)

    def summary(self) -> str:
        return f"one row {self.one}, more rows {self.many} ({self.source}{': ' + self.reason if self.reason else ''})"


def _utf8_files() -> None:
    """Files opened without an encoding read as UTF-8, as inductor reads its code templates.
    Python coerces a C locale to UTF-8 at start, but an embedded interpreter (Triton's Python
    stub) keeps ASCII and ignores PYTHONUTF8: there every compile failed on a template."""
    import locale

    if locale.getpreferredencoding(False).lower().replace("-", "") != "utf8":
        with contextlib.suppress(locale.Error):
            locale.setlocale(locale.LC_CTYPE, "C.UTF-8")


def _forced() -> str | None:
    value = os.environ.get(COMPILE_ENV, "auto").strip().lower()
    if value not in ("auto", "0", "1"):
        print(f"trtspec: {COMPILE_ENV}={value!r} is not auto, 1 or 0; measuring (auto)", file=sys.stderr)
        return None
    return None if value == "auto" else value


def compiler_missing() -> str | None:
    """Why inductor cannot build C++ here, or None."""
    from torch._inductor import cpp_builder

    try:
        cpp_builder.get_cpp_compiler()
    except Exception as err:  # inductor raises its own error types for a missing compiler
        return f"no C++ compiler for torch.compile ({type(err).__name__}: {err})"
    return None


def program_timer(
    model: DecoderLM, program: StepProgram, cos: torch.Tensor, sin: torch.Tensor, sizes: tuple[int, ...]
) -> Callable[[], dict[str, dict[str, float]]]:
    """A ``measure`` for choose_program: a step of each of ``sizes`` tokens (with its logits) on
    both paths at a short context of a private one-slot cache."""
    from trtspec.engines.torch.kernels import PREFILL, timing_step

    start = max(0, min(PREFILL, cos.shape[0] - max(sizes)))
    cache = KVCache(model.cfg, 1, start + max(sizes) + 1, model.model.embed_tokens.weight.dtype)
    steps = {str(n): timing_step(n, start, model.cfg.vocab_size) for n in sizes}

    def runner(forward) -> Callable[[StepInputs], None]:
        def run(step: StepInputs) -> None:
            hidden = forward.hidden_states(step, cos, sin, cache)  # [1, q, hidden]
            forward.logits(hidden[0, -step.rows[0][2] :])

        return run

    return lambda: time_paths(runner(model), runner(program), steps)


def time_paths(
    eager: Callable[[StepInputs], None], compiled: Callable[[StepInputs], None], steps: dict[str, StepInputs]
) -> dict[str, dict[str, float]]:
    """Median seconds of each step on each path, the paths interleaved (after one warm-up
    call each, which also compiles)."""
    runs = {"eager": eager, "compiled": compiled}
    samples: dict[str, dict[str, list[float]]] = {p: {k: [] for k in steps} for p in runs}
    for fn in runs.values():
        for step in steps.values():
            fn(step)
    for r in range(ROUNDS):
        for p in list(runs)[r % 2 :] + list(runs)[: r % 2]:
            for k, step in steps.items():
                t = time.perf_counter()
                runs[p](step)
                samples[p][k].append(time.perf_counter() - t)
    return {p: {k: statistics.median(v) for k, v in s.items()} for p, s in samples.items()}


def decide(seconds: dict[str, dict[str, float]]) -> tuple[str, str]:
    """(one-row path, more-rows path): compiled where its steps' medians sum lower."""

    def best(kinds: list[str]) -> str:
        return "compiled" if sum(seconds["compiled"][k] for k in kinds) < sum(seconds["eager"][k] for k in kinds) else "eager"

    many = [k for k in seconds["eager"] if k != "1"]
    return best(["1"]), best(many) if many else "compiled"


def choose_program(key: str, measure: Callable[[], dict[str, dict[str, float]]], cache_dir: Path | None = None) -> ProgramChoice:
    """This machine's choice for ``key``: forced by TRTSPEC_COMPILE, cached, or measured now by
    ``measure`` (time_paths over the engine's steps) and cached. Never raises: a failure is
    the eager path with its reason."""
    forced = _forced()
    if forced == "0":
        return ProgramChoice("eager", "eager", "forced", f"{COMPILE_ENV}=0")
    missing = compiler_missing()
    if missing:
        return ProgramChoice("eager", "eager", "fallback", missing)
    _configure()
    if forced == "1":
        return ProgramChoice("compiled", "compiled", "forced", f"{COMPILE_ENV}=1")
    path = (cache_dir or cache_root()) / CACHE_FILE
    full_key = json.dumps(json.loads(key) | {"programs": PROGRAMS_VERSION}, sort_keys=True)
    what = f"the compiled-or-eager choice for {contention.describe(key)}"
    cached = contention.records(path).get(full_key)
    if not (isinstance(cached, dict) and {cached.get("one"), cached.get("many")} <= {"eager", "compiled"}):
        cached = None
    if cached is not None and contention.stands(cached, what):
        seconds = dict(cached.get("seconds", {}))
        return ProgramChoice(cached["one"], cached["many"], "cached", seconds=seconds, others_busy=cached.get("others_busy"))
    try:
        with contention.Watch() as watch:  # how busy the other processes kept the cores meanwhile
            seconds = measure()
    except Exception as err:  # never fail a load over a speed choice
        reason = compile_failure(err)
        return ProgramChoice("eager", "eager", "fallback", reason)
    one, many = decide(seconds)
    if contention.replaces(cached, watch.others, what):
        contention.store(path, full_key, {"one": one, "many": many, "seconds": seconds}, watch.others)
    return ProgramChoice(one, many, "measured", seconds=seconds, others_busy=watch.others)


def compile_failure(err: BaseException) -> str:
    """One line saying why compiling failed: the compiler's own error, not inductor's wrapper."""
    inner = getattr(err, "inner_exception", None) or err.__cause__ or err
    lines = [line.strip() for line in str(inner).splitlines() if line.strip()]
    return f"compiling failed ({type(inner).__name__}: {lines[0][:200] if lines else ''})"


def saved_folder(choice: str, weights: str) -> Path:
    """Where the programs of an engine are saved (saved.py): a folder per digest of everything
    they depend on: this machine and its threads, torch and the kernels (``choice``, the kernel
    choice's key and layout), the weights (their digest) and trtspec's traced code."""
    parts = [choice, weights, PROGRAMS_VERSION, saved.code_digest(), saved.FORMAT]
    return cache_root() / "programs" / hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


def machine_record() -> tuple[str, str]:
    """(key, machine name) under which a manifest records this machine's compiled-step choice:
    a digest of the CPU, its threads, torch and this code's programs."""
    from trtspec.engines.torch.kernels import machine_key
    from trtspec.machine import cpu_name

    key = hashlib.sha256(f"{machine_key()}|{PROGRAMS_VERSION}".encode()).hexdigest()[:16]
    return key, f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}"

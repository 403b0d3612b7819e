"""The commands a trtllm build runs, generated from typed data.

For a draft/target spec the build is:

1. per role, HF checkpoint -> TensorRT-LLM checkpoint: the family's ``convert_checkpoint.py``
   (no quantization, INT8 or INT4 weight-only) or ``quantization/quantize.py`` (FP8, INT4-AWQ);
2. ``trtllm-build`` of the TARGET with ``--speculative_decoding_mode draft_tokens_external
   --max_draft_len K --use_paged_context_fmha enable`` (+ ``--gather_generation_logits`` only
   when draft-logit acceptance is on);
3. ``trtllm-build`` of the CONTROL engine: the same target checkpoint and flags minus the two
   speculative ones. Why a separate engine rather than the speculative target with zero
   drafts: upstream's own equality test (tests/integration/defs/examples/
   test_draft_target_model.py) compares draft-target output token by token against such a
   baseline engine, and no upstream test shows the speculative engine without draft tokens to
   be an exact control (see tests/data/trtllm/NOTES.md, "Is speculative target with zero draft
   tokens an exact control?"). Building it costs one more engine build, not another convert;
4. ``trtllm-build`` of the DRAFT as an ordinary engine with paged context FMHA.

Every flag used here is checked against the upstream flag inventory in tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from trtspec.engines.trtllm.families import Family
from trtspec.layout import EngineKind, role_of
from trtspec.spec import BuildLimits, EngineSpec, ModelSpec

Tool = Literal["convert_checkpoint", "quantize", "trtllm-build"]

TRTLLM_BUILD = "trtllm-build"
QUANTIZE_SCRIPT = "quantization/quantize.py"
# Weight-only values -> the converter's --weight_only_precision (QuantAlgo W8A16 / W4A16:
# per-channel scales, no calibration).
WEIGHT_ONLY = {"int8_wo": "int8", "int4_wo": "int4"}
CALIB_SIZE = 512  # quantize.py's default, written out so the manifest records it
AWQ_BLOCK_SIZE = 128
DEFAULT_MAX_NUM_TOKENS = 8192  # BuildConfig's default


@dataclass(frozen=True)
class Command:
    """One external command: what it is for, which tool's flags it uses, and its argv."""

    step: str
    tool: Tool
    argv: tuple[str, ...]

    def flags(self) -> list[tuple[str, str | None]]:
        """``(--flag, value or None)`` pairs after the program (and script) arguments."""
        args = list(self.argv)
        start = next(i for i, a in enumerate(args) if a.startswith("--"))
        pairs: list[tuple[str, str | None]] = []
        for i in range(start, len(args)):
            if args[i].startswith("--"):
                nxt = args[i + 1] if i + 1 < len(args) else None
                pairs.append((args[i], None if nxt is None or nxt.startswith("--") else nxt))
        return pairs


@dataclass(frozen=True)
class Layout:
    """Where a build reads and writes; deterministic so a dry run shows the real commands."""

    python: str  # interpreter that runs the converter scripts
    examples: str  # TensorRT-LLM examples/ folder
    sources: dict[str, Path]  # HF checkpoint folder, by role
    checkpoints: dict[str, Path]  # TensorRT-LLM checkpoint folder, by role
    engines: dict[str, Path]  # engine folder being written, by engine kind


def convert_command(role: str, model: ModelSpec, family: Family, layout: Layout) -> Command:
    """HF -> TensorRT-LLM checkpoint, sharded for the role's tp/pp, quantized if asked."""
    # in, out and dtype, as both scripts take them
    io = ["--model_dir", str(layout.sources[role]), "--output_dir", str(layout.checkpoints[role]), "--dtype", model.dtype]
    parallel = ["--tp_size", str(model.tp_size), "--pp_size", str(model.pp_size)]
    if model.quantization in ("fp8", "int4_awq"):
        script = f"{layout.examples}/{QUANTIZE_SCRIPT}"
        argv = [
            layout.python,
            script,
            *io,
            "--qformat",
            model.quantization,
            "--calib_size",
            str(CALIB_SIZE),
            *parallel,
        ]
        if model.quantization == "fp8":
            argv += ["--kv_cache_dtype", "fp8"]
        else:
            argv += ["--awq_block_size", str(AWQ_BLOCK_SIZE)]
        return Command(f"quantize {role} checkpoint ({model.quantization})", "quantize", tuple(argv))
    argv = [layout.python, f"{layout.examples}/{family.converter}", *io, *parallel]
    precision = WEIGHT_ONLY.get(model.quantization)
    if precision is not None:
        argv += ["--use_weight_only", "--weight_only_precision", precision]
    suffix = f" ({precision} weight-only)" if precision is not None else ""
    return Command(f"convert {role} checkpoint{suffix}", "convert_checkpoint", tuple(argv))


def engine_limits(limits: BuildLimits, max_draft_len: int) -> dict[str, int]:
    """The shape flags of an engine.

    The orchestrator re-sends the whole sequence (prompt + tokens so far) on every step, as
    upstream's BLS does, so an engine must accept inputs up to max_seq_len - 1 tokens; the
    spec's max_input_len limits the user's prompt and is enforced by the orchestrator.
    KV-cache block reuse keeps the re-sent prefix from being recomputed.
    """
    max_input = limits.max_seq_len - 1
    per_step = limits.max_batch_size * (max_draft_len + 1)
    # Room for one whole sequence in a step (no chunked context), for every request's K+1
    # verify tokens, and otherwise the release's default budget.
    batched = min(DEFAULT_MAX_NUM_TOKENS, limits.max_batch_size * limits.max_seq_len)
    max_num_tokens = max(limits.max_seq_len, per_step, batched)
    return {
        "max_batch_size": limits.max_batch_size,
        "max_input_len": max_input,
        "max_seq_len": limits.max_seq_len,
        "max_num_tokens": max_num_tokens,
    }


def build_command(spec: EngineSpec, kind: EngineKind, layout: Layout) -> Command:
    role = role_of(kind)
    model = spec.models()[role]
    k = spec.speculative.max_draft_len
    argv = [TRTLLM_BUILD, "--checkpoint_dir", str(layout.checkpoints[role]), "--output_dir", str(layout.engines[kind])]
    for name, value in engine_limits(spec.limits(role), k).items():
        argv += [f"--{name}", str(value)]
    argv += [
        "--max_beam_width",
        "1",
        "--gemm_plugin",
        "auto",
        # paged context FMHA is what lets KV-cache blocks be reused across requests
        "--use_paged_context_fmha",
        "enable",
        "--workers",
        str(model.tp_size * model.pp_size),
    ]
    if kind == "target":
        argv += ["--speculative_decoding_mode", "draft_tokens_external", "--max_draft_len", str(k)]
    steps = {
        "target": "build target engine (draft_tokens_external)",
        "control": "build control engine (target without speculative flags)",
        "draft": "build draft engine",
    }
    return Command(steps[kind], "trtllm-build", tuple(argv))


def plan_commands(
    spec: EngineSpec, families: dict[str, Family], layout: Layout, units: tuple[str, ...] = ("target", "draft")
) -> list[Command]:
    """Every command, in order, for the build units that need building.

    Unit "target" makes the target and control engines from one converted checkpoint; unit
    "draft" makes the draft engine.
    """
    commands = [convert_command(role, spec.models()[role], families[role], layout) for role in units if role in spec.models()]
    if "target" in units:
        commands += [build_command(spec, "target", layout), build_command(spec, "control", layout)]
    if "draft" in units and spec.draft is not None:
        commands.append(build_command(spec, "draft", layout))
    return commands

"""Typed Triton model configs rendered to ``config.pbtxt`` and checked by parsing them back.

Why not a text template: a template filled by string substitution happily writes
``${max_batch_size}`` or ``TYPE_INT23`` into a file that only fails when the server loads it.
Here every value goes through Triton's own ``ModelConfig`` protobuf (shipped with
``tritonclient``), so a wrong enum name or type fails while rendering, and the printed text is
parsed again and compared with the message before anything is written.

Example::

    cfg = ModelConfig(
        name="echo", backend="python", max_batch_size=0,
        inputs=[TensorSpec("INPUT0", "TYPE_INT32", [-1])],
        outputs=[TensorSpec("OUTPUT0", "TYPE_INT32", [-1])],
    )
    write(cfg, repo / "echo" / "config.pbtxt")
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from google.protobuf import text_format

try:  # Triton's own schema; tritonclient is part of the `serve` extra
    from tritonclient.grpc import model_config_pb2 as pb
except ImportError as err:  # pragma: no cover - depends on the install
    raise ImportError("config.pbtxt rendering needs tritonclient: pip install 'trtspec[serve]'") from err

from trtspec.errors import TrtspecError
from trtspec.files import write_text_atomic

InstanceKind = Literal["KIND_AUTO", "KIND_CPU", "KIND_GPU", "KIND_MODEL"]

# Unfilled template markers as used by the TensorRT-LLM backend templates (``${name}``).
_PLACEHOLDER = re.compile(r"\$\{[^}]*\}")


class PbtxtError(TrtspecError):
    """A model config is invalid; the message names the model and the field to fix."""


@dataclass(frozen=True)
class TensorSpec:
    """One model input or output.

    ``dims`` excludes the batch dimension when ``max_batch_size > 0`` (Triton's convention);
    ``-1`` marks a variable-size dimension. ``optional`` applies to inputs only.
    """

    name: str
    data_type: str  # a pb.DataType name, e.g. "TYPE_INT32"
    dims: Sequence[int]
    optional: bool = False
    reshape: Sequence[int] | None = None
    # Inputs only: let the dynamic batcher group requests whose shapes differ (ragged lengths).
    allow_ragged_batch: bool = False


@dataclass(frozen=True)
class DynamicBatching:
    """Server-side batching of separate requests; ``preferred_batch_sizes`` may be empty."""

    max_queue_delay_microseconds: int = 0
    preferred_batch_sizes: Sequence[int] = ()
    # Requests waiting beyond this are refused at once (UNAVAILABLE); None: unbounded.
    max_queue_size: int | None = None


@dataclass(frozen=True)
class ModelConfig:
    """The subset of Triton's ModelConfig that trtspec generates.

    Anything not modelled here (sequence batching, ensemble steps, warmup, ...) can be given as
    ``extra_pbtxt``: it is merged into the message with protobuf's text parser, so it is checked
    by the same schema as the rest.
    """

    name: str
    backend: str = ""  # "python", "tensorrtllm", ...; or set ``platform``
    platform: str = ""  # "ensemble"
    max_batch_size: int = 0
    inputs: Sequence[TensorSpec] = ()
    outputs: Sequence[TensorSpec] = ()
    # Values must be non-empty: the trtllm backend parses some of them as numbers, and an empty
    # string is rarely a meaningful setting. Omit a key instead of leaving it empty, unless the
    # backend needs the key present and empty (listed in ``empty_parameters``).
    parameters: Mapping[str, str] = field(default_factory=dict)
    empty_parameters: Sequence[str] = ()
    instance_count: int = 1
    instance_kind: InstanceKind = "KIND_CPU"
    decoupled: bool = False
    dynamic_batching: DynamicBatching | None = None
    extra_pbtxt: str = ""


def to_proto(cfg: ModelConfig) -> pb.ModelConfig:
    """Build the protobuf message; raises PbtxtError on any value protobuf or Triton rejects."""
    msg = pb.ModelConfig()
    try:
        msg.name = cfg.name
        msg.backend = cfg.backend
        msg.platform = cfg.platform
        msg.max_batch_size = cfg.max_batch_size
        for spec in cfg.inputs:
            tensor = msg.input.add()
            _fill_tensor(tensor, spec, cfg.name)
            tensor.optional = spec.optional
            tensor.allow_ragged_batch = spec.allow_ragged_batch
        for spec in cfg.outputs:
            if spec.optional or spec.allow_ragged_batch:
                raise PbtxtError(
                    f"model {cfg.name!r}: output {spec.name!r} is marked optional or ragged; "
                    "only inputs can be optional or ragged"
                )
            _fill_tensor(msg.output.add(), spec, cfg.name)
        for key, value in cfg.parameters.items():
            msg.parameters[key].string_value = value
        for key in cfg.empty_parameters:
            if cfg.parameters.get(key):
                raise PbtxtError(f"model {cfg.name!r}: parameter {key!r} is listed as empty but has a value")
            msg.parameters[key].string_value = ""
        if cfg.instance_count < 1:
            raise PbtxtError(f"model {cfg.name!r}: instance_count is {cfg.instance_count}; use 1 or more")
        if cfg.platform != "ensemble":  # an ensemble has no instances of its own
            group = msg.instance_group.add()
            group.count = cfg.instance_count
            group.kind = _enum(pb.ModelInstanceGroup.Kind, cfg.instance_kind, f"model {cfg.name!r}: instance_kind")
        if cfg.decoupled:
            msg.model_transaction_policy.decoupled = True
        if cfg.dynamic_batching is not None:
            batching = msg.dynamic_batching
            batching.max_queue_delay_microseconds = cfg.dynamic_batching.max_queue_delay_microseconds
            batching.preferred_batch_size.extend(cfg.dynamic_batching.preferred_batch_sizes)
            if cfg.dynamic_batching.max_queue_size is not None:
                batching.default_queue_policy.max_queue_size = cfg.dynamic_batching.max_queue_size
        if cfg.extra_pbtxt:
            text_format.Merge(cfg.extra_pbtxt, msg)
    except (TypeError, ValueError, text_format.ParseError) as err:
        # protobuf raises these for wrong Python types, out-of-range ints and bad extra text.
        raise PbtxtError(f"model {cfg.name!r}: invalid config value: {err}") from err
    return msg


def render(cfg: ModelConfig) -> str:
    """Return the ``config.pbtxt`` text for ``cfg``, verified by parsing it back."""
    msg = to_proto(cfg)
    text = text_format.MessageToString(msg)
    parsed = check_text(text, allow_empty=cfg.empty_parameters)
    if parsed != msg:  # would mean text_format lost something: never write such a file
        raise PbtxtError(f"model {cfg.name!r}: config.pbtxt does not parse back to the same config")
    return text


def parse(text: str) -> pb.ModelConfig:
    """Parse config.pbtxt text into Triton's ModelConfig message (no semantic checks)."""
    msg = pb.ModelConfig()
    try:
        text_format.Parse(text, msg)
    except text_format.ParseError as err:
        raise PbtxtError(f"config.pbtxt does not parse: {err}") from err
    return msg


def check_text(text: str, allow_empty: Sequence[str] = ()) -> pb.ModelConfig:
    """Parse ``text`` and reject what Triton would only reject at load time (or never).

    Use it on any config.pbtxt, including ones filled from upstream templates.
    """
    placeholders = sorted(set(_PLACEHOLDER.findall(text)))
    if placeholders:
        raise PbtxtError(
            f"config.pbtxt still contains template placeholders {', '.join(placeholders)}; "
            "give each a value or remove the parameter"
        )
    msg = parse(text)
    problems = _semantic_problems(msg, set(allow_empty))
    if problems:
        label = msg.name or "<unnamed>"
        raise PbtxtError(f"model {label!r}: " + "; ".join(problems))
    return msg


def write(cfg: ModelConfig, path: str | os.PathLike[str]) -> Path:
    """Render ``cfg`` and write it atomically to ``path`` (parents are created), so a server
    polling the repository never sees a half-written config."""
    target = Path(path)
    write_text_atomic(target, render(cfg))
    return target


def _fill_tensor(tensor: pb.ModelInput | pb.ModelOutput, spec: TensorSpec, model: str) -> None:
    tensor.name = spec.name
    tensor.data_type = _enum(pb.DataType, spec.data_type, f"model {model!r}: tensor {spec.name!r} data_type")
    tensor.dims.extend(spec.dims)
    if spec.reshape is not None:
        tensor.reshape.shape.extend(spec.reshape)


def _enum(enum_type: object, name: str, what: str) -> int:
    try:
        return enum_type.Value(name)  # type: ignore[attr-defined]
    except ValueError:
        allowed = ", ".join(enum_type.keys())  # type: ignore[attr-defined]
        raise PbtxtError(f"{what} is {name!r}; expected one of {allowed}") from None


def _semantic_problems(msg: pb.ModelConfig, allow_empty: set[str]) -> list[str]:
    """Values that parse fine but make an unusable or ambiguous config."""
    problems: list[str] = []
    if not msg.name:
        problems.append("name is empty")
    if not msg.backend and not msg.platform:
        problems.append("neither backend nor platform is set")
    if msg.max_batch_size < 0:
        problems.append(f"max_batch_size is {msg.max_batch_size}; use 0 (no batching) or more")
    for kind, tensors in (("input", msg.input), ("output", msg.output)):
        seen: set[str] = set()
        for tensor in tensors:
            label = f"{kind} {tensor.name!r}"
            if not tensor.name:
                problems.append(f"an {kind} has an empty name")
            elif tensor.name in seen:
                problems.append(f"{label} is declared twice")
            seen.add(tensor.name)
            if tensor.data_type == pb.TYPE_INVALID:
                problems.append(f"{label} has no data_type")
            if not tensor.dims:
                problems.append(f"{label} has no dims")
            bad = [d for d in tensor.dims if d == 0 or d < -1]
            if bad:
                problems.append(f"{label} has dims {list(tensor.dims)}; each must be -1 or >= 1")
    for key, param in msg.parameters.items():
        if not key:
            problems.append("a parameter has an empty key")
        elif not param.string_value and key not in allow_empty:
            problems.append(f"parameter {key!r} has an empty value; set it or leave it out")
    for group in msg.instance_group:
        # 0 is proto3's "unset", which Triton reads as 1; only a negative count is wrong.
        if group.count < 0:
            problems.append(f"instance_group count is {group.count}; it must be at least 1")
    return problems

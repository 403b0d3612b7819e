"""Which Hugging Face models the TensorRT-LLM backend builds, and how.

One table maps an HF ``model_type`` to the TensorRT-LLM example that converts it and the
quantizations upstream lists for it. Sources (TensorRT-LLM, read with the search tools):
``examples/models/core/{llama,qwen}/convert_checkpoint.py`` (flags in
tests/data/trtllm/flags.json), the Qwen README support matrix (MoE rows: no FP8, no AWQ) and
``docs/source/reference/precision.md`` (Mixtral: no W4A16 AWQ).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from trtspec.errors import TrtspecError
from trtspec.spec import QUANTIZATIONS

# The one place the targeted release is named. The Triton container below is the one
# tensorrtllm_backend's Dockerfile builds with TENSORRTLLM_VER=1.2.1 (commit 0b9d7d5a).
TRTLLM_RELEASE = "1.2.1"
TRTLLM_SERIES = "1.2."  # installed versions outside this series get a warning
TRITON_CONTAINER = "nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3"
# The converter scripts are not part of the wheel: they live in the TensorRT-LLM source tree
# (`git clone -b v1.2.1 https://github.com/NVIDIA/TensorRT-LLM`). Point at its examples/.
EXAMPLES_ENV = "TRTSPEC_TRTLLM_EXAMPLES"
DEFAULT_EXAMPLES_DIR = "/app/tensorrt_llm/examples"

ALL_QUANTIZATIONS = QUANTIZATIONS  # every trtllm family supports every spec quantization


@dataclass(frozen=True)
class Family:
    """A TensorRT-LLM model family: its converter and the quantizations it supports."""

    name: str
    converter: str  # convert_checkpoint.py, relative to the examples dir
    flags_key: str  # key of this converter in tests/data/trtllm/flags.json
    quantizations: tuple[str, ...]


_LLAMA_CONVERTER = "models/core/llama/convert_checkpoint.py"
_QWEN_CONVERTER = "models/core/qwen/convert_checkpoint.py"

# HF config.json `model_type` -> family. Mistral and Mixtral use the llama converter
# (MODEL_MAP maps them to LLaMAForCausalLM).
FAMILIES: dict[str, Family] = {
    "llama": Family("llama", _LLAMA_CONVERTER, "llama", ALL_QUANTIZATIONS),
    "mistral": Family("mistral", _LLAMA_CONVERTER, "llama", ALL_QUANTIZATIONS),
    "mixtral": Family("mixtral", _LLAMA_CONVERTER, "llama", ("none", "fp8", "int8_wo")),
    "qwen2": Family("qwen2", _QWEN_CONVERTER, "qwen", ALL_QUANTIZATIONS),
    "qwen2_moe": Family("qwen2_moe", _QWEN_CONVERTER, "qwen", ("none", "int8_wo")),
}


def family_for(role: str, model_type: str) -> Family:
    """The family of an HF ``model_type``; TrtspecError (exit 2) when there is none."""
    family = FAMILIES.get(model_type)
    if family is None:
        raise TrtspecError(
            f"{role}: model_type '{model_type}' is not supported by backend trtllm "
            f"(supported: {', '.join(FAMILIES)}); pick a model of those families or use "
            "backend: torch"
        )
    return family


def check_quantization(role: str, family: Family, quantization: str) -> None:
    if quantization not in family.quantizations:
        raise TrtspecError(
            f"{role}.quantization: '{quantization}' is not supported for the {family.name} "
            f"family in TensorRT-LLM {TRTLLM_RELEASE} (supported: "
            f"{', '.join(family.quantizations)}); choose one of those"
        )


def examples_dir() -> str:
    """Where the TensorRT-LLM examples (converter scripts) are, from the environment."""
    return os.environ.get(EXAMPLES_ENV, DEFAULT_EXAMPLES_DIR)

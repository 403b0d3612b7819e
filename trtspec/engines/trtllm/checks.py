"""Checks for backend trtllm that need only the spec and the HF config (no GPU, no weights).

`trtspec check` and `trtspec build` (including --dry-run) call :func:`check_model` per role,
so an unsupported model, a parallel layout that cannot split the model, or a GPU list of the
wrong length is reported with exit 2 before anything is converted.
"""

from __future__ import annotations

import json
from pathlib import Path

from trtspec.engines.trtllm.families import Family, check_quantization, family_for
from trtspec.errors import CheckpointError, TrtspecError
from trtspec.spec import EngineSpec

_QUANTIZED_DTYPES = ("float16", "bfloat16")


def check_model(spec: EngineSpec, role: str, hf_config) -> Family:
    """Validate ``role`` of ``spec`` against its HF config; return its family."""
    model = spec.models()[role]
    if spec.speculative.method != "draft_target":
        raise TrtspecError(
            f"speculative.method: backend trtllm builds draft_target pairs only (got "
            f"{spec.speculative.method}); use method: draft_target or backend: torch"
        )
    if model.gguf_file is not None:
        raise TrtspecError(
            f"{role}.gguf_file: backend trtllm converts Hugging Face safetensors checkpoints, "
            "not GGUF; point the spec at the original checkpoint or use backend: torch"
        )
    family = family_for(role, hf_config.model_type)
    check_quantization(role, family, model.quantization)
    if model.quantization != "none" and model.dtype not in _QUANTIZED_DTYPES:
        raise TrtspecError(
            f"{role}.dtype: quantization {model.quantization} runs with float16 or bfloat16 "
            f"activations, not {model.dtype}; set dtype: float16 or bfloat16"
        )
    _check_split(role, "tp_size", model.tp_size, "num_attention_heads", hf_config.num_attention_heads)
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    # Fewer KV heads than ranks is fine when they can be replicated evenly (TensorRT-LLM
    # duplicates them, e.g. 8 KV heads on TP=16); otherwise each rank needs whole heads.
    if kv_heads % model.tp_size and model.tp_size % kv_heads:
        raise TrtspecError(
            f"{role}.tp_size: {model.tp_size} neither divides nor is a multiple of "
            f"num_key_value_heads ({kv_heads}); use a tp_size among "
            f"{_divisors(kv_heads)} or a multiple of {kv_heads}"
        )
    _check_split(role, "pp_size", model.pp_size, "num_hidden_layers", hf_config.num_hidden_layers)
    world = model.tp_size * model.pp_size  # gpu_device_ids match it: the spec checks that
    if role == "draft":
        target = spec.target
        target_world = target.tp_size * target.pp_size
        if world > target_world:
            raise TrtspecError(
                f"draft.tp_size: the draft spans {world} GPU(s) (tp x pp) but the target only "
                f"{target_world}; the draft must be the smaller model: lower the draft's "
                "tp_size/pp_size or swap the roles"
            )
    return family


def _check_split(role: str, field: str, size: int, what: str, total: int) -> None:
    if total % size:
        raise TrtspecError(f"{role}.{field}: {size} does not divide {what} ({total}); use one of {_divisors(total)}")


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, min(n, 64) + 1) if n % d == 0)


def refuse_untrusted_code(role: str, folder: Path, trusted: bool) -> None:
    """Refuse a checkpoint that ships its own Python code unless the spec trusts it.

    TensorRT-LLM 1.2's converters load configs with trust_remote_code=True hard-coded (e.g.
    examples/models/core/llama/convert_checkpoint.py@fd96a08b, AutoConfig.from_pretrained)
    and take no flag to turn it off, so trtspec cannot pass `false` to them: it refuses the
    code itself. The same check runs for the LLM API, which gets the spec's value.
    """
    if trusted:
        return
    found = []
    for name in ("config.json", "tokenizer_config.json"):
        path = Path(folder) / name
        if path.is_file():
            data = json.loads(path.read_text(encoding="utf-8"))
            if isinstance(data, dict) and data.get("auto_map"):
                found.append(f"auto_map in {name}")
    found += [p.name for p in sorted(Path(folder).glob("*.py"))]
    if found:
        raise CheckpointError(
            f"{role}: {folder} ships custom code ({', '.join(found)}) and the spec does not "
            f"trust it; TensorRT-LLM would run it. Review the code and set "
            f"{role}.trust_remote_code: true, or use a checkpoint without custom code"
        )

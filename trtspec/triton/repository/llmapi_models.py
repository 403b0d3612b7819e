"""Model repository for trtllm.runtime llmapi: Python-backend models that run the LLM API.

  tensorrt_llm_bls             speculative endpoint: model.yaml = the build's speculative.yaml
  tensorrt_llm_bls_streaming   the same, decoupled (serve.streaming): one response per step
  target_only                  control endpoint: model.yaml = the build's control.yaml

Each model folder holds config.pbtxt (trtspec's text contract, repository.BLS_INPUTS/OUTPUTS),
1/model.py (a shim into trtspec.triton.models.llmapi_model) and 1/model.yaml laid out as
upstream's llmapi model expects it (TensorRT-LLM triton_backend/all_models/llmapi/
tensorrt_llm/1/model.yaml@0ebb1536): top-level LLM API arguments plus a reserved
`triton_config` block (max_batch_size, decoupled). The LLM arguments are checked against the
field inventory again and the file is parsed back.
Multi-GPU as upstream: one plain tritonserver; the LLM API starts its own MPI workers for
tensor_parallel_size > 1 (no mpirun around the server).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from trtspec.engines.trtllm import llmapi
from trtspec.errors import EngineError, TrtspecError
from trtspec.spec import LoadedSpec
from trtspec.speculative.llmapi import IMPLS, TRITON_CONFIG, read_config
from trtspec.triton.backend.params import LlmapiEndpointParams
from trtspec.triton.repository.pbtxt import DynamicBatching, ModelConfig

LLMAPI_SHIM = "from trtspec.triton.backend.models.llmapi_model import TritonPythonModel  # noqa: F401\n"


def model_yaml(args_file: Path, batch: int, line: str, decoupled: bool = False) -> str:
    args = read_config(args_file)
    llmapi.check_keys(args, str(args_file), (line,))
    data = dict(args) | {TRITON_CONFIG: {"max_batch_size": batch, "decoupled": decoupled}}
    text = (
        "# LLM API arguments (from " + args_file.name + ") and Triton's triton_config block,\n"
        "# laid out as TensorRT-LLM's triton_backend/all_models/llmapi model.yaml.\n" + yaml.safe_dump(data, sort_keys=False)
    )
    if yaml.safe_load(text) != data:
        raise EngineError(f"model.yaml for {args_file} did not read back as written; trtspec bug")
    return text


def plan(
    loaded: LoadedSpec, engines_dir: Path, impl: str, endpoint_inputs, endpoint_outputs, names: dict[str, str]
) -> tuple[dict, dict, Path, int]:
    """(models, extra files, tokenizer dir, vocab) for write_repository."""
    if impl not in IMPLS:
        raise TrtspecError(f"--llmapi {impl!r}: use one of {', '.join(IMPLS)}")
    spec = loaded.spec
    folder = Path(engines_dir) / llmapi.FOLDER
    manifest = llmapi.read_manifest(folder, spec)
    tokenizer_dir = Path(manifest.checkpoints["target"])
    import json

    vocab = int(json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"])
    lim = spec.limits("target")
    models, extra = {}, {}
    endpoints = {
        names["bls"]: ("speculative", llmapi.SPECULATIVE, False),
        names["control"]: ("target_only", llmapi.CONTROL, False),
    }
    if spec.serve.streaming:
        endpoints[names["streaming"]] = ("speculative", llmapi.SPECULATIVE, True)
    for name, (mode, args_file, decoupled) in endpoints.items():
        params = LlmapiEndpointParams(
            **LlmapiEndpointParams.from_spec(spec, mode, vocab, tokenizer_dir),
            llmapi_impl=impl,
            trtllm_line=spec.trtllm.line,
            gpu_device_ids=",".join(map(str, spec.target.gpu_device_ids)) if spec.target.gpu_device_ids else None,
        )
        cfg = ModelConfig(
            name=name,
            backend="python",
            max_batch_size=lim.max_batch_size,
            inputs=endpoint_inputs,
            outputs=endpoint_outputs,
            parameters=params.to_params(),
            instance_count=1,
            decoupled=decoupled,
            dynamic_batching=DynamicBatching(max_queue_delay_microseconds=0),
        )
        models[name] = (cfg, LLMAPI_SHIM)
        extra[f"{name}/1/model.yaml"] = model_yaml(folder / args_file, lim.max_batch_size, spec.trtllm.line, decoupled)
    return models, extra, tokenizer_dir, vocab

"""Triton models on NVIDIA's C++ ``tensorrtllm`` backend (their config.pbtxt files).

For a trtllm spec the repository holds three engine models, all with the tensorrt_llm
model's tensor contract (input_ids, input_lengths, request_output_len, draft_input_ids, ...
-> output_ids, sequence_length, acceptance figures):

- ``target``  the speculative target engine (draft_tokens_external); the orchestrator sends it
  the whole sequence plus ``draft_input_ids`` and reads back the accepted tokens;
- ``draft``   the draft engine, asked for k tokens per step;
- ``control`` the target built without speculative flags, behind the target-only endpoint
  that verify compares against (see trtspec.engines.trtllm.commands for why).

Choices that the orchestrator relies on:

- ``exclude_input_in_output`` defaults to false as upstream's BLS assumes; trtspec's
  orchestrator sends the input tensor ``exclude_input_in_output=true`` with every call and reads
  only the new tokens (the same answer the torch engine models give).
- ``enable_kv_cache_reuse`` is true: the re-sent prefix is served from cached KV blocks.
- No engine model is decoupled (one response per call): the orchestrator runs the loop step
  by step and streams at its own (decoupled) endpoint.
- ``max_beam_width`` 1 and ``inflight_fused_batching``; requests are batched by the backend
  itself, so inputs are not declared ragged (Triton only groups requests of equal shape).

Values are strings, as the backend parses them. Two keys the backend reads without a default
must be present and EMPTY to keep guided decoding off (``guided_decoding_backend``,
``xgrammar_tokenizer_info_path``); they are declared as ``empty_parameters``, the only empty
values pbtxt accepts.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from trtspec.errors import TrtspecError
from trtspec.layout import ENGINE_KINDS, ENGINE_MODELS, TRTLLM_TOKENIZER_DIR
from trtspec.spec import EngineSpec, ModelSpec
from trtspec.triton.repository.bounds import smallest_unserved
from trtspec.triton.repository.pbtxt import DynamicBatching, ModelConfig, TensorSpec

# Read unguarded by the backend; an empty value disables guided decoding.
EMPTY_BY_DESIGN = ("guided_decoding_backend", "xgrammar_tokenizer_info_path")
EXECUTOR_WORKER = "/opt/tritonserver/backends/tensorrtllm/trtllmExecutorWorker"
LOGITS_DTYPE = "TYPE_FP32"  # trtllm-build's default logits dtype, as upstream's docs fill it
KV_CACHE_BUDGET = 0.9  # fraction of free GPU memory for KV caches, split among co-located engines
_ACTIVATION_DTYPE = {"float16": "TYPE_FP16", "bfloat16": "TYPE_BF16", "float32": "TYPE_FP32"}


def _scalar(name: str, dtype: str, optional: bool = True) -> TensorSpec:
    return TensorSpec(name, dtype, [1], optional=optional, reshape=[])


def engine_inputs(activation_dtype: str) -> list[TensorSpec]:
    return [
        TensorSpec("input_ids", "TYPE_INT32", [-1]),
        _scalar("input_lengths", "TYPE_INT32", optional=False),
        _scalar("request_output_len", "TYPE_INT32", optional=False),
        TensorSpec("draft_input_ids", "TYPE_INT32", [-1], optional=True),
        TensorSpec("draft_logits", LOGITS_DTYPE, [-1, -1], optional=True),
        _scalar("draft_acceptance_threshold", "TYPE_FP32"),
        _scalar("end_id", "TYPE_INT32"),
        _scalar("pad_id", "TYPE_INT32"),
        TensorSpec("stop_words_list", "TYPE_INT32", [2, -1], optional=True),
        TensorSpec("bad_words_list", "TYPE_INT32", [2, -1], optional=True),
        TensorSpec("embedding_bias", "TYPE_FP32", [-1], optional=True),
        _scalar("beam_width", "TYPE_INT32"),
        _scalar("temperature", "TYPE_FP32"),
        _scalar("runtime_top_k", "TYPE_INT32"),
        _scalar("runtime_top_p", "TYPE_FP32"),
        _scalar("len_penalty", "TYPE_FP32"),
        _scalar("repetition_penalty", "TYPE_FP32"),
        _scalar("min_tokens", "TYPE_INT32"),
        _scalar("presence_penalty", "TYPE_FP32"),
        _scalar("frequency_penalty", "TYPE_FP32"),
        _scalar("seed", "TYPE_UINT64"),
        _scalar("return_log_probs", "TYPE_BOOL"),
        _scalar("return_context_logits", "TYPE_BOOL"),
        _scalar("return_generation_logits", "TYPE_BOOL"),
        _scalar("return_perf_metrics", "TYPE_BOOL"),
        _scalar("exclude_input_in_output", "TYPE_BOOL"),
        _scalar("stop", "TYPE_BOOL"),
        _scalar("streaming", "TYPE_BOOL"),
        # Declared so their data types are set from the spec, as the upstream template requires.
        TensorSpec("prompt_embedding_table", activation_dtype, [-1, -1], optional=True),
        TensorSpec("encoder_input_features", activation_dtype, [-1, -1], optional=True),
    ]


# Declared as upstream's template does, never sent by trtspec's orchestrator: the smallest shape.
UNSERVED_ENGINE_INPUTS = frozenset({"draft_logits", "prompt_embedding_table", "encoder_input_features"})

ENGINE_OUTPUTS = [
    TensorSpec("output_ids", "TYPE_INT32", [-1, -1]),  # [beams, tokens], prompt included
    TensorSpec("sequence_length", "TYPE_INT32", [-1]),
    TensorSpec("cum_log_probs", "TYPE_FP32", [-1]),
    TensorSpec("output_log_probs", "TYPE_FP32", [-1, -1]),
    TensorSpec("context_logits", LOGITS_DTYPE, [-1, -1]),
    TensorSpec("generation_logits", LOGITS_DTYPE, [-1, -1, -1]),
    TensorSpec("batch_index", "TYPE_INT32", [1]),
    TensorSpec("sequence_index", "TYPE_INT32", [1]),
    TensorSpec("kv_cache_alloc_new_blocks", "TYPE_INT32", [1]),
    TensorSpec("kv_cache_reused_blocks", "TYPE_INT32", [1]),
    TensorSpec("kv_cache_alloc_total_blocks", "TYPE_INT32", [1]),
    TensorSpec("acceptance_rate", "TYPE_FP32", [1]),
    TensorSpec("total_accepted_draft_tokens", "TYPE_INT32", [1]),
    TensorSpec("total_draft_tokens", "TYPE_INT32", [1]),
]


def _model(spec: EngineSpec, kind: str) -> ModelSpec:
    model = spec.draft if kind == "draft" else spec.target
    if model is None:
        raise TrtspecError("backend trtllm serves a draft/target pair; add `draft` to the spec")
    return model


def gpu_ids(spec: EngineSpec, kind: str) -> list[int]:
    """The GPUs of an engine: the spec's list, else the first tp x pp devices."""
    model = _model(spec, kind)
    if model.gpu_device_ids is not None:
        return list(model.gpu_device_ids)
    return list(range(model.tp_size * model.pp_size))


def kv_cache_fraction(spec: EngineSpec) -> float:
    """Share the KV-cache budget among the engines on the most crowded GPU."""
    load: dict[int, int] = {}
    for kind in ENGINE_KINDS:
        for gpu in gpu_ids(spec, kind):
            load[gpu] = load.get(gpu, 0) + 1
    return round(KV_CACHE_BUDGET / max(load.values()), 2)


def participant_ids(spec: EngineSpec) -> dict[str, list[int]]:
    """MPI ranks per engine when the orchestrator does not spawn workers (rank 0 orchestrates)."""
    ranks, nxt = {}, 1
    for kind in ENGINE_KINDS:
        n = len(gpu_ids(spec, kind))
        ranks[kind] = list(range(nxt, nxt + n))
        nxt += n
    return ranks


def engine_model_configs(
    spec: EngineSpec,
    engines_dir: Path,
    repo_names: Mapping[str, str] = ENGINE_MODELS,
    *,
    spawn_processes: bool = True,
) -> list[ModelConfig]:
    """Configs of the target, draft and control models for the engines in ``engines_dir``."""
    fraction = kv_cache_fraction(spec)
    ranks = participant_ids(spec)
    configs = []
    for kind in ENGINE_KINDS:
        role_model = _model(spec, kind)
        limits = spec.limits("draft" if kind == "draft" else "target")
        folder = Path(engines_dir) / kind
        params = {
            "gpt_model_type": "inflight_fused_batching",
            "gpt_model_path": str(folder),
            "max_beam_width": "1",
            "batch_scheduler_policy": "guaranteed_no_evict",
            "kv_cache_free_gpu_mem_fraction": f"{fraction}",
            "enable_kv_cache_reuse": "true",
            "exclude_input_in_output": "false",
            "enable_chunked_context": "false",
            "normalize_log_probs": "true",
            "FORCE_CPU_ONLY_INPUT_TENSORS": "no",
            "executor_worker_path": EXECUTOR_WORKER,
            "gpu_device_ids": ",".join(str(g) for g in gpu_ids(spec, kind)),
            "tokenizer_dir": str(folder / TRTLLM_TOKENIZER_DIR),
        }
        if not spawn_processes:
            params["participant_ids"] = ",".join(str(r) for r in ranks[kind])
        configs.append(
            ModelConfig(
                name=repo_names[kind],
                backend="tensorrtllm",
                max_batch_size=limits.max_batch_size,
                inputs=smallest_unserved(engine_inputs(_ACTIVATION_DTYPE[role_model.dtype]), UNSERVED_ENGINE_INPUTS),
                outputs=ENGINE_OUTPUTS,
                parameters=params,
                instance_count=1,
                instance_kind="KIND_CPU",  # the backend places the engine on gpu_device_ids itself
                # Never decoupled: the orchestrator calls engines step by step over BLS (one
                # response per call) and streams at the endpoint, for the control path too.
                decoupled=False,
                dynamic_batching=DynamicBatching(0, (limits.max_batch_size,)),
                extra_pbtxt="dynamic_batching { default_queue_policy { max_queue_size: 0 } }",
                empty_parameters=EMPTY_BY_DESIGN,
            )
        )
    return configs

"""Inventory of the TensorRT-LLM LLM API's field names, per TensorRT-LLM line.

Read by hand from the upstream sources below (NVIDIA/TensorRT-LLM, path@commit) and typed in
here as data; tests check every key trtspec writes against it, and the conformance double
(speculative/llmapi/double.py) refuses any argument it lacks. Where a class was read only in part the set
says so; a name missing here is refused even if upstream has it (we never guess a field).

Sources:
  1.2   1.2.1/_modules/tensorrt_llm/llmapi/llm_args.html@58fb435eacc402f3bd177e60f592c955d2b0719d
        (the published source of v1.2.1's tensorrt_llm/llmapi/llm_args.py) and
        1.2.1/_modules/tensorrt_llm/sampling_params.html@58fb435eacc402f3bd177e60f592c955d2b0719d
  1.3+  tensorrt_llm/llmapi/llm_args.py@0004396720054fd8e205cbf616f21f0b57c6b412 (main, 2026)
        tensorrt_llm/sampling_params.py@000a01de66f0eab4ab05640711f0253f50f5209c (main)
        "1.3+" covers 1.4 too: a field the 1.4 release candidates dropped is left out (the
        Eagle3DecodingConfig reference of 1.3.0rc27 has eagle_choices and num_eagle_layers,
        1.4.0rc1 no eagle_choices, 1.4.0rc4 neither: nvidia.github.io/TensorRT-LLM/<version>/
        llm-api/reference/Eagle3DecodingConfig.html)
        AutoDecodingConfig (decoding_type AUTO): DecodingBaseConfig's fields and no own, read at
        nvidia.github.io/TensorRT-LLM/1.3.0rc29/llm-api/reference/AutoDecodingConfig.html and in
        llm_args.py (main): "automatically select a good, draft-model free speculation algorithm
        with some heuristic. Attributes that are inherited from the base class are ignored."
        Written for 1.3+ only (1.2.1 has an AUTO class too; trtspec has not inventoried it).
"""

from __future__ import annotations

from dataclasses import dataclass

LINES = ("1.2", "1.3+")


def _by_line(both: set[str], only_12: set[str] = frozenset(), only_13: set[str] = frozenset()) -> dict[str, frozenset[str]]:
    """A config's fields per release line: those both lines have, plus each line's own."""
    return {"1.2": frozenset(both | only_12), "1.3+": frozenset(both | only_13)}


SOURCES = {
    "1.2": {
        "repo": "NVIDIA/TensorRT-LLM",
        "llm_args": "1.2.1/_modules/tensorrt_llm/llmapi/llm_args.html",
        "sampling_params": "1.2.1/_modules/tensorrt_llm/sampling_params.html",
        "commit": "58fb435eacc402f3bd177e60f592c955d2b0719d",
    },
    "1.3+": {
        "repo": "NVIDIA/TensorRT-LLM",
        "llm_args": "tensorrt_llm/llmapi/llm_args.py@0004396720054fd8e205cbf616f21f0b57c6b412",
        "sampling_params": "tensorrt_llm/sampling_params.py@000a01de66f0eab4ab05640711f0253f50f5209c",
        "commit": "0004396720054fd8e205cbf616f21f0b57c6b412",
    },
}

# BaseLlmArgs, read from its first field through max_num_tokens and a few beyond (partial:
# TorchLlmArgs' own fields such as cuda_graph_config were not inventoried).
_LLM_ARGS_COMMON = {
    "model",
    "tokenizer",
    "tokenizer_mode",
    "custom_tokenizer",
    "skip_tokenizer_init",
    "trust_remote_code",
    "tensor_parallel_size",
    "dtype",
    "revision",
    "tokenizer_revision",
    "pipeline_parallel_size",
    "context_parallel_size",
    "gpus_per_node",
    "moe_cluster_parallel_size",
    "moe_tensor_parallel_size",
    "moe_expert_parallel_size",
    "enable_attention_dp",
    "enable_lm_head_tp_in_adp",
    "pp_partition",
    "cp_config",
    "load_format",
    "enable_lora",
    "lora_config",
    "kv_cache_config",
    "enable_chunked_prefill",
    "guided_decoding_backend",
    "batched_logits_processor",
    "iter_stats_max_iterations",
    "request_stats_max_iterations",
    "peft_cache_config",
    "scheduler_config",
    "cache_transceiver_config",
    "sparse_attention_config",
    "speculative_config",
    "max_batch_size",
    "max_input_len",
    "max_seq_len",
    "max_beam_width",
    "max_num_tokens",
    "gather_generation_logits",
    "num_postprocess_workers",
    "postprocess_tokenizer_dir",
    "reasoning_parser",
}
LLM_ARGS = _by_line(
    _LLM_ARGS_COMMON,
    only_12={"fail_fast_on_attention_window_too_large"},
    only_13={
        "post_processor_hook",
        "model_kwargs",
        "kv_cache_compression_config",
        "num_serve_frontends",
        "decoding_config",
        "otlp_traces_endpoint",
        "backend",
        "return_perf_metrics",
        "perf_metrics_output_dir",
    },
)

# KvCacheConfig: complete in both.
_KV_COMMON = {
    "enable_block_reuse",
    "max_tokens",
    "max_attention_window",
    "sink_token_length",
    "free_gpu_memory_fraction",
    "host_cache_size",
    "cross_kv_cache_fraction",
    "secondary_offload_min_priority",
    "event_buffer_max_size",
    "attention_dp_events_gather_period_ms",
    "enable_partial_reuse",
    "copy_on_partial_reuse",
    "use_uvm",
    "max_gpu_total_bytes",
    "dtype",
    "mamba_ssm_cache_dtype",
    "tokens_per_block",
}
KV_CACHE_CONFIG = _by_line(
    _KV_COMMON,
    only_12={"onboard_blocks"},
    only_13={
        "disk_cache_size",
        "disk_cache_path",
        "kv_events_config",
        "iteration_stats_interval",
        "mamba_ssm_stochastic_rounding",
        "mamba_ssm_philox_rounds",
        "mamba_state_cache_interval",
        "mamba_state_config",
        "use_kv_cache_manager_v2",
        "enable_swa_scratch_reuse",
        "kv_cache_event_hash_algo",
        "max_util_for_resume",
        "enable_kv_pool_rebalance",
        "kv_pool_rebalance_min_sampled_kv_caches",
        "kv_pool_rebalance_cooldown_secs",
        "kv_pool_rebalance_target_ratio_update_interval",
        "kv_pool_rebalance_ratio_threshold",
    },
)

# DecodingBaseConfig fields (complete). In 1.2 `decoding_type` is a ClassVar read by
# DecodingBaseConfig.from_dict; in 1.3+ it is the pydantic discriminator field.
# `speculative_model_dir` is a validation alias of speculative_model in both.
DECODING_BASE = _by_line(
    {
        "decoding_type",
        "max_draft_len",
        "max_total_draft_tokens",
        "speculative_model",
        "speculative_model_dir",
        "max_concurrency",
        "draft_len_schedule",
        "load_format",
        "allow_advanced_sampling",
    },
    only_12={"acceptance_window", "acceptance_length_threshold"},
    only_13={
        "acceptance_rate_window_size",
        "acceptance_rate_threshold",
        "use_rejection_sampling",
        "advanced_sampling_mode",
        "enable_penalty",
    },
)
# EagleDecodingConfig. The tree fields: eagle_choices (a static tree; 1.2.1 warns "still under
# development, PLEASE DO NOT USE IT", 1.3 deprecates it, 1.4 removed it), use_dynamic_tree +
# dynamic_tree_max_topK + DecodingBase's max_total_draft_tokens (EAGLE-2's dynamic tree; 1.2.1
# resets max_total_draft_tokens to max_draft_len, 1.3+ takes it in [max_draft_len, topK x
# max_draft_len]); max_non_leaves_per_layer (a TensorRT-engine EAGLE-1 convert setting, never
# written by trtspec); num_eagle_layers (TensorRT flow only; gone in 1.4.0rc4).
_EAGLE_COMMON = frozenset(
    {
        "greedy_sampling",
        "posterior_threshold",
        "use_dynamic_tree",
        "dynamic_tree_max_topK",
        "max_non_leaves_per_layer",
        "eagle3_one_model",
        "eagle3_layers_to_capture",
        "eagle3_model_arch",
    }
)
_EAGLE = _by_line(_EAGLE_COMMON, only_12={"eagle_choices", "num_eagle_layers"})
_NGRAM = frozenset({"max_matching_ngram_size", "is_keep_all", "is_use_oldest", "is_public_pool"})
# SADecodingConfig (the suffix automaton, standalone) and SAEnhancerConfig (``sa_config`` on
# Eagle3, MTP and PARD; not on Draft_Target): complete, 1.3+ only (1.2.1 has neither).
_SA = frozenset({"max_matching_ngram_size", "enable_global_pool", "global_pool_size"})
SA_ENHANCER = {"1.3+": frozenset({"threshold", "enable_global_pool"})}

# decoding_type spelling -> the fields that class takes (inventoried classes only).
# 1.2: the keys of DecodingBaseConfig.from_dict's table; 1.3+: the Literal of each class.
DECODING_TYPES = {
    "1.2": {
        "DraftTarget": DECODING_BASE["1.2"],
        "Eagle": DECODING_BASE["1.2"] | _EAGLE["1.2"],  # runs EAGLE-3 on pytorch (eagle3_one_model)
        "NGram": DECODING_BASE["1.2"] | _NGRAM,
    },
    "1.3+": {
        "Draft_Target": DECODING_BASE["1.3+"],
        "Eagle3": DECODING_BASE["1.3+"] | _EAGLE["1.3+"] | {"sa_config"},
        "NGram": DECODING_BASE["1.3+"] | _NGRAM,
        "SA": DECODING_BASE["1.3+"] | _SA,
        "AUTO": DECODING_BASE["1.3+"],  # AutoDecodingConfig: the base fields, which it ignores
    },
}
# Spellings the other line uses, named in errors (1.2 has no Eagle3/Draft_Target key).
ALL_DECODING_TYPES = {
    "1.2": frozenset({"MTP", "Medusa", "Eagle", "Lookahead", "NGram", "DraftTarget", "SaveState", "UserProvided", "AUTO"}),
    "1.3+": frozenset(
        {
            "Draft_Target",
            "Eagle3",
            "Eagle",
            "MTP",
            "NGram",
            "SA",
            "User_Provided",
            "SaveState",
            "PARD",
            "DFlash",
            "DSpark",
            "AUTO",
        }
    ),
}

# decoding_type per (method, line). 1.2.x: the keys of DecodingBaseConfig.from_dict, where
# "Eagle" runs EAGLE-3 on the PyTorch backend; 1.3+: the discriminator Literals of the
# SpeculativeConfig union (llm_args.py@0004396720054fd8e205cbf616f21f0b57c6b412).
DECODING_TYPE = {
    ("draft_target", "1.2"): "DraftTarget",
    ("draft_target", "1.3+"): "Draft_Target",
    ("eagle3", "1.2"): "Eagle",
    ("eagle3", "1.3+"): "Eagle3",
    ("ngram", "1.2"): "NGram",
    ("ngram", "1.3+"): "NGram",
    ("suffix", "1.3+"): "SA",  # 1.2 has no suffix automaton: spec validation refuses it there
    ("auto", "1.3+"): "AUTO",  # a draft-model-free method chosen by upstream's heuristic; spec validation: 1.3+ only
}
# and back: the trtspec method a decoding_type of either line runs
METHOD_OF = {decoding_type: method for (method, _line), decoding_type in DECODING_TYPE.items()}

# SamplingParams (complete, both lines; 1.2.1 also has prompt_ignore_length).
_SAMPLING = {
    "end_id",
    "pad_id",
    "max_tokens",
    "bad",
    "bad_token_ids",
    "stop",
    "stop_token_ids",
    "include_stop_str_in_output",
    "embedding_bias",
    "logits_processor",
    "apply_batched_logits_processor",
    "n",
    "best_of",
    "use_beam_search",
    "top_k",
    "top_p",
    "top_p_min",
    "top_p_reset_ids",
    "top_p_decay",
    "seed",
    "temperature",
    "min_tokens",
    "beam_search_diversity_rate",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "length_penalty",
    "early_stopping",
    "no_repeat_ngram_size",
    "min_p",
    "beam_width_array",
    "logprobs",
    "prompt_logprobs",
    "return_context_logits",
    "return_generation_logits",
    "exclude_input_from_output",
    "return_encoder_output",
    "return_perf_metrics",
    "additional_model_outputs",
    "lookahead_config",
    "guided_decoding",
    "ignore_eos",
    "detokenize",
    "add_special_tokens",
    "truncate_prompt_tokens",
    "skip_special_tokens",
    "spaces_between_special_tokens",
}
SAMPLING_PARAMS = _by_line(_SAMPLING, only_12={"prompt_ignore_length"})


@dataclass(frozen=True)
class Unknown:
    """A key trtspec wrote that the inventory of ``line`` lacks, with where it sits."""

    line: str
    path: str

    def __str__(self) -> str:
        return f"{self.path} (TensorRT-LLM {self.line})"


def unknown_keys(args: dict, line: str) -> list[Unknown]:
    """Every key of an LLM API argument dict (as written to YAML) missing from ``line``."""
    out = [Unknown(line, k) for k in args if k not in LLM_ARGS[line]]
    kv = args.get("kv_cache_config") or {}
    out += [Unknown(line, f"kv_cache_config.{k}") for k in kv if k not in KV_CACHE_CONFIG[line]]
    spec = args.get("speculative_config")
    if spec is not None:
        kind = spec.get("decoding_type")
        fields = DECODING_TYPES[line].get(kind)
        if fields is None:
            out.append(Unknown(line, f"speculative_config.decoding_type={kind}"))
        else:
            out += [Unknown(line, f"speculative_config.{k}") for k in spec if k not in fields]
        sa = spec.get("sa_config")
        if isinstance(sa, dict) and "sa_config" in (fields or ()):
            out += [Unknown(line, f"speculative_config.sa_config.{k}") for k in sa if k not in SA_ENHANCER[line]]
    return out

"""Inventory of vLLM's speculative config: the fields of ``SpeculativeConfig`` and the
methods it takes, read by hand from upstream and typed in here as data. Tests check every
speculative setting trtspec hands vLLM (lab/peers.py) against it; a name missing here is a
trtspec bug, never a guess.

Source: vllm-project/vllm vllm/config/speculative.py@f19b16d95e4395790661f4835e4436bc3dd5d9c7
(every field of the class, in order; the suffix fields need Arctic Inference installed), and
num_speculative_tokens_per_batch_size ("dynamic speculative decoding control": a list of
(range_start, range_end, num_speculative_tokens) with inclusive batch-size ranges), read at
vllm/config/speculative.py@002e77c1f0ef9b19cff8b9e21cfbd6feb3d6b443.
"""

from __future__ import annotations

SOURCE = "vllm-project/vllm vllm/config/speculative.py@f19b16d95e4395790661f4835e4436bc3dd5d9c7"

SPECULATIVE_CONFIG = frozenset(
    {
        "enforce_eager",
        "num_speculative_tokens",
        "model",
        "method",
        "draft_tensor_parallel_size",
        "tensor_parallel_size",
        "quantization",
        "max_model_len",
        "revision",
        "code_revision",
        "disable_by_batch_size",
        "disable_padded_drafter_batch",
        "prompt_lookup_max",
        "prompt_lookup_min",
        "speculative_token_tree",
        "parallel_drafting",
        "target_model_config",
        "target_parallel_config",
        "draft_model_config",
        "draft_parallel_config",
        "suffix_decoding_max_tree_depth",
        "suffix_decoding_max_cached_requests",
        "suffix_decoding_max_spec_factor",
        "suffix_decoding_min_token_prob",
        "draft_load_config",
        "num_speculative_tokens_per_batch_size",  # @002e77c1f0ef9b19cff8b9e21cfbd6feb3d6b443
    }
)

# SpeculativeMethod: the Literal's values (the MTP model types collapse to "mtp").
METHODS = frozenset({"ngram", "medusa", "mlp_speculator", "draft_model", "suffix", "eagle", "eagle3", "mtp", "ngram_gpu"})


def unknown_fields(config: dict) -> list[str]:
    """The keys of a speculative config (and a method) vLLM's SpeculativeConfig lacks."""
    out = [k for k in config if k not in SPECULATIVE_CONFIG]
    if "method" in config and config["method"] not in METHODS:
        out.append(f"method={config['method']}")
    ranges = config.get("num_speculative_tokens_per_batch_size")
    if ranges is not None and not _batch_ranges(ranges):
        out.append(f"num_speculative_tokens_per_batch_size={ranges}")
    return out


def _batch_ranges(ranges) -> bool:
    """list[tuple[int, int, int]]: (range_start, range_end, num_speculative_tokens), inclusive."""
    return isinstance(ranges, list) and all(
        isinstance(r, (list, tuple)) and len(r) == 3 and all(isinstance(x, int) for x in r) and 1 <= r[0] <= r[1] and r[2] >= 0
        for r in ranges
    )

"""TensorRT-LLM's version rules: what each runtime (llmapi, engine) and each line (1.2, 1.3+)
takes of a spec, checked when the spec loads (EngineSpec's validator calls
check_trtllm_runtime with itself; this room sits below the spec, so ``spec`` is untyped here).
A ValueError is rendered as a spec error. The LLM API's field names per line are beside them
(fields.py); the argument files written from a spec are checked against those.
"""

from __future__ import annotations

# backend trtllm: two runtimes exist upstream (docs/trtllm.md).
# llmapi: the LLM API on the PyTorch backend, default since TensorRT-LLM 1.0 and the only
# runtime on 1.3+; engine: trtllm-build engines served by tensorrtllm_backend, 1.2.x and older
# only (removed from main in 2026: NVIDIA/TensorRT-LLM PRs #15907, #15918, #15763).
# What each runtime needs, in the words every message uses.
NEEDS = {
    "llmapi": "TensorRT-LLM 1.2.x (trtllm.line: '1.2') or 1.3 and later (trtllm.line: '1.3+')",
    "engine": "TensorRT-LLM 1.2.x or older (trtllm-build and the tensorrtllm Triton backend were removed in 1.3)",
}
LLMAPI_METHODS = ("draft_target", "eagle3", "ngram", "suffix")
ENGINE_METHODS = ("draft_target",)


def check_trtllm_runtime(spec) -> None:
    """Raise ValueError (rendered as a spec error) for settings the chosen runtime lacks."""
    t, s = spec.trtllm, spec.speculative
    if s.use_draft_logits:
        raise ValueError(
            "speculative.use_draft_logits: trtspec certifies greedy token identity, and "
            "draft-logit acceptance matches the target only in distribution; neither runtime "
            "serves it here, so remove it"
        )
    if t.runtime == "engine":
        check_engine_runtime(spec)
    else:
        check_llmapi_runtime(spec)


def check_engine_runtime(spec) -> None:
    """trtllm.runtime engine: trtllm-build draft_target pairs on TensorRT-LLM 1.2 (ValueError)."""
    t, s = spec.trtllm, spec.speculative
    if t.line != "1.2":
        raise ValueError(
            f"trtllm.runtime engine needs {NEEDS['engine']}; set trtllm.line: '1.2' or use "
            f"trtllm.runtime: llmapi (needs {NEEDS['llmapi']})"
        )
    if s.suffix is not None and s.method in ENGINE_METHODS:
        raise ValueError(
            "speculative.suffix: trtllm.runtime engine has no suffix drafting; remove suffix or use "
            f"trtllm.runtime: llmapi with method eagle3 (needs {NEEDS['llmapi']})"
        )
    if s.tree is not None:
        raise ValueError(
            "speculative.tree: trtllm.runtime engine builds draft_target pairs, which draft chains "
            "(trtllm-build drafts trees only in EAGLE-1 engines, which trtspec does not build); remove "
            f"tree, or use trtllm.runtime: llmapi with method eagle3 and tree.dynamic (needs {NEEDS['llmapi']})"
        )
    if s.adaptive:
        raise ValueError(
            "speculative.adaptive: trtllm.runtime engine drafts the k a request sends; remove adaptive "
            f"or use trtllm.runtime: llmapi (needs {NEEDS['llmapi']})"
        )
    if s.method not in ENGINE_METHODS:
        raise ValueError(
            f"speculative.method {s.method}: trtllm.runtime engine builds draft_target "
            f"pairs only; use trtllm.runtime: llmapi (needs {NEEDS['llmapi']}) for "
            f"{', '.join(LLMAPI_METHODS)}"
        )


def check_llmapi_runtime(spec) -> None:
    """trtllm.runtime llmapi: what the LLM API takes of the spec (ValueError)."""
    t, s = spec.trtllm, spec.speculative
    check_llmapi_adaptive(spec)
    if s.default_draft_tokens != s.max_draft_len:
        raise ValueError(
            "speculative.default_draft_tokens: the LLM API drafts max_draft_len tokens every step "
            "and takes no per-request draft length; remove default_draft_tokens or set it to "
            f"max_draft_len ({s.max_draft_len})"
        )
    if s.schedule and s.schedule.get(1) != s.max_draft_len:
        raise ValueError(
            "speculative.schedule: TensorRT-LLM's draft_len_schedule must map 1 sequence to "
            f"max_draft_len; set schedule[1] to {s.max_draft_len} or max_draft_len to {s.schedule.get(1)}"
        )
    if s.switch_off is not None and (s.switch_off.min_acceptance_rate is None) != (t.line == "1.2"):
        raise ValueError(
            "speculative.switch_off: TensorRT-LLM 1.3+ switches speculation off on an acceptance "
            "rate (acceptance_rate_window_size / acceptance_rate_threshold), 1.2 on an acceptance "
            "length (acceptance_window / acceptance_length_threshold); give min_acceptance_rate for "
            "trtllm.line '1.3+', min_acceptance_length for '1.2'"
        )
    check_llmapi_suffix(spec)
    check_llmapi_tree(spec)
    if s.method == "ngram" and s.min_ngram != 1:
        raise ValueError(
            "speculative.min_ngram: the LLM API's NGram drafter has no minimum match length "
            "(only max_matching_ngram_size, from max_ngram); remove min_ngram"
        )
    if spec.draft is not None:
        d = spec.draft
        if d.tp_size != 1 or d.pp_size != 1 or d.gpu_device_ids is not None:
            raise ValueError(
                "draft.tp_size/pp_size/gpu_device_ids: under trtllm.runtime llmapi the draft "
                "runs inside the target's ranks with the target's parallelism; remove them"
            )
        if d.quantization != "none":
            raise ValueError(
                "draft.quantization: the LLM API reads a draft's quantization from its "
                "checkpoint (hf_quant_config.json); remove it and point draft at a quantized "
                "checkpoint instead"
            )
    if t.max_num_tokens < spec.limits("target").max_input_len:
        raise ValueError(
            f"trtllm.max_num_tokens ({t.max_num_tokens}) is below build.max_input_len "
            f"({spec.limits('target').max_input_len}); without chunked prefill a prompt must fit "
            "one step: raise max_num_tokens or lower max_input_len"
        )


def check_llmapi_adaptive(spec) -> None:
    """Adaptive speculation under the LLM API (ValueError where it has no equivalent). Method
    auto over drafters without a model is AutoDecodingConfig (decoding_type AUTO, 1.3+), whose
    own heuristic picks a draft-model-free method and its k, ignoring the inherited settings;
    no LLM API config picks k per request from acceptance (adaptive)."""
    s = spec.speculative
    if s.adaptive:
        raise ValueError(
            "speculative.adaptive: the LLM API picks no k per request from acceptance (its draft_len_schedule "
            "caps k by batch size, for every request); remove adaptive and keep speculative.schedule, or use "
            "backend torch"
        )
    if s.method != "auto":
        return
    if spec.trtllm.line != "1.3+":
        raise ValueError(
            "speculative.method auto: trtspec writes TensorRT-LLM's AUTO decoding for 1.3 and later only; "
            "set trtllm.line: '1.3+' or use backend torch"
        )
    if s.model_draft is not None:
        raise ValueError(
            f"speculative.auto.methods lists {s.model_draft}: TensorRT-LLM's AUTO chooses a draft-model-free "
            "method by its own heuristic and loads no draft model; list only ngram and suffix (and remove "
            "draft), or use backend torch"
        )
    given = [n for n in ("schedule", "switch_off", "suffix", "max_ngram", "min_ngram") if n in s.model_fields_set]
    if given:
        raise ValueError(
            f"speculative.{given[0]}: TensorRT-LLM's AUTO ignores the settings it inherits and sets its own "
            f"(drafter, k and n-gram size by concurrency); remove {given[0]} or use backend torch"
        )


def check_llmapi_suffix(spec) -> None:
    """Suffix decoding under the LLM API is TensorRT-LLM's suffix automaton (1.3+): SA
    standalone, ``sa_config`` on Eagle3. What it lacks is refused by name (ValueError)."""
    s, line = spec.speculative, spec.trtllm.line
    sx = s.suffix_drafting
    if sx is None:
        return
    what = "method suffix" if s.method == "suffix" else f"speculative.suffix on method {s.method}"
    if line == "1.2":
        raise ValueError(
            f"{what}: TensorRT-LLM 1.2 has no suffix automaton (SADecodingConfig / sa_config came in 1.3); "
            "set trtllm.line: '1.3+' or remove it"
        )
    if s.method == "draft_target":
        raise ValueError(
            "speculative.suffix on method draft_target: TensorRT-LLM's Draft_Target config has no sa_config "
            "(Eagle3, MTP and PARD have); remove suffix or use method eagle3"
        )
    defaults = type(sx)()  # SuffixSpec's own defaults
    for name, why in (
        ("max_depth", "matches as long as it can"),
        ("spec_factor", "drafts max_draft_len tokens on a match"),
        ("min_token_prob", "keeps no frequencies"),
        ("cache_tokens", "bounds its pool in requests (cache_responses), not tokens"),
    ):
        if getattr(sx, name) != getattr(defaults, name):
            raise ValueError(f"speculative.suffix.{name}: TensorRT-LLM's suffix automaton {why}; remove {name}")
    limit = spec.limits("target").max_batch_size
    if s.method == "suffix" and 0 < sx.cache_responses < limit:
        raise ValueError(
            f"speculative.suffix.cache_responses ({sx.cache_responses}): TensorRT-LLM's global_pool_size "
            f"must be >= max_batch_size ({limit}); raise it, or set 0 to keep requests apart"
        )


def check_llmapi_tree(spec) -> None:
    """A draft tree under the LLM API is Eagle3DecodingConfig's dynamic tree (use_dynamic_tree,
    dynamic_tree_max_topK, max_total_draft_tokens), on 1.3+ only; what a line lacks is refused
    by name (ValueError). Sources: docs/trtllm.md, Draft trees."""
    s, line = spec.speculative, spec.trtllm.line
    if s.tree is None:
        return
    if s.method != "eagle3":
        raise ValueError(
            f"speculative.tree on method {s.method}: TensorRT-LLM drafts trees only with EAGLE "
            "(Eagle3DecodingConfig); its Draft_Target config takes no tree: remove tree or use method eagle3"
        )
    if line == "1.2":
        raise ValueError(
            "speculative.tree: TensorRT-LLM 1.2's EagleDecodingConfig resets max_total_draft_tokens to "
            "max_draft_len (no node budget) and marks its draft-token tree unfinished; set trtllm.line: "
            "'1.3+' with tree.dynamic, or remove tree"
        )
    if s.tree.choices is not None:
        raise ValueError(
            "speculative.tree.choices: TensorRT-LLM removed static trees (eagle_choices) in 1.4 and "
            "trtllm.line '1.3+' covers 1.4 and later; use tree.dynamic (use_dynamic_tree, "
            "dynamic_tree_max_topK, max_total_draft_tokens) or remove tree"
        )

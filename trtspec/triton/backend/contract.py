"""The `tensorrt_llm_bls` / `ensemble` tensor contract and what trtspec does with each field.

Tables of every input and output TensorRT-LLM's Triton backend declares on its
`tensorrt_llm_bls` and `ensemble` models (release 1.2.x; names, types and dims as upstream,
checked against tests/data/trtllm/triton_params.json), plus trtspec's own extensions. The
repository writer renders them into config.pbtxt, so an upstream client never meets
"unexpected inference input". ``check_supported`` turns each field trtspec does not implement
into one INVALID_ARG error that names the feature: nothing is silently ignored.

Dims exclude the batch dimension (max_batch_size > 0). ``reshape=()`` is upstream's
``reshape: { shape: [ ] }``: the model sees [b] instead of [b, 1].
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from trtspec.errors import RequestError
from trtspec.spec import ServeSpec
from trtspec.speculative.processing import Processing
from trtspec.speculative.sampling import SamplingParams


class Tensor(NamedTuple):
    name: str
    data_type: str  # Triton DataType name
    dims: tuple[int, ...]
    optional: bool = True
    reshape: tuple[int, ...] | None = None
    ragged: bool = False


def _t(name, data_type, dims=(1,), **kw) -> Tensor:
    return Tensor(name, data_type, tuple(dims), **kw)


SCALAR = ()  # reshape to [b]
LOGITS_TYPE = "TYPE_FP32"  # upstream's ${logits_datatype}
PROMPT_TABLE_TYPE = "TYPE_FP16"  # upstream's ${prompt_embedding_table_data_type}

UPSTREAM_BLS_INPUTS: tuple[Tensor, ...] = (
    _t("text_input", "TYPE_STRING", optional=False),
    _t("decoder_text_input", "TYPE_STRING"),
    _t("image_input", "TYPE_FP16", (-1, 3, -1, -1)),
    _t("image_bytes_input", "TYPE_UINT8", (-1, -1, -1, -1)),
    _t("image_url_input", "TYPE_STRING"),
    _t("image_sizes_input", "TYPE_INT64", (-1, 2)),
    _t("video_bytes_input", "TYPE_UINT8", (-1, -1, -1, -1)),
    _t("max_tokens", "TYPE_INT32", optional=False),
    _t("bad_words", "TYPE_STRING", (-1,)),
    _t("stop_words", "TYPE_STRING", (-1,)),
    _t("exclude_input_in_output", "TYPE_BOOL"),
    _t("end_id", "TYPE_INT32"),
    _t("pad_id", "TYPE_INT32"),
    _t("top_k", "TYPE_INT32"),
    _t("top_p", "TYPE_FP32"),
    _t("temperature", "TYPE_FP32"),
    _t("length_penalty", "TYPE_FP32"),
    _t("repetition_penalty", "TYPE_FP32"),
    _t("min_tokens", "TYPE_INT32"),
    _t("presence_penalty", "TYPE_FP32"),
    _t("frequency_penalty", "TYPE_FP32"),
    _t("seed", "TYPE_UINT64"),
    _t("return_log_probs", "TYPE_BOOL", reshape=SCALAR),
    _t("return_context_logits", "TYPE_BOOL", reshape=SCALAR),
    _t("return_generation_logits", "TYPE_BOOL", reshape=SCALAR),
    _t("num_return_sequences", "TYPE_INT32", reshape=SCALAR),
    _t("beam_width", "TYPE_INT32"),
    _t("stream", "TYPE_BOOL"),
    _t("prompt_embedding_table", PROMPT_TABLE_TYPE, (-1, -1)),
    _t("prompt_vocab_size", "TYPE_INT32"),
    _t("prompt_table_extra_id", "TYPE_UINT64"),
    _t("embedding_bias_words", "TYPE_STRING", (-1,)),
    _t("embedding_bias_weights", "TYPE_FP32", (-1,)),
    _t("num_draft_tokens", "TYPE_INT32"),
    _t("use_draft_logits", "TYPE_BOOL", reshape=SCALAR),
    _t("lora_task_id", "TYPE_UINT64", reshape=SCALAR),
    _t("lora_weights", "TYPE_FP16", (-1, -1), ragged=True),
    _t("lora_config", "TYPE_INT32", (-1, 3), ragged=True),
    _t("return_perf_metrics", "TYPE_BOOL", reshape=SCALAR),
    _t("return_num_input_tokens", "TYPE_BOOL", reshape=SCALAR),
    _t("return_num_output_tokens", "TYPE_BOOL", reshape=SCALAR),
    _t("guided_decoding_guide_type", "TYPE_STRING"),
    _t("guided_decoding_guide", "TYPE_STRING"),
)

UPSTREAM_BLS_OUTPUTS: tuple[Tensor, ...] = (
    _t("text_output", "TYPE_STRING", (-1,)),
    _t("cum_log_probs", "TYPE_FP32", (-1,)),
    _t("output_log_probs", "TYPE_FP32", (-1, -1)),
    _t("context_logits", LOGITS_TYPE, (-1, -1)),
    _t("generation_logits", LOGITS_TYPE, (-1, -1, -1)),
    _t("batch_index", "TYPE_INT32"),
    _t("sequence_index", "TYPE_INT32"),
    _t("kv_cache_alloc_new_blocks", "TYPE_INT32"),
    _t("kv_cache_reused_blocks", "TYPE_INT32"),
    _t("kv_cache_alloc_total_blocks", "TYPE_INT32"),
    _t("arrival_time_ns", "TYPE_INT64"),
    _t("first_scheduled_time_ns", "TYPE_INT64"),
    _t("first_token_time_ns", "TYPE_INT64"),
    _t("last_token_time_ns", "TYPE_INT64"),
    _t("acceptance_rate", "TYPE_FP32"),
    _t("total_accepted_draft_tokens", "TYPE_INT32"),
    _t("total_draft_tokens", "TYPE_INT32"),
    _t("num_input_tokens", "TYPE_INT32"),
    _t("num_output_tokens", "TYPE_INT32"),
)

# trtspec's additions (optional inputs; outputs sent only when asked or always harmless).
TRTSPEC_BLS_INPUTS: tuple[Tensor, ...] = (
    _t("apply_chat_template", "TYPE_BOOL"),  # encode text_input with the tokenizer's chat template
    _t("return_margins", "TYPE_BOOL"),  # target's top-1 minus top-2 logit per output token
    _t("draft_tree", "TYPE_BOOL"),  # false: draft a chain where the deployment drafts a tree
    # Suffix decoding's cache of earlier responses (docs/suffix.md): the scope (a tenant key of
    # at most MAX_SCOPE_BYTES UTF-8 bytes) whose responses the request reads and feeds, and
    # suffix_cache false: neither read nor feed it.
    _t("suffix_cache_scope", "TYPE_STRING"),
    _t("suffix_cache", "TYPE_BOOL"),
    # serve.capture (docs/capture.md): false keeps this request out of the capture.
    _t("capture", "TYPE_BOOL"),
)
TRTSPEC_BLS_OUTPUTS: tuple[Tensor, ...] = (
    _t("output_ids", "TYPE_INT32", (-1,)),
    _t("sequence_length", "TYPE_INT32"),
    _t("output_margins", "TYPE_FP32", (-1,)),
    _t("perf_metrics_json", "TYPE_STRING"),  # every SpecMetrics count
    _t("finish_reason", "TYPE_STRING"),  # "length", "eos" or "stop" (what ended generation)
)

BLS_INPUTS = UPSTREAM_BLS_INPUTS + TRTSPEC_BLS_INPUTS
BLS_OUTPUTS = UPSTREAM_BLS_OUTPUTS + TRTSPEC_BLS_OUTPUTS

# Upstream's `ensemble` takes the BLS inputs less the multimodal and draft ones, each with
# dims [1] / [-1] and no reshape, and returns the same outputs.
_NOT_IN_ENSEMBLE = {
    "image_input",
    "image_bytes_input",
    "image_url_input",
    "image_sizes_input",
    "video_bytes_input",
    "num_draft_tokens",
    "use_draft_logits",
}
UPSTREAM_ENSEMBLE_INPUTS: tuple[Tensor, ...] = tuple(
    t._replace(reshape=None) for t in UPSTREAM_BLS_INPUTS if t.name not in _NOT_IN_ENSEMBLE
)
ENSEMBLE_INPUTS = UPSTREAM_ENSEMBLE_INPUTS + TRTSPEC_BLS_INPUTS + (_t("num_draft_tokens", "TYPE_INT32"),)
ENSEMBLE_OUTPUTS = BLS_OUTPUTS


# ----------------------------------------------------------------------------- refusals

# Inputs whose mere presence asks for a feature trtspec does not implement.
_UNSUPPORTED_PRESENT = {
    "decoder_text_input": "encoder-decoder models (decoder_text_input)",
    "image_input": "multimodal inputs (image_input)",
    "image_bytes_input": "multimodal inputs (image_bytes_input)",
    "image_url_input": "multimodal inputs (image_url_input)",
    "image_sizes_input": "multimodal inputs (image_sizes_input)",
    "video_bytes_input": "multimodal inputs (video_bytes_input)",
    "prompt_embedding_table": "prompt tuning tables (prompt_embedding_table)",
    "prompt_vocab_size": "prompt tuning tables (prompt_vocab_size)",
    "prompt_table_extra_id": "prompt tuning tables (prompt_table_extra_id)",
    "lora_task_id": "LoRA adapters (lora_task_id)",
    "lora_weights": "LoRA adapters (lora_weights)",
    "lora_config": "LoRA adapters (lora_config)",
    "guided_decoding_guide_type": "guided decoding (guided_decoding_guide_type)",
    "guided_decoding_guide": "guided decoding (guided_decoding_guide)",
}
# The inputs above: config.pbtxt gives them the smallest shape (triton/repository/bounds.py).
UNSERVED_INPUTS = frozenset(_UNSUPPORTED_PRESENT)


def _values(inputs: Mapping[str, np.ndarray], name: str) -> np.ndarray | None:
    x = inputs.get(name)
    return None if x is None else np.asarray(x).reshape(-1)


def unsupported(feature: str, fix: str) -> RequestError:
    return RequestError(f"{feature} is not supported by trtspec; {fix}")


def check_supported(inputs: Mapping[str, np.ndarray]) -> None:
    """Raise RequestError naming the first requested feature trtspec does not implement.

    Accepted: sampling (top_k, top_p, temperature, seed: sampling_of), logits processing
    (penalties, min_tokens, bad_words, embedding bias: processing_of) and return_log_probs —
    the endpoint refuses those three when its engines return no logits —, beam_width 1, any
    length_penalty (beam search only in TensorRT-LLM), use_draft_logits false,
    num_return_sequences >= 1 (the endpoint checks it can answer more than one).
    """
    for name, feature in _UNSUPPORTED_PRESENT.items():
        if name in inputs:
            raise unsupported(feature, f"remove the {name} input")
    beam = _values(inputs, "beam_width")
    if beam is not None and (beam != 1).any():
        raise unsupported(f"beam search (beam_width={int(beam.max())})", "send beam_width 1")
    flag = _values(inputs, "return_context_logits")
    if flag is not None and flag.astype(bool).any():
        raise unsupported(
            "returning prompt logits (return_context_logits)",
            "send return_context_logits false; return_generation_logits gives the target's logits at the generated tokens",
        )
    draft_logits = _values(inputs, "use_draft_logits")
    if draft_logits is not None and draft_logits.astype(bool).any():
        raise unsupported(
            "draft-logit (probabilistic) acceptance (use_draft_logits)",
            "send use_draft_logits false: drafts are accepted when they match the target's greedy tokens",
        )
    check_sampling_values(inputs)
    n = _values(inputs, "num_return_sequences")
    if n is not None and (n < 1).any():
        raise RequestError("num_return_sequences must be >= 1")


def check_sampling_values(inputs: Mapping[str, np.ndarray]) -> None:
    """Sampling inputs in range (see sampling_of for what they mean)."""
    temperature = _values(inputs, "temperature")
    if temperature is not None and (~np.isfinite(temperature) | (temperature < 0)).any():
        raise RequestError("temperature must be a finite number >= 0")
    top_k = _values(inputs, "top_k")
    top_p = _values(inputs, "top_p")
    if top_k is not None and (top_k < 0).any():
        raise RequestError("top_k must be >= 0")
    if top_p is not None and (~np.isfinite(top_p) | (top_p < 0) | (top_p > 1)).any():
        raise RequestError("top_p must be between 0 and 1")


def sampling_of(inputs: Mapping[str, np.ndarray], rows: int) -> list[SamplingParams | None]:
    """Per row: None for greedy decoding, else the sampler's parameters, as TensorRT-LLM reads
    them: greedy when top_k is 1, when top_k and top_p are both 0 or absent (its default), or
    when temperature is 0; otherwise sampling at temperature (default 1) from the top_k most
    likely tokens (0: all) within nucleus mass top_p (0: all), with seed (default 0)."""
    check_sampling_values(inputs)
    t, k, p, seed = _columns(inputs, rows, "temperature", "top_k", "top_p", "seed")
    out: list[SamplingParams | None] = []
    for r in range(rows):
        if k[r] == 1 or (k[r] == 0 and p[r] == 0) or t[r] == 0:
            out.append(None)
        else:
            out.append(
                SamplingParams(
                    temperature=float(t[r]),
                    top_k=int(k[r]),
                    top_p=float(p[r]) if p[r] > 0 else 1.0,
                    seed=int(seed[r]) % 2**63,
                )
            )
    return out


# Upstream's value of each sampling and logits-processing input a request leaves out, and the
# dtype it is read as.
DEFAULTS: dict[str, tuple[float | int, type]] = {
    "temperature": (1.0, np.float64),
    "top_k": (0, np.int64),
    "top_p": (0.0, np.float64),
    "seed": (0, np.uint64),
    "repetition_penalty": (1.0, np.float64),
    "presence_penalty": (0.0, np.float64),
    "frequency_penalty": (0.0, np.float64),
    "min_tokens": (1, np.int64),
}


def _columns(inputs: Mapping[str, np.ndarray], rows: int, *names: str) -> list[np.ndarray]:
    """Each input in ``names`` as a [rows] array, its DEFAULTS value where it is left out."""
    return [_column(inputs, name, rows, *DEFAULTS[name]) for name in names]


def _column(inputs: Mapping[str, np.ndarray], name: str, rows: int, default, dtype) -> np.ndarray:
    v = _values(inputs, name)
    if v is None:
        return np.full(rows, default, dtype=dtype)
    if v.size not in (1, rows):
        raise RequestError(f"{name} must hold one value per prompt ({rows}); got {v.size}")
    return np.broadcast_to(v.astype(dtype), rows)


def _words(inputs: Mapping[str, np.ndarray], name: str, row: int, rows: int) -> list[str]:
    """A BYTES [b, n] (or [n] for every row) input's strings for one row."""
    x = inputs.get(name)
    if x is None:
        return []
    words = np.asarray(x)
    words = words.reshape(rows, -1)[row] if words.size and words.size % rows == 0 and words.ndim > 1 else words.reshape(-1)
    out = []
    for w in words:
        if isinstance(w, bytes):
            try:
                w = w.decode("utf-8")
            except UnicodeDecodeError:
                raise RequestError(f"{name} is not valid UTF-8; send UTF-8 text") from None
        out.append(str(w))
    return out


def processing_of(inputs: Mapping[str, np.ndarray], rows: int, tokenizer, vocab_size: int) -> list[Processing | None]:
    """Per row: the logits processing a request asks for, None when it asks for none.

    Read as TensorRT-LLM's preprocessing model reads the text inputs: each bad word is
    tokenized on its own without special tokens (``_to_word_list_format``); each embedding
    bias word with the tokenizer's defaults, every one of its tokens getting the word's
    weight, summed (``_get_embedding_bias``). min_tokens 0 and 1 are off (upstream's default
    is 1). The temperature goes along: upstream applies it before the penalties.
    """
    names = ("repetition_penalty", "presence_penalty", "frequency_penalty", "min_tokens", "temperature")
    rep, pres, freq, min_tokens, temperature = _columns(inputs, rows, *names)
    out: list[Processing | None] = []
    for r in range(rows):
        bad = tuple(tuple(tokenizer(w, add_special_tokens=False)["input_ids"]) for w in _words(inputs, "bad_words", r, rows) if w)
        words = _words(inputs, "embedding_bias_words", r, rows)
        weights = _values(inputs, "embedding_bias_weights")
        bias: list[tuple[int, float]] = []
        if words or (weights is not None and weights.size):
            w = np.asarray(inputs.get("embedding_bias_weights", np.zeros(0)), dtype=np.float64)
            w = w.reshape(rows, -1)[r] if w.size and w.size % rows == 0 and w.ndim > 1 else w.reshape(-1)
            if len(w) != len(words):
                raise RequestError(
                    f"embedding_bias_words ({len(words)}) and embedding_bias_weights ({len(w)}) must pair up one to one"
                )
            for word, weight in zip(words, w):
                bias += [(int(t), float(weight)) for t in tokenizer(word)["input_ids"]]
        t = float(temperature[r])
        proc = Processing(
            repetition_penalty=float(rep[r]),
            presence_penalty=float(pres[r]),
            frequency_penalty=float(freq[r]),
            min_tokens=max(0, int(min_tokens[r])),
            bad_words=bad,
            bias=tuple(bias),
            temperature=t if t > 0 else 1.0,  # 0 means greedy; nothing to scale
        )
        proc.check_ids(vocab_size)
        # A request with only a temperature keeps it: its log probs are read at that temperature.
        out.append(proc if proc.active or proc.temperature != 1.0 else None)
    return out


# -- size limits: what one request may make the server read or hold ------------------------

# Inputs that are tokenized. Their size is checked before any tokenizing, so a multi-megabyte
# text costs a length check, not seconds of a tokenizer (operations: Triton backend).
TEXT_INPUTS = ("text_input", "stop_words", "bad_words", "embedding_bias_words")
# One response may hold at most serve.max_response_mb (the spec's default where a repository
# does not say): a vocab-sized float32 row per token of generation_logits is what grows; the
# Python backend carries responses through /dev/shm (64 MB in a default container).
DEFAULT_MAX_RESPONSE_MB: int = ServeSpec.model_fields["max_response_mb"].default


def longest_token_bytes(tokenizer) -> int:
    """The most UTF-8 bytes one vocabulary entry decodes to (at least 4: one character)."""
    try:
        texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    except Exception:  # a tokenizer without a vocabulary to read: UTF-8's widest character x 8
        return 32
    return max(4, max((len(t.encode("utf-8", "replace")) for t in texts), default=4))


def text_byte_limit(tokenizer, max_input_len: int) -> int:
    """The UTF-8 bytes a request's text may have: twice what max_input_len tokens can cover
    (every token covers at most ``longest_token_bytes``; twice, so that normalisation never
    refuses a prompt that fits). Text beyond it cannot fit and is refused untokenized."""
    return 2 * max_input_len * longest_token_bytes(tokenizer)


def _byte_sizes(x) -> list[int]:
    return [len(v) if isinstance(v, bytes) else len(str(v).encode("utf-8", "surrogatepass")) for v in np.asarray(x).reshape(-1)]


def check_text_sizes(inputs: Mapping[str, np.ndarray], limit: int, max_input_len: int) -> None:
    """Refuse, by name, a text input longer than ``limit`` bytes (each prompt on its own; the
    words of each list together), before anything is tokenized."""
    for name in TEXT_INPUTS:
        x = inputs.get(name)
        if x is None:
            continue
        sizes = _byte_sizes(x)
        n = max(sizes, default=0) if name == "text_input" else sum(sizes)
        if n > limit:
            raise RequestError(
                f"{name} is {n} bytes, more than the {limit} bytes that max_input_len {max_input_len} tokens "
                "can hold (refused before tokenizing); shorten it, or rebuild with a larger build.max_input_len"
            )


def check_response_size(rows: int, max_tokens: int, vocab_size: int, logits: bool, limit_mb: int) -> None:
    """Refuse a request whose generation_logits (rows x max_tokens x vocab float32, held while
    it generates and then sent) would exceed ``limit_mb``, naming the output and the fix."""
    if not logits:
        return
    per_token = rows * vocab_size * 4
    need = per_token * max_tokens
    if need > limit_mb * 2**20:
        most = max(0, limit_mb * 2**20 // per_token)
        raise RequestError(
            f"return_generation_logits with max_tokens {max_tokens} would make a {need / 2**20:.0f} MB response "
            f"({rows} sequence(s) x {max_tokens} tokens x {vocab_size} vocab x 4 bytes), more than the "
            f"{limit_mb} MB a response may hold (serve.max_response_mb); ask at most {most} tokens, leave "
            "return_generation_logits out, or raise serve.max_response_mb"
        )

"""The upstream `tensorrt_llm_bls` / `ensemble` contract: every tensor declared as upstream
declares it, and every field trtspec does not implement refused by name (no model needed)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from trtspec.errors import RequestError
from trtspec.triton.backend import contract

UPSTREAM = json.loads((Path(__file__).parent / "data" / "trtllm" / "triton_params.json").read_text())["tensorrt_llm_bls"]
PLACEHOLDER_TYPES = {
    "${logits_datatype}": contract.LOGITS_TYPE,
    "${prompt_embedding_table_data_type}": contract.PROMPT_TABLE_TYPE,
}


def _upstream(kind):
    out = []
    for t in UPSTREAM[kind]:
        reshape = t.get("reshape")
        out.append(
            (
                t["name"],
                PLACEHOLDER_TYPES.get(t["data_type"], t["data_type"]),
                tuple(t["dims"]),
                t.get("optional", False) if kind == "inputs" else False,
                None if reshape is None else tuple(reshape),
                t.get("allow_ragged_batch", False),
            )
        )
    return out


def _ours(table, outputs=False):
    return [
        (
            t.name,
            t.data_type,
            t.dims,
            False if outputs else t.optional,
            None if outputs else t.reshape,
            False if outputs else t.ragged,
        )
        for t in table
    ]


def test_bls_declares_every_upstream_tensor_exactly():
    assert _ours(contract.UPSTREAM_BLS_INPUTS) == _upstream("inputs")
    assert _ours(contract.UPSTREAM_BLS_OUTPUTS, outputs=True) == _upstream("outputs")
    assert len(contract.UPSTREAM_BLS_INPUTS) == 43 and len(contract.UPSTREAM_BLS_OUTPUTS) == 19
    # trtspec's extras never shadow an upstream name and are optional.
    upstream = {t.name for t in contract.UPSTREAM_BLS_INPUTS + contract.UPSTREAM_BLS_OUTPUTS}
    assert not upstream & {t.name for t in contract.TRTSPEC_BLS_INPUTS + contract.TRTSPEC_BLS_OUTPUTS}
    assert all(t.optional for t in contract.TRTSPEC_BLS_INPUTS)


def test_ensemble_takes_what_upstream_clients_send():
    names = {t.name for t in contract.ENSEMBLE_INPUTS}
    # What upstream's end_to_end_grpc_client sends to `ensemble` with its default flags and more.
    sent = {
        "text_input",
        "max_tokens",
        "stream",
        "beam_width",
        "temperature",
        "num_return_sequences",
        "bad_words",
        "stop_words",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "return_log_probs",
        "return_context_logits",
        "return_generation_logits",
        "embedding_bias_words",
        "embedding_bias_weights",
        "end_id",
        "pad_id",
        "exclude_input_in_output",
        "lora_weights",
        "lora_config",
        "lora_task_id",
        "return_perf_metrics",
        "guided_decoding_guide_type",
        "guided_decoding_guide",
        "top_k",
        "top_p",
        "seed",
        "min_tokens",
        "length_penalty",
    }
    assert sent <= names
    assert {t.name for t in contract.ENSEMBLE_OUTPUTS} == {t.name for t in contract.BLS_OUTPUTS}


def _col(value, dtype=None):
    return np.array([[value]], dtype=np.object_ if isinstance(value, bytes) else dtype)


GREEDY_AS_UPSTREAM_SENDS = [
    {"beam_width": _col(1, np.int32), "temperature": _col(1.0, np.float32)},  # client defaults
    {"top_k": _col(1, np.int32), "top_p": _col(0.9, np.float32), "temperature": _col(0.7, np.float32)},
    {"top_k": _col(0, np.int32), "top_p": _col(0.0, np.float32), "seed": _col(7, np.uint64)},
    {
        "repetition_penalty": _col(1.0, np.float32),
        "presence_penalty": _col(0.0, np.float32),
        "frequency_penalty": _col(0.0, np.float32),
        "min_tokens": _col(1, np.int32),
        "length_penalty": _col(1.3, np.float32),
        "use_draft_logits": np.array([False]),
        "return_log_probs": np.array([False]),
        "return_context_logits": np.array([False]),
        "num_return_sequences": np.array([1], dtype=np.int32),
        "bad_words": np.array([[b""]], dtype=np.object_),
    },
]


@pytest.mark.parametrize("inputs", GREEDY_AS_UPSTREAM_SENDS)
def test_greedy_settings_are_accepted(inputs):
    contract.check_supported(inputs)


def test_sampling_inputs_read_as_tensorrt_llm_reads_them():
    from trtspec.speculative.sampling import SamplingParams

    for greedy in GREEDY_AS_UPSTREAM_SENDS[:3] + [{"top_k": _col(40, np.int32), "temperature": _col(0.0, np.float32)}]:
        assert contract.sampling_of(greedy, 1) == [None]
    assert contract.sampling_of({"top_k": _col(40, np.int32)}, 1) == [SamplingParams(1.0, 40, 1.0, 0)]
    got = contract.sampling_of(
        {"top_p": _col(0.9, np.float32), "temperature": _col(0.5, np.float32), "seed": _col(7, np.uint64)}, 1
    )
    assert got == [SamplingParams(0.5, 0, float(np.float32(0.9)), 7)]  # the FP32 input, as sent
    two = {"top_k": np.array([[1], [5]], dtype=np.int32), "seed": np.array([[1], [2]], dtype=np.uint64)}
    assert contract.sampling_of(two, 2) == [None, SamplingParams(1.0, 5, 1.0, 2)]


REFUSED = [
    ({"beam_width": _col(4, np.int32)}, "beam search (beam_width=4) is not supported"),
    ({"temperature": _col(-1.0, np.float32)}, "temperature must be a finite number >= 0"),
    ({"num_return_sequences": np.array([0], dtype=np.int32)}, "num_return_sequences must be >= 1"),
    ({"lora_task_id": np.array([3], dtype=np.uint64)}, "LoRA adapters (lora_task_id)"),
    ({"lora_weights": np.zeros((1, 2, 4), dtype=np.float16)}, "LoRA adapters (lora_weights)"),
    ({"prompt_embedding_table": np.zeros((1, 2, 4), dtype=np.float16)}, "prompt tuning tables"),
    ({"guided_decoding_guide_type": _col(b"json")}, "guided decoding"),
    ({"image_url_input": _col(b"http://x")}, "multimodal inputs (image_url_input)"),
    ({"decoder_text_input": _col(b"x")}, "encoder-decoder models"),
    ({"return_context_logits": np.array([True])}, "returning prompt logits (return_context_logits)"),
    ({"use_draft_logits": np.array([True])}, "draft-logit (probabilistic) acceptance"),
]


@pytest.mark.parametrize(("inputs", "message"), REFUSED)
def test_unsupported_features_are_refused_by_name(inputs, message):
    with pytest.raises(RequestError) as err:
        contract.check_supported(inputs)
    assert message in str(err.value)
    assert "unexpected" not in str(err.value)


class _WordTokenizer:
    """Each character is a token (its code point); special tokens add a BOS id 1."""

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": ([1] if add_special_tokens else []) + [ord(c) for c in text]}


def test_processing_inputs_read_as_upstream_preprocessing_reads_them():
    inputs = {
        "repetition_penalty": _col(1.2, np.float32),
        "presence_penalty": _col(0.5, np.float32),
        "min_tokens": _col(4, np.int32),
        "temperature": _col(0.7, np.float32),
        "bad_words": np.array([[b"ab", b"", b"c"]], dtype=np.object_),
        "embedding_bias_words": np.array([[b"xy", b"x"]], dtype=np.object_),
        "embedding_bias_weights": np.array([[2.0, 0.5]], dtype=np.float32),
    }
    (proc,) = contract.processing_of(inputs, 1, _WordTokenizer(), 200)
    assert proc.repetition_penalty == pytest.approx(1.2) and proc.presence_penalty == 0.5
    assert proc.min_tokens == 4 and proc.temperature == pytest.approx(0.7)
    assert proc.bad_words == ((97, 98), (99,))  # each word alone, no special tokens, empty skipped
    # bias words with the tokenizer's defaults (BOS gets the weight too), every token, summed
    bias = {}
    for t, w in proc.bias:
        bias[t] = bias.get(t, 0) + w
    assert bias == {1: 2.5, 120: 2.5, 121: 2.0}


def test_neutral_processing_inputs_ask_for_nothing():
    inputs = {
        "repetition_penalty": _col(1.0, np.float32),
        "presence_penalty": _col(0.0, np.float32),
        "frequency_penalty": _col(0.0, np.float32),
        "min_tokens": _col(1, np.int32),
        "bad_words": np.array([[b""]], dtype=np.object_),
    }
    assert contract.processing_of(inputs, 1, _WordTokenizer(), 200) == [None]
    # a temperature alone changes no token, but it is kept: log probs are read at it
    (proc,) = contract.processing_of(inputs | {"temperature": _col(0.5, np.float32)}, 1, _WordTokenizer(), 200)
    assert not proc.active and proc.temperature == 0.5


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        (
            {
                "embedding_bias_words": np.array([[b"x", b"y"]], dtype=np.object_),
                "embedding_bias_weights": np.array([[1.0]], dtype=np.float32),
            },
            "must pair up one to one",
        ),
        ({"bad_words": np.array([[b"\xff"]], dtype=np.object_)}, "bad_words is not valid UTF-8"),
        ({"bad_words": np.array([["\u0190"]], dtype=np.object_)}, "outside the vocabulary"),
        ({"presence_penalty": _col(float("inf"), np.float32)}, "presence_penalty must be a finite"),
    ],
)
def test_bad_processing_inputs_are_named(inputs, message):
    with pytest.raises(RequestError, match=message):
        contract.processing_of(inputs, 1, _WordTokenizer(), 200)

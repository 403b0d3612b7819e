"""The text endpoints' config.pbtxt parameters, typed: one home for how they are written and read.

The repository writers fill an ``EngineEndpointParams`` (torch and trtllm engine models behind
the endpoint) or an ``LlmapiEndpointParams`` (the LLM API inside the endpoint) and write
``to_params()`` into config.pbtxt; the backend models read them back with ``from_params`` and
turn them into the endpoint's ``OrchestratorSettings`` (``settings``). Each field is one
parameter (its name, unless the field's metadata says another) as a string: numbers in
decimal, flags "true"/"false", the load-aware schedule and switch-off as JSON. A field left
None is not written; a parameter that is not there reads back as the field's default.

Light on purpose (no torch): models/llmapi_model.py reads gpu_device_ids before anything
that may load CUDA.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TypeVar

P = TypeVar("P", bound="EndpointParams")


def _param(name: str | None = None, default=None, codec: str | None = None):
    return field(default=default, metadata={"param": name, "codec": codec})


@dataclass(frozen=True, kw_only=True)
class EndpointParams:
    """What every text endpoint is told (triton/repository/writer.py, llmapi_models.py)."""

    mode: str  # "speculative" or "target_only"
    method: str
    # The deployment's draft length, speculative.default_draft_tokens: a request's k when it
    # sends none (upstream's per-request input is num_draft_tokens, contract.py).
    default_draft_tokens: int
    max_input_len: int
    max_seq_len: int
    max_draft_len: int
    vocab_size: int  # the target's
    tokenizer_dir: str
    apply_chat_template: bool = False  # the default when a request does not say
    max_queue: int = 64  # serve.max_queue: requests waiting beyond a full batch

    @staticmethod
    def from_spec(spec, mode: str, vocab_size: int, tokenizer_dir) -> dict:
        """The fields every endpoint takes from the engine spec (spec.EngineSpec), as keywords."""
        lim = spec.limits("target")
        return {
            "mode": mode,
            "method": spec.speculative.method,
            "default_draft_tokens": spec.speculative.default_draft_tokens,
            "max_input_len": lim.max_input_len,
            "max_seq_len": lim.max_seq_len,
            "max_draft_len": spec.speculative.max_draft_len,
            "vocab_size": vocab_size,
            "tokenizer_dir": str(tokenizer_dir),
            "apply_chat_template": False,  # raw text in, as upstream's preprocessing
            "max_queue": spec.serve.max_queue,  # the speculative endpoints' scheduler / streams' bound
        }

    def to_params(self) -> dict[str, str]:
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                out[f.metadata.get("param") or f.name] = _encode(value, f.metadata.get("codec"))
        return out

    @classmethod
    def from_params(cls: type[P], params: Mapping[str, str]) -> P:
        hints = typing.get_type_hints(cls)
        values = {}
        for f in dataclasses.fields(cls):
            name = f.metadata.get("param") or f.name
            if params.get(name):
                values[f.name] = _decode(params[name], hints[f.name], f.metadata.get("codec"))
        return cls(**values)

    def _limits(self, max_batch_size: int):
        from trtspec.speculative.requests import Limits

        return Limits(
            vocab_size=self.vocab_size,
            max_seq_len=self.max_seq_len,
            max_draft_len=self.max_draft_len,
            max_input_len=self.max_input_len,
            max_batch_size=max_batch_size,
            default_draft_tokens=self.default_draft_tokens,
            drafts=self.mode == "speculative",  # target_only checks a request's num_draft_tokens, drafts none
        )


@dataclass(frozen=True, kw_only=True)
class EngineEndpointParams(EndpointParams):
    """An endpoint that calls engine models over BLS (models/orchestrator.py)."""

    target_model: str = _param("tensorrt_llm_model_name", "")
    draft_model: str | None = _param("tensorrt_llm_draft_model_name")  # method draft_target
    max_ngram: int = 0
    min_ngram: int = 1
    # The target engine model answers return_margins, return_generation_logits and the
    # kv_cache_* counts (torch engine models).
    engine_margins: bool = False
    engine_requests: str = "batched"  # "per_row": one request per row (tensorrtllm models)
    engine_continues: bool = False  # a TensorRT-LLM target keeps decoding after a rejected draft
    max_response_mb: int | None = None  # None: contract.DEFAULT_MAX_RESPONSE_MB
    engine_timeout_s: float | None = None  # None: bls.ENGINE_TIMEOUT_S (speculative endpoints)
    eagle3_head_dir: str | None = None  # method eagle3: the head engine folder ...
    eagle3_target_dir: str | None = None  # ... and the target's (its embeddings and RoPE)
    # Load-aware speculation (spec speculative.schedule / switch_off): {active sequences: k}
    # as JSON {"n": k}, and the SwitchOffSpec as JSON of its fields: {"window",
    # "min_acceptance_length"} or {"window", "min_acceptance_rate"}.
    schedule: tuple[tuple[int, int], ...] | None = _param("draft_len_schedule", codec="schedule")
    switch_off: object | None = _param(codec="switch_off")
    # Suffix drafting (spec speculative.suffix_drafting: method suffix, or layered on the
    # model draft) as JSON of its SuffixSpec fields; None: none.
    suffix: object | None = _param(codec="suffix")
    # The deployment's draft tree (spec speculative.tree) as JSON of its TreeSpec fields; None:
    # chains. A request drafts it unless it sends draft_tree false.
    tree: object | None = _param(codec="tree")
    # Adaptive speculation (spec method auto, or adaptive): the methods the policy chooses
    # among, comma-separated ("draft_target,suffix,ngram"; one for adaptive k); None: fixed k.
    adaptive_methods: str | None = None
    probe_every: int = 16
    # serve.capture (speculative/capture.py) as JSON of its CaptureSpec fields, dir absolute;
    # None: no request is kept. The endpoint chooses the requests, the target model keeps them.
    capture: object | None = _param(codec="capture")

    def settings(self, decoupled: bool, max_batch_size: int):
        from trtspec.triton.backend.contract import DEFAULT_MAX_RESPONSE_MB
        from trtspec.triton.backend.orchestrator_core import OrchestratorSettings

        return OrchestratorSettings(
            mode=self.mode,
            decoupled=decoupled,
            target_model=self.target_model,
            draft_model=self.draft_model,
            method=self.method,
            max_ngram=self.max_ngram,
            min_ngram=self.min_ngram,
            limits=replace(self._limits(max_batch_size), default_tree=self._tree_shape()),
            draft_vocab_limit=self.vocab_size,
            chat_template_default=self.apply_chat_template,
            margins_supported=self.engine_margins,
            eagle3_head_dir=self.eagle3_head_dir,
            eagle3_target_dir=self.eagle3_target_dir,
            target_continues=self.engine_continues,
            sampling_supported=self.engine_margins,  # generation_logits: torch engine models
            kv_blocks_supported=self.engine_margins,
            schedule=self.schedule,
            switch_off=self.switch_off,
            max_response_mb=DEFAULT_MAX_RESPONSE_MB if self.max_response_mb is None else self.max_response_mb,
            suffix=self.suffix,
            adaptive_methods=tuple(self.adaptive_methods.split(",")) if self.adaptive_methods else None,
            probe_every=self.probe_every,
            capture=self.capture if self.mode == "speculative" else None,
        )

    def _tree_shape(self):
        """The deployment's tree as the loop's shape (a dynamic tree max_draft_len deep)."""
        if self.tree is None:
            return None
        from trtspec.spec import SpeculativeSpec
        from trtspec.speculative.tree import tree_shape

        return tree_shape(SpeculativeSpec(method=self.method, max_draft_len=self.max_draft_len, tree=self.tree))


@dataclass(frozen=True, kw_only=True)
class LlmapiEndpointParams(EndpointParams):
    """An endpoint that runs the LLM API itself (models/llmapi_model.py)."""

    llmapi_impl: str  # speculative.llmapi.IMPLS
    trtllm_line: str
    gpu_device_ids: str | None = None  # "0,1": CUDA_VISIBLE_DEVICES for the LLM's workers

    def settings(self, decoupled: bool, max_batch_size: int):
        from trtspec.triton.backend.orchestrator_core import OrchestratorSettings

        # No engine models to call: the LLM API drafts and verifies; only parsing and packing
        # are the orchestrator's.
        return OrchestratorSettings(
            mode=self.mode,
            decoupled=decoupled,
            target_model="",
            draft_model=None,
            method=self.method,
            max_ngram=0,
            min_ngram=1,
            limits=self._limits(max_batch_size),
            chat_template_default=self.apply_chat_template,
            margins_supported=False,
        )


# Parameters that carry one of the spec's settings blocks as JSON of its fields.
_SPEC_CODECS = {"suffix": "SuffixSpec", "tree": "TreeSpec", "capture": "CaptureSpec", "switch_off": "SwitchOffSpec"}


def _encode(value, codec: str | None) -> str:
    if codec == "schedule":
        return json.dumps({str(n): k for n, k in sorted(value)})
    if codec in _SPEC_CODECS:
        return json.dumps(value.model_dump(exclude_none=True), sort_keys=True)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _decode(text: str, hint, codec: str | None):
    if codec == "schedule":
        from trtspec.speculative.schedule import DraftSchedule

        return DraftSchedule.from_mapping({int(n): int(k) for n, k in json.loads(text).items()}).points
    if codec in _SPEC_CODECS:
        from trtspec import spec

        return getattr(spec, _SPEC_CODECS[codec])(**json.loads(text))
    kind = next((a for a in typing.get_args(hint) if a is not type(None)), hint)  # int | None -> int
    if kind is bool:
        return text == "true"
    return kind(text)


def load_aware(speculative) -> dict:
    """The spec's `speculative.schedule` / `switch_off` / adaptive methods as EngineEndpointParams keywords."""
    out: dict = {}
    if speculative.schedule:
        out["schedule"] = tuple(sorted(speculative.schedule.items()))
    if speculative.switch_off is not None:
        out["switch_off"] = speculative.switch_off
    if speculative.adapts:
        out["adaptive_methods"] = ",".join(speculative.methods)
        out["probe_every"] = speculative.auto.probe_every if speculative.auto is not None else 16
    return out

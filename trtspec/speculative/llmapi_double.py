"""A CPU conformance double of the TensorRT-LLM LLM API, over trtspec's torch engines.

It stands in for ``tensorrt_llm`` where there is no GPU, so the argument files trtspec writes
and the request path that reads them (in-process verify, the Triton llmapi models) run in CI.
It is strict where upstream is strict: every constructor refuses a name the field inventory
of its TensorRT-LLM line lacks (engines/trtllm/llmapi_fields.py, read from upstream at recorded commits),
decoding_type is spelt as that line spells it, and required fields are required. It is not
TensorRT-LLM: greedy only, one rank, local checkpoints only, and EAGLE-3 is refused (it needs
the target's hidden states, which the torch engines do not expose). Results produced with
it are labelled as such by every caller.

Surface mirrored (names as upstream): LLM(**kwargs).generate(inputs, sampling_params) ->
RequestOutput(.prompt_token_ids, .outputs[i] CompletionOutput(.text, .token_ids,
.finish_reason, .request_perf_metrics.speculative_decoding.{acceptance_rate,
total_accepted_draft_tokens, total_draft_tokens}), .finished), LLM.shutdown(),
SamplingParams(**kwargs), and update_llm_args_with_extra_dict(llm_args, extra, path=None)
(upstream: tensorrt_llm/llmapi/llm_utils.py, used by its Triton llmapi model.py).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from trtspec.engines.trtllm.llmapi_fields import (
    ALL_DECODING_TYPES,
    DECODING_TYPES,
    KV_CACHE_CONFIG,
    LLM_ARGS,
    SAMPLING_PARAMS,
)
from trtspec.spec import MAX_DRAFT_LEN_LIMIT

VERSIONS = {"1.2": "1.2.1+trtspec.double", "1.3+": "1.3.0+trtspec.double"}


def _refuse_unknown(what: str, given, allowed, line: str) -> None:
    extra = sorted(set(given) - set(allowed))
    if extra:
        # pydantic's wording upstream: "Extra inputs are not permitted"
        raise ValueError(f"{what}: {', '.join(extra)}: Extra inputs are not permitted (TensorRT-LLM {line})")


class KvCacheConfig:
    def __init__(self, line: str, **kwargs):
        _refuse_unknown("KvCacheConfig", kwargs, KV_CACHE_CONFIG[line], line)
        self.enable_block_reuse = kwargs.get("enable_block_reuse", True)
        self.free_gpu_memory_fraction = kwargs.get("free_gpu_memory_fraction", 0.9)
        if not 0 <= self.free_gpu_memory_fraction <= 1:
            raise ValueError("free_gpu_memory_fraction must be in [0, 1]")


@dataclass
class DecodingConfig:
    """One of upstream's *DecodingConfig classes, by its decoding_type spelling."""

    line: str
    decoding_type: str
    fields: dict

    @classmethod
    def from_dict(cls, line: str, data: dict) -> DecodingConfig:
        data = dict(data)
        kind = data.get("decoding_type")
        if kind not in ALL_DECODING_TYPES[line]:
            # 1.2.x: DecodingBaseConfig.from_dict; 1.3+: the union's discriminator
            raise ValueError(f"Invalid decoding type: {kind} (TensorRT-LLM {line})")
        if kind not in DECODING_TYPES[line]:
            raise NotImplementedError(f"decoding type {kind} is not inventoried by trtspec")
        _refuse_unknown(f"{kind} speculative_config", data, DECODING_TYPES[line][kind], line)
        data.pop("decoding_type")
        if "speculative_model_dir" in data:  # validation alias upstream
            data["speculative_model"] = data.pop("speculative_model_dir")
        if not data.get("max_draft_len"):
            raise ValueError(f"max_draft_len must be > 0 for {kind}")
        if kind in ("DraftTarget", "Draft_Target", "Eagle", "Eagle3") and not data.get("speculative_model"):
            raise ValueError(f"speculative_model must be specified for {kind}")
        if kind == "NGram" and line == "1.2" and not data.get("max_matching_ngram_size"):
            # 1.2.1 defaults it to 0 and asserts it is positive when the drafter is built
            raise ValueError("max_matching_ngram_size must be > 0 for NGram (TensorRT-LLM 1.2)")
        return cls(line, kind, data)


class SamplingParams:
    def __init__(self, line: str, **kwargs):
        _refuse_unknown("SamplingParams", kwargs, SAMPLING_PARAMS[line], line)
        self.max_tokens = kwargs.get("max_tokens", 32)  # upstream default
        self.end_id = kwargs.get("end_id")
        self.top_k = kwargs.get("top_k")
        self.top_p = kwargs.get("top_p")
        self.temperature = kwargs.get("temperature")
        self.return_perf_metrics = kwargs.get("return_perf_metrics", False)
        self.skip_special_tokens = kwargs.get("skip_special_tokens", True)
        self.stop_token_ids = kwargs.get("stop_token_ids")
        # upstream's _greedy_decoding: top_k None or 1 and top_p None or 0
        if self.top_k not in (None, 1) or self.top_p not in (None, 0.0):
            raise NotImplementedError("the conformance double decodes greedily only (top_k 1)")


@dataclass
class SpeculativeDecodingStats:
    acceptance_rate: float
    total_accepted_draft_tokens: int
    total_draft_tokens: int


@dataclass
class RequestPerfMetrics:
    speculative_decoding: SpeculativeDecodingStats


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    request_perf_metrics: RequestPerfMetrics | None = None


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True


def update_llm_args_with_extra_dict(line: str, llm_args: dict, extra: dict, extra_llm_api_options: str | None = None) -> dict:
    """Merge a YAML mapping into LLM kwargs, turning the nested dicts into config objects."""
    merged = dict(llm_args)
    for key, value in extra.items():
        if key == "speculative_config" and isinstance(value, dict):
            value = DecodingConfig.from_dict(line, value)
        elif key == "kv_cache_config" and isinstance(value, dict):
            value = KvCacheConfig(line, **value)
        merged[key] = value
    return merged


class LLM:
    """Loads the target (and a draft) checkpoint into torch engines; greedy generation."""

    def __init__(self, line: str, **kwargs):
        _refuse_unknown("LLM", kwargs, LLM_ARGS[line], line)
        if "model" not in kwargs:
            raise ValueError("model: Field required")
        self.line = line
        self.args = kwargs
        if kwargs.get("tensor_parallel_size", 1) != 1 or kwargs.get("pipeline_parallel_size", 1) != 1:
            raise NotImplementedError("the conformance double runs one rank (tensor/pipeline parallel 1)")
        spec = kwargs.get("speculative_config")
        if isinstance(spec, dict):
            spec = DecodingConfig.from_dict(line, spec)
        self.speculative_config = spec
        kv = kwargs.get("kv_cache_config")
        self.kv_cache_config = KvCacheConfig(line, **kv) if isinstance(kv, dict) else kv
        self.max_batch_size = int(kwargs.get("max_batch_size") or 2048)
        self.max_input_len = int(kwargs.get("max_input_len") or 1024)
        self.max_num_tokens = int(kwargs.get("max_num_tokens") or 8192)
        dtype = kwargs.get("dtype", "auto")
        trust = bool(kwargs.get("trust_remote_code", False))
        target_dir = _local_folder(kwargs["model"], "model")
        self.max_seq_len = int(kwargs.get("max_seq_len") or _max_positions(target_dir, trust))
        self.target = _engine(target_dir, dtype, self.max_seq_len, self.max_batch_size, trust)
        self.draft = None
        if spec is not None and spec.decoding_type in ("Eagle", "Eagle3"):
            raise NotImplementedError(
                "the conformance double runs draft-target and NGram; EAGLE-3 needs the target's "
                "hidden states: verify it with the real tensorrt_llm on a GPU"
            )
        if spec is not None and spec.decoding_type in ("DraftTarget", "Draft_Target"):
            draft_dir = _local_folder(spec.fields["speculative_model"], "speculative_model")
            self.draft = _engine(draft_dir, dtype, self.max_seq_len, self.max_batch_size, trust)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(target_dir, trust_remote_code=trust)
        self._lock = threading.Lock()  # one generate at a time, like one executor loop
        self._next_id = 0

    def generate(self, inputs, sampling_params=None, use_tqdm: bool = False):
        """One RequestOutput per input (a list in, a list out), as upstream's LLM.generate."""
        from trtspec.speculative.drafters import ModelDrafter, NgramDrafter
        from trtspec.speculative.loop import GenerationRequest, NoDrafter, generate
        from trtspec.speculative.verifier import LogitsVerifier

        single = isinstance(inputs, str) or (isinstance(inputs, list) and inputs and isinstance(inputs[0], int))
        batch = [inputs] if single else list(inputs)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(batch)
        params = [p if p is not None else SamplingParams(self.line) for p in params]
        requests = []
        for prompt, sp in zip(batch, params):
            ids = self.tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else [int(t) for t in prompt]
            self._check(ids, sp.max_tokens)
            end = sp.end_id if sp.end_id is not None else self.tokenizer.eos_token_id
            k = self.speculative_config.fields["max_draft_len"] if self.speculative_config else 0
            stops = tuple((int(t),) for t in (sp.stop_token_ids or ()))
            requests.append(GenerationRequest(ids, sp.max_tokens, k, frozenset({int(end)}), stops))
        spec = self.speculative_config
        if spec is None:
            drafter = NoDrafter()
        elif self.draft is not None:
            drafter = ModelDrafter(self.draft.run, min(self.draft.vocab_size, self.target.vocab_size))
        else:
            drafter = NgramDrafter(int(spec.fields["max_matching_ngram_size"]), 1)
        with self._lock:
            results = generate(requests, drafter, LogitsVerifier(self.target.run))
            outs = []
            for prompt, req, sp, res in zip(batch, requests, params, results):
                m = res.metrics
                perf = None
                if sp.return_perf_metrics:
                    rate = m.accepted / m.drafted if m.drafted else 0.0
                    perf = RequestPerfMetrics(SpeculativeDecodingStats(rate, m.accepted, m.drafted))
                text = self.tokenizer.decode(res.output_ids, skip_special_tokens=sp.skip_special_tokens)
                reason = "length" if res.finish_reason == "length" else "stop"
                out = CompletionOutput(0, text, list(res.output_ids), reason, perf)
                outs.append(RequestOutput(self._next_id, prompt if isinstance(prompt, str) else None, req.prompt_ids, [out]))
                self._next_id += 1
        return outs[0] if single else outs

    def _check(self, ids: list[int], max_tokens: int) -> None:
        if not ids:
            raise ValueError("The prompt is empty")
        if len(ids) > self.max_input_len or len(ids) > self.max_num_tokens:
            raise ValueError(
                f"The prompt length ({len(ids)}) exceeds max_input_len "
                f"({self.max_input_len}) or max_num_tokens ({self.max_num_tokens})"
            )
        if len(ids) + max_tokens > self.max_seq_len:
            raise ValueError(f"prompt ({len(ids)}) + max_tokens ({max_tokens}) exceeds max_seq_len ({self.max_seq_len})")
        vocab = self.target.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"token id outside the vocabulary (0..{vocab - 1})")

    def shutdown(self) -> None:
        self.target = self.draft = None


def _local_folder(value, what: str) -> Path:
    p = Path(str(value))
    if not (p / "config.json").is_file():
        raise NotImplementedError(f"{what} {value}: the conformance double loads local Hugging Face checkpoint folders only")
    return p


def _max_positions(folder: Path, trust: bool) -> int:
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(folder, trust_remote_code=trust).max_position_embeddings)


def _engine(folder: Path, dtype: str, max_seq_len: int, slots: int, trust: bool):
    """A TorchEngine over a Hugging Face checkpoint folder, built in memory."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from trtspec.engines.torch.build import _expected_keys
    from trtspec.engines.torch.engine import DTYPES, TorchEngine
    from trtspec.engines.torch.model import DecoderConfig, DecoderLM

    hf_config = AutoConfig.from_pretrained(folder, trust_remote_code=trust)
    if dtype == "auto":  # upstream: the checkpoint's dtype
        dtype = str(getattr(hf_config, "torch_dtype", None) or "float32").removeprefix("torch.")
    cfg = DecoderConfig.from_hf(hf_config)
    state: dict = {}
    for f in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(f)))
    keep = _expected_keys(cfg, state)
    state = {k: v.to(DTYPES[dtype]).contiguous() for k, v in state.items() if k in keep}
    with torch.no_grad():
        model = DecoderLM.from_state_dict(cfg, state)
    # TorchEngine reads only these manifest fields (max_draft_len: how far its slots roll back).
    manifest = SimpleNamespace(limits={"max_seq_len": max_seq_len}, dtype=dtype, max_draft_len=MAX_DRAFT_LEN_LIMIT)
    return TorchEngine(folder, manifest, model, hf_config, slots)


def api(line: str) -> SimpleNamespace:
    """The double's module surface for one TensorRT-LLM line (as `import tensorrt_llm`)."""

    def bind(fn):
        return lambda *a, **kw: fn(line, *a, **kw)

    return SimpleNamespace(
        __version__=VERSIONS[line],
        LLM=bind(LLM),
        SamplingParams=bind(SamplingParams),
        update_llm_args_with_extra_dict=bind(update_llm_args_with_extra_dict),
        is_double=True,
    )

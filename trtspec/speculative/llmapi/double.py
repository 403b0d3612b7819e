"""A CPU conformance double of the TensorRT-LLM LLM API, over trtspec's torch engines.

It stands in for ``tensorrt_llm`` where there is no GPU, so the argument files trtspec writes
and the request path that reads them (in-process verify, the Triton llmapi models) run in CI.
It is strict where upstream is strict: every constructor refuses a name the field inventory
of its TensorRT-LLM line lacks (trtllm_lines/fields.py, read from upstream at recorded commits),
decoding_type is spelt as that line spells it, and required fields are required. It is not
TensorRT-LLM: greedy only, one rank, local checkpoints only, one request batch at a time.
EAGLE-3 (decoding type Eagle on 1.2, Eagle3 on 1.3+) runs a head folder in the layout upstream
loads, reading the target engine's captured layer outputs. Results produced with it are
labelled as such by every caller.

Surface mirrored (names as upstream): LLM(**kwargs).generate(inputs, sampling_params) ->
RequestOutput(.prompt_token_ids, .outputs[i] CompletionOutput(.text, .token_ids,
.finish_reason, .request_perf_metrics.speculative_decoding.{acceptance_rate,
total_accepted_draft_tokens, total_draft_tokens}), .finished), LLM.shutdown(),
LLM.generate_async(inputs, sampling_params, streaming=True) -> a result that iterates once per
step (.outputs[0].token_ids_diff / .text_diff, .finished) and .abort(), SamplingParams(**kwargs)
with stop / stop_token_ids / include_stop_str_in_output as upstream applies them (stop strings
become token sequences via tokenizer.encode(s, add_special_tokens=False); with
include_stop_str_in_output False the matched stop tokens are cut from token_ids:
tensorrt_llm/sampling_params.py@000a01de _setup, executor/result.py@005bc848
_handle_sequence), and update_llm_args_with_extra_dict(llm_args, extra, path=None)
(upstream: tensorrt_llm/llmapi/llm_utils.py, used by its Triton llmapi model.py).
"""

from __future__ import annotations

import functools
import queue
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from trtspec.spec import MAX_DRAFT_LEN_LIMIT
from trtspec.trtllm_lines.fields import (
    ALL_DECODING_TYPES,
    DECODING_TYPES,
    KV_CACHE_CONFIG,
    LLM_ARGS,
    METHOD_OF,
    SA_ENHANCER,
    SAMPLING_PARAMS,
)

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
        if kind == "AUTO":  # which drafter and what k are upstream's heuristic, not a field
            raise NotImplementedError(
                "decoding type AUTO: TensorRT-LLM chooses the drafter and k by its own heuristic, which the "
                "conformance double does not run; verify an AUTO build on TensorRT-LLM"
            )
        _refuse_unknown(f"{kind} speculative_config", data, DECODING_TYPES[line][kind], line)
        if isinstance(data.get("sa_config"), dict):
            _refuse_unknown(f"{kind} sa_config", data["sa_config"], SA_ENHANCER[line], line)
        data.pop("decoding_type")
        if "speculative_model_dir" in data:  # validation alias upstream
            data["speculative_model"] = data.pop("speculative_model_dir")
        if not data.get("max_draft_len"):
            raise ValueError(f"max_draft_len must be > 0 for {kind}")
        if METHOD_OF[kind] in ("draft_target", "eagle3") and not data.get("speculative_model"):
            raise ValueError(f"speculative_model must be specified for {kind}")
        if data.get("use_dynamic_tree") or data.get("dynamic_tree_max_topK") is not None:
            _check_dynamic_tree(kind, line, data)
        if kind == "NGram" and line == "1.2" and not data.get("max_matching_ngram_size"):
            # 1.2.1 defaults it to 0 and asserts it is positive when the drafter is built
            raise ValueError("max_matching_ngram_size must be > 0 for NGram (TensorRT-LLM 1.2)")
        return cls(line, kind, data)


def _check_dynamic_tree(kind: str, line: str, data: dict) -> None:
    """EagleDecodingConfig.validate_eagle_config's dynamic-tree rules, as each line has them."""
    top_k, k = data.get("dynamic_tree_max_topK"), data["max_draft_len"]
    if not top_k or top_k <= 0:
        raise ValueError("dynamic_tree_max_topK should be provided, which indicates the number of nodes to expand each time")
    if line == "1.2":  # 1.2.1 sets max_total_draft_tokens = max_draft_len before the tree logic
        data["max_total_draft_tokens"] = k
        return
    total = data.get("max_total_draft_tokens")
    if total is None:
        data["max_total_draft_tokens"] = top_k * k
    elif not k <= total <= top_k * k:
        raise ValueError(
            f"max_total_draft_tokens ({total}) should be >= max_draft_len ({k}) and <= "
            f"dynamic_tree_max_topK * max_draft_len ({top_k * k}) for {kind}"
        )


class SamplingParams:
    def __init__(self, line: str, **kwargs):
        _refuse_unknown("SamplingParams", kwargs, SAMPLING_PARAMS[line], line)
        self.max_tokens = kwargs.get("max_tokens", 32)  # upstream default
        self.end_id = kwargs.get("end_id")
        self.ignore_eos = bool(kwargs.get("ignore_eos", False))
        self.top_k = kwargs.get("top_k")
        self.top_p = kwargs.get("top_p")
        self.temperature = kwargs.get("temperature")
        self.return_perf_metrics = kwargs.get("return_perf_metrics", False)
        self.skip_special_tokens = kwargs.get("skip_special_tokens", True)
        self.stop_token_ids = kwargs.get("stop_token_ids")
        stop = kwargs.get("stop")
        self.stop = [stop] if isinstance(stop, str) else list(stop or [])
        self.include_stop_str_in_output = bool(kwargs.get("include_stop_str_in_output", False))
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
    finish_reason: str | None
    request_perf_metrics: RequestPerfMetrics | None = None
    stop_reason: str | int | None = None
    token_ids_diff: list[int] = field(default_factory=list)  # streaming: this step's tokens
    text_diff: str = ""


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


def _load_policy(spec):
    """draft_len_schedule ({batch size: draft length}), 1.2's acceptance_window /
    acceptance_length_threshold and 1.3+'s acceptance_rate_window_size /
    acceptance_rate_threshold, applied by the one loop as upstream's executor applies them."""
    from trtspec.speculative.schedule import LoadPolicy

    if spec is None:
        return None
    fields = spec.fields
    schedule = {int(n): int(k) for n, k in (fields.get("draft_len_schedule") or {}).items()}
    if schedule and schedule.get(1) != fields.get("max_draft_len"):  # upstream's validator
        raise ValueError("draft_len_schedule must contain batch_size=1 with draft_len equal to max_draft_len")
    window, threshold = fields.get("acceptance_window"), fields.get("acceptance_length_threshold")
    switch = (int(window), float(threshold)) if window and threshold is not None else None
    window, threshold = fields.get("acceptance_rate_window_size"), fields.get("acceptance_rate_threshold")
    rate = (int(window), float(threshold)) if window and threshold is not None else None  # window 0: off upstream
    return LoadPolicy.of(schedule or None, switch, rate)


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
        self.head = None
        method = METHOD_OF[spec.decoding_type] if spec is not None else None
        if method == "eagle3":  # 1.2's "Eagle", 1.3+'s "Eagle3"
            head_dir = _local_folder(spec.fields["speculative_model"], "speculative_model")
            self.head = _eagle3_head(head_dir, self.target, dtype, spec.fields.get("eagle3_layers_to_capture"))
        if method == "draft_target":
            draft_dir = _local_folder(spec.fields["speculative_model"], "speculative_model")
            self.draft = _engine(draft_dir, dtype, self.max_seq_len, self.max_batch_size, trust)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(target_dir, trust_remote_code=trust)
        self._lock = threading.Lock()  # one generate at a time, like one executor loop
        self._next_id = 0
        self._policy = _load_policy(spec)

    def generate(self, inputs, sampling_params=None, use_tqdm: bool = False):
        """One RequestOutput per input (a list in, a list out), as upstream's LLM.generate."""
        single = isinstance(inputs, str) or (isinstance(inputs, list) and inputs and isinstance(inputs[0], int))
        batch = [inputs] if single else list(inputs)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(batch)
        params = [p if p is not None else SamplingParams(self.line) for p in params]
        requests = [self._request(prompt, sp) for prompt, sp in zip(batch, params)]
        with self._lock:
            results = self._run(requests)
            outs = [self._output(prompt, req, sp, res) for prompt, req, sp, res in zip(batch, requests, params, results)]
        return outs[0] if single else outs

    def generate_async(self, inputs, sampling_params=None, streaming: bool = False):
        """A result to iterate (streaming: once per step, with token_ids_diff/text_diff) or to
        call .result() on; .abort() stops it at the next step (finish_reason 'cancelled')."""
        sp = sampling_params if sampling_params is not None else SamplingParams(self.line)
        return _AsyncResult(self, inputs, sp, self._request(inputs, sp), streaming)

    def _request(self, prompt, sp: SamplingParams):
        from trtspec.speculative.loop import GenerationRequest

        ids = self.tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else [int(t) for t in prompt]
        self._check(ids, sp.max_tokens)
        end = sp.end_id if sp.end_id is not None else self.tokenizer.eos_token_id
        ends = frozenset() if sp.ignore_eos else frozenset({int(end)})  # upstream: ignore_eos ends on no id
        k = self.speculative_config.fields["max_draft_len"] if self.speculative_config else 0
        return GenerationRequest(ids, sp.max_tokens, k, ends, tuple(w for _, w in self._stops(sp)))

    def _stops(self, sp: SamplingParams) -> list[tuple[str | int, tuple[int, ...]]]:
        """(stop reason, token sequence) pairs, as upstream's _get_stop_reasons_and_words."""
        pairs: list[tuple[str | int, tuple[int, ...]]] = [(int(t), (int(t),)) for t in (sp.stop_token_ids or ())]
        pairs += [(w, tuple(self.tokenizer.encode(w, add_special_tokens=False))) for w in sp.stop]
        return [(r, w) for r, w in pairs if w]

    def _drafter(self):
        from trtspec.speculative.drafters import engine_drafter, make_drafter
        from trtspec.speculative.loop import NoDrafter

        spec = self.speculative_config
        if spec is None:
            return NoDrafter()
        method = METHOD_OF[spec.decoding_type]
        max_ngram = int(spec.fields["max_matching_ngram_size"]) if method == "ngram" else 0
        return make_drafter(
            method,
            max_ngram=max_ngram,
            min_ngram=1,
            # TensorRT-LLM's draft model computes its own K/V: so does the double's
            draft_model=engine_drafter(self.target, self.draft, self.head, draft_kv="own"),
            suffix=self._suffix,
            cache=self._suffix_cache,
        )

    @functools.cached_property
    def _suffix(self):
        """Suffix drafting as the SA config / sa_config asks: the automaton's longest match
        and pool, with trtspec's defaults for what upstream does not set (None: none)."""
        from trtspec.spec import SuffixSpec

        spec = self.speculative_config
        if spec is None:
            return None
        f = spec.fields
        if spec.decoding_type == "SA":
            # upstream's pool when global_pool_size is None: max(64, max_batch_size)
            pool = int(f.get("global_pool_size") or max(64, self.max_batch_size)) if f.get("enable_global_pool") else 0
            return SuffixSpec(cache_responses=pool)
        if isinstance(f.get("sa_config"), dict):
            sa = f["sa_config"]
            keep = SuffixSpec().cache_responses if sa.get("enable_global_pool") else 0
            return SuffixSpec(threshold=int(sa.get("threshold", 4)), cache_responses=keep)
        return None

    @functools.cached_property
    def _suffix_cache(self):
        from trtspec.speculative.drafters import response_cache

        return response_cache(self._suffix)

    def _run(self, requests, on_step=None):
        from trtspec.speculative.loop import generate
        from trtspec.speculative.verifier import LogitsVerifier

        return generate(requests, self._drafter(), LogitsVerifier(self.target.run), on_step, self._policy)

    def _output(self, prompt, req, sp: SamplingParams, res, cancelled: bool = False) -> RequestOutput:
        m = res.metrics
        perf = None
        if sp.return_perf_metrics:
            rate = m.accepted / m.drafted if m.drafted else 0.0
            perf = RequestPerfMetrics(SpeculativeDecodingStats(rate, m.accepted, m.drafted))
        ids, stop_reason = list(res.output_ids), None
        if res.finish_reason == "stop":  # a stop sequence ended it: which one, and cut it?
            for reason, words in self._stops(sp):
                if tuple(ids[-len(words) :]) == words:
                    stop_reason = reason
                    if not sp.include_stop_str_in_output:
                        ids = ids[: -len(words)]
                    break
        reason = "cancelled" if cancelled else ("length" if res.finish_reason == "length" else "stop")
        text = self.tokenizer.decode(ids, skip_special_tokens=sp.skip_special_tokens)
        out = CompletionOutput(0, text, ids, reason, perf, stop_reason)
        self._next_id += 1
        return RequestOutput(self._next_id - 1, prompt if isinstance(prompt, str) else None, req.prompt_ids, [out])

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
        self.target = self.draft = self.head = None


class _Cancelled(Exception):
    pass


class _AsyncResult:
    """generate_async's result: the generation runs in a thread; iterating yields this object
    once per step (streaming) or once at the end, its ``outputs[0]`` updated each time."""

    def __init__(self, llm: LLM, prompt, sp: SamplingParams, request, streaming: bool):
        self._llm, self._sp, self._streaming = llm, sp, streaming
        self._steps: queue.Queue = queue.Queue()
        self._aborted = threading.Event()
        self.request_id = -1
        self.prompt = prompt if isinstance(prompt, str) else None
        self.prompt_token_ids = request.prompt_ids
        self.outputs = [CompletionOutput(0, "", [], None)]
        self.finished = False
        threading.Thread(target=self._work, args=(prompt, request), daemon=True).start()

    def _work(self, prompt, request) -> None:
        def on_step(i, emitted, done):
            if self._aborted.is_set():
                raise _Cancelled
            if self._streaming and not done:
                self._steps.put(("step", list(emitted)))

        try:
            with self._llm._lock:
                try:
                    (res,) = self._llm._run([request], on_step)
                    final = self._llm._output(prompt, request, self._sp, res)
                except _Cancelled:
                    final = None
            self._steps.put(("final", final))
        except Exception as err:  # surfaced to the caller's iteration
            self._steps.put(("error", err))

    def abort(self) -> None:
        self._aborted.set()

    def __iter__(self):
        return self

    def __next__(self):
        if self.finished:
            raise StopIteration
        kind, value = self._steps.get()
        out = self.outputs[0]
        if kind == "error":
            self.finished = True
            raise value
        if kind == "step":
            before = out.text
            out.token_ids = out.token_ids + value
            out.token_ids_diff = value
            out.text = self._llm.tokenizer.decode(out.token_ids, skip_special_tokens=self._sp.skip_special_tokens)
            out.text_diff = out.text[len(before) :] if out.text.startswith(before) else out.text
            return self
        self.finished = True
        if value is None:  # aborted
            out.finish_reason, out.token_ids_diff, out.text_diff = "cancelled", [], ""
            return self
        final = value.outputs[0]
        self.request_id = value.request_id
        final.token_ids_diff = final.token_ids[len(out.token_ids) :]
        final.text_diff = final.text[len(out.text) :] if final.text.startswith(out.text) else final.text
        self.outputs = [final]
        return self

    def result(self):
        for _ in self:
            pass
        return self


def _eagle3_head(folder: Path, target, dtype: str, layers):
    """The head of an EAGLE-3 checkpoint folder beside the target engine, which then captures
    the layers it reads (``eagle3_layers_to_capture``; upstream's default when unset)."""
    import torch
    from safetensors.torch import load_file

    from trtspec.engines.eagle3_checkpoint import default_layer_ids, read_head_config
    from trtspec.engines.torch.eagle3_head import Eagle3Head, HeadEngine

    n_layers = target.config.num_layers
    cfg = read_head_config(folder, n_layers, role="speculative_model")
    if layers:
        want = tuple(sorted(layers))
    elif n_layers == 1:
        want = (0,)
    elif n_layers <= 5:  # upstream has no default for 2-5 layers (Eagle3SpecMetadata.__post_init__)
        raise ValueError("Not enough hidden layers for default EAGLE3 capture; set eagle3_layers_to_capture")
    else:
        want = tuple(default_layer_ids(n_layers))  # (1, L//2-1, L-4), upstream's default
    if want != tuple(cfg.layer_ids):
        raise ValueError(
            f"eagle3_layers_to_capture {list(want)} differs from the layers the head at {folder} reads "
            f"{list(cfg.layer_ids)}; set eagle3_layers_to_capture to the head's layers"
        )
    torch_dtype = target.cache.k[0].dtype if dtype == "auto" else getattr(torch, dtype)
    state: dict = {}
    for f in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(f)))
    state = {k: (v if k == "d2t" else v.to(torch_dtype)) for k, v in state.items() if k != "t2d"}
    head = Eagle3Head.from_state_dict(cfg, state)
    target.capture_features(cfg.layer_ids)
    return HeadEngine(
        head, target.model.model.embed_tokens, target.cos, target.sin, target.max_seq_len, torch_dtype, target.max_batch_size
    )


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

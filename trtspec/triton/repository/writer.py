"""`trtspec repo`: write the Triton model repository for a spec's built engines.

Models (names as in NVIDIA's inflight_batcher_llm repository, so clients work unchanged):

  tensorrt_llm                 target engine, tensorrt_llm tensor contract
  tensorrt_llm_draft           draft engine (method draft_target only; eagle3's head runs in the
                               text endpoints and reads the target model's captured features)
  tensorrt_llm_bls             speculative text endpoint, tensorrt_llm_bls contract, unary
  tensorrt_llm_bls_streaming   the same, decoupled: streams each step (serve.streaming)
  target_only                  target-only control, same contract, no speculation
  ensemble                     upstream clients' default name: one ensemble step into
                               tensorrt_llm_bls_streaming (or tensorrt_llm_bls without streaming)

For the torch backend the engine models are Python-backend models (trtspec.triton.backend.models);
for trtllm they are NVIDIA's tensorrtllm backend (trtspec.triton.repository.trtllm_models) and the
control endpoint calls the baseline `tensorrt_llm_control` engine. Every config.pbtxt is
rendered from typed data and parsed back; model.py files are one-line shims into the package.
The repository is built in a temp folder and renamed into place (a running server is never
shown half a repository). A folder named `triton` is never created: in a working directory
it would shadow OpenAI Triton for torch._dynamo.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from trtspec.engines.manifest import check_manifest
from trtspec.errors import TrtspecError
from trtspec.files import swap_into_place
from trtspec.layout import (
    BLS_MODEL,
    BLS_STREAMING_MODEL,
    CONTROL_MODEL,
    DRAFT_MODEL,
    ENGINE_MODELS,
    ENSEMBLE_MODEL,
    REPO_INFO,
    TARGET_MODEL,
    engine_folder,
    engine_kinds,
    role_of,
    tokenizer_folder,
)
from trtspec.spec import CaptureSpec, LoadedSpec
from trtspec.speculative.llmapi import TENSORRT_LLM
from trtspec.triton.backend import contract
from trtspec.triton.backend.contract import Tensor
from trtspec.triton.backend.params import EngineEndpointParams, load_aware
from trtspec.triton.repository import pbtxt
from trtspec.triton.repository.bounds import smallest_unserved
from trtspec.triton.repository.pbtxt import DynamicBatching, ModelConfig, TensorSpec

ENGINE_SHIM = "from trtspec.triton.backend.models.engine_model import TritonPythonModel  # noqa: F401\n"
ORCHESTRATOR_SHIM = "from trtspec.triton.backend.models.orchestrator import TritonPythonModel  # noqa: F401\n"


def _in(name, dtype, dims=(1,), optional=True, ragged=False) -> TensorSpec:
    return TensorSpec(name, dtype, list(dims), optional=optional, allow_ragged_batch=ragged)


ENGINE_INPUTS = [
    _in("input_ids", "TYPE_INT32", [-1], optional=False, ragged=True),
    _in("input_lengths", "TYPE_INT32", optional=False),
    _in("request_output_len", "TYPE_INT32", optional=False),
    _in("draft_input_ids", "TYPE_INT32", [-1], ragged=True),
    _in("end_id", "TYPE_INT32"),
    _in("pad_id", "TYPE_INT32"),
    _in("streaming", "TYPE_BOOL"),
    _in("exclude_input_in_output", "TYPE_BOOL"),
    _in("return_margins", "TYPE_BOOL"),  # trtspec: top-1 minus top-2 logit per token
    _in("return_generation_logits", "TYPE_BOOL"),  # upstream's name: logits of the scored positions
    # upstream's logits processing inputs (the orchestrator's drafts mirror the request's)
    _in("temperature", "TYPE_FP32"),
    _in("repetition_penalty", "TYPE_FP32"),
    _in("presence_penalty", "TYPE_FP32"),
    _in("frequency_penalty", "TYPE_FP32"),
    _in("min_tokens", "TYPE_INT32"),
    _in("bad_words_list", "TYPE_INT32", [2, -1], ragged=True),
    _in("embedding_bias", "TYPE_FP32", [-1], ragged=True),
    _in("return_perf_metrics", "TYPE_BOOL"),  # upstream: kv_cache_* block counts of the context phase
    _in("draft_tree_parents", "TYPE_INT32", [-1], ragged=True),  # trtspec: the drafts are a draft tree
    _in("return_top_k", "TYPE_INT32"),  # trtspec: candidates at every scored position (tree drafting)
]
ENGINE_OUTPUTS = [
    TensorSpec("output_ids", "TYPE_INT32", [-1, -1]),  # [beam, tokens]
    TensorSpec("sequence_length", "TYPE_INT32", [-1]),  # [beam]
    TensorSpec("output_margins", "TYPE_FP32", [-1, -1]),
    TensorSpec("generation_logits", "TYPE_FP32", [-1, -1, -1]),  # [beam, positions, vocab]
    TensorSpec("kv_cache_alloc_new_blocks", "TYPE_INT32", [1]),
    TensorSpec("kv_cache_reused_blocks", "TYPE_INT32", [1]),
    TensorSpec("kv_cache_alloc_total_blocks", "TYPE_INT32", [1]),
    TensorSpec("top_k_ids", "TYPE_INT32", [-1, -1, -1]),  # [beam, positions, K]
    TensorSpec("top_k_log_probs", "TYPE_FP32", [-1, -1, -1]),
]


def tensor_specs(table: Sequence[Tensor], outputs: bool = False) -> list[TensorSpec]:
    """contract.py's tables as pbtxt TensorSpecs (outputs are never optional or ragged)."""
    return [
        TensorSpec(
            t.name,
            t.data_type,
            list(t.dims),
            optional=t.optional and not outputs,
            reshape=None if t.reshape is None else list(t.reshape),
            allow_ragged_batch=t.ragged,
        )
        for t in table
    ]


BLS_INPUTS = smallest_unserved(tensor_specs(contract.BLS_INPUTS))
BLS_OUTPUTS = tensor_specs(contract.BLS_OUTPUTS, outputs=True)


def ensemble_config(step_model: str, batch: int) -> ModelConfig:
    """Upstream's `ensemble` name and tensors, one step: the text endpoint ``step_model``
    (tokenizing and detokenizing happen inside it, so no pre/postprocessing models)."""
    inputs = smallest_unserved(tensor_specs(contract.ENSEMBLE_INPUTS))
    outputs = tensor_specs(contract.ENSEMBLE_OUTPUTS, outputs=True)
    maps = "".join(f'  input_map {{ key: "{t.name}" value: "{t.name}" }}\n' for t in inputs)
    maps += "".join(f'  output_map {{ key: "{t.name}" value: "{t.name}" }}\n' for t in outputs)
    step = f'ensemble_scheduling {{ step {{\n  model_name: "{step_model}"\n  model_version: -1\n{maps}}} }}\n'
    return ModelConfig(
        name=ENSEMBLE_MODEL, platform="ensemble", max_batch_size=batch, inputs=inputs, outputs=outputs, extra_pbtxt=step
    )


# method eagle3 (trtspec extension): the orchestrator's head asks the target model for the
# features it captured of positions hidden_states_from..input_length-1.
EAGLE3_INPUTS = [_in("hidden_states_from", "TYPE_INT32")]
# serve.capture (trtspec extension): an endpoint sends the target model each answered request
# it chose (prompt + response); the target keeps it from the features and labels it kept while
# serving it (speculative/capture.py).
CAPTURE_INPUTS = [
    _in("capture_request_id", "TYPE_STRING"),
    _in("capture_scope", "TYPE_STRING"),
    _in("capture_prompt_length", "TYPE_INT32"),
]
CAPTURE_OUTPUTS = [TensorSpec("capture_kept", "TYPE_INT32", [1])]
EAGLE3_OUTPUTS = [
    TensorSpec("hidden_states", "TYPE_FP32", [-1, -1]),  # [positions, n_layers * hidden]
    TensorSpec("hidden_states_length", "TYPE_INT32", [1]),  # -1: not cached
]


def _head_layers(engines_dir: Path) -> tuple[int, ...]:
    from trtspec.engines.eagle3_checkpoint import read_head_config

    target = json.loads((engines_dir / "target" / "config.json").read_text())
    return read_head_config(engines_dir / "draft", int(target["num_hidden_layers"])).layer_ids


@dataclass(frozen=True)
class RepoPlan:
    """What write_repository produces: model name -> (config, model.py source or None)."""

    models: dict[str, tuple[ModelConfig, str | None]]
    info: dict
    extra_files: dict[str, str] | None = None  # relative path -> text (llmapi model.yaml)


def _vocab_size(folder: Path) -> int:
    config = json.loads((folder / "config.json").read_text())
    config = config.get("pretrained_config", config)  # trtllm engines nest it
    return int(config["vocab_size"])


# How the text endpoints call each backend's engine models (EngineEndpointParams keywords).
# Torch engine models take a batch of rows in one request and return margins, logits and
# KV-block counts; tensorrtllm models are non-decoupled: one request per row (the in-flight
# batcher merges them), and a TensorRT-LLM target keeps decoding after a rejected draft.
TORCH_ENGINE_CALLS = {"engine_margins": True, "engine_requests": "batched", "engine_continues": False}
TRTLLM_ENGINE_CALLS = {"engine_margins": False, "engine_requests": "per_row", "engine_continues": True}


def plan_repository(loaded: LoadedSpec, engines_dir: Path, llmapi_impl: str = TENSORRT_LLM) -> RepoPlan:
    """Typed configs for every model; EngineError when the engines are missing or stale."""
    spec = loaded.spec
    engines_dir = Path(engines_dir).resolve()
    if spec.backend == "trtllm" and spec.trtllm.runtime == "llmapi":
        return _plan_llmapi(loaded, engines_dir, llmapi_impl)
    for kind in engine_kinds(spec.backend, spec.models()):  # trtllm: target + control engines
        check_manifest(engine_folder(engines_dir, kind), kind, spec.build_hash(role_of(kind)))
    batch = spec.limits("target").max_batch_size
    if spec.backend == "torch":
        vocab = _vocab_size(engines_dir / "target")
        models = _torch_engine_models(loaded, engines_dir, batch, vocab)
        engine = TORCH_ENGINE_CALLS
    else:
        from trtspec.triton.repository.trtllm_models import engine_model_configs

        models = {cfg.name: (cfg, None) for cfg in engine_model_configs(spec, engines_dir)}
        vocab = _vocab_size(engines_dir / "target")
        engine = TRTLLM_ENGINE_CALLS
    models.update(_endpoint_models(loaded, engines_dir, vocab, engine))
    # The streaming endpoint answers stream=false with one response too, so upstream's
    # clients get both behaviours from `ensemble`.
    models[ENSEMBLE_MODEL] = (ensemble_config(BLS_STREAMING_MODEL if spec.serve.streaming else BLS_MODEL, batch), None)
    return RepoPlan(models, _repo_info(loaded, engines_dir, models))


def _plan_llmapi(loaded: LoadedSpec, engines_dir: Path, llmapi_impl: str) -> RepoPlan:
    """Runtime llmapi: the LLM API models (llmapi_models.py) behind the same endpoint names."""
    from trtspec.triton.repository import llmapi_models

    models, extra, _, _ = llmapi_models.plan(
        loaded,
        engines_dir,
        llmapi_impl,
        BLS_INPUTS,
        BLS_OUTPUTS,
        {"bls": BLS_MODEL, "control": CONTROL_MODEL, "streaming": BLS_STREAMING_MODEL},
    )
    return RepoPlan(models, _repo_info(loaded, engines_dir, models, runtime="llmapi", llmapi_impl=llmapi_impl), extra)


def _repo_info(loaded: LoadedSpec, engines_dir: Path, models: Mapping[str, object], **runtime: str) -> dict:
    """The repository's REPO_INFO record (``runtime``: what only some runtimes record)."""
    spec = loaded.spec
    return {
        "spec": spec.name,
        "spec_path": str(loaded.path),
        "engines_dir": str(engines_dir),
        "backend": spec.backend,
        **runtime,
        "serve": spec.serve.model_dump(mode="json"),
        "models": sorted(models),
    }


def _torch_engine_models(
    loaded: LoadedSpec, engines_dir: Path, batch: int, vocab: int
) -> dict[str, tuple[ModelConfig, str | None]]:
    """The torch engines as Python-backend models: target, draft (draft_target) and control."""
    spec = loaded.spec
    has_draft = spec.speculative.model_draft == "draft_target"
    capture = capture_of(loaded)
    models: dict[str, tuple[ModelConfig, str | None]] = {}
    # The control endpoint gets its own copy of the target (own KV cache): verify --url
    # must compare two paths that share no cache state, or a cache bug would pass as
    # "identical". Slots: one per batch row of every orchestrator instance that calls the
    # engine (speculative, plus streaming), so live sequences never evict each other.
    callers = spec.serve.instance_count * (2 if spec.serve.streaming else 1)
    engines = {TARGET_MODEL: ("target", batch * callers)}
    if has_draft:
        engines[DRAFT_MODEL] = ("draft", batch * callers)
    engines[ENGINE_MODELS["control"]] = ("control", batch * spec.serve.instance_count)
    for name, (kind, slots) in engines.items():
        role = role_of(kind)
        params = {
            "engine_dir": str(engine_folder(engines_dir, role)),
            "role": kind,
            "kv_cache_slots": str(slots),
            # the most draft tokens one request scores: the target verifies chains and trees;
            # the draft scores a tree's nodes while growing it (none for chains)
            "max_draft_len": str(_scored_width(spec.speculative, kind)),
            "exclude_input_in_output": "false",
            "enable_kv_cache_reuse": "true",
        }
        if kind == "draft":
            params["vocab_limit"] = str(min(vocab, _vocab_size(engines_dir / "draft")))
        inputs, outputs = ENGINE_INPUTS, ENGINE_OUTPUTS
        if spec.speculative.model_draft == "eagle3":  # the target answers the head's feature requests
            params["capture_layers"] = ",".join(str(i) for i in _head_layers(engines_dir))
            inputs, outputs = ENGINE_INPUTS + EAGLE3_INPUTS, ENGINE_OUTPUTS + EAGLE3_OUTPUTS
            if kind == "target" and capture is not None:
                params["capture"] = json.dumps(capture.model_dump(), sort_keys=True)
                inputs, outputs = inputs + CAPTURE_INPUTS, outputs + CAPTURE_OUTPUTS
        cfg = ModelConfig(
            name=name,
            backend="python",
            max_batch_size=spec.limits(role).max_batch_size,
            inputs=inputs,
            outputs=outputs,
            parameters=params,
            instance_count=1,
            # Each calling endpoint instance waits on one engine call at a time, so a queue of
            # one request per caller holds every legitimate call; beyond it (a client calling
            # the engine model directly) Triton answers UNAVAILABLE instead of queueing.
            dynamic_batching=DynamicBatching(max_queue_delay_microseconds=0, max_queue_size=slots // batch),
        )
        models[name] = (cfg, ENGINE_SHIM)
    return models


def capture_of(loaded: LoadedSpec) -> CaptureSpec | None:
    """serve.capture with its folder made absolute (the models do not know the spec's folder)."""
    c = loaded.spec.serve.capture
    return None if c is None else c.model_copy(update={"dir": str(loaded.capture_dir())})


def _scored_width(speculative, kind: str) -> int:
    if kind == "target":
        return speculative.verify_width
    if kind == "draft" and speculative.tree is not None:
        return speculative.tree.grown_nodes(speculative.max_draft_len)
    return 0


def _endpoint_models(
    loaded: LoadedSpec, engines_dir: Path, vocab: int, engine: Mapping[str, object]
) -> dict[str, tuple[ModelConfig, str | None]]:
    """The text endpoints (orchestrator models): speculative, target-only control, streaming."""
    spec = loaded.spec
    limits = spec.limits("target")
    batch = limits.max_batch_size
    has_draft = spec.speculative.model_draft == "draft_target"
    head = spec.speculative.model_draft == "eagle3"  # runs in the orchestrator (method eagle3, or auto listing it)
    models: dict[str, tuple[ModelConfig, str | None]] = {}
    endpoints = {BLS_MODEL: ("speculative", False), CONTROL_MODEL: ("target_only", False)}
    if spec.serve.streaming:
        endpoints[BLS_STREAMING_MODEL] = ("speculative", True)
    for name, (mode, decoupled) in endpoints.items():
        params = EngineEndpointParams(
            **EngineEndpointParams.from_spec(spec, mode, vocab, tokenizer_folder(engines_dir, spec.backend)),
            target_model=ENGINE_MODELS["control"] if mode == "target_only" else TARGET_MODEL,
            draft_model=DRAFT_MODEL if has_draft else None,
            max_ngram=spec.speculative.max_ngram,
            min_ngram=spec.speculative.min_ngram,
            suffix=spec.speculative.suffix_drafting if mode == "speculative" else None,
            tree=spec.speculative.tree if mode == "speculative" else None,
            max_response_mb=spec.serve.max_response_mb,  # contract.check_response_size
            eagle3_head_dir=str(engines_dir / "draft") if head else None,
            eagle3_target_dir=str(engines_dir / "target") if head else None,
            capture=capture_of(loaded) if mode == "speculative" else None,
            **engine,
            **(load_aware(spec.speculative) if mode == "speculative" else {}),
        )
        cfg = ModelConfig(
            name=name,
            backend="python",
            max_batch_size=batch,
            inputs=BLS_INPUTS,
            outputs=BLS_OUTPUTS,
            parameters=params.to_params(),
            instance_count=spec.serve.instance_count,
            decoupled=decoupled,
            # The control answers inside execute(), so Triton's queue is where its requests
            # wait; the speculative endpoints' execute() returns at once and their scheduler
            # bounds the queue (a Triton bound too would refuse a burst that has free places).
            dynamic_batching=DynamicBatching(
                max_queue_delay_microseconds=0, max_queue_size=spec.serve.max_queue if mode == "target_only" else None
            ),
        )
        models[name] = (cfg, ORCHESTRATOR_SHIM)
    return models


def write_repository(loaded: LoadedSpec, engines_dir: Path, repo_dir: Path, llmapi_impl: str = TENSORRT_LLM) -> Path:
    """Write the repository atomically (temp folder + rename); return its path."""
    plan = plan_repository(loaded, engines_dir, llmapi_impl)
    repo_dir = Path(repo_dir).resolve()
    if repo_dir.name == "triton":
        raise TrtspecError("do not name the repository folder `triton`: it breaks `import torch._dynamo`; pick another name")
    if repo_dir.exists() and not (repo_dir / REPO_INFO).is_file() and any(repo_dir.iterdir()):
        raise TrtspecError(f"{repo_dir} exists and is not a trtspec model repository; choose another folder with -o")
    repo_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{repo_dir.name}.tmp-", dir=repo_dir.parent))
    try:
        for name, (cfg, source) in plan.models.items():
            pbtxt.write(cfg, tmp / name / "config.pbtxt")
            (tmp / name / "1").mkdir(parents=True, exist_ok=True)
            if source is not None:
                (tmp / name / "1" / "model.py").write_text(source)
        for rel, text in (plan.extra_files or {}).items():
            (tmp / rel).write_text(text)
        (tmp / REPO_INFO).write_text(json.dumps(plan.info, indent=2) + "\n")
        swap_into_place(tmp, repo_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return repo_dir


def read_repo_info(repo_dir: Path) -> dict | None:
    path = Path(repo_dir) / REPO_INFO
    return json.loads(path.read_text()) if path.is_file() else None

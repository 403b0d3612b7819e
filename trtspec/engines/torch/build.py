"""Torch backend of `trtspec build`: cast a checkpoint to the engine dtype (its Linears
weight-only quantized when the spec says so: quant.py) and save it as a torch engine folder
(weights, config, tokenizer) for the neutral build to finish."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

from trtspec import console
from trtspec.checkpoints import Checkpoint
from trtspec.device import resolve
from trtspec.engines.build import BuildPlan, finish_torch_engine
from trtspec.engines.manifest import read_manifest, write_manifest
from trtspec.engines.torch.engine import DTYPES, WEIGHTS
from trtspec.engines.torch.gguf_blocks import read_q4_1
from trtspec.engines.torch.model import SUPPORTED_MODEL_TYPES, DecoderConfig, DecoderLM
from trtspec.engines.torch.quant import linear_names, quantize_state, scheme_of, unsupported_shape
from trtspec.errors import CheckpointError
from trtspec.spec import LoadedSpec


class TorchBackend:
    name = "torch"

    def check_model(self, loaded: LoadedSpec, role: str, hf_config) -> None:
        if hf_config.model_type not in SUPPORTED_MODEL_TYPES:
            raise CheckpointError(
                f"{role}: model_type '{hf_config.model_type}' is not supported by the torch "
                f"backend (supported: {', '.join(SUPPORTED_MODEL_TYPES)}); use one of those "
                "families or backend: trtllm"
            )

    def dry_run(self, loaded: LoadedSpec, plan: BuildPlan) -> BuildPlan:
        return plan

    def build(self, loaded: LoadedSpec, checkpoints: dict[str, Checkpoint], plan: BuildPlan) -> None:
        for unit in plan.units:
            head = unit.role == "draft" and loaded.spec.speculative.model_draft == "eagle3"  # eagle3, or auto listing it
            if unit.needs_build and head:
                from trtspec.engines.torch.eagle3_build import build_head_engine

                build_head_engine(loaded, checkpoints["draft"], unit.folders["draft"])
            elif unit.needs_build:
                build_torch_engine(loaded, checkpoints[unit.role], unit.folders[unit.role])
            if not head and resolve(loaded.spec.device).type == "cpu":
                compile_for_this_machine(unit.role, unit.folders[unit.role])


BACKEND = TorchBackend()


def compile_for_this_machine(role: str, folder: Path) -> None:
    """The engine's kernel and compiled-step choices made on this machine (measured, compiled
    into inductor's cache, cached) and recorded in its manifest; a no-op when the manifest
    records this machine's already, or with TRTSPEC_COMPILE=0."""
    from trtspec.engines.torch.compiled import COMPILE_ENV, machine_record
    from trtspec.engines.torch.engine import TorchEngine

    if os.environ.get(COMPILE_ENV, "auto").strip() == "0":
        return
    manifest = read_manifest(folder)
    key, machine = machine_record()
    if key in manifest.programs:
        return
    with console.step(f"{role}: compiling the step for this machine ({machine})"):
        # two slots: the slot count is then a dynamic size, and the programs compiled here are the
        # ones every later load finds in inductor's cache, a server's at each thread count
        engine = TorchEngine.load(folder, slots=2)
        engine.warm_programs()
        choice = engine.programs
        record = {"machine": machine, "one": choice.one, "many": choice.many, "source": choice.source, "reason": choice.reason}
        record["compile_seconds"] = round(float(sum(engine.program.compiled_kinds.values())), 1) if engine.program else 0.0
        write_manifest(folder, manifest.model_copy(update={"programs": {**manifest.programs, key: record}}))
    console.info(f"{role}: step {choice.summary()}")


def build_torch_engine(loaded: LoadedSpec, ckpt: Checkpoint, folder: Path) -> None:
    """Cast the checkpoint to the engine dtype and save it as a torch engine folder."""
    from safetensors.torch import save_file

    role = ckpt.role
    hf_config = ckpt.hf_config()
    BACKEND.check_model(loaded, role, hf_config)
    tmp = Path(tempfile.mkdtemp(prefix=f".{role}.tmp-", dir=folder.parent))
    try:
        with console.step(f"{role}: loading {ckpt.model.source_id}"):
            state = ckpt.load_state_dict()
            cfg = DecoderConfig.from_hf(hf_config)
            dtype = DTYPES[ckpt.model.dtype]
            expected = _expected_keys(cfg, state)
            source = {k: v for k, v in state.items() if k in expected}
            state = {k: v.to(dtype).contiguous() for k, v in source.items()}
            try:
                model = DecoderLM.from_state_dict(cfg, state)  # strict: every tensor, right shapes
            except (KeyError, RuntimeError) as e:
                raise CheckpointError(
                    f"{role}: the checkpoint's tensors do not fit a {hf_config.model_type} model "
                    f"({str(e).splitlines()[0][:200]}); is config.json from the same checkpoint?"
                ) from e
        # Tied embeddings are stored once, as in the source checkpoint.
        if cfg.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        parameters = sum(t.numel() for t in state.values())
        quantization = ckpt.model.quantization
        if quantization != "none":
            with console.step(f"{role}: quantizing ({quantization})"):
                state = weight_only_state(ckpt, hf_config, model, source, state)
        with console.step(
            f"{role}: writing {ckpt.model.dtype} engine" + (f" ({quantization})" if quantization != "none" else "")
        ):
            save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt"})
            hf_config.dtype = ckpt.model.dtype
            hf_config.save_pretrained(tmp)
            finish_torch_engine(loaded, ckpt, role, tmp, folder, state, parameters=parameters)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def weight_only_state(ckpt: Checkpoint, hf_config, model: DecoderLM, source: dict, state: dict) -> dict:
    """The engine's ``state`` with every Linear stored as the spec's weight-only quantization
    (quant.py), quantized from the ``source`` (checkpoint-precision) weights, or for int4_wo
    from a GGUF source, its Q4_1 blocks as they are: checked here to reproduce the
    checkpoint's float weights bit for bit, so a wrong name or row order cannot slip in."""
    role, quantization = ckpt.role, ckpt.model.quantization
    names = linear_names(model)
    for name in names:
        linear = model.get_submodule(name)
        why = unsupported_shape(scheme_of(name, quantization), linear.out_features, linear.in_features)
        if why is not None:
            raise CheckpointError(f"{role}.quantization: {name}: {why}; use int8_wo or quantization: none")
    exact = {}
    if quantization == "int4_wo" and ckpt.gguf is not None:
        exact = read_q4_1(ckpt.gguf, hf_config)
        for name, weight in exact.items():
            if not torch.equal(weight.dequantize(), source[f"{name}.weight"].float()):
                raise CheckpointError(
                    f"{role}: the Q4_1 blocks of {name} in {ckpt.gguf.name} do not reproduce the weights "
                    "transformers read from it; set quantization: int8_wo or none for this GGUF"
                )
    weights = {f"{name}.weight": source.get(f"{name}.weight", source["model.embed_tokens.weight"]) for name in names}
    return quantize_state(names, state | weights, quantization, DTYPES[ckpt.model.dtype], exact)


def _expected_keys(cfg: DecoderConfig, state: dict) -> set[str]:
    """Parameter names of the decoder (extra buffers such as rotary inv_freq are dropped)."""
    import torch

    qkv_bias = "model.layers.0.self_attn.q_proj.bias" in state
    o_bias = "model.layers.0.self_attn.o_proj.bias" in state
    mlp_bias = "model.layers.0.mlp.gate_proj.bias" in state
    with torch.device("meta"):
        return set(DecoderLM(cfg, qkv_bias, o_bias, mlp_bias).state_dict())

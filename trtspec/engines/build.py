"""`trtspec build`: turn a spec's checkpoints into one engine folder per role.

Each role is built in a hidden temp folder beside its destination, the manifest is written
last, and the folder is renamed into place; an interrupted build leaves nothing that loads.
A role whose manifest already matches the spec and the source weights is left alone.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from trtspec import console
from trtspec.checkpoints import Checkpoint, check_embedding_rows, require_shared_tokenizer, resolve
from trtspec.engines.manifest import (
    Manifest,
    SourceRecord,
    file_record,
    now,
    read_manifest,
    versions,
    write_manifest,
)
from trtspec.engines.model import SUPPORTED_MODEL_TYPES, DecoderConfig, DecoderLM
from trtspec.engines.torch_engine import DTYPES, WEIGHTS
from trtspec.errors import CheckpointError, EngineError, TrtspecError
from trtspec.spec import LoadedSpec


@dataclass
class RolePlan:
    role: str
    source: str
    dtype: str
    folder: Path
    action: str  # "build", "rebuild", "up to date"


@dataclass
class BuildResult:
    output_dir: Path
    plans: list[RolePlan] = field(default_factory=list)

    @property
    def built(self) -> list[str]:
        return [p.role for p in self.plans if p.action != "up to date"]


def plan(loaded: LoadedSpec, output_dir: Path, force: bool = False) -> list[RolePlan]:
    """What build would do, from the spec and existing manifests only (reads no weights)."""
    plans = []
    for role, model in loaded.spec.models().items():
        folder = output_dir / role
        action = "build"
        if folder.exists():
            action = "rebuild"
            if not force:
                try:
                    manifest = read_manifest(folder)
                    if manifest.spec_hash == loaded.spec.build_hash(role):
                        action = "up to date?"  # confirmed against source hashes in build()
                except EngineError:
                    pass
        plans.append(RolePlan(role, model.source_id, model.dtype, folder, action))
    return plans


def ensure_writable(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise TrtspecError(
            f"output folder {folder} is not writable ({e.strerror}); pass --output DIR "
            "or fix its permissions"
        ) from e


def build(
    loaded: LoadedSpec,
    output_dir: Path,
    force: bool = False,
    allow_pickle: bool = False,
) -> BuildResult:
    spec = loaded.spec
    if spec.backend != "torch":
        from trtspec.engines.trtllm import build as trtllm_build

        return trtllm_build.build(loaded, output_dir, force=force, allow_pickle=allow_pickle)
    ensure_writable(output_dir)
    remove_stale_temps(output_dir)
    with console.step("resolving checkpoints"):
        checkpoints = {role: resolve(loaded, role, allow_pickle) for role in spec.models()}
    with console.step("checking draft/target compatibility"):
        check_pair(checkpoints)
    result = BuildResult(output_dir)
    for p in plan(loaded, output_dir, force):
        ckpt = checkpoints[p.role]
        if p.action == "up to date?":
            if _sources_match(p.folder, ckpt):
                p.action = "up to date"
                console.info(f"{p.role}: {p.folder} is up to date (same spec and weights); "
                             "nothing to do (use --force to rebuild)")
                result.plans.append(p)
                continue
            p.action = "rebuild"
        build_torch_engine(loaded, ckpt, p.folder)
        result.plans.append(p)
    return result


def check_pair(checkpoints: dict[str, Checkpoint]) -> None:
    """Supported architecture, consistent embeddings, and one shared tokenizer."""
    toks = {}
    for role, ckpt in checkpoints.items():
        cfg = ckpt.hf_config()
        toks[role] = ckpt.tokenizer()
        check_embedding_rows(role, cfg, toks[role])
    if "draft" in toks:
        require_shared_tokenizer(toks["target"], toks["draft"])


def check_torch_architecture(role: str, hf_config) -> None:
    if hf_config.model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"{role}: model_type '{hf_config.model_type}' is not supported by the torch "
            f"backend (supported: {', '.join(SUPPORTED_MODEL_TYPES)}); use one of those "
            "families or backend: trtllm"
        )


def _sources_match(folder: Path, ckpt: Checkpoint) -> bool:
    manifest = read_manifest(folder)
    return manifest.source.weights == ckpt.source_weights


def remove_stale_temps(output_dir: Path) -> None:
    for stale in output_dir.glob(".*.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)


def build_torch_engine(loaded: LoadedSpec, ckpt: Checkpoint, folder: Path) -> Manifest:
    """Cast the checkpoint to the engine dtype and save it as a torch engine folder."""
    from safetensors.torch import save_file

    spec, role = loaded.spec, ckpt.role
    hf_config = ckpt.hf_config()
    check_torch_architecture(role, hf_config)
    tmp = Path(tempfile.mkdtemp(prefix=f".{role}.tmp-", dir=folder.parent))
    try:
        with console.step(f"{role}: loading {ckpt.model.source_id}"):
            state = ckpt.load_state_dict()
            cfg = DecoderConfig.from_hf(hf_config)
            dtype = DTYPES[ckpt.model.dtype]
            expected = _expected_keys(cfg, state)
            state = {k: v.to(dtype).contiguous() for k, v in state.items() if k in expected}
            try:
                DecoderLM.from_state_dict(cfg, state)  # strict: every tensor, right shapes
            except (KeyError, RuntimeError) as e:
                raise CheckpointError(
                    f"{role}: the checkpoint's tensors do not fit a {hf_config.model_type} model "
                    f"({str(e).splitlines()[0][:200]}); is config.json from the same checkpoint?"
                ) from e
        with console.step(f"{role}: writing {ckpt.model.dtype} engine"):
            # Tied embeddings are stored once, as in the source checkpoint.
            if cfg.tie_word_embeddings:
                state.pop("lm_head.weight", None)
            save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt"})
            hf_config.dtype = ckpt.model.dtype
            hf_config.save_pretrained(tmp)
            ckpt.tokenizer().save_pretrained(tmp)
            gen = ckpt.folder / "generation_config.json"
            if gen.is_file():
                shutil.copy2(gen, tmp / "generation_config.json")
            files = {
                str(p.relative_to(tmp)): file_record(p)
                for p in sorted(tmp.rglob("*"))
                if p.is_file()
            }
            manifest = Manifest(
                complete=True,
                name=spec.name,
                role=role,
                backend="torch",
                spec_hash=spec.build_hash(role),
                dtype=ckpt.model.dtype,
                max_draft_len=spec.speculative.max_draft_len,
                limits=spec.limits(role).model_dump(),
                model_type=hf_config.model_type,
                architecture=(hf_config.architectures or [type(hf_config).__name__])[0],
                parameters=sum(t.numel() for t in state.values()),
                source=SourceRecord(
                    id=ckpt.model.source_id,
                    revision=ckpt.model.revision,
                    gguf_file=ckpt.model.gguf_file,
                    weights=ckpt.source_weights,
                ),
                files=files,
                versions=versions(),
                created=now(),
            )
            write_manifest(tmp, manifest)
            swap_into_place(tmp, folder)
        return manifest
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _expected_keys(cfg: DecoderConfig, state: dict) -> set[str]:
    """Parameter names of the decoder (extra buffers such as rotary inv_freq are dropped)."""
    qkv_bias = "model.layers.0.self_attn.q_proj.bias" in state
    o_bias = "model.layers.0.self_attn.o_proj.bias" in state
    mlp_bias = "model.layers.0.mlp.gate_proj.bias" in state
    import torch

    with torch.device("meta"):
        names = set(DecoderLM(cfg, qkv_bias, o_bias, mlp_bias).state_dict())
    return names


def swap_into_place(tmp: Path, folder: Path) -> None:
    """Rename the finished build over the destination; the old one goes only after."""
    if folder.exists():
        old = folder.with_name(f".{folder.name}.tmp-old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(folder, old)
        os.replace(tmp, folder)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, folder)

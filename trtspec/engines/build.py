"""`trtspec build`, backend-neutral: plan, reconcile, build each unit, finish each engine.

A unit is one spec role and the engines built from it (layout.KINDS_OF_ROLE: the trtllm
target unit also makes the control engine). The plan reads only the spec and existing
manifests; reconciling it against the resolved checkpoints' source hashes says which units
are really up to date. Backends (engines/torch, engines/trtllm) build the rest; every engine
is finished here the same way: tokenizer, manifest last, temp folder renamed into place, so
an interrupted build leaves nothing that loads.
"""

from __future__ import annotations

import importlib
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Protocol

from trtspec import console
from trtspec.checkpoints import Checkpoint, check_embedding_rows, require_shared_tokenizer, resolve
from trtspec.device import place
from trtspec.engines.manifest import Manifest, SourceRecord, now, read_manifest, versions, write_manifest
from trtspec.errors import EngineError
from trtspec.files import file_record, remove_stale_temps, swap_into_place, writable_folder
from trtspec.layout import KINDS_OF_ROLE, EngineKind, engine_folder, role_of
from trtspec.spec import LoadedSpec


class BuildState(str, Enum):
    """What a build does to a unit."""

    BUILD = "build"  # nothing there yet
    REBUILD = "rebuild"  # there, but stale, broken or --force
    CHECK_SOURCES = "up to date unless the source weights changed"  # manifests match the spec
    UP_TO_DATE = "up to date"  # manifests match the spec and the source weights


@dataclass
class UnitPlan:
    role: str
    source: str
    dtype: str
    folders: dict[EngineKind, Path]  # engine kind -> its folder
    state: BuildState

    @property
    def needs_build(self) -> bool:
        return self.state in (BuildState.BUILD, BuildState.REBUILD)


@dataclass
class BuildPlan:
    """What `trtspec build` will do; ``details`` and ``commands`` come from the backend."""

    name: str
    backend: str
    output_dir: Path
    units: list[UnitPlan]
    details: dict[str, str] = field(default_factory=dict)  # role -> backend's description
    notes: list[str] = field(default_factory=list)
    commands: list[tuple[str, str]] = field(default_factory=list)  # (step, shell command line)
    header: str = ""
    footer: str = "dry run: nothing written"

    def lines(self) -> list[str]:
        """The dry run as printed."""
        out = [self.header or f"plan for {self.name} (backend {self.backend}) -> {self.output_dir}"]
        for u in self.units:
            where = " + ".join(str(f) for f in u.folders.values())
            detail = self.details.get(u.role, f"{u.source} as {u.dtype}")
            out.append(f"  {u.role}: {detail} -> {where}  [{u.state.value}]")
        out += [f"  {note}" for note in self.notes]
        for i, (step, line) in enumerate(self.commands, 1):
            out += [f"[{i}/{len(self.commands)}] {step}", f"  {line}"]
        out.append(self.footer)
        return out

    def to_dict(self) -> dict:
        return {
            "spec": self.name,
            "backend": self.backend,
            "output_dir": str(self.output_dir),
            "units": [
                {
                    "role": u.role,
                    "source": u.source,
                    "dtype": u.dtype,
                    "state": u.state.value,
                    "engines": {k: str(f) for k, f in u.folders.items()},
                }
                for u in self.units
            ],
            "commands": [{"step": s, "command": c} for s, c in self.commands],
            "written": False,
        }


@dataclass
class BuildResult:
    output_dir: Path
    units: list[UnitPlan] = field(default_factory=list)

    @property
    def built(self) -> list[str]:
        """Engine kinds (re)built, in build order."""
        return [kind for u in self.units if u.state != BuildState.UP_TO_DATE for kind in u.folders]

    def to_dict(self) -> dict:
        return {
            "output_dir": str(self.output_dir),
            "built": self.built,
            "up_to_date": [k for u in self.units if u.state == BuildState.UP_TO_DATE for k in u.folders],
        }


class EngineBackend(Protocol):
    """What a backend provides to the neutral build: a model check and a build of units."""

    def check_model(self, loaded: LoadedSpec, role: str, hf_config) -> None:
        """CheckpointError/TrtspecError when the backend cannot build this model."""

    def dry_run(self, loaded: LoadedSpec, plan: BuildPlan) -> BuildPlan:
        """Add the backend's details and commands to the plan; reads no weights."""

    def build(self, loaded: LoadedSpec, checkpoints: dict[str, Checkpoint], plan: BuildPlan) -> None:
        """Build every unit that needs it, finishing each engine with finish_engine."""


_BACKENDS = {"torch": "trtspec.engines.torch.build", "trtllm": "trtspec.engines.trtllm.build"}
# trtllm.runtime llmapi compiles nothing: it writes LLM API argument files (own build()).
_LLMAPI = "trtspec.engines.trtllm.llmapi"


def _llmapi(loaded: LoadedSpec):
    """The llmapi build module when the spec uses trtllm.runtime llmapi, else None."""
    spec = loaded.spec
    if spec.backend == "trtllm" and spec.trtllm.runtime == "llmapi":
        return importlib.import_module(_LLMAPI)
    return None


def backend_for(name: str) -> EngineBackend:
    """The backend module's BACKEND (imported on demand: trtllm needs no torch at plan time)."""
    return importlib.import_module(_BACKENDS[name]).BACKEND


# -------------------------------------------------------------------------------- planning


def plan(loaded: LoadedSpec, output_dir: Path, force: bool = False) -> BuildPlan:
    """What build would do, from the spec and existing manifests only (reads no weights)."""
    spec = loaded.spec
    units = []
    for role, model in spec.models().items():
        folders = {kind: engine_folder(output_dir, kind) for kind in KINDS_OF_ROLE[spec.backend][role]}
        units.append(UnitPlan(role, model.source_id, model.dtype, folders, _state(loaded, role, folders, force)))
    return BuildPlan(spec.name, spec.backend, output_dir, units)


def _state(loaded: LoadedSpec, role: str, folders: dict[EngineKind, Path], force: bool) -> BuildState:
    if not any(f.exists() for f in folders.values()):
        return BuildState.BUILD
    if force:
        return BuildState.REBUILD
    want = loaded.spec.build_hash(role)
    for kind, folder in folders.items():
        try:
            m = read_manifest(folder)
        except EngineError:
            return BuildState.REBUILD
        if m.spec_hash != want or m.role != kind:
            return BuildState.REBUILD
    return BuildState.CHECK_SOURCES


def reconcile(plan: BuildPlan, checkpoints: dict[str, Checkpoint]) -> None:
    """Settle CHECK_SOURCES units against the resolved source weights' hashes."""
    for unit in plan.units:
        if unit.state != BuildState.CHECK_SOURCES:
            continue
        same = all(read_manifest(f).source.weights == checkpoints[unit.role].source_weights for f in unit.folders.values())
        if same:
            unit.state = BuildState.UP_TO_DATE
            where = ", ".join(str(f) for f in unit.folders.values())
            console.info(f"{unit.role}: {where} is up to date (same spec and weights); nothing to do (use --force to rebuild)")
        else:
            unit.state = BuildState.REBUILD


def dry_run(loaded: LoadedSpec, output_dir: Path, force: bool = False) -> BuildPlan:
    """The plan with the backend's details; checks what it can and writes nothing."""
    if (llmapi := _llmapi(loaded)) is not None:
        return llmapi.dry_run(loaded, output_dir, force)
    return backend_for(loaded.spec.backend).dry_run(loaded, plan(loaded, output_dir, force))


# -------------------------------------------------------------------------------- building


def check_pair(checkpoints: dict[str, Checkpoint], method: str = "draft_target") -> None:
    """Consistent embeddings, and one shared tokenizer; an EAGLE-3 head made for the target."""
    toks = {}
    for role, ckpt in checkpoints.items():
        if role == "draft" and method == "eagle3":
            from trtspec.engines.eagle3_checkpoint import check_head_checkpoint

            check_head_checkpoint(checkpoints["target"], ckpt)  # a head has no tokenizer
            continue
        toks[role] = ckpt.tokenizer()
        check_embedding_rows(role, ckpt.hf_config(), toks[role])
    if "draft" in toks:
        require_shared_tokenizer(toks["target"], toks["draft"])


def resolve_pair(loaded: LoadedSpec, allow_pickle: bool = False, roles=None) -> dict[str, Checkpoint]:
    """Resolve both checkpoints (or only ``roles``) and check that they make a pair. An EAGLE-3
    head built alone (`trtspec refresh`) is still checked against the target it drafts for."""
    method = loaded.spec.speculative.model_draft or loaded.spec.speculative.method
    needed = set(loaded.spec.models() if roles is None else roles)
    if method == "eagle3" and "draft" in needed:
        needed.add("target")
    with console.step("resolving checkpoints"):
        checkpoints = {role: resolve(loaded, role, allow_pickle) for role in loaded.spec.models() if role in needed}
    with console.step("checking draft/target compatibility"):
        check_pair(checkpoints, method)
    return {role: c for role, c in checkpoints.items() if roles is None or role in roles}


def build(loaded: LoadedSpec, output_dir: Path, force: bool = False, allow_pickle: bool = False, roles=None) -> BuildResult:
    """Build every role of the spec, or only ``roles`` (distill builds the target alone)."""
    if (llmapi := _llmapi(loaded)) is not None:
        return llmapi.build(loaded, output_dir, force=force, allow_pickle=allow_pickle)
    backend = backend_for(loaded.spec.backend)
    if loaded.spec.backend == "torch":
        # The folders are the same on every device; refusing here (a CPU-only torch asked for
        # cuda, bfloat16 on a pre-Ampere GPU) saves building what would not load there.
        place(loaded.spec.device, {role: m.dtype for role, m in loaded.spec.models().items()})
    prepare: Callable[[], None] | None = getattr(backend, "prepare", None)
    if prepare is not None:  # e.g. trtllm: refuse at once where tensorrt_llm is missing
        prepare()
    with writable_folder(output_dir):  # a refused build leaves no empty folder behind
        remove_stale_temps(output_dir)
        checkpoints = resolve_pair(loaded, allow_pickle, roles)
        the_plan = plan(loaded, output_dir, force)
        the_plan.units = [u for u in the_plan.units if u.role in checkpoints]
        reconcile(the_plan, checkpoints)
        backend.build(loaded, checkpoints, the_plan)
    return BuildResult(output_dir, the_plan.units)


def finish_engine(
    loaded: LoadedSpec,
    ckpt: Checkpoint,
    kind: str,
    tmp: Path,
    folder: Path,
    *,
    backend: str,
    parameters: int,
    versions: dict[str, str],
    max_draft_len: int,
    tokenizer_dir: str | None = "",
    commands: list[list[str]] | None = None,
    swap: bool = True,
) -> Manifest:
    """Add the tokenizer (under ``tokenizer_dir``; None: the engine has none, as an EAGLE-3
    head) and generation_config.json, record every
    file in the manifest (written last) and rename the temp folder into place (``swap=False``:
    the caller swaps a unit of engines at once)."""
    spec, model = loaded.spec, ckpt.model
    if tokenizer_dir is not None:
        ckpt.tokenizer().save_pretrained(tmp / tokenizer_dir)
    gen = ckpt.folder / "generation_config.json"
    if tokenizer_dir is not None and gen.is_file():
        shutil.copy2(gen, tmp / "generation_config.json")
    cfg = ckpt.hf_config()
    role = role_of(kind)
    files = {str(p.relative_to(tmp)): file_record(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
    manifest = Manifest(
        complete=True,
        name=spec.name,
        role=kind,
        backend=backend,
        spec_hash=spec.build_hash(role),
        dtype=model.dtype,
        quantization=model.quantization,
        max_draft_len=max_draft_len,
        limits=spec.limits(role).model_dump(),
        model_type=cfg.model_type,
        architecture=(cfg.architectures or [cfg.model_type])[0],
        parameters=parameters,
        source=SourceRecord(id=model.source_id, revision=model.revision, gguf_file=model.gguf_file, weights=ckpt.source_weights),
        files=files,
        versions=versions,
        commands=commands or [],
        created=now(),
    )
    write_manifest(tmp, manifest)
    if swap:
        swap_into_place(tmp, folder)
    return manifest


def finish_torch_engine(
    loaded: LoadedSpec, ckpt: Checkpoint, role: str, tmp: Path, folder: Path, state: dict, parameters: int | None = None, **extra
) -> None:
    """finish_engine for a torch engine folder whose weights are ``state`` (a state dict);
    ``parameters``: the model's count where the state's tensors are not one number a weight
    (quantized codes)."""
    finish_engine(
        loaded,
        ckpt,
        role,
        tmp,
        folder,
        backend="torch",
        parameters=parameters if parameters is not None else sum(t.numel() for t in state.values()),
        versions=versions(),
        max_draft_len=loaded.spec.speculative.max_draft_len,
        **extra,
    )

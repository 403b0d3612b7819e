"""`trtspec build` for backend trtllm: convert, build target/control/draft engines, record.

Layout under the output folder::

    target/   speculative target engine (draft_tokens_external), tokenizer/, manifest.json
    control/  the same target without speculative flags: what verify compares against
    draft/    the draft engine
    trtllm-build.log   every step's output, streamed as it runs

Each engine is written to ``.<kind>.tmp-build`` and renamed into place after its manifest;
converted checkpoints go to ``.checkpoints.tmp-build`` and are deleted at the end. The temp
names are fixed so that ``--dry-run`` prints exactly the commands a build runs (the manifest
records them). A unit whose manifests match the spec and the source weights is skipped.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import platform
import shlex
import shutil
import subprocess
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from rich.markup import escape
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from trtspec import __version__, console
from trtspec.checkpoints import Checkpoint, parameter_count, require_shared_tokenizer, resolve
from trtspec.engines.build import (
    BuildResult,
    RolePlan,
    remove_stale_temps,
    swap_into_place,
    check_pair,
    ensure_writable,
)
from trtspec.engines.manifest import Manifest, SourceRecord, file_record, now, read_manifest, write_manifest
from trtspec.engines.trtllm.checks import check_model
from trtspec.engines.trtllm.commands import Command, EngineKind, Layout, plan_commands
from trtspec.engines.trtllm.families import (
    EXAMPLES_ENV,
    TRITON_CONTAINER,
    TRTLLM_RELEASE,
    TRTLLM_SERIES,
    Family,
    examples_dir,
)
from trtspec.errors import CheckpointError, EngineError, RuntimeFailure
from trtspec.spec import LoadedSpec

LOG_NAME = "trtllm-build.log"
TMP_SUFFIX = ".tmp-build"
UNIT_ENGINES: dict[str, tuple[EngineKind, ...]] = {"target": ("target", "control"), "draft": ("draft",)}
_LOG_TAIL = 25


@dataclass
class Plan:
    """What a trtllm build of a spec will do (from configs and manifests; no weights read)."""

    output_dir: Path
    families: dict[str, Family]
    actions: dict[str, str]  # unit -> "build" | "rebuild" | "up to date?"
    layout: Layout
    commands: list[Command] = field(default_factory=list)


def engine_role(kind: str) -> str:
    """The spec role an engine is built from (the control engine is the target's)."""
    return "draft" if kind == "draft" else "target"


def make_layout(output_dir: Path, sources: dict[str, Path], python: str, examples: str) -> Layout:
    work = output_dir / f".checkpoints{TMP_SUFFIX}"
    return Layout(
        python=python,
        examples=examples.rstrip("/"),
        sources=dict(sources),
        checkpoints={role: work / role for role in sources},
        engines={kind: output_dir / f".{kind}{TMP_SUFFIX}" for kind in ("target", "control", "draft")},
    )


def make_plan(loaded: LoadedSpec, output_dir: Path, force: bool, sources: dict[str, Path],
              configs: dict, python: str | None = None, examples: str | None = None) -> Plan:
    """Check every role and list the commands for the units that need building."""
    spec = loaded.spec
    families = {role: check_model(spec, role, configs[role]) for role in spec.models()}
    actions = {unit: _unit_action(loaded, output_dir, unit, force) for unit in spec.models()}
    layout = make_layout(output_dir, sources, python or sys.executable, examples or examples_dir())
    todo = tuple(u for u, a in actions.items() if a != "up to date?")
    return Plan(output_dir, families, actions, layout, plan_commands(spec, families, layout, todo))


def _unit_action(loaded: LoadedSpec, output_dir: Path, unit: str, force: bool) -> str:
    folders = [output_dir / kind for kind in UNIT_ENGINES[unit]]
    if not any(f.exists() for f in folders):
        return "build"
    if force:
        return "rebuild"
    want = loaded.spec.build_hash(unit)
    for folder, kind in zip(folders, UNIT_ENGINES[unit]):
        try:
            m = read_manifest(folder)
        except EngineError:
            return "rebuild"
        if m.spec_hash != want or m.role != kind:
            return "rebuild"
    return "up to date?"  # confirmed against the source weights by build()


# --------------------------------------------------------------------------------------------
# dry run
# --------------------------------------------------------------------------------------------


def print_plan(loaded: LoadedSpec, out_dir: Path, force: bool) -> Plan:
    """Check the spec against each model's config and print every command; writes nothing.

    Needs no tensorrt_llm and no weights: Hub models contribute only config and tokenizer files.
    """
    spec = loaded.spec
    folders = {role: _config_folder(loaded, role) for role in spec.models()}
    configs = {role: _read_config(role, folder, spec.models()[role].trust_remote_code)
               for role, folder in folders.items()}
    plan = make_plan(loaded, out_dir, force, folders, configs)
    note = _compare_tokenizers_if_present(folders)
    out = console.out
    out.print(f"plan for {spec.name} (backend trtllm, TensorRT-LLM {TRTLLM_RELEASE}) -> {out_dir}",
              markup=False)
    for role, model in spec.models().items():
        engines = " + ".join(str(out_dir / k) for k in UNIT_ENGINES[role])
        action = plan.actions[role]
        if action == "up to date?":
            action = "up to date unless the source weights changed"
        out.print(
            f"  {role}: {model.source_id} [{plan.families[role].name}, {model.dtype}, "
            f"tp {model.tp_size} x pp {model.pp_size}, quantization {model.quantization}] "
            f"-> {engines}  ({action})",
            markup=False,
        )
    out.print(f"  {note}", markup=False)
    for i, cmd in enumerate(plan.commands, 1):
        out.print(f"[{i}/{len(plan.commands)}] {cmd.step}", markup=False)
        out.print(f"  {shlex.join(cmd.argv)}", markup=False)
    out.print(
        f"dry run: nothing written. Builds run inside {TRITON_CONTAINER} (TensorRT-LLM "
        f"{TRTLLM_RELEASE}); converter scripts from {plan.layout.examples} (set {EXAMPLES_ENV})",
        markup=False,
    )
    return plan


def _config_folder(loaded: LoadedSpec, role: str) -> Path:
    """A folder with the role's config.json (and tokenizer if any), without weights."""
    model = loaded.spec.models()[role]
    if model.path is not None:
        folder = loaded.resolve(model.path)
        if not (folder / "config.json").is_file():
            raise CheckpointError(
                f"{role}.path: {folder} has no config.json; point it at a Hugging Face "
                "checkpoint folder or fix the path"
            )
        return folder
    from huggingface_hub import snapshot_download

    try:
        patterns = ["*.json", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
        return Path(snapshot_download(model.repo, revision=model.revision, allow_patterns=patterns))
    except Exception as e:  # offline, gated, unknown revision: all say the same thing here
        raise CheckpointError(
            f"{role}: could not fetch config.json of {model.repo}@{model.revision} "
            f"({type(e).__name__}); check the repo id, revision and network, or use a local path"
        ) from e


def _read_config(role: str, folder: Path, trust_remote_code: bool):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except ValueError as e:
        raise CheckpointError(f"{role}: cannot read {folder}/config.json ({e})") from e


def _compare_tokenizers_if_present(folders: dict[str, Path]) -> str:
    if "draft" not in folders:
        return "no draft: nothing to compare"
    if not all(any(f.glob("tokenizer*")) for f in folders.values()):
        return "tokenizers not compared (no tokenizer files beside a config); `trtspec check` does"
    from transformers import AutoTokenizer

    toks = {role: AutoTokenizer.from_pretrained(f) for role, f in folders.items()}
    require_shared_tokenizer(toks["target"], toks["draft"])
    return "tokenizers identical"


# --------------------------------------------------------------------------------------------
# build
# --------------------------------------------------------------------------------------------


def tensorrt_llm_installed() -> bool:
    """Located without importing it (the import takes seconds and initialises CUDA)."""
    return importlib.util.find_spec("tensorrt_llm") is not None


def require_tensorrt_llm() -> str:
    """The installed TensorRT-LLM version; one-line RuntimeFailure (exit 3) when absent."""
    if not tensorrt_llm_installed():
        raise RuntimeFailure(
            f"tensorrt_llm is not installed: run trtspec build inside the TensorRT-LLM container "
            f"({TRITON_CONTAINER}, TensorRT-LLM {TRTLLM_RELEASE}) or set backend: torch"
        )
    version = _dist_version("tensorrt_llm") or _dist_version("tensorrt-llm") or "unknown"
    if not version.startswith(TRTLLM_SERIES):
        console.info(
            f"warning: tensorrt_llm {version} is installed; trtspec targets {TRTLLM_RELEASE} "
            "and its flags may differ"
        )
    return version


def build(loaded: LoadedSpec, output_dir: Path, force: bool = False,
          allow_pickle: bool = False) -> BuildResult:
    spec = loaded.spec
    trtllm_version = require_tensorrt_llm()
    ensure_writable(output_dir)
    remove_stale_temps(output_dir)
    with console.step("resolving checkpoints"):
        ckpts = {role: resolve(loaded, role, allow_pickle) for role in spec.models()}
    with console.step("checking draft/target compatibility"):
        check_pair(ckpts)
    configs = {role: c.hf_config() for role, c in ckpts.items()}
    plan = make_plan(loaded, output_dir, force, {r: c.folder for r, c in ckpts.items()}, configs)
    result = BuildResult(output_dir)
    for unit, action in plan.actions.items():
        if action == "up to date?":
            if all(read_manifest(output_dir / k).source.weights == ckpts[unit].source_weights
                   for k in UNIT_ENGINES[unit]):
                plan.actions[unit] = "up to date"
                console.info(f"{unit}: engines in {output_dir} are up to date; nothing to do "
                             "(use --force to rebuild)")
            else:
                plan.actions[unit] = "rebuild"
    todo = tuple(u for u, a in plan.actions.items() if a != "up to date")
    commands = plan_commands(spec, plan.families, plan.layout, todo)
    _check_scripts(commands)
    log_path = output_dir / LOG_NAME
    try:
        run_commands(commands, log_path)
        for unit in todo:
            for kind in UNIT_ENGINES[unit]:
                used = [c for c in commands if _belongs(c, unit, kind, plan.layout)]
                _finish_engine(loaded, ckpts[unit], kind, plan.layout.engines[kind],
                               output_dir / kind, used, trtllm_version)
    finally:
        shutil.rmtree(plan.layout.checkpoints["target"].parent, ignore_errors=True)
        for kind in plan.layout.engines.values():
            shutil.rmtree(kind, ignore_errors=True)
    for unit, action in plan.actions.items():
        model = spec.models()[unit]
        for kind in UNIT_ENGINES[unit]:
            result.plans.append(RolePlan(kind, model.source_id, model.dtype, output_dir / kind, action))
    return result


def _belongs(cmd: Command, unit: str, kind: str, layout: Layout) -> bool:
    """The convert of the engine's role, and the engine's own trtllm-build."""
    if cmd.tool == "trtllm-build":
        return str(layout.engines[kind]) in cmd.argv
    return str(layout.checkpoints[unit]) in cmd.argv


def _check_scripts(commands: list[Command]) -> None:
    for cmd in commands:
        if cmd.tool != "trtllm-build" and not Path(cmd.argv[1]).is_file():
            raise RuntimeFailure(
                f"{cmd.argv[1]} not found: clone TensorRT-LLM v{TRTLLM_RELEASE} "
                f"(git clone -b v{TRTLLM_RELEASE} https://github.com/NVIDIA/TensorRT-LLM) and set "
                f"{EXAMPLES_ENV}=<clone>/examples"
            )
    if any(c.tool == "trtllm-build" for c in commands) and shutil.which("trtllm-build") is None:
        raise RuntimeFailure("trtllm-build is not on PATH: run inside the TensorRT-LLM container")


def run_commands(commands: list[Command], log_path: Path) -> None:
    """Run each command, streaming its output to ``log_path`` and a progress display.

    A failing step raises RuntimeFailure naming the step, its exit code and the log's tail.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    n = len(commands)
    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with open(log_path, "w", encoding="utf-8") as log, Progress(*columns, console=console.err) as progress:
        for i, cmd in enumerate(commands, 1):
            label = f"[{i}/{n}] {cmd.step}"
            task = progress.add_task(escape(label), total=None)
            log.write(f"=== {label}\n$ {shlex.join(cmd.argv)}\n")
            log.flush()
            tail: deque[str] = deque(maxlen=_LOG_TAIL)
            rc = _stream(cmd, log, tail, lambda line: progress.update(
                task, description=escape(f"{label}: {line[:90]}")))
            if rc != 0:
                shown = "\n".join(f"  {line}" for line in tail)
                raise RuntimeFailure(
                    f"step '{cmd.step}' failed (exit {rc}); full log: {log_path}\n"
                    f"last lines:\n{shown}"
                )
            progress.update(task, description=escape(f"{label} done"), total=1, completed=1)


def _stream(cmd: Command, log, tail: deque[str], show) -> int:
    try:
        proc = subprocess.Popen(list(cmd.argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, text=True, errors="replace", bufsize=1)
    except OSError as e:
        raise RuntimeFailure(f"step '{cmd.step}' could not start {cmd.argv[0]}: {e.strerror}") from e
    try:
        for line in proc.stdout or ():
            log.write(line)
            line = line.rstrip()
            if line:
                tail.append(line)
                show(line)
        return proc.wait()
    except BaseException:  # Ctrl-C: do not leave a GPU build running behind us
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise


def _finish_engine(loaded: LoadedSpec, ckpt: Checkpoint, kind: str, tmp: Path, folder: Path,
                   commands: list[Command], trtllm_version: str) -> None:
    """Add tokenizer and manifest to a built engine folder and rename it into place."""
    spec, model = loaded.spec, ckpt.model
    ckpt.tokenizer().save_pretrained(tmp / "tokenizer")
    gen = ckpt.folder / "generation_config.json"
    if gen.is_file():
        shutil.copy2(gen, tmp / "generation_config.json")
    cfg = ckpt.hf_config()
    files = {str(p.relative_to(tmp)): file_record(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
    manifest = Manifest(
        complete=True,
        name=spec.name,
        role=kind,
        backend="trtllm",
        spec_hash=spec.build_hash(engine_role(kind)),
        dtype=model.dtype,
        max_draft_len=spec.speculative.max_draft_len if kind == "target" else 0,
        limits=spec.limits(engine_role(kind)).model_dump(),
        model_type=cfg.model_type,
        architecture=(cfg.architectures or [cfg.model_type])[0],
        parameters=parameter_count(ckpt.weight_files),
        source=SourceRecord(id=model.source_id, revision=model.revision, gguf_file=model.gguf_file,
                            weights=ckpt.source_weights),
        files=files,
        versions=tool_versions(trtllm_version),
        commands=[list(c.argv) for c in commands],
        created=now(),
    )
    write_manifest(tmp, manifest)
    swap_into_place(tmp, folder)


def tool_versions(trtllm_version: str) -> dict[str, str]:
    found = {"trtspec": __version__, "python": platform.python_version(), "tensorrt_llm": trtllm_version}
    for dist in ("tensorrt", "torch", "transformers", "nvidia-modelopt"):
        version = _dist_version(dist)
        if version:
            found[dist] = version
    return found


def _dist_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None

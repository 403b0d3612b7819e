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
from trtspec.checkpoints import Checkpoint, parameter_count, require_shared_tokenizer
from trtspec.engines.build import BuildPlan, UnitPlan, finish_engine, plan
from trtspec.engines.trtllm.checks import check_model, refuse_untrusted_code
from trtspec.engines.trtllm.commands import Command, Layout, plan_commands
from trtspec.engines.trtllm.families import (
    EXAMPLES_ENV,
    TRITON_CONTAINER,
    TRTLLM_RELEASE,
    TRTLLM_SERIES,
    Family,
    examples_dir,
)
from trtspec.errors import CheckpointError, RuntimeFailure
from trtspec.files import swap_unit_into_place
from trtspec.layout import ENGINE_KINDS, TRTLLM_TOKENIZER_DIR
from trtspec.spec import LoadedSpec

LOG_NAME = "trtllm-build.log"
TMP_SUFFIX = ".tmp-build"
_LOG_TAIL = 25


@dataclass
class Plan:
    """What a trtllm build of a spec will do (from configs and manifests; no weights read)."""

    output_dir: Path
    families: dict[str, Family]
    units: list[UnitPlan]
    layout: Layout
    commands: list[Command] = field(default_factory=list)


def make_layout(output_dir: Path, sources: dict[str, Path], python: str, examples: str) -> Layout:
    work = output_dir / f".checkpoints{TMP_SUFFIX}"
    return Layout(
        python=python,
        examples=examples.rstrip("/"),
        sources=dict(sources),
        checkpoints={role: work / role for role in sources},
        engines={kind: output_dir / f".{kind}{TMP_SUFFIX}" for kind in ENGINE_KINDS},
    )


def make_plan(
    loaded: LoadedSpec,
    output_dir: Path,
    force: bool,
    sources: dict[str, Path],
    configs: dict,
    python: str | None = None,
    examples: str | None = None,
) -> Plan:
    """Check every role and list the commands for the units that need building."""
    spec = loaded.spec
    families = {role: check_model(spec, role, configs[role]) for role in spec.models()}
    units = plan(loaded, output_dir, force).units
    layout = make_layout(output_dir, sources, python or sys.executable, examples or examples_dir())
    return Plan(output_dir, families, units, layout, _commands(spec, families, layout, units))


def _commands(spec, families, layout: Layout, units: list[UnitPlan]) -> list[Command]:
    """Commands for the units that need building."""
    todo = tuple(u.role for u in units if u.needs_build)
    return plan_commands(spec, families, layout, todo)


def _config_folder(loaded: LoadedSpec, role: str) -> Path:
    """A folder with the role's config.json (and tokenizer if any), without weights."""
    model = loaded.spec.models()[role]
    if model.path is not None:
        folder = loaded.resolve(model.path)
        if not (folder / "config.json").is_file():
            raise CheckpointError(
                f"{role}.path: {folder} has no config.json; point it at a Hugging Face checkpoint folder or fix the path"
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
        console.info(f"warning: tensorrt_llm {version} is installed; trtspec targets {TRTLLM_RELEASE} and its flags may differ")
    return version


class TrtllmBackend:
    name = "trtllm"

    def prepare(self) -> None:
        require_tensorrt_llm()

    def check_model(self, loaded: LoadedSpec, role: str, hf_config) -> None:
        check_model(loaded.spec, role, hf_config)

    def dry_run(self, loaded: LoadedSpec, bplan: BuildPlan) -> BuildPlan:
        spec = loaded.spec
        folders = {role: _config_folder(loaded, role) for role in spec.models()}
        for role, folder in folders.items():
            refuse_untrusted_code(role, folder, spec.models()[role].trust_remote_code)
        configs = {role: _read_config(role, folder, spec.models()[role].trust_remote_code) for role, folder in folders.items()}
        tplan = make_plan(loaded, bplan.output_dir, False, folders, configs)
        tplan.units = bplan.units  # the neutral plan decided each unit's state
        tplan.commands = _commands(spec, tplan.families, tplan.layout, bplan.units)
        bplan.header = f"plan for {spec.name} (backend trtllm, TensorRT-LLM {TRTLLM_RELEASE}) -> {bplan.output_dir}"
        for role, model in spec.models().items():
            bplan.details[role] = (
                f"{model.source_id} [{tplan.families[role].name}, {model.dtype}, "
                f"tp {model.tp_size} x pp {model.pp_size}, quantization {model.quantization}]"
            )
        bplan.notes.append(_compare_tokenizers_if_present(folders))
        bplan.commands = [(cmd.step, shlex.join(cmd.argv)) for cmd in tplan.commands]
        bplan.footer = (
            f"dry run: nothing written. Builds run inside {TRITON_CONTAINER} (TensorRT-LLM "
            f"{TRTLLM_RELEASE}); converter scripts from {tplan.layout.examples} (set {EXAMPLES_ENV})"
        )
        return bplan

    def build(self, loaded: LoadedSpec, ckpts: dict[str, Checkpoint], bplan: BuildPlan) -> None:
        trtllm_version = require_tensorrt_llm()
        spec, output_dir = loaded.spec, bplan.output_dir
        for role, c in ckpts.items():
            refuse_untrusted_code(role, c.folder, c.model.trust_remote_code)
        configs = {role: c.hf_config() for role, c in ckpts.items()}
        tplan = make_plan(loaded, output_dir, False, {r: c.folder for r, c in ckpts.items()}, configs)
        todo = tuple(u.role for u in bplan.units if u.needs_build)
        commands = plan_commands(spec, tplan.families, tplan.layout, todo)
        _check_scripts(commands)
        try:
            run_commands(commands, output_dir / LOG_NAME)
            for unit in bplan.units:
                if not unit.needs_build:
                    continue
                pairs = []
                for kind, folder in unit.folders.items():
                    used = [c for c in commands if _belongs(c, unit.role, kind, tplan.layout)]
                    _finish_engine(loaded, ckpts[unit.role], kind, tplan.layout.engines[kind], folder, used, trtllm_version)
                    pairs.append((tplan.layout.engines[kind], folder))
                # target and control are one unit: never a new target beside an old control
                swap_unit_into_place(pairs)
        finally:
            shutil.rmtree(tplan.layout.checkpoints["target"].parent, ignore_errors=True)
            for kind in tplan.layout.engines.values():
                shutil.rmtree(kind, ignore_errors=True)


BACKEND = TrtllmBackend()


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
            # _stream calls show() only within this iteration, so the closure sees this task.
            rc = _stream(
                cmd,
                log,
                tail,
                lambda line, task=task, label=label: progress.update(task, description=escape(f"{label}: {line[:90]}")),
            )
            if rc != 0:
                shown = "\n".join(f"  {line}" for line in tail)
                raise RuntimeFailure(f"step '{cmd.step}' failed (exit {rc}); full log: {log_path}\nlast lines:\n{shown}")
            progress.update(task, description=escape(f"{label} done"), total=1, completed=1)


def _stream(cmd: Command, log, tail: deque[str], show) -> int:
    try:
        proc = subprocess.Popen(
            list(cmd.argv),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
            bufsize=1,
        )
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


def _finish_engine(
    loaded: LoadedSpec, ckpt: Checkpoint, kind: str, tmp: Path, folder: Path, commands: list[Command], trtllm_version: str
) -> None:
    """Finish a built engine folder: tokenizer in its own subfolder, manifest, rename."""
    finish_engine(
        loaded,
        ckpt,
        kind,
        tmp,
        folder,
        backend="trtllm",
        parameters=parameter_count(ckpt.weight_files),
        versions=tool_versions(trtllm_version),
        max_draft_len=loaded.spec.speculative.max_draft_len if kind == "target" else 0,
        tokenizer_dir=TRTLLM_TOKENIZER_DIR,
        commands=[list(c.argv) for c in commands],
        swap=False,
    )


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

"""`trtspec build` for trtllm.runtime llmapi: LLM API argument files, no engine compile.

The LLM API (PyTorch backend) loads Hugging Face checkpoints itself, so a build resolves and
checks both checkpoints as the other backends do and then writes, per deployment::

    llmapi/speculative.yaml   LLM API arguments with `speculative_config`
    llmapi/control.yaml       the same arguments without it: what verify compares against
    llmapi/manifest.json      spec hash, source weights, TensorRT-LLM line, file hashes

The YAML files are what `trtllm-serve --extra_llm_api_options`, `trtllm-bench
--extra_llm_api_options` and the Triton model repository (model.yaml) read. Every key is
checked against the field inventory of both TensorRT-LLM lines (trtllm_lines/fields.py) and the
files are parsed back before the folder is renamed into place.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import yaml

from trtspec import console
from trtspec.checkpoints import Checkpoint, check_embedding_rows, require_shared_tokenizer, resolve
from trtspec.engines.build import BuildPlan, BuildResult, BuildState, UnitPlan
from trtspec.engines.manifest import MANIFEST, REBUILD, BuildRecord, SourceRecord, check_files, now, read_build, versions
from trtspec.errors import CheckpointError, EngineError
from trtspec.files import (
    FileRecord,
    ensure_writable,
    file_record,
    remove_stale_temps,
    swap_into_place,
    write_json_atomic,
    write_text_atomic,
)
from trtspec.spec import EngineSpec, LoadedSpec
from trtspec.trtllm_lines.fields import DECODING_TYPE, LINES, METHOD_OF, Unknown, unknown_keys

FOLDER = "llmapi"
SPECULATIVE = "speculative.yaml"
CONTROL = "control.yaml"
FORMAT = 1

_QUANT_FILES = ("hf_quant_config.json",)


class LlmapiManifest(BuildRecord):
    """What an llmapi build wrote and from what; written last."""

    format: int = FORMAT  # this file's own format
    spec_hash: str
    line: str
    method: str
    checkpoints: dict[str, str]  # role -> local checkpoint folder the YAML names
    sources: dict[str, SourceRecord]
    files: dict[str, FileRecord]
    versions: dict[str, str]
    created: str


def speculative_config(spec: EngineSpec, draft_dir: Path | None, line: str) -> dict:
    """The `speculative_config` mapping for ``line`` (keys inventoried in trtllm_lines.fields)."""
    s = spec.speculative
    if s.method == "auto":  # spec validation: draft-model-free methods, 1.3+, no inherited settings
        return {"decoding_type": DECODING_TYPE[("auto", line)]}  # AUTO sets its own k: none written
    cfg: dict = {"decoding_type": DECODING_TYPE[(s.method, line)], "max_draft_len": s.max_draft_len}
    if s.method in ("draft_target", "eagle3"):
        cfg["speculative_model"] = str(draft_dir)
        if s.method == "eagle3" and (layers := _head_layers_if_not_default(draft_dir)) is not None:
            # upstream captures {1, L//2-1, L-4} unless told; a head trained on other layers says so
            cfg["eagle3_layers_to_capture"] = layers
        if s.suffix is not None:  # layered: spec validation allows it on eagle3, 1.3+ only
            cfg["sa_config"] = {"threshold": s.suffix.threshold, "enable_global_pool": s.suffix.cache_responses > 0}
        if s.tree is not None:  # spec validation allows only a dynamic tree, on eagle3, 1.3+
            cfg |= dynamic_tree_keys(s.tree)
    elif s.method == "suffix":
        sx = s.suffix_drafting
        # -1: the longest match the automaton finds (trtspec matches as long as max_depth allows)
        cfg["max_matching_ngram_size"] = -1
        cfg["enable_global_pool"] = sx.cache_responses > 0
        if sx.cache_responses > 0:  # slots kept for cross-request search, finished ones included
            cfg["global_pool_size"] = sx.cache_responses
    else:
        # 1.2.1 defaults this to 0 and asserts > 0; main defaults to 2: always write it.
        cfg["max_matching_ngram_size"] = s.max_ngram
    return cfg | schedule_keys(s.schedule, s.switch_off, line)


def dynamic_tree_keys(tree) -> dict:
    """EAGLE-2's dynamic tree as Eagle3DecodingConfig takes it (1.3+): expand the top K per
    step for max_draft_len steps, verify max_total_draft_tokens nodes (the root not counted;
    upstream's range [max_draft_len, K x max_draft_len] is spec validation's)."""
    if tree.dynamic is None:
        raise ValueError("TensorRT-LLM 1.4 has no static tree (eagle_choices); spec validation refuses it")
    return {
        "use_dynamic_tree": True,
        "dynamic_tree_max_topK": tree.dynamic.top_k,
        "max_total_draft_tokens": tree.dynamic.nodes,
    }


def schedule_keys(schedule: dict[int, int] | None, switch_off, line: str) -> dict:
    """Load-aware speculation as DecodingBaseConfig takes it, both lines:
    ``draft_len_schedule`` {batch size threshold: draft length} must hold {1: max_draft_len}
    (upstream's validator; spec validation checks it); 0 switches speculation off at that
    batch size. The acceptance switch-off is 1.2's ``acceptance_window`` /
    ``acceptance_length_threshold`` (rolling mean acceptance length over finished requests)
    and 1.3+'s ``acceptance_rate_window_size`` / ``acceptance_rate_threshold`` (rolling mean
    of accepted / drafted tokens over speculating iterations); spec validation gives each
    line its own threshold (min_acceptance_length, min_acceptance_rate)."""
    out: dict = {}
    if schedule:
        out["draft_len_schedule"] = dict(sorted(schedule.items()))
    if switch_off is None:
        return out
    if line == "1.2" and switch_off.min_acceptance_length is not None:
        return out | {"acceptance_window": switch_off.window, "acceptance_length_threshold": switch_off.min_acceptance_length}
    if line == "1.3+" and switch_off.min_acceptance_rate is not None:
        return out | {
            "acceptance_rate_window_size": switch_off.window,
            "acceptance_rate_threshold": switch_off.min_acceptance_rate,
        }
    raise ValueError("switch_off's threshold does not fit the line (spec validation refuses it)")


def _head_layers_if_not_default(head_dir: Path | None) -> list[int] | None:
    """The target layers a trtspec head reads, unless they are what upstream captures by
    default: (1, L//2-1, L-4) for L > 5 layers, (L-1,) for one; for 2-5 layers upstream has no
    default and raises (tensorrt_llm/_torch/speculative/eagle3.py, Eagle3SpecMetadata
    .__post_init__), so they are always written. A Hub head without trtspec's record: None."""
    from trtspec.engines.eagle3_checkpoint import default_layer_ids

    if head_dir is None:
        return None
    try:
        own = json.loads((Path(head_dir) / "config.json").read_text(encoding="utf-8")).get("trtspec") or {}
        layers = [int(i) for i in own.get("target_layer_ids") or []]
        n_target = int(own["target_num_layers"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if not layers:
        return None
    upstream_default = (0,) if n_target == 1 else (tuple(default_layer_ids(n_target)) if n_target > 5 else None)
    return None if tuple(layers) == upstream_default else layers


def llm_args(spec: EngineSpec, target_dir: Path, draft_dir: Path | None, speculative: bool, line: str | None = None) -> dict:
    """LLM API keyword arguments, as YAML-able data (BaseLlmArgs field names)."""
    line = line or spec.trtllm.line
    t, lim = spec.target, spec.limits("target")
    args: dict = {
        "model": str(target_dir),
        "dtype": t.dtype,
        "trust_remote_code": t.trust_remote_code,  # only ever what the spec says
        "tensor_parallel_size": t.tp_size,
        "pipeline_parallel_size": t.pp_size,
        "max_batch_size": lim.max_batch_size,
        "max_input_len": lim.max_input_len,
        "max_seq_len": lim.max_seq_len,
        "max_beam_width": 1,
        "max_num_tokens": spec.trtllm.max_num_tokens,
        # Block reuse is what makes re-sent prefixes cheap (and is upstream's default); the
        # fraction is explicit because two LLMs share a GPU under Triton.
        "kv_cache_config": {
            "enable_block_reuse": True,
            "free_gpu_memory_fraction": spec.trtllm.kv_cache_free_gpu_memory_fraction,
        },
    }
    if speculative:
        args["speculative_config"] = speculative_config(spec, draft_dir, line)
    return args


def check_keys(args: dict, what: str, lines: tuple[str, ...] = LINES) -> None:
    """Every key must exist in each of ``lines``' inventories (the decoding_type spelled per
    line); the files a build writes are checked against their own line."""
    missing = []
    for line in lines:
        probe = json.loads(json.dumps(args))
        spec_cfg = probe.get("speculative_config")
        if spec_cfg is not None:
            method = METHOD_OF[spec_cfg["decoding_type"]]
            if (method, line) not in DECODING_TYPE:  # e.g. suffix before 1.3: no such class
                missing.append(Unknown(line, f"speculative_config.decoding_type for method {method}"))
                continue
            spec_cfg["decoding_type"] = DECODING_TYPE[(method, line)]
        missing += unknown_keys(probe, line)
    if missing:
        raise EngineError(
            f"{what}: keys not in the LLM API inventory: {', '.join(map(str, missing))}; this is a trtspec bug, report it"
        )


def render(args: dict, header: str) -> str:
    return f"# {header}\n" + yaml.safe_dump(args, sort_keys=False)


def plan_files(spec: EngineSpec, ckpt_dirs: dict[str, Path]) -> dict[str, str]:
    """File name -> YAML text for both configurations (checked, not yet written)."""
    line = spec.trtllm.line
    files = {}
    for name, speculative in ((SPECULATIVE, True), (CONTROL, False)):
        args = llm_args(spec, ckpt_dirs["target"], ckpt_dirs.get("draft"), speculative)
        check_keys(args, name, (line,))
        kind = "speculative" if speculative else "control (target only)"
        header = (
            f"trtspec {spec.name}: LLM API arguments, {kind}, TensorRT-LLM {line}. "
            "Read by trtllm-serve/trtllm-bench --extra_llm_api_options and Triton model.yaml."
        )
        files[name] = render(args, header)
    return files


def read_args(path: Path) -> dict:
    """Parse an argument file back; EngineError if it is not a mapping."""
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise EngineError(f"{path} is not a YAML mapping; run `trtspec build SPEC --force`")
    return data


def check_checkpoints(spec: EngineSpec, ckpts: dict[str, Checkpoint]) -> None:
    """Checks the LLM API would otherwise fail on at load time, on a GPU."""
    from trtspec.engines.trtllm.checks import refuse_untrusted_code

    for role, c in ckpts.items():
        refuse_untrusted_code(role, c.folder, c.model.trust_remote_code)
    target = ckpts["target"]
    cfg = target.hf_config()
    for field, size, what in (
        ("tp_size", spec.target.tp_size, "num_attention_heads"),
        ("pp_size", spec.target.pp_size, "num_hidden_layers"),
    ):
        total = getattr(cfg, what)
        if total % size:
            raise CheckpointError(f"target.{field}: {size} does not divide {what} ({total}); pick a {field} that divides it")
    tok = target.tokenizer()
    check_embedding_rows("target", cfg, tok)
    if spec.target.quantization != "none" and not _declares_quantization(target.folder):
        raise CheckpointError(
            f"target.quantization {spec.target.quantization}: the LLM API reads quantization "
            f"from a pre-quantized checkpoint, and {target.folder} declares none "
            "(no hf_quant_config.json or quantization_config); quantize it first (NVIDIA "
            "Model Optimizer) and point target at the result"
        )
    if "draft" not in ckpts:
        return
    draft = ckpts["draft"]
    dcfg = draft.hf_config()
    arch = " ".join(dcfg.architectures or []).lower()
    if spec.speculative.method == "eagle3":
        if "eagle" not in arch and "eagle" not in dcfg.model_type.lower():
            raise CheckpointError(
                f"draft: method eagle3 needs an EAGLE-3 head checkpoint, but {draft.folder} is "
                f"a {dcfg.model_type} model ({arch or 'no architectures'}); use a head from "
                "`trtspec distill` or a Hub EAGLE-3 repo, or method: draft_target"
            )
        return
    dtok = draft.tokenizer()
    check_embedding_rows("draft", dcfg, dtok)
    require_shared_tokenizer(tok, dtok)


def _declares_quantization(folder: Path) -> bool:
    if any((folder / f).is_file() for f in _QUANT_FILES):
        return True
    config = json.loads((folder / "config.json").read_text())
    return "quantization_config" in config


def resolve_and_check(loaded: LoadedSpec, allow_pickle: bool = False) -> dict[str, Checkpoint]:
    with console.step("resolving checkpoints"):
        ckpts = {role: resolve(loaded, role, allow_pickle) for role in loaded.spec.models()}
    with console.step("checking checkpoints for the LLM API"):
        check_checkpoints(loaded.spec, ckpts)
    return ckpts


def build(loaded: LoadedSpec, output_dir: Path, force: bool = False, allow_pickle: bool = False) -> BuildResult:
    """Resolve and check the checkpoints, write the argument files and manifest atomically."""
    spec = loaded.spec
    ensure_writable(output_dir)
    remove_stale_temps(output_dir)
    folder = output_dir / FOLDER
    ckpts = resolve_and_check(loaded, allow_pickle)
    sources = {role: _source(c) for role, c in ckpts.items()}
    unit = UnitPlan("target", spec.target.source_id, spec.target.dtype, {FOLDER: folder}, BuildState.BUILD)
    result = BuildResult(output_dir, [unit])
    if folder.exists():
        unit.state = BuildState.REBUILD
        if not force and _up_to_date(folder, spec, sources):
            unit.state = BuildState.UP_TO_DATE
            console.info(f"llmapi: {folder} is up to date (same spec and weights); nothing to do (use --force to rebuild)")
            return result
    files = plan_files(spec, {r: c.folder for r, c in ckpts.items()})
    tmp = Path(tempfile.mkdtemp(prefix=f".{FOLDER}.tmp-", dir=output_dir))
    try:
        for name, text in files.items():
            write_text_atomic(tmp / name, text)
            parsed = read_args(tmp / name)  # parse back: what upstream's yaml.safe_load sees
            if render(parsed, text.splitlines()[0][2:]) != text:
                raise EngineError(f"{name} did not read back as written; this is a trtspec bug")
            check_keys(parsed, name, (spec.trtllm.line,))
        manifest = LlmapiManifest(
            complete=True,
            name=spec.name,
            spec_hash=spec.build_hash("target"),
            line=spec.trtllm.line,
            method=spec.speculative.method,
            checkpoints={r: str(c.folder) for r, c in ckpts.items()},
            sources=sources,
            files={n: file_record(tmp / n) for n in files},
            versions=versions(),
            created=now(),
        )
        write_json_atomic(tmp / MANIFEST, manifest.model_dump(mode="json"))
        swap_into_place(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    console.info(f"wrote {folder / SPECULATIVE} and {folder / CONTROL}")
    return result


def _source(c: Checkpoint) -> SourceRecord:
    return SourceRecord(id=c.model.source_id, revision=c.model.revision, gguf_file=c.model.gguf_file, weights=c.source_weights)


def _up_to_date(folder: Path, spec: EngineSpec, sources: dict[str, SourceRecord]) -> bool:
    try:
        m = read_manifest(folder, spec)
    except EngineError:
        return False
    return m.sources == sources


def read_manifest(folder: Path, spec: EngineSpec) -> LlmapiManifest:
    """The manifest of an llmapi folder built from ``spec``; EngineError says to rebuild."""
    m = read_build(folder, LlmapiManifest, "llmapi build", "build")
    if m.spec_hash != spec.build_hash("target"):
        raise EngineError(f"{folder} was built from a different spec; {REBUILD}")
    check_files(folder, m.files)
    return m


def dry_run(loaded: LoadedSpec, output_dir: Path, force: bool = False) -> BuildPlan:
    """The files a build writes, from the spec alone (checkpoints not resolved; nothing written)."""
    spec = loaded.spec
    folder = output_dir / FOLDER
    state = BuildState.BUILD
    if folder.exists():
        state = BuildState.REBUILD
        if not force:
            try:
                read_manifest(folder, spec)
                state = BuildState.CHECK_SOURCES
            except EngineError:
                pass
    unit = UnitPlan("target", spec.target.source_id, spec.target.dtype, {FOLDER: folder}, state)
    dirs = {r: Path(f"<{r} checkpoint: {m.source_id}>") for r, m in spec.models().items()}
    plan = BuildPlan(spec.name, spec.backend, output_dir, [unit])
    plan.header = f"plan for {spec.name} (backend trtllm, runtime llmapi, TensorRT-LLM {spec.trtllm.line}) -> {folder}"
    plan.details["target"] = "LLM API arguments (speculative and control), no engine compile"
    for name, text in plan_files(spec, dirs).items():
        plan.notes.append(f"--- {name}")
        plan.notes += text.rstrip("\n").splitlines()
    plan.footer = "dry run: nothing written (no engine compile: the LLM API loads the checkpoints)"
    return plan

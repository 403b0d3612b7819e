"""Contract tests for the trtllm build commands: flags, checks, dry run, missing tensorrt_llm.

TensorRT-LLM cannot be installed here, so every generated flag is checked against the
upstream flag inventory (tests/data/trtllm/flags.json, read from TensorRT-LLM 1.2.x with the
commit of each file).
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from trtspec.cli.app import app
from trtspec.engines import build
from trtspec.engines.trtllm import build as trtllm_build
from trtspec.engines.trtllm.checks import check_model
from trtspec.engines.trtllm.commands import Command
from trtspec.errors import SpecError, TrtspecError
from trtspec.spec import load_spec

DATA = Path(__file__).parent / "data"
SPECS = DATA / "specs"
HF = DATA / "trtllm" / "hf_configs"
FLAGS = json.loads((DATA / "trtllm" / "flags.json").read_text())
GOLDEN_SPECS = ["trtllm-1gpu", "trtllm-tp2", "trtllm-fp8"]


def plan_for(name: str, tmp_path: Path):
    loaded = load_spec(SPECS / f"{name}.yaml")
    folders = {role: trtllm_build._config_folder(loaded, role) for role in loaded.spec.models()}
    configs = {role: trtllm_build._read_config(role, f, False) for role, f in folders.items()}
    return trtllm_build.make_plan(
        loaded, tmp_path / name, False, folders, configs, python="python3", examples="/opt/trtllm/examples"
    )


def inventory(cmd: Command) -> dict:
    if cmd.tool == "trtllm-build":
        return FLAGS["trtllm_build"]["flags"]
    if cmd.tool == "quantize":
        return FLAGS["quantize"]["flags"]
    family = "qwen" if "/qwen/" in cmd.argv[1] else "llama"
    return FLAGS["convert_checkpoint"][family]["flags"]


@pytest.mark.parametrize("name", GOLDEN_SPECS)
def test_every_flag_exists_in_the_targeted_release(name, tmp_path):
    plan = plan_for(name, tmp_path)
    assert plan.commands
    for cmd in plan.commands:
        known = inventory(cmd)
        seen = set()
        for flag, value in cmd.flags():
            assert flag in known, f"{cmd.step}: {flag} is not a {cmd.tool} flag in TensorRT-LLM 1.2.x"
            assert flag not in seen, f"{cmd.step}: {flag} given twice"
            seen.add(flag)
            meta = known[flag]
            if meta.get("action") == "store_true":
                assert value is None, f"{cmd.step}: {flag} takes no value"
                continue
            assert value is not None, f"{cmd.step}: {flag} needs a value"
            if "choices" in meta:
                assert value in [str(c) for c in meta["choices"]], f"{cmd.step}: {flag} {value}"
            if meta.get("type") == "int":
                int(value)


def test_scripts_are_the_family_converters_and_quantize(tmp_path):
    cmds = {c.step: c for c in plan_for("trtllm-fp8", tmp_path).commands}
    assert cmds["quantize target checkpoint (fp8)"].argv[1] == "/opt/trtllm/examples/quantization/quantize.py"
    draft = cmds["convert draft checkpoint (int8 weight-only)"].argv
    assert draft[1] == "/opt/trtllm/examples/models/core/llama/convert_checkpoint.py"
    qwen = plan_for("trtllm-tp2", tmp_path).commands[0].argv
    assert qwen[1] == "/opt/trtllm/examples/models/core/qwen/convert_checkpoint.py"


def test_int4_weight_only_is_the_converters_int4_precision(tmp_path):
    """int4_wo means TensorRT-LLM's W4A16 (--weight_only_precision int4), for llama and qwen."""
    data = (SPECS / "trtllm-fp8.yaml").read_text().replace("quantization: int8_wo", "quantization: int4_wo")
    (tmp_path / "specs").mkdir()
    path = tmp_path / "specs" / "int4.yaml"
    path.write_text(data.replace("path: ../", f"path: {SPECS.parent}/"))
    loaded = load_spec(path)
    folders = {role: trtllm_build._config_folder(loaded, role) for role in loaded.spec.models()}
    configs = {role: trtllm_build._read_config(role, f, False) for role, f in folders.items()}
    plan = trtllm_build.make_plan(loaded, tmp_path / "out", False, folders, configs, python="python3", examples="/x")
    cmds = {c.step: c for c in plan.commands}
    draft = cmds["convert draft checkpoint (int4 weight-only)"]
    flags = dict(draft.flags())
    assert "--use_weight_only" in flags and flags["--weight_only_precision"] == "int4"
    for family in ("llama", "qwen"):
        assert "int4" in FLAGS["convert_checkpoint"][family]["flags"]["--weight_only_precision"]["choices"]


def test_target_control_and_draft_flags(tmp_path):
    by_step = {c.step.split(" (")[0]: dict(c.flags()) for c in plan_for("trtllm-1gpu", tmp_path).commands}
    target, control, draft = (by_step[f"build {k} engine"] for k in ("target", "control", "draft"))
    assert target["--speculative_decoding_mode"] == "draft_tokens_external"
    assert target["--max_draft_len"] == "4"
    for flags in (target, control, draft):
        assert flags["--use_paged_context_fmha"] == "enable"
        assert "--gather_generation_logits" not in flags  # greedy acceptance: no logits
        assert "--gather_context_logits" not in flags  # an error with max_draft_len > 0
    # the control is the target minus exactly the speculative flags
    assert {k: v for k, v in target.items() if k not in ("--speculative_decoding_mode", "--max_draft_len", "--output_dir")} == {
        k: v for k, v in control.items() if k != "--output_dir"
    }
    assert "--speculative_decoding_mode" not in draft


def test_draft_logits_are_refused_not_silently_built(tmp_path):
    """use_draft_logits once changed build flags but nothing at serving time: now refused."""
    data = (SPECS / "trtllm-fp8.yaml").read_text().replace("speculative:\n", "speculative:\n  use_draft_logits: true\n")
    path = tmp_path / "spec.yaml"
    path.write_text(data.replace("path: ../", f"path: {SPECS.parent}/"))
    with pytest.raises(SpecError, match="speculative.use_draft_logits: trtspec certifies greedy token identity"):
        load_spec(path)


def test_tp_sharding_reaches_convert_and_workers(tmp_path):
    cmds = plan_for("trtllm-tp2", tmp_path).commands
    convert_target = dict(cmds[0].flags())
    assert (convert_target["--tp_size"], convert_target["--pp_size"]) == ("2", "1")
    build_target = dict(next(c for c in cmds if c.step.startswith("build target")).flags())
    assert build_target["--workers"] == "2"


# -- bad input: exit 2, exact messages -------------------------------------------------------


def write_spec(tmp_path: Path, target: str, draft: str, extra: str = "", target_extra: str = "", draft_extra: str = "") -> Path:
    text = (
        "name: bad\nbackend: trtllm\ntrtllm: {runtime: engine}\n"
        f"target:\n  path: {HF / target}\n  dtype: bfloat16\n{target_extra}"
        f"draft:\n  path: {HF / draft}\n  dtype: bfloat16\n{draft_extra}{extra}"
    )
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    return path


def dry_run_error(path: Path) -> TrtspecError:
    with pytest.raises(TrtspecError) as info:
        build.dry_run(load_spec(path), path.parent / "out", False)  # what `build --dry-run` runs
    assert info.value.exit_code == 2
    return info.value


def test_unsupported_family(tmp_path):
    err = dry_run_error(write_spec(tmp_path, "gpt2", "gpt2"))
    assert str(err) == (
        "target: model_type 'gpt2' is not supported by backend trtllm (supported: llama, "
        "mistral, mixtral, qwen2, qwen2_moe); pick a model of those families or use backend: torch"
    )


def model_check_error(role: str, model_type: str, layers: int, **model) -> TrtspecError:
    """check_model's refusal of trtllm-1gpu.yaml with ``model`` set on ``role``'s model, whose
    checkpoint config is a ``model_type`` of ``layers`` layers (32 heads, 8 KV heads)."""
    spec = load_spec(SPECS / "trtllm-1gpu.yaml").spec
    spec = spec.model_copy(update={role: getattr(spec, role).model_copy(update=model)})
    cfg = SimpleNamespace(model_type=model_type, num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=layers)
    with pytest.raises(TrtspecError) as info:
        check_model(spec, role, cfg)
    return info.value


def test_quantization_not_supported_by_family():
    err = model_check_error("target", "mixtral", 32, quantization="int4_awq")
    assert err.exit_code == 2
    assert str(err) == (
        "target.quantization: 'int4_awq' is not supported for the mixtral family in "
        "TensorRT-LLM 1.2.1 (supported: none, fp8, int8_wo); choose one of those"
    )


# Qwen2.5-7B: 28 heads but 4 KV heads, so tp 14 divides the heads and neither divides nor is a
# multiple of the KV heads; Llama-3.1-8B: 32 layers; a draft must not span more GPUs than its target.
@pytest.mark.parametrize(
    ("pair", "extra", "message"),
    [
        (
            ("qwen2.5-7b-instruct", "qwen2.5-0.5b-instruct"),
            {"target_extra": "  tp_size: 3\n"},
            "target.tp_size: 3 does not divide num_attention_heads (28); use one of 1, 2, 4, 7, 14, 28",
        ),
        (
            ("qwen2.5-7b-instruct", "qwen2.5-0.5b-instruct"),
            {"target_extra": "  tp_size: 14\n"},
            "target.tp_size: 14 neither divides nor is a multiple of num_key_value_heads (4); "
            "use a tp_size among 1, 2, 4 or a multiple of 4",
        ),
        (
            ("llama-3.1-8b-instruct", "llama-3.2-1b-instruct"),
            {"target_extra": "  pp_size: 3\n"},
            "target.pp_size: 3 does not divide num_hidden_layers (32); use one of 1, 2, 4, 8, 16, 32",
        ),
        (
            ("llama-3.1-8b-instruct", "llama-3.2-1b-instruct"),
            {"draft_extra": "  tp_size: 2\n"},
            "draft.tp_size: the draft spans 2 GPU(s) (tp x pp) but the target only 1; the draft "
            "must be the smaller model: lower the draft's tp_size/pp_size or swap the roles",
        ),
    ],
    ids=["tp-not-dividing-heads", "tp-not-fitting-kv-heads", "pp-not-dividing-layers", "draft-wider-than-target"],
)
def test_parallel_layouts_that_do_not_fit(tmp_path, pair, extra, message):
    assert str(dry_run_error(write_spec(tmp_path, *pair, **extra))) == message


def test_quantization_needs_half_precision(tmp_path):
    path = write_spec(tmp_path, "llama-3.1-8b-instruct", "llama-3.2-1b-instruct", target_extra="  quantization: fp8\n")
    path.write_text(path.read_text().replace("dtype: bfloat16\n  quantization", "dtype: float32\n  quantization"))
    err = dry_run_error(path)
    assert str(err) == (
        "target.dtype: quantization fp8 runs with float16 or bfloat16 activations, not float32; set dtype: float16 or bfloat16"
    )


def test_gpu_count_mismatch(tmp_path):
    path = write_spec(
        tmp_path, "qwen2.5-7b-instruct", "qwen2.5-0.5b-instruct", target_extra="  tp_size: 2\n  gpu_device_ids: [0]\n"
    )
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert info.value.exit_code == 2
    assert str(info.value) == (
        f"{path}: target: gpu_device_ids lists 1 GPU(s) but tp_size x pp_size = 2; list exactly 2 device id(s)"
    )


@pytest.mark.parametrize(
    "value,reason",
    [
        (0, "Input should be greater than or equal to 1 (got 0)"),
        (17, "Input should be less than or equal to 16 (got 17)"),
    ],
)
def test_max_draft_len_out_of_range(tmp_path, value, reason):
    path = write_spec(
        tmp_path, "llama-3.1-8b-instruct", "llama-3.2-1b-instruct", extra=f"speculative:\n  max_draft_len: {value}\n"
    )
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert info.value.exit_code == 2
    assert str(info.value) == f"{path}: speculative.max_draft_len: {reason}"


def test_ngram_is_refused_by_the_engine_runtime(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(
        f"name: ng\nbackend: trtllm\ntrtllm: {{runtime: engine}}\ntarget:\n  path: {HF / 'llama-3.1-8b-instruct'}\n"
        "speculative:\n  method: ngram\n"
    )
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert str(info.value) == (
        f"{path}: (top level): speculative.method ngram: trtllm.runtime engine builds "
        "draft_target pairs only; use trtllm.runtime: llmapi (needs TensorRT-LLM 1.2.x "
        "(trtllm.line: '1.2') or 1.3 and later (trtllm.line: '1.3+')) for draft_target, eagle3, ngram, suffix"
    )


def test_gguf_is_refused():
    assert str(model_check_error("draft", "llama", 16, gguf_file="m.gguf")).startswith("draft.gguf_file: backend trtllm converts")


# -- CLI ---------------------------------------------------------------------------------------


def test_cli_dry_run_prints_every_command_without_tensorrt_llm(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)  # any import of it would now fail
    out = tmp_path / "engines"
    result = CliRunner().invoke(app, ["build", str(SPECS / "trtllm-tp2.yaml"), "--dry-run", "-o", str(out)])
    assert result.exit_code == 0, result.output
    plan = trtllm_build.make_plan(
        load_spec(SPECS / "trtllm-tp2.yaml"),
        out.resolve(),
        False,
        *_sources_and_configs("trtllm-tp2"),
    )
    assert len(plan.commands) == 5
    for cmd in plan.commands:
        assert shlex.join(cmd.argv) in result.stdout
    assert not out.exists()  # dry run writes nothing


def _sources_and_configs(name: str):
    loaded = load_spec(SPECS / f"{name}.yaml")
    folders = {r: trtllm_build._config_folder(loaded, r) for r in loaded.spec.models()}
    return folders, {r: trtllm_build._read_config(r, f, False) for r, f in folders.items()}


def test_cli_dry_run_bad_input_exits_2(tmp_path):
    result = CliRunner().invoke(app, ["build", str(write_spec(tmp_path, "gpt2", "gpt2")), "--dry-run"])
    assert result.exit_code == 2
    assert "target: model_type 'gpt2' is not supported by backend trtllm" in result.stderr


def test_cli_build_without_tensorrt_llm_is_one_line_exit_3(tmp_path, monkeypatch):
    monkeypatch.setattr(trtllm_build, "tensorrt_llm_installed", lambda: False)
    result = CliRunner().invoke(app, ["build", str(SPECS / "trtllm-1gpu.yaml"), "-o", str(tmp_path / "e")])
    assert result.exit_code == 3
    assert result.stderr.strip().splitlines() == [
        "Error: tensorrt_llm is not installed: run trtspec build inside the TensorRT-LLM container "
        "(nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3, TensorRT-LLM 1.2.1) or set backend: torch"
    ]
    assert not (tmp_path / "e").exists()  # failed before touching anything


# -- the runner ------------------------------------------------------------------------------


def test_failing_step_names_the_step_and_shows_the_log_tail(tmp_path):
    ok = Command("first step", "trtllm-build", (sys.executable, "-c", "print('fine')"))
    bad = Command(
        "second step", "trtllm-build", (sys.executable, "-c", "import sys\nfor i in range(40): print('line', i)\nsys.exit(7)")
    )
    log = tmp_path / "build.log"
    with pytest.raises(TrtspecError) as info:
        trtllm_build.run_commands([ok, bad], log)
    msg = str(info.value)
    assert info.value.exit_code == 3
    assert msg.startswith(f"step 'second step' failed (exit 7); full log: {log}\nlast lines:\n")
    assert "line 39" in msg and "line 14" not in msg  # the tail, not the whole log
    text = log.read_text()
    assert "=== [1/2] first step" in text and "fine" in text and "line 0" in text


def test_missing_program_names_the_step(tmp_path):
    cmd = Command("build target engine", "trtllm-build", ("/nonexistent/trtllm-build", "--x"))
    with pytest.raises(TrtspecError, match="^step 'build target engine' could not start /nonexistent/trtllm-build"):
        trtllm_build.run_commands([cmd], tmp_path / "log")

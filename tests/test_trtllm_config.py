"""Triton configs and launch commands for trtllm repositories, and golden files.

Golden files live in tests/golden/trtllm/<spec>/: commands.txt (the dry-run command list),
<model>/config.pbtxt for each engine model, launch.txt (server argv + env). Regenerate them
after an intended change with:  UPDATE_GOLDEN=1 .venv/bin/pytest tests/test_trtllm_config.py
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import pytest

from trtspec.engines.trtllm import build as trtllm_build
from trtspec.layout import ENGINE_MODELS
from trtspec.spec import load_spec
from trtspec.triton.repository import pbtxt
from trtspec.triton.repository.trtllm_models import EMPTY_BY_DESIGN, engine_model_configs
from trtspec.triton.server.process import ADMIN_KEY_ENV, ServerCommand
from trtspec.triton.server.trtllm_launch import launch_command, launch_for_spec

ROOT = Path(__file__).parent
SPECS = ROOT / "data" / "specs"
GOLDEN = ROOT / "golden" / "trtllm"
PARAMS = json.loads((ROOT / "data" / "trtllm" / "triton_params.json").read_text())["tensorrt_llm"]
GOLDEN_SPECS = ["trtllm-1gpu", "trtllm-tp2", "trtllm-fp8"]
UPDATE = os.environ.get("UPDATE_GOLDEN") == "1"
BOOLS = set(json.loads((ROOT / "data" / "trtllm" / "triton_params.json").read_text())["parameter_semantics"]["bool_accepted"])


def engines_dir(name: str) -> Path:
    return Path("/engines") / name


def server(name: str) -> ServerCommand:
    # A fixed admin key: the served one is random per start unless TRTSPEC_ADMIN_KEY is set.
    return ServerCommand(
        binary=Path("/opt/tritonserver/bin/tritonserver"),
        model_repository=Path("/model_repo") / name,
        admin_key="golden-admin-key",
    )


def check_golden(path: Path, text: str) -> None:
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.is_file(), f"missing golden file {path}; run with UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"{path} differs; if intended, regenerate with UPDATE_GOLDEN=1"


def commands_text(name: str) -> str:
    loaded = load_spec(SPECS / f"{name}.yaml")
    folders = {r: trtllm_build._config_folder(loaded, r) for r in loaded.spec.models()}
    configs = {r: trtllm_build._read_config(r, f, False) for r, f in folders.items()}
    plan = trtllm_build.make_plan(
        loaded, engines_dir(name), False, folders, configs, python="python3", examples="/app/tensorrt_llm/examples"
    )
    lines = []
    for cmd in plan.commands:
        lines += [f"# {cmd.step}", shlex.join(cmd.argv).replace(str(ROOT.parent), "<repo>")]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("name", GOLDEN_SPECS)
def test_golden_commands(name):
    check_golden(GOLDEN / name / "commands.txt", commands_text(name))


@pytest.mark.parametrize("name", GOLDEN_SPECS)
def test_golden_configs(name):
    spec = load_spec(SPECS / f"{name}.yaml").spec
    for cfg in engine_model_configs(spec, engines_dir(name)):
        check_golden(GOLDEN / name / cfg.name / "config.pbtxt", pbtxt.render(cfg))


@pytest.mark.parametrize("name", GOLDEN_SPECS)
def test_golden_launch(name):
    spec = load_spec(SPECS / f"{name}.yaml").spec
    launch = launch_for_spec(spec, server(name), python="python3")
    text = json.dumps({"argv": launch.argv, "env": launch.env, "world_size": launch.world_size}, indent=2) + "\n"
    check_golden(GOLDEN / name / "launch.json", text)


@pytest.mark.parametrize("name", GOLDEN_SPECS)
def test_configs_parse_and_set_every_mandatory_parameter(name):
    spec = load_spec(SPECS / f"{name}.yaml").spec
    known = {p["key"] for p in PARAMS["parameters"]}
    allowed = PARAMS["allowed_values"]
    for cfg in engine_model_configs(spec, engines_dir(name)):
        text = pbtxt.render(cfg)
        assert "${" not in text
        msg = pbtxt.parse(text)  # Triton's own ModelConfig protobuf
        kind = next(k for k, v in ENGINE_MODELS.items() if v == msg.name)
        params = {k: v.string_value for k, v in msg.parameters.items()}
        # the documented mandatory list, each with a valid value
        assert msg.backend in allowed["triton_backend"] and msg.backend == "tensorrtllm"
        assert msg.max_batch_size == spec.limits("draft" if kind == "draft" else "target").max_batch_size
        assert msg.HasField("dynamic_batching")
        assert msg.dynamic_batching.max_queue_delay_microseconds == 0
        assert msg.dynamic_batching.HasField("default_queue_policy")
        assert msg.dynamic_batching.default_queue_policy.max_queue_size == 0
        # Engines answer one response per call: the orchestrator calls them step by step over
        # BLS and streams at its own endpoint (a decoupled engine would break those calls).
        assert msg.model_transaction_policy.decoupled is False
        assert params["gpt_model_path"] == str(engines_dir(name) / kind)
        assert params["gpt_model_type"] in allowed["batching_strategy"]
        dtypes = {t.name: pbtxt.pb.DataType.Name(t.data_type) for t in [*msg.input, *msg.output]}
        assert dtypes["encoder_input_features"] in allowed["encoder_input_features_data_type"]
        assert dtypes["prompt_embedding_table"] in allowed["prompt_embedding_table_data_type"]
        for logits in ("generation_logits", "context_logits", "draft_logits"):
            assert dtypes[logits] in allowed["logits_datatype"]
        # what draft-target needs
        assert params["enable_kv_cache_reuse"] == "true"
        assert params["exclude_input_in_output"] == "false"
        assert params["max_beam_width"] == "1"
        assert params["batch_scheduler_policy"] in allowed["batch_scheduler_policy"]
        for key in ("enable_kv_cache_reuse", "exclude_input_in_output", "enable_chunked_context", "normalize_log_probs"):
            assert params[key] in BOOLS
        assert 0 < float(params["kv_cache_free_gpu_mem_fraction"]) <= 0.9
        # keys the backend reads without a default: present, and empty to keep guided decoding off
        for key in EMPTY_BY_DESIGN:
            assert key in params and params[key] == ""
        assert params["tokenizer_dir"]
        assert set(params) <= known, set(params) - known
        assert {t.name for t in msg.input} >= {
            "input_ids",
            "input_lengths",
            "request_output_len",
            "draft_input_ids",
            "end_id",
            "pad_id",
        }
        assert {t.name for t in msg.output} >= {"output_ids", "sequence_length"}


def test_gpu_device_ids_follow_the_spec():
    spec = load_spec(SPECS / "trtllm-tp2.yaml").spec
    ids = {c.name: c.parameters["gpu_device_ids"] for c in engine_model_configs(spec, Path("/e"))}
    assert ids == {"tensorrt_llm": "0,1", "tensorrt_llm_control": "0,1", "tensorrt_llm_draft": "2"}


def test_participant_ids_when_workers_are_not_spawned():
    spec = load_spec(SPECS / "trtllm-tp2.yaml").spec
    cfgs = engine_model_configs(spec, Path("/e"), spawn_processes=False)
    ranks = {c.name: c.parameters["participant_ids"] for c in cfgs}
    assert ranks == {"tensorrt_llm": "1,2", "tensorrt_llm_draft": "3", "tensorrt_llm_control": "4,5"}
    launch = launch_for_spec(spec, server("x"), spawn_processes=False)
    assert launch.world_size == 6  # orchestrator rank + 2 + 1 + 2
    assert launch.env == {
        "TRTLLM_ORCHESTRATOR": "1",
        "TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES": "0",
        ADMIN_KEY_ENV: "golden-admin-key",
    }
    assert launch.argv.count("-n") == 6


def test_orchestrator_mode_with_spawned_workers_is_one_rank():
    spec = load_spec(SPECS / "trtllm-tp2.yaml").spec
    launch = launch_for_spec(spec, server("x"))
    assert launch.orchestrator and launch.world_size == 1
    assert launch.env == {
        "TRTLLM_ORCHESTRATOR": "1",
        "TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES": "1",
        ADMIN_KEY_ENV: "golden-admin-key",
    }
    assert launch.argv[:6] == ["mpirun", "--allow-run-as-root", "-x", ADMIN_KEY_ENV, "-n", "1"]
    assert launch.argv[8:10] == ["trtspec.triton.server.rank", "/opt/tritonserver/bin/tritonserver"]
    for gpu in (0, 1, 2):
        assert f"--cuda-memory-pool-byte-size={gpu}:0" in launch.argv
    assert "--http-address=127.0.0.1" in launch.argv  # loopback unless told otherwise


def test_leader_mode_one_rank_per_gpu():
    launch = launch_command(server("x"), [("tensorrt_llm", 2)])
    assert not launch.orchestrator and launch.world_size == 2 and launch.env == {ADMIN_KEY_ENV: "golden-admin-key"}
    ranks = " ".join(launch.argv).split(" : ")
    assert len(ranks) == 2
    assert "--model-control-mode=none" in ranks[0]
    assert "--model-control-mode=explicit" in ranks[1] and "--load-model=tensorrt_llm" in ranks[1]
    assert "shm-region-prefix-name=prefix0_" in ranks[0] and "shm-region-prefix-name=prefix1_" in ranks[1]


def test_write_config_is_atomic_and_parses(tmp_path):
    spec = load_spec(SPECS / "trtllm-1gpu.yaml").spec
    cfg = engine_model_configs(spec, tmp_path)[0]
    path = pbtxt.write(cfg, tmp_path / cfg.name / "config.pbtxt")
    assert pbtxt.parse(path.read_text()).name == cfg.name
    assert [p.name for p in path.parent.iterdir()] == ["config.pbtxt"]

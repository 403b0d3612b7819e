"""Method auto, adaptive k, the load schedule and the switch-off written for other engines:
TensorRT-LLM 1.3+'s AUTO and draft_len_schedule, vLLM's num_speculative_tokens_per_batch_size,
SGLang's --speculative-adaptive with its config file. Every setting written has 0 unknown
fields against the upstream inventories; each piece an engine lacks is refused by name."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from conftest import write_spec
from sglang_fields import unknown_adaptive_config, unknown_flags
from vllm_fields import unknown_fields

from trtspec.engines.exports import sglang_adaptive_config, sglang_args, vllm_speculative_config
from trtspec.errors import SpecError
from trtspec.spec import load_spec
from trtspec.trtllm_lines.fields import unknown_keys

LLMAPI_13 = {"backend": "trtllm", "trtllm.runtime": "llmapi", "trtllm.line": "1.3+", "speculative.default_draft_tokens": None}
FREE_AUTO = {"speculative.method": "auto", "speculative.auto": {"methods": ["suffix", "ngram"]}}
EAGLE = {"speculative.method": "eagle3"}
ADAPTIVE = {"speculative.adaptive": True}
SCHEDULE = {"speculative.schedule": {1: 8, 4: 2, 8: 0}}  # the tiny spec drafts up to 8, max_batch_size 4
SWITCH_OFF = {"speculative.switch_off": {"window": 8, "min_acceptance_length": 1.5}}


def _spec(tmp_path, tiny_ckpts, draft="draft", **overrides):
    return load_spec(write_spec(tmp_path, tiny_ckpts, draft, **overrides)).spec


def _refused(tmp_path, tiny_ckpts, needle, draft="draft", **overrides) -> None:
    with pytest.raises(SpecError, match=r"spec\.yaml: \(top level\): " + re.escape(needle)) as info:
        _spec(tmp_path, tiny_ckpts, draft, **overrides)
    assert info.value.exit_code == 2


def _export_refused(export, s, needle) -> None:
    with pytest.raises(SpecError, match="^" + re.escape(needle)) as info:
        export(s, "/d")
    assert info.value.exit_code == 2


# ---------------------------------------------------------------- TensorRT-LLM 1.3+


def test_llmapi_writes_auto_over_free_drafters_as_AUTO(tmp_path, tiny_ckpts):
    from trtspec.engines.build import build
    from trtspec.speculative.llmapi.double import DecodingConfig

    loaded = load_spec(write_spec(tmp_path, tiny_ckpts, None, **LLMAPI_13, **FREE_AUTO))
    build(loaded, loaded.output_dir())
    args = yaml.safe_load((loaded.output_dir() / "llmapi" / "speculative.yaml").read_text())
    assert args["speculative_config"] == {"decoding_type": "AUTO"}  # AUTO sets its own k and drafter
    assert unknown_keys(args, "1.3+") == []
    # the conformance double does not pretend to run upstream's heuristic
    with pytest.raises(NotImplementedError, match="decoding type AUTO: TensorRT-LLM chooses the drafter and k"):
        DecodingConfig.from_dict("1.3+", args["speculative_config"])


def test_llmapi_writes_the_schedule_on_1_3(tmp_path, tiny_ckpts):
    from trtspec.engines.trtllm.llmapi import llm_args

    spec = _spec(tmp_path, tiny_ckpts, **LLMAPI_13, **SCHEDULE)
    args = llm_args(spec, tmp_path / "t", tmp_path / "d", True)
    assert args["speculative_config"]["draft_len_schedule"] == {1: 8, 4: 2, 8: 0}
    assert unknown_keys(args, "1.3+") == []


@pytest.mark.parametrize(
    "draft, overrides, needle",
    [
        ("draft", ADAPTIVE, "speculative.adaptive: the LLM API picks no k per request from acceptance"),
        (
            None,
            {**FREE_AUTO, "trtllm.line": "1.2"},
            "speculative.method auto: trtspec writes TensorRT-LLM's AUTO decoding for 1.3",
        ),
        (
            "draft",
            {"speculative.method": "auto", "speculative.auto": {"methods": ["draft_target", "ngram"]}},
            "speculative.auto.methods lists draft_target: TensorRT-LLM's AUTO chooses a draft-model-free method",
        ),
        (None, {**FREE_AUTO, "speculative.schedule": {1: 8, 4: 2}}, "speculative.schedule: TensorRT-LLM's AUTO ignores"),
        (None, {**FREE_AUTO, "speculative.max_ngram": 4}, "speculative.max_ngram: TensorRT-LLM's AUTO ignores"),
        (None, {**FREE_AUTO, "speculative.suffix": {"cache_responses": 10}}, "speculative.suffix: TensorRT-LLM's AUTO ignores"),
    ],
    ids=["adaptive", "auto-1.2", "auto-model-draft", "auto-schedule", "auto-max_ngram", "auto-suffix"],
)
def test_llmapi_refuses_what_it_lacks_by_name(tmp_path, tiny_ckpts, draft, overrides, needle):
    _refused(tmp_path, tiny_ckpts, needle, draft, **{**LLMAPI_13, **overrides})


RATE_OFF = {"speculative.switch_off": {"window": 1, "min_acceptance_rate": 1.0}}


def test_llmapi_writes_the_rate_switch_off_on_1_3_and_the_double_applies_it(tmp_path, tiny_ckpts):
    """switch_off.min_acceptance_rate is 1.3+'s acceptance_rate_window_size / threshold: the
    mean over the last N drafting steps of accepted / drafted; below it, off for good."""
    from trtspec.engines.build import build
    from trtspec.speculative.llmapi import acceptance, greedy_params, load_api, make_llm

    loaded = load_spec(write_spec(tmp_path, tiny_ckpts, **LLMAPI_13, **RATE_OFF))
    build(loaded, loaded.output_dir())
    args = yaml.safe_load((loaded.output_dir() / "llmapi" / "speculative.yaml").read_text())
    sc = args["speculative_config"]
    assert (sc["acceptance_rate_window_size"], sc["acceptance_rate_threshold"]) == (1, 1.0)
    assert unknown_keys(args, "1.3+") == []
    api = load_api("double", "1.3+")
    llm = make_llm(api, loaded.output_dir() / "llmapi" / "speculative.yaml")
    sp = greedy_params(api, 16, True)
    first = llm.generate("The quick brown fox", sp).outputs[0]
    accepted, drafted = acceptance(first)
    assert 0 < drafted and accepted < drafted  # a step below rate 1.0 turned it off ...
    second = llm.generate("The quick brown fox", sp).outputs[0]
    assert acceptance(second) == (0, 0) and second.token_ids == first.token_ids  # ... for good, same tokens


def test_the_rate_switch_counts_drafting_steps_only():
    from trtspec.speculative.schedule import LoadPolicy

    policy = LoadPolicy.of(None, None, (2, 0.5))
    policy.stepped(4, 1)
    policy.stepped(0, 0)  # a step that drafted nothing is no sample
    policy.finished(4, 1.0)  # nor is a finished request
    assert policy.cap(1) is None
    policy.stepped(4, 2)  # mean of 0.25 and 0.5 < 0.5
    assert policy.cap(1) == 0


@pytest.mark.parametrize(
    "backend, overrides, needle",
    [
        ({}, {"speculative.switch_off": {"window": 4}}, "speculative.switch_off: give one threshold: min_acceptance_length"),
        (
            {},
            {"speculative.switch_off": {"window": 4, "min_acceptance_length": 2, "min_acceptance_rate": 0.5}},
            "speculative.switch_off: give one threshold: min_acceptance_length",
        ),
        ({**LLMAPI_13, "trtllm.line": "1.2"}, RATE_OFF, "speculative.switch_off: TensorRT-LLM 1.3+ switches speculation off"),
        (LLMAPI_13, SWITCH_OFF, "speculative.switch_off: TensorRT-LLM 1.3+ switches speculation off"),
    ],
    ids=["no-threshold", "two-thresholds", "llmapi-1.2-rate", "llmapi-1.3-length"],
)
def test_each_runtime_takes_its_own_switch_off(tmp_path, tiny_ckpts, backend, overrides, needle):
    with pytest.raises(SpecError, match=re.escape(needle)) as info:
        _spec(tmp_path, tiny_ckpts, **backend, **overrides)
    assert info.value.exit_code == 2


# ---------------------------------------------------------------- vLLM


def test_vllm_takes_the_schedule_per_batch_size(tmp_path, tiny_ckpts):
    s = _spec(tmp_path, tiny_ckpts, **SCHEDULE).speculative
    cfg = vllm_speculative_config(s, "/d", max_batch_size=4)
    assert cfg == {
        "method": "draft_model",
        "model": "/d",
        "num_speculative_tokens": 8,
        "num_speculative_tokens_per_batch_size": [[1, 3, 8], [4, 7, 2], [8, 8, 0]],
    }
    assert unknown_fields(cfg) == []
    assert unknown_fields(cfg | {"num_speculative_tokens_per_batch_size": {1: 8}}) == [
        "num_speculative_tokens_per_batch_size={1: 8}"
    ]
    assert unknown_fields(cfg | {"num_speculative_tokens_per_batch_sizes": []}) == ["num_speculative_tokens_per_batch_sizes"]


@pytest.mark.parametrize(
    "draft, overrides, needle",
    [
        (None, FREE_AUTO, "speculative.method auto: vLLM drafts with one method and chooses no drafter per request"),
        ("draft", ADAPTIVE, "speculative.adaptive: vLLM picks no k per request from acceptance"),
        ("draft", SWITCH_OFF, "speculative.switch_off: vLLM has no switch-off on acceptance"),
        (
            "draft",
            {**EAGLE, **SCHEDULE, "speculative.tree": {"choices": [[0], [1], [0, 0], [1, 0]]}},
            "speculative.schedule on a tree: vLLM's num_speculative_tokens_per_batch_size sets a chain's length",
        ),
        ("draft", {"speculative.schedule": {1: 0}}, "speculative.schedule: the schedule drafts nothing at any load"),
    ],
    ids=["auto", "adaptive", "switch_off", "schedule-tree", "schedule-zero"],
)
def test_vllm_refuses_what_it_lacks_by_name(tmp_path, tiny_ckpts, draft, overrides, needle):
    s = _spec(tmp_path, tiny_ckpts, draft, **overrides).speculative
    _export_refused(lambda s, d: vllm_speculative_config(s, d, max_batch_size=4), s, needle)


# ---------------------------------------------------------------- SGLang


def test_sglang_adaptive_eagle3_with_its_config_file(tmp_path, tiny_ckpts):
    s = _spec(tmp_path / "a", tiny_ckpts, **EAGLE, **ADAPTIVE).speculative
    argv = sglang_args(s, "/h")
    assert argv == [
        "--speculative-adaptive",
        "--speculative-algorithm", "EAGLE3",
        "--speculative-draft-model-path", "/h",
        "--speculative-num-steps", "8",
        "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", "9",
        "--speculative-adaptive-config", "sglang_adaptive.json",
    ]  # fmt: skip
    assert unknown_flags(argv) == []
    assert sglang_adaptive_config(s) == {"1": {"candidate_steps": list(range(9))}}
    loaded = _spec(tmp_path / "b", tiny_ckpts, **EAGLE, **ADAPTIVE, **SCHEDULE).speculative
    cfg = sglang_adaptive_config(loaded)
    assert cfg == {"1": {"candidate_steps": list(range(9))}, "4": {"candidate_steps": [0, 1, 2]}, "8": {"candidate_steps": [0]}}
    assert unknown_adaptive_config(cfg) == [] and unknown_flags(sglang_args(loaded, "/h")) == []
    assert unknown_adaptive_config(
        {"bs1": {"candidate_steps": [1]}, "2": {"steps": [1]}, "4": {"candidate_steps": [1], "alpha": 1}}
    ) == [
        "bs1: not a batch-size slot with candidate_steps",
        "2: not a batch-size slot with candidate_steps",
        "4.alpha",
    ]
    assert unknown_flags(["--speculative-adaptive", "--speculative-adaptive-configs", "x"]) == ["--speculative-adaptive-configs"]


@pytest.mark.parametrize(
    "draft, overrides, needle",
    [
        (None, FREE_AUTO, "speculative.method auto: SGLang drafts with one method and chooses no drafter per request"),
        ("draft", ADAPTIVE, "speculative.adaptive on method draft_target: SGLang adapts the draft depth of EAGLE drafts only"),
        (
            "draft",
            {**EAGLE, **SCHEDULE},
            "speculative.schedule: SGLang takes a draft length per batch size only as the candidate",
        ),
        ("draft", {**EAGLE, **SWITCH_OFF}, "speculative.switch_off: SGLang has no switch-off on acceptance"),
    ],
    ids=["auto", "adaptive-draft_target", "schedule-without-adaptive", "switch_off"],
)
def test_sglang_refuses_what_it_lacks_by_name(tmp_path, tiny_ckpts, draft, overrides, needle):
    _export_refused(sglang_args, _spec(tmp_path, tiny_ckpts, draft, **overrides).speculative, needle)


def test_check_prints_the_adaptive_sglang_command_and_its_file(tmp_path, tiny_ckpts):
    from test_eagle3 import random_head
    from typer.testing import CliRunner

    from trtspec.cli.app import app

    ck = {"target": tiny_ckpts["target"], "head": random_head(tiny_ckpts["target"], tmp_path / "head")}
    path = write_spec(tmp_path / "s", ck, "head", **EAGLE, **ADAPTIVE, **SCHEDULE)
    r = CliRunner().invoke(app, ["check", str(path), "--json"])
    assert r.exit_code == 0, r.output
    elsewhere = json.loads(r.stdout)["elsewhere"]
    assert elsewhere["sglang"]["args"][0] == "--speculative-adaptive"
    assert elsewhere["sglang"]["files"] == {"sglang_adaptive.json": sglang_adaptive_config(load_spec(path).spec.speculative)}
    assert elsewhere["vllm"]["error"].startswith("speculative.adaptive: vLLM picks no k per request")
    text = CliRunner().invoke(app, ["check", str(path)], terminal_width=400).output
    assert 'with sglang_adaptive.json: {"1": {"candidate_steps": [0, 1, 2, 3, 4, 5, 6, 7, 8]}' in text

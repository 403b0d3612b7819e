"""speculative.tree written for other engines: TensorRT-LLM's LLM API YAML, vLLM's
speculative_config and SGLang's launch flags, each checked against the inventory of upstream
names (0 unknown fields), and refused by name where an engine has no such tree."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml
from conftest import write_spec
from sglang_fields import unknown_flags
from test_eagle3 import random_head
from vllm_fields import unknown_fields

from trtspec.engines.build import build
from trtspec.engines.exports import VLLM_TREE_ENV, sglang_args, uneven_level, vllm_speculative_config
from trtspec.errors import SpecError
from trtspec.spec import load_spec
from trtspec.speculative.llmapi.double import DecodingConfig
from trtspec.trtllm_lines.fields import DECODING_TYPES, unknown_keys

LLMAPI_13 = {"backend": "trtllm", "speculative.default_draft_tokens": None, "trtllm.line": "1.3+"}
DYNAMIC = {"speculative.tree": {"dynamic": {"top_k": 2, "nodes": 12}}}  # the tiny spec drafts 8 deep
STATIC = {"speculative.tree": {"choices": [[0], [1], [0, 0], [0, 1], [1, 0], [1, 1], [0, 0, 0], [0, 1, 0], [1, 0, 0], [1, 1, 0]]}}
EAGLE = {"speculative.method": "eagle3"}


def _spec(tmp_path, tiny_ckpts, **overrides):
    return load_spec(write_spec(tmp_path, tiny_ckpts, "draft", **overrides)).spec


def _error(tmp_path, tiny_ckpts, **overrides) -> str:
    with pytest.raises(SpecError) as info:
        _spec(tmp_path, tiny_ckpts, **overrides)
    assert info.value.exit_code == 2
    return str(info.value)


# ---------------------------------------------------------------- TensorRT-LLM


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (
            {**LLMAPI_13, **EAGLE, **DYNAMIC, "trtllm.line": "1.2"},
            "speculative.tree: TensorRT-LLM 1.2's EagleDecodingConfig resets max_total_draft_tokens to max_draft_len",
        ),
        (
            {**LLMAPI_13, **EAGLE, **STATIC},
            "speculative.tree.choices: TensorRT-LLM removed static trees (eagle_choices) in 1.4",
        ),
        (
            {**LLMAPI_13, **DYNAMIC},
            "speculative.tree on method draft_target: TensorRT-LLM drafts trees only with EAGLE",
        ),
        (
            {**LLMAPI_13, **DYNAMIC, "trtllm.runtime": "engine", "trtllm.line": "1.2"},
            "speculative.tree: trtllm.runtime engine builds draft_target pairs, which draft chains",
        ),
    ],
)
def test_trtllm_refuses_trees_by_name(tmp_path, tiny_ckpts, overrides, needle):
    assert needle in _error(tmp_path, tiny_ckpts, **overrides)


def test_the_inventory_has_static_trees_on_1_2_only():
    assert "eagle_choices" in DECODING_TYPES["1.2"]["Eagle"]
    assert "eagle_choices" not in DECODING_TYPES["1.3+"]["Eagle3"]  # removed in 1.4.0rc1
    cfg = {"decoding_type": "Eagle3", "max_draft_len": 2, "speculative_model": "h", "eagle_choices": [[0], [1]]}
    assert [str(u) for u in unknown_keys({"speculative_config": cfg}, "1.3+")] == [
        "speculative_config.eagle_choices (TensorRT-LLM 1.3+)"
    ]


def test_llmapi_build_writes_the_dynamic_tree(tmp_path, tiny_ckpts):
    head = tmp_path / "head"
    shutil.copytree(tiny_ckpts["draft"], head)
    cfg = json.loads((head / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLMEagle3"]
    (head / "config.json").write_text(json.dumps(cfg))
    loaded = load_spec(write_spec(tmp_path / "s", {**tiny_ckpts, "head": head}, "head", **LLMAPI_13, **EAGLE, **DYNAMIC))
    build(loaded, loaded.output_dir())
    args = yaml.safe_load((loaded.output_dir() / "llmapi" / "speculative.yaml").read_text())
    assert args["speculative_config"] == {
        "decoding_type": "Eagle3",
        "max_draft_len": 8,
        "speculative_model": str(head),
        "use_dynamic_tree": True,
        "dynamic_tree_max_topK": 2,
        "max_total_draft_tokens": 12,
    }
    assert unknown_keys(args, "1.3+") == []
    # upstream's own rules, as the conformance double holds them: the budget in [k, K x k]
    DecodingConfig.from_dict("1.3+", args["speculative_config"])
    with pytest.raises(ValueError, match=r"max_total_draft_tokens \(17\) should be >= max_draft_len \(8\) and <= "):
        DecodingConfig.from_dict("1.3+", args["speculative_config"] | {"max_total_draft_tokens": 17})
    # 1.2.1 resets the budget to max_draft_len: why trtspec refuses trees there
    on_12 = DecodingConfig.from_dict("1.2", args["speculative_config"] | {"decoding_type": "Eagle"})
    assert on_12.fields["max_total_draft_tokens"] == 8


# ---------------------------------------------------------------- vLLM


def test_vllm_chain_and_static_tree_against_the_inventory(tmp_path, tiny_ckpts):
    chain = vllm_speculative_config(_spec(tmp_path / "c", tiny_ckpts, **EAGLE).speculative, "/h")
    assert chain == {"method": "eagle3", "model": "/h", "num_speculative_tokens": 8}
    tree = vllm_speculative_config(_spec(tmp_path / "t", tiny_ckpts, **EAGLE, **STATIC).speculative, "/h")
    assert tree == {
        "method": "eagle3",
        "model": "/h",
        "num_speculative_tokens": 10,
        "speculative_token_tree": "[(0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1), (0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]",
    }
    assert unknown_fields(chain) == [] and unknown_fields(tree) == []
    assert VLLM_TREE_ENV == {"VLLM_ATTENTION_BACKEND": "TREE_ATTN"}
    draft = vllm_speculative_config(_spec(tmp_path / "d", tiny_ckpts).speculative, "/d")
    assert draft["method"] == "draft_model" and unknown_fields(draft) == []


@pytest.mark.parametrize(
    "overrides, needle",
    [
        ({**EAGLE, **DYNAMIC}, "speculative.tree.dynamic: vLLM has no dynamic tree"),
        (STATIC, "speculative.tree on method draft_target: vLLM drafts trees in its EAGLE proposer only"),
        (
            {**EAGLE, "speculative.tree": {"choices": [[0], [1], [0, 0]]}},
            "speculative.tree.choices: the nodes at depth 2 are not children 0 .. c - 1 of every node above them",
        ),
    ],
)
def test_vllm_refuses_trees_it_cannot_draft(tmp_path, tiny_ckpts, overrides, needle):
    s = _spec(tmp_path, tiny_ckpts, **overrides).speculative
    with pytest.raises(SpecError, match="^" + needle.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")) as info:
        vllm_speculative_config(s, "/h")
    assert info.value.exit_code == 2


def test_uneven_levels():
    assert uneven_level(((0,), (1,), (0, 0), (1, 0))) is None
    assert uneven_level(((0,), (1,), (0, 0))) == 2  # node (1,) has no child
    assert uneven_level(((0,), (2,))) == 1  # rank 1 missing: vLLM would draft it, not rank 2
    assert uneven_level(((0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1), (0, 0, 0))) == 3


# ---------------------------------------------------------------- SGLang


def test_sglang_chain_and_dynamic_tree_against_the_inventory(tmp_path, tiny_ckpts):
    chain = sglang_args(_spec(tmp_path / "c", tiny_ckpts, **EAGLE).speculative, "/h")
    assert chain == [
        "--speculative-algorithm", "EAGLE3",
        "--speculative-draft-model-path", "/h",
        "--speculative-num-steps", "8",
        "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", "9",
    ]  # fmt: skip
    tree = sglang_args(_spec(tmp_path / "t", tiny_ckpts, **EAGLE, **DYNAMIC).speculative, "/h")
    assert tree[4:] == ["--speculative-num-steps", "8", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "13"]
    draft = sglang_args(_spec(tmp_path / "d", tiny_ckpts, **DYNAMIC).speculative, "/d")
    assert draft[:2] == ["--speculative-algorithm", "STANDALONE"]
    assert unknown_flags(chain) == unknown_flags(tree) == unknown_flags(draft) == []
    assert unknown_flags(["--speculative-topk", "2", "--speculative-algorithm", "EAGLE-3"]) == [
        "--speculative-topk",
        "--speculative-algorithm=EAGLE-3",
    ]


def test_sglang_refuses_a_static_tree_and_methods_without_a_model_draft(tmp_path, tiny_ckpts):
    s = _spec(tmp_path / "s", tiny_ckpts, **EAGLE, **STATIC).speculative
    with pytest.raises(SpecError, match=r"^speculative\.tree\.choices: SGLang builds EAGLE-2's dynamic tree only"):
        sglang_args(s, "/h")
    ngram = load_spec(write_spec(tmp_path / "n", tiny_ckpts, None, **{"speculative.method": "ngram"})).spec.speculative
    with pytest.raises(SpecError, match=r"^speculative\.method ngram: trtspec writes SGLang settings for model drafts"):
        sglang_args(ngram, "/h")
    with pytest.raises(SpecError, match=r"^speculative\.method ngram: trtspec writes vLLM settings for model drafts"):
        vllm_speculative_config(ngram, "/h")


def test_an_llmapi_tree_spec_builds_and_verifies_through_the_double(tmp_path, tiny_ckpts):
    from test_eagle3 import random_head
    from typer.testing import CliRunner

    from trtspec.cli.app import app

    ck = {"target": tiny_ckpts["target"], "head": random_head(tiny_ckpts["target"], tmp_path / "head")}
    over = {**LLMAPI_13, **EAGLE, "speculative.tree": {"dynamic": {"top_k": 2, "nodes": 5}}, "speculative.max_draft_len": 3}
    loaded = load_spec(write_spec(tmp_path, ck, "head", **over, **{"verify.max_tokens": 16}))
    build(loaded, loaded.output_dir())
    cfg = yaml.safe_load((loaded.output_dir() / "llmapi" / "speculative.yaml").read_text())["speculative_config"]
    assert (cfg["use_dynamic_tree"], cfg["dynamic_tree_max_topK"], cfg["max_total_draft_tokens"]) == (True, 2, 5)
    report = tmp_path / "r.json"
    r = CliRunner().invoke(app, ["verify", str(loaded.path), "--llmapi", "double", "--json-file", str(report)])
    assert r.exit_code == 0, r.output
    assert json.loads(report.read_text())["identical"]


def test_the_llmapi_endpoint_refuses_a_per_request_tree_switch():
    import numpy as np

    from trtspec.errors import RequestError
    from trtspec.triton.backend.llmapi_core import LlmapiEndpoint

    core = LlmapiEndpoint.__new__(LlmapiEndpoint)
    with pytest.raises(RequestError, match="draft_tree is not supported by the LLM API endpoints"):
        core.parse({"text_input": np.array([[b"hi"]], dtype=np.object_), "draft_tree": np.array([[False]])})


# ---------------------------------------------------------------- trtspec check prints them


def test_check_gives_the_same_draft_for_vllm_and_sglang_or_says_why_not(tmp_path, tiny_ckpts):
    """`trtspec check` reports the spec's draft as vLLM's speculative_config and SGLang's flags
    (the resolved folders), and names the engine that cannot express it instead of guessing."""
    from typer.testing import CliRunner

    from trtspec.cli.app import app

    runner = CliRunner()
    ck = {"target": tiny_ckpts["target"], "head": random_head(tiny_ckpts["target"], tmp_path / "head")}
    path = write_spec(tmp_path / "t", ck, "head", **EAGLE, **STATIC)
    r = runner.invoke(app, ["check", str(path), "--json"])
    assert r.exit_code == 0, r.output
    elsewhere = json.loads(r.stdout)["elsewhere"]
    s = load_spec(path).spec.speculative
    draft = elsewhere["vllm"]["speculative_config"]["model"]
    assert elsewhere["vllm"] == {"speculative_config": vllm_speculative_config(s, draft), "env": VLLM_TREE_ENV}
    assert elsewhere["sglang"]["error"].startswith("speculative.tree.choices: SGLang builds EAGLE-2's dynamic tree only")
    text = runner.invoke(app, ["check", str(path)], terminal_width=400).output
    assert f"VLLM_ATTENTION_BACKEND=TREE_ATTN vllm serve {elsewhere['target']} --speculative-config" in text
    assert "SGLang: speculative.tree.choices" in text
    chain = runner.invoke(app, ["check", str(write_spec(tmp_path / "c", ck, "head", **EAGLE)), "--json"])
    assert json.loads(chain.stdout)["elsewhere"]["sglang"]["args"][:2] == ["--speculative-algorithm", "EAGLE3"]
    ngram = runner.invoke(
        app, ["check", str(write_spec(tmp_path / "n", tiny_ckpts, None, **{"speculative.method": "ngram"})), "--json"]
    )
    assert json.loads(ngram.stdout)["elsewhere"] == {}

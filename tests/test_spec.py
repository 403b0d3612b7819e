"""Engine spec validation: every error names the field path and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from trtspec.errors import SpecError
from trtspec.spec import load_spec

ROOT = Path(__file__).resolve().parents[1]
BASE = {
    "name": "t",
    "target": {"path": "/tmp/x", "dtype": "float32"},
    "draft": {"path": "/tmp/x", "dtype": "bfloat16"},
}


def _write(tmp_path, data) -> Path:
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return p


def _error(tmp_path, data) -> str:
    with pytest.raises(SpecError) as e:
        load_spec(_write(tmp_path, data))
    assert e.value.exit_code == 2
    return str(e.value)


def _with(**changes):
    data = yaml.safe_load(yaml.safe_dump(BASE))
    for dotted, value in changes.items():
        node = data
        *parents, last = dotted.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        if value is None:
            node.pop(last)
        else:
            node[last] = value
    return data


@pytest.mark.parametrize("path", sorted((ROOT / "engine_specs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_specs_are_valid(path):
    loaded = load_spec(path)
    assert loaded.spec.name == path.stem or loaded.spec.name


def test_defaults_and_paths(tmp_path):
    loaded = load_spec(_write(tmp_path, _with(target__path="rel/dir")))
    spec = loaded.spec
    assert spec.backend == "torch"
    assert spec.speculative.method == "draft_target"
    assert spec.speculative.default_draft_tokens == spec.speculative.max_draft_len
    assert loaded.resolve("rel/dir") == (tmp_path / "rel/dir").resolve()
    assert spec.build_hash("target") != spec.build_hash("draft")


def test_unknown_key_names_path_and_allowed_keys(tmp_path):
    msg = _error(tmp_path, _with(target__dtpye="float32"))
    assert msg.endswith(
        "target.dtpye: unknown key; remove or rename it (allowed: repo, revision, path, "
        "gguf_file, dtype, trust_remote_code, tp_size, pp_size, quantization, gpu_device_ids, build)"
    )


def test_unknown_top_level_key(tmp_path):
    assert "surprise: unknown key; remove or rename it (allowed: name, backend," in _error(tmp_path, _with(surprise=1))


def test_missing_required_key(tmp_path):
    assert _error(tmp_path, _with(name=None)).endswith("name: required key is missing; add it")


def test_bad_dtype(tmp_path):
    msg = _error(tmp_path, _with(draft__dtype="int8"))
    assert "draft.dtype: Input should be 'float32', 'float16' or 'bfloat16' (got 'int8')" in msg


def test_input_len_must_be_below_seq_len(tmp_path):
    msg = _error(tmp_path, _with(build={"max_input_len": 512, "max_seq_len": 512}))
    assert "build: max_input_len (512) must be smaller than max_seq_len (512)" in msg
    assert "lower max_input_len or raise max_seq_len" in msg


@pytest.mark.parametrize("k", [0, 17])
def test_max_draft_len_range(tmp_path, k):
    msg = _error(tmp_path, _with(speculative={"max_draft_len": k}))
    assert "speculative.max_draft_len:" in msg


def test_default_draft_tokens_within_max(tmp_path):
    msg = _error(tmp_path, _with(speculative={"max_draft_len": 4, "default_draft_tokens": 6}))
    assert "default_draft_tokens (6) exceeds max_draft_len (4)" in msg


def test_default_draft_tokens_is_max_draft_len_unless_given(tmp_path):
    s = load_spec(_write(tmp_path, _with(speculative={"max_draft_len": 6}))).spec.speculative
    assert s.default_draft_tokens == 6
    given = load_spec(_write(tmp_path, _with(speculative={"max_draft_len": 6, "default_draft_tokens": 2})))
    assert given.spec.speculative.default_draft_tokens == 2


def test_the_per_request_name_is_refused_in_the_spec_with_the_deployment_name(tmp_path):
    """num_draft_tokens is what a request sends; the spec names its default default_draft_tokens."""
    msg = _error(tmp_path, _with(speculative={"max_draft_len": 4, "num_draft_tokens": 2}))
    assert "speculative" in msg and "default_draft_tokens: rename the key" in msg
    # an invalid max_draft_len is reported alone, not as a second error on the default it fills
    msg = _error(tmp_path, _with(speculative={"max_draft_len": "four"}))
    assert "max_draft_len" in msg and "default_draft_tokens" not in msg


def test_draft_target_needs_draft(tmp_path):
    msg = _error(tmp_path, _with(draft=None))
    assert "method draft_target needs a `draft` model; add one or use method: ngram" in msg


def test_ngram_forbids_draft(tmp_path):
    assert "method ngram uses no draft model; remove `draft`" in _error(tmp_path, _with(speculative={"method": "ngram"}))


def test_repo_needs_pinned_revision(tmp_path):
    msg = _error(tmp_path, _with(target={"repo": "org/model"}))
    assert "target: `repo: org/model` needs a pinned `revision`" in msg
    msg = _error(tmp_path, _with(target={"repo": "org/model", "revision": "main"}))
    assert "revision 'main' is a moving branch; pin a commit sha or tag" in msg


def test_exactly_one_source(tmp_path):
    msg = _error(tmp_path, _with(target={"repo": "org/m", "revision": "abc", "path": "/x"}))
    assert "give exactly one source" in msg


def test_torch_backend_rejects_trtllm_options(tmp_path):
    msg = _error(tmp_path, _with(target__tp_size=2))
    assert "target: tp_size and pp_size are TensorRT-LLM options" in msg


@pytest.mark.parametrize("value", ["int8_wo", "int4_wo"])
def test_torch_backend_takes_weight_only_quantization(tmp_path, value):
    spec = load_spec(_write(tmp_path, _with(draft__quantization=value, target__quantization=value))).spec
    assert spec.draft.quantization == value and spec.target.quantization == value


@pytest.mark.parametrize("value", ["fp8", "int4_awq"])
def test_torch_backend_refuses_trtllm_quantizations(tmp_path, value):
    msg = _error(tmp_path, _with(draft__quantization=value))
    assert (
        f"draft.quantization: {value} is a TensorRT-LLM quantization; the torch backend runs none, int8_wo, int4_wo "
        "(or set backend: trtllm)"
    ) in msg


def test_quantized_torch_engine_needs_the_cpu(tmp_path):
    msg = _error(tmp_path, _with(device="cuda", draft__quantization="int4_wo"))
    assert "draft.quantization: int4_wo runs PyTorch's CPU weight-only kernels; set device: cpu (not cuda)" in msg


def test_eagle3_head_is_not_quantized(tmp_path):
    data = _with(speculative__method="eagle3", draft__quantization="int8_wo")
    msg = _error(tmp_path, data)
    assert "draft.quantization: the torch backend runs an EAGLE-3 head as trained; remove quantization" in msg


def test_bad_name(tmp_path):
    assert "name: 'My Spec' is not a usable name" in _error(tmp_path, _with(name="My Spec"))


def test_name_with_trailing_newline_is_refused(tmp_path):
    # `$` in a regex also matches before a final newline; the whole name must match.
    assert "is not a usable name" in _error(tmp_path, _with(name="demo\n"))


def test_yaml_syntax_error_names_line(tmp_path):
    msg = _error(tmp_path, "name: x\ntarget: [unclosed\n")
    assert "invalid YAML" in msg and "line" in msg


def test_not_a_mapping(tmp_path):
    assert "the spec must be a YAML mapping" in _error(tmp_path, "- a\n- b\n")


def test_missing_file(tmp_path):
    with pytest.raises(SpecError, match="spec file .* not found"):
        load_spec(tmp_path / "nope.yaml")


def test_prompts_file(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"prompt": "one"}\n\n{"prompt": "two"}\n')
    loaded = load_spec(_write(tmp_path, _with(verify={"prompts": ["zero"], "prompts_file": "p.jsonl"})))
    assert loaded.verify_prompts() == ["zero", "one", "two"]
    (tmp_path / "p.jsonl").write_text('{"text": "one"}\n')
    with pytest.raises(SpecError, match=r'p.jsonl:1: expected \{"prompt": "<non-empty text>"\}'):
        loaded.verify_prompts()


# ------------------------------------------------------------------ not UTF-8, trust, limits

LATIN1_SPEC = "name: t\n# caf\xe9\ntarget: {path: /tmp/x}\n".encode("latin-1")  # é as one byte, 0xe9


@pytest.mark.parametrize(
    "argv",
    [
        ["check", "{spec}"],
        ["build", "{spec}", "--dry-run"],
        ["verify", "{spec}"],
        ["bench", "{spec}"],
        ["repo", "{spec}"],
        ["serve", "{spec}", "--dry-run"],
        ["deploy", "k8s", "{spec}"],
        ["distill", "{spec}"],
        ["openai", "{spec}"],
    ],
    ids=lambda a: " ".join(a[:2]),
)
def test_a_spec_that_is_not_utf8_is_exit_2_naming_file_and_offset(tmp_path, argv):
    from typer.testing import CliRunner

    from trtspec.cli.app import app

    spec = tmp_path / "latin1.yaml"
    spec.write_bytes(LATIN1_SPEC)
    r = CliRunner().invoke(app, [a.format(spec=spec) for a in argv])
    assert r.exit_code == 2, r.output
    assert f"spec file {spec}: not UTF-8 text (byte 0xe9 at byte offset {LATIN1_SPEC.index(0xE9)})" in r.stderr
    assert "Traceback" not in r.output


@pytest.mark.parametrize("data", [b'{"prompt": "caf\xe9"}\n', b'{"prompt": "x"}\n\x00\xff\xfe binary'])
def test_a_prompts_file_that_is_not_utf8_is_exit_2_naming_file_and_offset(tmp_path, data):
    from typer.testing import CliRunner

    from trtspec.cli.app import app

    (tmp_path / "p.jsonl").write_bytes(data)
    bad = next(i for i in range(len(data)) if data[i] >= 0x80)
    loaded = load_spec(_write(tmp_path, _with(verify={"prompts_file": "p.jsonl"})))
    with pytest.raises(SpecError) as e:
        loaded.verify_prompts()
    assert f"verify.prompts_file {tmp_path / 'p.jsonl'}: not UTF-8 text (byte 0x{data[bad]:02x} at byte offset {bad})" in str(
        e.value
    )
    spec = _write(tmp_path, _with())
    for argv in (
        ["bench", str(spec), "--prompts-file", str(tmp_path / "p.jsonl")],
        ["distill", str(spec), "--prompts", str(tmp_path / "p.jsonl"), "--output", str(tmp_path / "head")],
    ):
        r = CliRunner().invoke(app, argv)
        assert r.exit_code == 2, r.output
        assert f"{tmp_path / 'p.jsonl'}: not UTF-8 text" in r.stderr and f"byte offset {bad}" in r.stderr


def test_trust_remote_code_needs_a_full_commit_sha(tmp_path):
    for revision in ("v1.0", "abc1234", "refs/pr/1"):
        msg = _error(tmp_path, _with(target={"repo": "org/m", "revision": revision, "trust_remote_code": True}))
        assert (
            f"trust_remote_code runs the repo's code, so `revision` must be a full 40-character commit sha, not '{revision}'"
            in msg
        )
    sha = "0123456789abcdef0123456789abcdef01234567"
    loaded = load_spec(_write(tmp_path, _with(target={"repo": "org/m", "revision": sha, "trust_remote_code": True})))
    assert loaded.spec.target.revision == sha
    # a tag stays fine without remote code
    assert load_spec(_write(tmp_path, _with(target={"repo": "org/m", "revision": "v1.0"}))).spec.target.revision == "v1.0"


@pytest.mark.parametrize(
    ("limits", "named"),
    [
        ({"max_batch_size": 2}, "max_batch_size 2 < the target's 4"),
        ({"max_seq_len": 1024, "max_input_len": 512}, "max_seq_len 1024 < the target's 2048"),
        ({"max_input_len": 256}, "max_input_len 256 < the target's 1024"),
    ],
)
@pytest.mark.parametrize("method", ["draft_target", "eagle3"])
def test_a_draft_built_smaller_than_the_target_is_refused(tmp_path, limits, named, method):
    full = {"max_batch_size": 4, "max_input_len": 1024, "max_seq_len": 2048} | limits
    msg = _error(tmp_path, _with(draft__build=full, speculative={"method": method}))
    assert "draft.build is smaller than the target's limits (" in msg and named in msg  # every smaller limit is named
    assert "raise draft.build or remove it" in msg
    bigger = {"max_batch_size": 8, "max_input_len": 1024, "max_seq_len": 4096}
    assert load_spec(_write(tmp_path, _with(draft__build=bigger))).spec.limits("draft").max_batch_size == 8


def test_max_response_mb_is_bounded_by_what_one_grpc_message_can_hold(tmp_path):
    msg = _error(tmp_path, _with(serve__max_response_mb=65_536))
    assert "serve.max_response_mb" in msg and "one gRPC message" in msg and "set at most 2047" in msg
    assert load_spec(_write(tmp_path, _with(serve__max_response_mb=2047))).spec.serve.max_response_mb == 2047


# --- speculative.tree: a static choice list or an EAGLE-2 dynamic tree, one error per problem


def _tree(tree, **speculative):
    return _with(speculative={"method": "eagle3", "max_draft_len": 3, "tree": tree} | speculative)


def test_a_static_tree_is_kept_breadth_first(tmp_path):
    spec = load_spec(_write(tmp_path, _tree({"choices": [[0, 0], [1], [0]]}))).spec
    tree = spec.speculative.tree
    assert tree.choices == ((0,), (1,), (0, 0))  # by depth, then path: vLLM's and TensorRT-LLM's order
    assert (tree.node_count, tree.depth(spec.speculative.max_draft_len)) == (3, 2)


def test_a_dynamic_tree_reaches_max_draft_len(tmp_path):
    spec = load_spec(_write(tmp_path, _tree({"dynamic": {"top_k": 4, "nodes": 8}}))).spec
    assert (spec.speculative.tree.node_count, spec.speculative.tree.depth(3)) == (8, 3)


@pytest.mark.parametrize(
    ("tree", "speculative", "needle"),
    [
        ({"choices": []}, {}, "speculative.tree.choices: no nodes: list each drafted node's path"),
        ({"choices": [[0], [1], [0]]}, {}, "speculative.tree.choices: [0] is listed twice; list each node once"),
        ({"choices": [[0], [1, 0]]}, {}, "speculative.tree.choices: [1, 0] has no parent: add [1] or remove it"),
        ({"choices": [[0], []]}, {}, "speculative.tree.choices: [] names the root, which is the last accepted token"),
        ({"choices": [[0], [-1]]}, {}, "speculative.tree.choices: [-1]: child ranks run from 0 to 15"),
        ({"choices": [[0], [0, 0]]}, {}, "is one branch, a chain: remove speculative.tree and set max_draft_len: 2"),
        (
            {"choices": [[0], [1], [0, 0], [0, 0, 0], [0, 0, 0, 0]]},
            {},
            "speculative: tree.choices: paths 4 deep, beyond max_draft_len (3); raise max_draft_len",
        ),
        (
            {
                "choices": [[i] for i in range(16)]
                + [[0, i] for i in range(16)]
                + [[1, i] for i in range(16)]
                + [[2, i] for i in range(16)]
                + [[3, 0]]
            },
            {},
            "65 nodes; a tree verifies at most 64",
        ),
        ({}, {}, "speculative.tree: give exactly one shape: `choices`"),
        ({"choices": [[0], [1]], "dynamic": {"top_k": 2, "nodes": 4}}, {}, "speculative.tree: give exactly one shape"),
        ({"dynamic": {"top_k": 1, "nodes": 3}}, {}, "tree.dynamic.top_k: top_k 1 drafts one branch, a chain"),
        (
            {"dynamic": {"top_k": 2, "nodes": 1}},
            {},
            "tree.dynamic.nodes: a tree of 1 node is a chain: remove speculative.tree or set nodes >= 2",
        ),
        ({"dynamic": {"top_k": 2, "nodes": 7}}, {}, "tree.dynamic.nodes (7) must lie between max_draft_len (3)"),
        ({"dynamic": {"top_k": 2, "nodes": 2}}, {}, "and top_k x max_draft_len (6)"),
        ({"dynamic": {"top_k": 2, "nodes": 65}}, {}, "speculative.tree.dynamic.nodes: Input should be less than or equal to 64"),
        (
            {"dynamic": {"top_k": 2, "nodes": 4, "depth": 3}},
            {},
            "tree.dynamic.depth: unknown key; remove or rename it (allowed: top_k, nodes)",
        ),
        (
            {"choices": [[0], [1]]},
            {"method": "ngram"},
            "tree: method ngram drafts one continuation, a chain; trees are drafted by draft_target and eagle3",
        ),
        ({"choices": [[0], [1]]}, {"suffix": {"threshold": 4}}, "tree: a layered suffix draft is a chain"),
        (
            {"dynamic": {"top_k": 16, "nodes": 20}},
            {"max_draft_len": 6},
            "tree.dynamic: growing the tree scores top_k x (max_draft_len - 1) = 80 nodes in one draft forward; at most 64",
        ),
    ],
)
def test_tree_refusals(tmp_path, tree, speculative, needle):
    data = _tree(tree, **speculative)
    if speculative.get("method") == "ngram":
        data.pop("draft")
    assert needle in _error(tmp_path, data)

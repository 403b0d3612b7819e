"""Method auto and adaptive k: the spec's settings, the one loop's choices (lossless, per
request, within a request, off and back), and where they reach (runtime, Triton, bench,
verify, exports, Prometheus)."""

from __future__ import annotations

import pytest
import yaml

from trtspec.errors import SpecError
from trtspec.spec import load_spec

BASE = {
    "name": "t",
    "target": {"path": "/tmp/x", "dtype": "float32"},
    "draft": {"path": "/tmp/x", "dtype": "bfloat16"},
}
AUTO = {"method": "auto", "auto": {"methods": ["draft_target", "suffix", "ngram"]}}


def _load(tmp_path, speculative: dict, draft: bool = True, **top):
    data = yaml.safe_load(yaml.safe_dump(BASE)) | {"speculative": speculative} | top
    if not draft:
        data.pop("draft")
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(data))
    return load_spec(p).spec


def _error(tmp_path, speculative: dict, draft: bool = True, **top) -> str:
    with pytest.raises(SpecError) as e:
        _load(tmp_path, speculative, draft, **top)
    assert e.value.exit_code == 2
    return str(e.value)


# ---------------------------------------------------------------- spec


def test_auto_lists_its_drafters_and_adapts(tmp_path):
    s = _load(tmp_path, AUTO).speculative
    assert s.methods == ("draft_target", "suffix", "ngram") and s.model_draft == "draft_target"
    assert s.adapts and s.suffix_drafting is not None
    free = _load(tmp_path, {"method": "auto", "auto": {"methods": ["ngram"]}}, draft=False).speculative
    assert free.model_draft is None and free.suffix_drafting is None
    one = _load(tmp_path, {"method": "ngram", "adaptive": True}, draft=False).speculative
    assert one.methods == ("ngram",) and one.adapts
    assert not _load(tmp_path, {"method": "ngram"}, draft=False).speculative.adapts


@pytest.mark.parametrize(
    "speculative, draft, expected",
    [
        ({"method": "auto"}, True, "method auto needs `auto: {methods: [draft_target, suffix, ngram]}`"),
        ({"method": "ngram", "auto": {"methods": ["ngram"]}}, False, "auto: applies to method auto; remove auto"),
        ({"method": "auto", "auto": {"methods": ["medusa"]}}, True, "auto.methods.0: Input should be"),
        ({"method": "auto", "auto": {"methods": ["auto"]}}, True, "auto.methods.0: Input should be"),
        ({"method": "auto", "auto": {"methods": []}}, True, "auto.methods"),
        ({"method": "auto", "auto": {"methods": ["ngram", "ngram"]}}, False, "lists a method twice"),
        ({"method": "auto", "auto": {"methods": ["eagle3", "ngram"]}}, True, "use method: eagle3 with adaptive: true"),
        (AUTO, False, "auto.methods lists draft_target, which drafts with a `draft` model; add draft or remove"),
        ({"method": "auto", "auto": {"methods": ["suffix", "ngram"]}}, True, "use no draft model; remove `draft`"),
        (AUTO | {"tree": {"dynamic": {"top_k": 2, "nodes": 4}}}, True, "tree: method auto drafts one continuation"),
        (
            {"method": "draft_target", "adaptive": True, "tree": {"dynamic": {"top_k": 2, "nodes": 4}}},
            True,
            "remove tree or adaptive",
        ),
        ({"method": "auto", "auto": {"methods": ["ngram"]}, "suffix": {}}, False, "auto.methods lists no suffix"),
        (AUTO | {"suffix": {"threshold": 3}}, True, "remove threshold"),
    ],
)
def test_auto_settings_are_refused_by_name(tmp_path, speculative, draft, expected):
    assert expected in _error(tmp_path, speculative, draft)


def test_trtllm_engine_runtime_refuses_adaptive_and_auto(tmp_path):
    trt = {"backend": "trtllm", "trtllm": {"runtime": "engine", "line": "1.2"}}
    assert "speculative.adaptive: trtllm.runtime engine drafts the k a request sends" in _error(
        tmp_path, {"method": "draft_target", "adaptive": True}, **trt
    )
    assert "speculative.method auto: trtllm.runtime engine builds draft_target" in _error(tmp_path, AUTO, **trt)

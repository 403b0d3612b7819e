"""The torch engine's Linear kernels: chosen per machine by measuring every layout, cached,
and interchangeable (the same greedy tokens whichever runs)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from trtspec.engines.torch import kernels
from trtspec.engines.torch.engine import TorchEngine
from trtspec.engines.torch.kernels import choose_kernels
from trtspec.engines.torch.model import OneDnnLinear
from trtspec.engines.torch.native import PanelLinear
from trtspec.runtime import Deployment

PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Summarise the following text in one sentence."]


def _layout_of(model) -> str:
    body = [c for m in model.model.modules() for c in m.children() if isinstance(c, nn.Linear | OneDnnLinear | PanelLinear)]
    kinds = {type(c) for c in body}
    assert len(kinds) == 1, f"mixed layouts in the layers: {kinds}"
    if kinds == {PanelLinear}:
        assert isinstance(model.lm_head, PanelLinear), "panel layers with another LM head: no such layout"
        return "panel"
    packed_head = isinstance(model.lm_head, OneDnnLinear)
    if kinds == {OneDnnLinear}:
        assert packed_head, "packed layers with a dense LM head: no such layout"
        return "onednn"
    return "head" if packed_head else "dense"


def _dense(folder, monkeypatch) -> TorchEngine:
    """A fresh dense (unpacked) engine; the environment forces nothing after."""
    monkeypatch.setenv("TRTSPEC_ONEDNN", "0")
    engine = TorchEngine.load(folder)
    monkeypatch.delenv("TRTSPEC_ONEDNN")
    return engine


@pytest.fixture
def dense_engine(built, monkeypatch):
    return _dense(built().target.folder, monkeypatch)


def _choose(engine, tmp_path, **kw):
    return choose_kernels(engine.model, engine.cos, engine.sin, verify_tokens=4, cache_dir=tmp_path, **kw)


def _fake_timer(faster: str, calls: list[str]):
    """A step timer that reports ``faster``'s steps as 1 ms each and the other layouts' as 3 ms."""

    def make(model, cos, sin, sizes):
        def timed() -> list[float]:
            layout = _layout_of(model)
            calls.append(layout)
            return [0.001 if layout == faster else 0.003 for _ in sizes]

        return timed

    return make


@pytest.mark.parametrize("faster", ["dense", "onednn", "head", "panel"])
def test_selection_measures_every_layout_and_keeps_the_fastest(dense_engine, tmp_path, monkeypatch, faster):
    if kernels.candidates(dense_engine.model) != kernels.LAYOUTS:
        pytest.skip("the panel kernel cannot be built here (no C++ compiler)")
    calls: list[str] = []
    monkeypatch.setattr(kernels, "step_timer", _fake_timer(faster, calls))
    choice = _choose(dense_engine, tmp_path)
    assert (choice.layout, choice.source) == (faster, "measured")
    assert set(calls) == set(kernels.LAYOUTS)  # all were timed, on the real model
    assert calls.count("dense") == calls.count("onednn") == calls.count("head") == calls.count("panel")
    assert choice.sizes == (1, 2, 3, 4)  # a decode step and every verify size up to verify_tokens=4
    assert choice.seconds == pytest.approx({name: 0.004 if name == faster else 0.012 for name in kernels.LAYOUTS})
    assert choice.steps == {name: [0.001 if name == faster else 0.003] * 4 for name in kernels.LAYOUTS}
    assert _layout_of(dense_engine.model) == faster  # the model runs what was chosen


def test_real_measurement_times_each_and_the_choice_is_the_lowest_median(dense_engine, tmp_path):
    choice = _choose(dense_engine, tmp_path)
    assert choice.source == "measured" and set(choice.seconds) == set(kernels.LAYOUTS)
    assert all(s > 0 for s in choice.seconds.values())
    if "|" not in choice.layout:  # a split choice is tested below
        assert choice.layout == min(choice.seconds, key=lambda k: (choice.seconds[k], k != "dense"))
        assert _layout_of(dense_engine.model) == choice.layout


def test_the_choice_is_cached_per_machine_and_measured_again_elsewhere(built, dense_engine, tmp_path, monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(kernels, "step_timer", _fake_timer("onednn", calls))
    first = _choose(dense_engine, tmp_path)
    measured = len(calls)
    entries = json.loads((tmp_path / kernels.CACHE_FILE).read_text())
    assert entries[first.key]["layout"] == "onednn"
    second = _dense(built().target.folder, monkeypatch)  # the same shape on the same machine
    cached = _choose(second, tmp_path)
    assert (cached.layout, cached.source, len(calls)) == ("onednn", "cached", measured)  # not timed again
    assert _layout_of(second.model) == "onednn"
    # Another CPU capability (here: an instruction-set cap in the environment) is another key.
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    third = _choose(_dense(built().target.folder, monkeypatch), tmp_path)
    assert third.source == "measured" and third.key != first.key and len(calls) > measured


def test_a_damaged_cache_is_measured_again_and_rewritten(dense_engine, tmp_path, monkeypatch):
    (tmp_path / kernels.CACHE_FILE).write_text("{not json")
    monkeypatch.setattr(kernels, "step_timer", _fake_timer("dense", []))
    choice = _choose(dense_engine, tmp_path)
    assert choice.source == "measured"
    assert json.loads((tmp_path / kernels.CACHE_FILE).read_text())[choice.key]["layout"] == "dense"


@pytest.mark.parametrize(("env", "layout"), [("0", "dense"), ("1", "onednn"), ("head", "head"), ("panel", "panel")])
def test_the_environment_can_force_a_layout_without_measuring(dense_engine, tmp_path, monkeypatch, env, layout):
    monkeypatch.setattr(kernels, "step_timer", lambda *a: pytest.fail("measured despite TRTSPEC_ONEDNN"))
    monkeypatch.setenv("TRTSPEC_ONEDNN", env)
    choice = _choose(dense_engine, tmp_path)
    assert (choice.layout, choice.source) == (layout, "forced")
    assert _layout_of(dense_engine.model) == layout
    assert not (tmp_path / kernels.CACHE_FILE).exists()


def test_a_failed_measurement_falls_back_to_dense(dense_engine, tmp_path, monkeypatch, capsys):
    calls = []

    def broken(model, cos, sin, sizes):
        def timed():
            calls.append(_layout_of(model))
            if len(calls) == 2:  # fails while the model is on the packed layout
                raise RuntimeError("oneDNN kernel exploded")
            return [0.001 for _ in sizes]

        return timed

    monkeypatch.setattr(kernels, "step_timer", broken)
    choice = _choose(dense_engine, tmp_path)
    assert (choice.layout, choice.source) == ("dense", "fallback")
    assert calls == ["dense", "onednn"]
    assert _layout_of(dense_engine.model) == "dense"
    assert "kernel measurement failed" in capsys.readouterr().err


def test_float16_weights_keep_dense_without_measuring(dense_engine, tmp_path, monkeypatch):
    monkeypatch.setattr(kernels, "step_timer", lambda *a: pytest.fail("measured a float16 model"))
    dense_engine.model.to(torch.float16)
    choice = _choose(dense_engine, tmp_path)
    assert (choice.layout, choice.source) == ("dense", "fallback")


def test_every_layout_decodes_the_same_greedy_tokens(built, monkeypatch):
    """Target-only and speculative, every prompt: identical token ids whichever kernels run."""
    dep = built()
    outs = {}
    for env, layout in (("0", "dense"), ("1", "onednn"), ("head", "head"), ("panel", "panel")):
        monkeypatch.setenv("TRTSPEC_ONEDNN", env)
        d = Deployment(dep.loaded, dep.loaded.output_dir())
        assert d.target.kernels.layout == layout and _layout_of(d.target.model) == layout
        reqs = [d.request(d.encode(p), 32, 4) for p in PROMPTS]
        outs[layout] = (
            [r.output_ids for r in d.generate(reqs, speculative=False)],
            [r.output_ids for r in d.generate(reqs, speculative=True)],
        )
    assert outs["dense"] == outs["onednn"] == outs["head"] == outs["panel"]
    assert all(len(ids) > 0 for ids in outs["dense"][0])


def test_bfloat16_engines_choose_too_and_every_layout_decodes_the_same_tokens(built, monkeypatch, tmp_path):
    """A bfloat16 engine (the demo's draft dtype) has the same layouts: PyTorch's dense bf16,
    the weights reordered for oneDNN's bf16 matmul, or only the LM head's; all give the same
    greedy tokens, and the measurement times each."""
    if not kernels._bf16_reorder_works():
        pytest.skip("this CPU has no oneDNN bf16 reorder (needs avx512bw/vl/dq or avx_ne_convert): dense only, tested below")
    dep = built(**{"target.dtype": "bfloat16", "draft.dtype": "bfloat16"})
    outs = {}
    for env, layout in (("0", "dense"), ("1", "onednn"), ("head", "head")):
        monkeypatch.setenv("TRTSPEC_ONEDNN", env)
        d = Deployment(dep.loaded, dep.loaded.output_dir())
        assert d.target.kernels.layout == layout and _layout_of(d.target.model) == layout
        assert d.draft.kernels.layout == layout
        reqs = [d.request(d.encode(p), 24, 4) for p in PROMPTS]
        outs[layout] = (
            [r.output_ids for r in d.generate(reqs, speculative=False)],
            [r.output_ids for r in d.generate(reqs, speculative=True)],
        )
    assert outs["dense"] == outs["onednn"] == outs["head"]
    monkeypatch.delenv("TRTSPEC_ONEDNN")
    engine = _dense(dep.target.folder, monkeypatch)
    calls: list[str] = []
    monkeypatch.setattr(kernels, "step_timer", _fake_timer("onednn", calls))
    choice = _choose(engine, tmp_path)
    assert (choice.layout, choice.source) == ("onednn", "measured") and set(calls) == set(kernels.LAYOUTS) - {"panel"}


@pytest.mark.parametrize("env", ["", "1", "head"])
def test_bfloat16_without_the_cpu_support_stays_dense(built, monkeypatch, tmp_path, env):
    """Where oneDNN cannot reorder bf16 weights (AVX2-only CPUs), a bfloat16 engine is neither
    measured nor forced onto a packed layout: it loads dense and says why."""
    monkeypatch.setattr(kernels, "_bf16_reorder_works", lambda: False)
    monkeypatch.setattr(kernels, "step_timer", lambda *a: pytest.fail("measured a layout this CPU cannot run"))
    dep = built(**{"target.dtype": "bfloat16", "draft.dtype": "bfloat16"})
    engine = _dense(dep.target.folder, monkeypatch)
    monkeypatch.setenv("TRTSPEC_ONEDNN", env)
    choice = _choose(engine, tmp_path)
    assert (choice.layout, choice.source) == ("dense", "fallback")
    assert "oneDNN cannot run this model" in choice.reason
    assert _layout_of(engine.model) == "dense"


def test_the_packed_layout_converts_nothing_per_call(built, monkeypatch):
    """onednn runs reordered weights on dense activations: no per-Linear conversion of the
    input to an mkldnn tensor and back (which cost more than the matmul at decode)."""
    from torch.profiler import profile

    monkeypatch.setenv("TRTSPEC_ONEDNN", "1")
    engine = TorchEngine.load(built().target.folder, slots=1)
    assert _layout_of(engine.model) == "onednn"
    from trtspec.engines.torch.engine import ForwardItem

    engine.run([ForwardItem(list(range(10, 30)), 1)])
    with profile() as prof:
        engine.run([ForwardItem(list(range(10, 31)), 1)])  # one decode step
    names = {e.key for e in prof.key_averages()}
    assert "mkldnn::_linear_pointwise" in names
    assert not names & {"aten::to_mkldnn", "aten::_to_dense", "aten::mkldnn_linear"}


def test_a_choice_made_with_other_kernels_is_measured_again(dense_engine, tmp_path, monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(kernels, "step_timer", _fake_timer("onednn", calls))
    first = _choose(dense_engine, tmp_path)
    monkeypatch.setattr(kernels, "KERNELS_VERSION", "older")
    again = _choose(_dense(dense_engine.folder, monkeypatch), tmp_path)
    assert first.source == again.source == "measured" and again.key != first.key


def _split_timer(calls: list[str], small: str = "head", threshold: int = 2):
    """``small`` fastest below ``threshold`` rows (1 ms vs 3), onednn from there on (2 ms vs 6):
    no single layout is best at every size, as on a Xeon with AMX."""

    def make(model, cos, sin, sizes):
        def timed() -> list[float]:
            layout = _layout_of(model)
            calls.append(layout)
            return [
                (0.001 if layout == small else 0.003) if n < threshold else (0.002 if layout == "onednn" else 0.006)
                for n in sizes
            ]

        return timed

    return make


def _forms(model) -> dict[str, tuple[type, type]]:
    """Each Linear's (one-row, more-rows) form."""
    out = {}
    for module_name, module in model.named_modules():
        for name, child in module.named_children():
            if isinstance(child, kernels.ByRows):
                out[f"{module_name}.{name}".lstrip(".")] = (type(child.one), type(child.many))
            elif isinstance(child, nn.Linear | OneDnnLinear) and not isinstance(module, kernels.ByRows):
                out[f"{module_name}.{name}".lstrip(".")] = (type(child), type(child))
    return out


def test_a_layout_per_shape_when_no_single_one_is_best_at_both(dense_engine, tmp_path, monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(kernels, "step_timer", _split_timer(calls))
    choice = _choose(dense_engine, tmp_path)
    assert (choice.layout, choice.source) == ("head|onednn", "measured")
    assert choice.steps["head"] == [0.001, 0.006, 0.006, 0.006] and choice.steps["onednn"] == [0.003, 0.002, 0.002, 0.002]
    forms = _forms(dense_engine.model)
    assert forms.pop("lm_head") == (OneDnnLinear, OneDnnLinear)  # packed in both: no second copy
    assert forms and all(one is not OneDnnLinear and many is OneDnnLinear for one, many in forms.values())
    # Cached as such: the next load of the same shape gets both forms without measuring.
    again = _dense(dense_engine.folder, monkeypatch)
    cached = _choose(again, tmp_path)
    assert (cached.layout, cached.source) == ("head|onednn", "cached") and _forms(again.model) == _forms(dense_engine.model)


def test_a_split_that_would_hold_too_much_twice_is_not_taken(dense_engine, tmp_path, monkeypatch):
    monkeypatch.setattr(kernels, "step_timer", _split_timer([]))
    monkeypatch.setattr(kernels, "MAX_SPLIT_BYTES", 0)
    choice = _choose(dense_engine, tmp_path)
    assert choice.layout in kernels.LAYOUTS and "|" not in choice.layout


@pytest.mark.parametrize(("small", "threshold", "layout"), [("head", 2, "head|onednn"), ("dense", 4, "dense|onednn@4")])
def test_a_split_choice_decodes_the_same_greedy_tokens(built, monkeypatch, tmp_path, small, threshold, layout):
    """Small steps on one form, larger ones on the other: the same token ids as dense."""
    dep = built()
    monkeypatch.setattr(kernels, "step_timer", _split_timer([], small, threshold))
    monkeypatch.setenv("TRTSPEC_CACHE", str(tmp_path))
    split_dep = Deployment(dep.loaded, dep.loaded.output_dir())
    assert split_dep.target.kernels.layout == layout
    monkeypatch.setenv("TRTSPEC_ONEDNN", "0")
    dense_dep = Deployment(dep.loaded, dep.loaded.output_dir())
    outs = []
    for d in (split_dep, dense_dep):
        reqs = [d.request(d.encode(p), 32, 4) for p in PROMPTS]
        outs.append(
            (
                [r.output_ids for r in d.generate(reqs, speculative=False)],
                [r.output_ids for r in d.generate(reqs, speculative=True)],
            )
        )
    assert outs[0] == outs[1] and all(outs[0][0])


def test_the_row_threshold_of_a_split_is_measured(dense_engine, tmp_path, monkeypatch):
    """dense fastest up to 3 rows, onednn from 4 (as a float32 SmolLM2 on a Xeon with AMX): the
    split runs 1-3 row inputs (decode, short verifies, small batches) dense, not only 1."""
    monkeypatch.setattr(kernels, "step_timer", _split_timer([], small="dense", threshold=4))
    choice = _choose(dense_engine, tmp_path)
    assert (choice.layout, choice.source) == ("dense|onednn@4", "measured")
    by_rows = [m for m in dense_engine.model.modules() if isinstance(m, kernels.ByRows)]
    assert by_rows and all(m.threshold == 4 for m in by_rows)
    linear = by_rows[0]
    ran = []
    monkeypatch.setattr(linear.one, "forward", lambda x: ran.append("one") or x)
    monkeypatch.setattr(linear.many, "forward", lambda x: ran.append("many") or x)
    width = linear.many.weight.shape[1] if isinstance(linear.many, nn.Linear) else linear.one.weight.shape[1]
    for rows in (1, 3, 4, 9):
        linear(torch.zeros(1, rows, width))
    assert ran == ["one", "one", "many", "many"]
    again = _dense(dense_engine.folder, monkeypatch)
    assert (_choose(again, tmp_path).layout, _forms(again.model)) == ("dense|onednn@4", _forms(dense_engine.model))


def test_split_choices_parse_and_a_bad_cached_one_is_measured_again(dense_engine, tmp_path, monkeypatch):
    assert kernels.split("dense") == ("dense", "dense", 2)
    assert kernels.split("head|onednn") == ("head", "onednn", 2)
    assert kernels.split("dense|onednn@4") == ("dense", "onednn", 4)
    assert kernels.join("dense", "onednn", 4) == "dense|onednn@4" and kernels.join("head", "onednn", 2) == "head|onednn"
    with pytest.raises(ValueError):
        kernels.split("dense|onednn@1")
    monkeypatch.setattr(kernels, "step_timer", _fake_timer("dense", []))
    key = kernels.choice_key(dense_engine.model, 4)
    (tmp_path / kernels.CACHE_FILE).write_text(json.dumps({key: {"layout": "dense|onednn@x"}}))
    assert _choose(dense_engine, tmp_path).source == "measured"


def test_an_engine_sized_to_short_data_is_measured_within_its_positions(built, tmp_path):
    """distill loads its target with max_seq_len = the longest prompt + response (here 20): the
    timed steps must fit its RoPE table (they once ran past it: 'index 40 is out of bounds',
    and the engine fell back to dense)."""
    engine = TorchEngine.load(built().target.folder, slots=1, max_seq_len=20)
    assert engine.kernels.source != "fallback", engine.kernels.reason
    assert all(t > 0 for t in kernels.step_timer(engine.model, engine.cos, engine.sin, kernels.timed_sizes(9))())


# -- an EAGLE-3 head's kernels ---------------------------------------------------------------------


def _head_layout(head) -> str:
    body = [
        c
        for m in (head.fc, *head.midlayer.modules())
        for c in (m, *m.children())
        if isinstance(c, nn.Linear | OneDnnLinear | PanelLinear)
    ]
    kinds = {type(c) for c in body}
    assert len(kinds) == 1, f"mixed layouts in the head's layer: {kinds}"
    if kinds == {PanelLinear}:
        return "panel"
    packed_head = isinstance(head.lm_head, OneDnnLinear)
    return "onednn" if kinds == {OneDnnLinear} else "head" if packed_head else "dense"


@pytest.fixture
def head_parts(built, tiny_ckpts, monkeypatch):
    """A random head for the tiny target, and what a HeadEngine shares with its target."""
    from transformers import AutoConfig

    from trtspec.distill.heads import new_head
    from trtspec.engines.eagle3_checkpoint import default_layer_ids

    hf = AutoConfig.from_pretrained(tiny_ckpts["target"])
    head, _ = new_head(hf, tiny_ckpts["target"], default_layer_ids(hf.num_hidden_layers), list(range(7, 300, 2)), 0, anchor=False)
    target = _dense(built().target.folder, monkeypatch)
    return head.eval(), target


def _head_engine(head, target, tmp_path, monkeypatch, env: str | None = None):
    from trtspec.engines.torch.eagle3_head import HeadEngine

    monkeypatch.setenv("TRTSPEC_CACHE", str(tmp_path))
    if env is not None:
        monkeypatch.setenv("TRTSPEC_ONEDNN", env)
    engine = HeadEngine(head, target.model.model.embed_tokens, target.cos, target.sin, 64, torch.float32, 2)
    monkeypatch.delenv("TRTSPEC_ONEDNN", raising=False)
    return engine


def _drafts(engine) -> tuple[list[int], torch.Tensor]:
    from trtspec.engines.torch.eagle3_head import HeadRow

    width = engine.cfg.n_features * engine.cfg.target_hidden_size
    state = engine.fuse(torch.linspace(-1, 1, 5 * width).view(5, width))
    outs = engine.extend([HeadRow(0, 0, state, [5, 9, 11, 13, 17]), HeadRow(1, 0, state[:2], [21, 23])])
    last = torch.stack([o[-1] for o in outs])
    return engine.next_ids(last), last


def test_a_head_engine_runs_its_own_packed_copy_and_drafts_what_the_dense_head_drafts(head_parts, tmp_path, monkeypatch):
    """The engine packs a copy: the caller's head (a trainer's) keeps its nn.Linear weights, and
    the packed head's layer outputs and draft ids are the dense head's."""
    head, target = head_parts
    dense = _head_engine(head, target, tmp_path, monkeypatch, env="0")
    packed = _head_engine(head, target, tmp_path, monkeypatch, env="1")
    assert (dense.kernels.layout, packed.kernels.layout, packed.kernels.source) == ("dense", "onednn", "forced")
    assert _head_layout(packed.head) == "onednn" and _head_layout(dense.head) == "dense"
    assert packed.head is not head and _head_layout(head) == "dense" and type(head.lm_head) is nn.Linear
    ids, outs = _drafts(dense)
    packed_ids, packed_outs = _drafts(packed)
    torch.testing.assert_close(packed_outs, outs, rtol=1e-5, atol=1e-5)
    assert packed_ids == ids


def test_a_heads_layout_is_measured_by_timing_head_steps_and_cached_under_its_own_key(head_parts, tmp_path, monkeypatch):
    from trtspec.engines.torch import eagle3_head

    head, target = head_parts
    calls: list[str] = []
    step_timer = eagle3_head.head_step_timer

    def fake(h, embed, cos, sin, dtype, sizes):
        assert sizes == eagle3_head.HEAD_STEP_SIZES
        real = step_timer(h, embed, cos, sin, dtype, sizes)  # the real step runs on every layout

        def timed():
            layout = _head_layout(h)
            calls.append(layout)
            assert all(t > 0 for t in real())
            return [0.001 if layout == "head" else 0.003 for _ in sizes]

        return timed

    monkeypatch.setattr(eagle3_head, "head_step_timer", fake)
    first = _head_engine(head, target, tmp_path, monkeypatch)
    assert (first.kernels.layout, first.kernels.source) == ("head", "measured")
    assert set(calls) == set(kernels.candidates(head)) and _head_layout(first.head) == "head"
    key = json.loads(first.kernels.key)
    assert key["model"] == "eagle3-head" and key != json.loads(kernels.choice_key(target.model, 4))
    measured = len(calls)
    second = _head_engine(head, target, tmp_path, monkeypatch)
    assert (second.kernels.layout, second.kernels.source, len(calls)) == ("head", "cached", measured)
    assert _head_layout(second.head) == "head"


def test_a_quantized_model_never_takes_the_cached_choice_of_a_float_model_of_its_shape(dense_engine, tmp_path):
    """The choice key names the quantization, and a cached layout the model cannot run (oneDNN's
    for weight-only Linears) is measured again, not applied."""
    from trtspec.engines.torch.quant import WeightOnlyLinear, quantize

    model = dense_engine.model
    float_key = kernels.choice_key(model, 4)
    (tmp_path / kernels.CACHE_FILE).write_text(json.dumps({float_key: {"layout": "onednn"}}))
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                bias = child.bias.detach() if child.bias is not None else None
                setattr(module, name, WeightOnlyLinear(quantize(child.weight, "int8_wo"), bias, torch.float32))
    choice = _choose(dense_engine, tmp_path)
    assert choice.layout.partition(":")[0] == "int8_wo"
    assert choice.source in ("measured", "quantized") and choice.key != float_key
    assert not kernels._valid("onednn", kernels.candidates(model))
    assert not [m for m in model.modules() if isinstance(m, OneDnnLinear)]

"""The compiled step (engines/torch/compiled.py) against the eager engine: the same logits to
float rounding, the same greedy tokens, speculative output identical to target-only, and a
failed compile that leaves the engine eager with its reason."""

from __future__ import annotations

import pytest
import torch
from conftest import load_engine as _load

from trtspec.engines.torch import compiled
from trtspec.engines.torch.engine import ForwardItem
from trtspec.engines.torch.kernels import one_row_form


@pytest.fixture(scope="module")
def folder(built):
    return built("same").target.folder.parent


@pytest.fixture(scope="module")
def pair(folder):
    """The tiny target twice: eager, and every step compiled."""
    return _load(folder, "target", "0"), _load(folder, "target", "1")


def _seq(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 384, (n,), generator=g).tolist()


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    # the same weights and formulas summed in another order: float32 rounding only
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_the_compiled_engine_runs_compiled_programs(pair):
    eager, fast = pair
    assert eager.program is None and eager.programs.source == "forced"
    assert fast.program is not None and (fast.programs.one, fast.programs.many) == ("compiled", "compiled")
    if one_row_form(fast.kernels) == "panel":  # the panel kernel streams a one-row step's weights itself
        assert not fast.program.streamed
    else:
        assert fast.program.streamed, "a float32 target streams its weights in one-row steps"


def test_decode_verify_and_prefill_steps_match_eager(pair):
    eager, fast = pair
    seq = _seq(30, 0)
    for eng in pair:
        eng.forget_prefixes()
    _same(fast.run([ForwardItem(seq, 30)])[0], eager.run([ForwardItem(seq, 30)])[0])  # prefill
    for n in range(31, 37):  # decode steps: one row
        seq = seq + [n]
        _same(fast.run([ForwardItem(seq, 1)])[0], eager.run([ForwardItem(seq, 1)])[0])
    for k in (1, 4, 8):  # verify steps of k + 1 tokens
        seq = seq + _seq(k + 1, k)
        _same(fast.run([ForwardItem(seq, k + 1)])[0], eager.run([ForwardItem(seq, k + 1)])[0])
    kinds = set(fast.program.compiled_kinds)  # (several rows, several tokens, captured layers, causal)
    assert {(False, True, False, True), (False, False, False, False), (False, True, False, False)} <= kinds


def test_a_ragged_batch_and_a_tree_match_eager(pair):
    eager, fast = pair
    seqs = [_seq(n, 10 + n) for n in (5, 17, 9, 30)]
    for eng in pair:
        eng.forget_prefixes()
    for a, b in zip(fast.run([ForwardItem(s, 3) for s in seqs]), eager.run([ForwardItem(s, 3) for s in seqs])):
        _same(a, b)
    # a batched decode: several rows, one token each
    seqs = [s + [1] for s in seqs]
    for a, b in zip(fast.run([ForwardItem(s, 1) for s in seqs]), eager.run([ForwardItem(s, 1) for s in seqs])):
        _same(a, b)
    tree = ForwardItem(seqs[0] + [4, 5, 6, 7], 5, tree=(-1, 0, 0, 1))
    _same(fast.run([tree])[0], eager.run([tree])[0])


def test_captured_layers_and_labels_match_eager(pair):
    eager, fast = pair
    seq = _seq(12, 3)
    labels = []
    for eng in pair:
        eng.capture_features((0, 1))
        eng.capture_labels(8)
        eng.run([ForwardItem(seq, 1)])
        (last,) = eng.run([ForwardItem(seq + [9], 1)])  # a one-row step keeps its features too
        ids, logits = eng.labels_of(seq + [9], 0, 13)
        top = torch.topk(last, 8, dim=-1)  # the labels are those of the logits the step returned
        assert torch.equal(ids[12:], top.indices) and torch.equal(logits[12:], top.values)
        assert (ids[:11] == -1).all() and (ids[11:] >= 0).all()  # only the positions scored
        labels.append((ids, logits))
    torch.testing.assert_close(fast.features_of(seq + [9], 0, 13), eager.features_of(seq + [9], 0, 13), rtol=1e-4, atol=1e-4)
    (fast_ids, fast_logits), (eager_ids, eager_logits) = labels[1], labels[0]
    torch.testing.assert_close(fast_logits, eager_logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(fast_ids[:, 0], eager_ids[:, 0])
    for eng in pair:
        eng.capture = ()
        eng.features = eng.labels = None


@pytest.mark.parametrize("method", ["draft_target", "ngram"])
def test_speculative_output_is_target_only_output_on_compiled_engines(built, monkeypatch, method):
    monkeypatch.setenv(compiled.COMPILE_ENV, "1")
    from trtspec.runtime import Deployment

    dep = built("same" if method == "draft_target" else None, **({"speculative.method": method} if method == "ngram" else {}))
    fresh = Deployment(dep.loaded, dep.target.folder.parent)  # loaded now: compiled
    assert fresh.target.program is not None
    prompts = [fresh.encode(p, chat_template=False) for p in ("The quick brown fox", "one two three one two three")]
    plain = fresh.generate([fresh.request(p, 24) for p in prompts], speculative=False)
    spec = fresh.generate([fresh.request(p, 24) for p in prompts], speculative=True)
    assert [r.output_ids for r in spec] == [r.output_ids for r in plain]


def test_no_compiler_runs_eager_and_says_why(folder, monkeypatch):
    monkeypatch.setattr(compiled, "compiler_missing", lambda: "no C++ compiler for torch.compile (test)")
    eng = _load(folder, "target", "auto", slots=1)
    assert eng.program is None and eng.programs.source == "fallback"
    assert "no C++ compiler" in eng.programs.reason
    assert eng.run([ForwardItem(_seq(8, 1), 1)])[0].shape[0] == 1


def test_a_failing_compile_runs_eager_and_says_why(folder, monkeypatch, tmp_path):
    monkeypatch.setenv("TRTSPEC_CACHE", str(tmp_path))  # nothing cached: measured now

    def broken(*args, **kwargs):
        raise RuntimeError("inductor could not lower this graph")

    monkeypatch.setattr(compiled.StepProgram, "_hidden", broken)
    eng = _load(folder, "target", "auto", slots=1)
    assert eng.program is None and eng.programs.source == "fallback"
    assert eng.programs.reason.startswith("compiling failed")
    assert eng.run([ForwardItem(_seq(8, 1), 1)])[0].shape[0] == 1


def test_the_measured_choice_is_cached_per_machine(folder, monkeypatch, tmp_path):
    monkeypatch.setenv("TRTSPEC_CACHE", str(tmp_path))
    first = _load(folder, "target", "auto", slots=1)
    assert first.programs.source == "measured"
    assert set(first.programs.seconds) == {"eager", "compiled"}
    again = _load(folder, "target", "auto", slots=1)
    assert again.programs.source == "cached"
    assert (again.programs.one, again.programs.many) == (first.programs.one, first.programs.many)


def test_decide_keeps_the_faster_path_per_kind():
    seconds = {"eager": {"1": 1.0, "2": 1.0, "6": 1.0}, "compiled": {"1": 0.5, "2": 1.5, "6": 0.9}}
    assert compiled.decide(seconds) == ("compiled", "eager")  # 2.4 > 2.0 for the verify steps
    seconds["compiled"]["2"] = 1.0
    assert compiled.decide(seconds) == ("compiled", "compiled")


def test_a_compile_that_fails_while_serving_turns_the_engine_eager_and_the_step_still_answers(folder, monkeypatch):
    eng = _load(folder, "target", "1", slots=1)
    reference = _load(folder, "target", "0", slots=1)
    seq = _seq(10, 4)

    def broken(*args, **kwargs):
        raise RuntimeError("BackendCompilerFailed: the C++ compiler went away")

    eng.program._compiled = broken  # torch.compile's path, and the saved programs' (saved.py)
    monkeypatch.setattr(eng.program.saved, "_compile", broken)
    (out,) = eng.run([ForwardItem(seq, 2)])
    assert eng.program is None and eng.programs.source == "fallback"
    assert "the C++ compiler went away" in eng.programs.reason
    assert torch.equal(out, reference.run([ForwardItem(seq, 2)])[0])
    (again,) = eng.run([ForwardItem(seq + [5], 1)])  # eager from now on, the cache consistent
    assert torch.equal(again, reference.run([ForwardItem(seq + [5], 1)])[0])


def test_a_warmed_engine_compiles_nothing_while_it_serves_at_any_count(folder):
    """A server's engine compiles every kind at every thread count the governor compares at
    load; afterwards no step at either count compiles (a compile in a request's path stalls it
    for seconds), and a load's first forward that did compile moved the count the governor
    reads to leave such a forward untimed."""
    from trtspec.engines.torch import threads

    engine = _load(folder, "target", "1", slots=2)
    before = compiled.compiles()
    engine.warm_programs()
    assert compiled.compiles() > before
    assert engine.program.counts == set(threads.governor().counts)
    warmed = compiled.compiles()
    for _ in threads.governor().in_turn():
        for rows in (1, 2):
            engine.forget_prefixes()
            engine.run([ForwardItem(_seq(5, i), 5) for i in range(rows)])
            engine.run([ForwardItem(_seq(5, i) + [7], 1) for i in range(rows)])
    assert compiled.compiles() == warmed

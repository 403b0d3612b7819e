"""The packed (oneDNN) Linears meet a fixed set of matmul shapes, whatever the prompt lengths:
oneDNN's primitive cache and ideep's keep an entry per shape, so a deployment that met a new
shape with every new prefill length grew until both caches were full (model.py row_blocks).
The fixed shapes change no value: logits bitwise equal, greedy tokens identical."""

from __future__ import annotations

import random

import pytest
import torch

from trtspec.engines.torch import threads
from trtspec.engines.torch.engine import ForwardItem, TorchEngine
from trtspec.engines.torch.model import EXACT_ROWS, OneDnnLinear, padded_rows, row_blocks, row_counts
from trtspec.runtime import Deployment


@pytest.fixture
def packed(built, monkeypatch):
    """The tiny target with every Linear packed for oneDNN."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN")
    monkeypatch.setenv("TRTSPEC_ONEDNN", "1")
    engine = TorchEngine.load(built().target.folder)
    monkeypatch.delenv("TRTSPEC_ONEDNN")
    assert isinstance(engine.model.lm_head, OneDnnLinear)
    return engine


def _seq(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(3, 384) for _ in range(n)]


def _matmul_rows(engine: TorchEngine, batches: list[list[int]]) -> dict[tuple[int, ...], set[int]]:
    """Per packed weight shape, the row counts of the oneDNN matmuls that ``batches`` (each a
    list of prompt lengths run as one batch of fresh prompts) ran."""
    rng = random.Random(0)

    def run() -> None:
        for lengths in batches:
            engine.forget_prefixes()
            engine.run([ForwardItem(_seq(n, rng), 1) for n in lengths])

    return _profiled_rows(run)


def _profiled_rows(work) -> dict[tuple[int, ...], set[int]]:
    """Per packed weight shape, the row counts of the oneDNN matmuls ``work()`` ran."""
    from torch.profiler import profile

    with profile(record_shapes=True) as prof:
        work()
    rows: dict[tuple[int, ...], set[int]] = {}
    for event in prof.events():
        if event.name == "mkldnn::_linear_pointwise":
            x, w = event.input_shapes[0], event.input_shapes[1]
            rows.setdefault(tuple(w), set()).add(x[0])
    return rows


# Every row count a packed matmul may run: as given up to EXACT_ROWS, then four per doubling.
ROW_COUNTS = set(range(1, EXACT_ROWS + 1)) | {q << s for s in range(2, 6) for q in (5, 6, 7, 8)}


def test_row_blocks_pad_to_four_sizes_per_doubling_and_cap_each_matmul():
    assert sorted(ROW_COUNTS - set(range(1, EXACT_ROWS + 1))) == [
        20,
        24,
        28,
        32,
        40,
        48,
        56,
        64,
        80,
        96,
        112,
        128,
        160,
        192,
        224,
        256,
    ]
    assert [padded_rows(n) for n in (1, 16, 17, 20, 21, 33, 64, 65, 129, 256)] == [1, 16, 20, 20, 24, 40, 64, 80, 160, 256]
    assert row_blocks(257) == [256, 1] and row_blocks(300) == [256, 48] and row_blocks(1024) == [256] * 4
    for rows in range(1, 3000):
        blocks = row_blocks(rows)
        assert set(blocks) <= ROW_COUNTS and sum(blocks) >= rows
        assert sum(blocks) - rows < blocks[-1] / 5  # padding: under a fifth of the rows run


def test_prompts_of_any_length_meet_a_fixed_set_of_matmul_shapes(packed):
    """150 prefill lengths alone and in ragged batches of 2-4: each weight meets at most the
    32 row counts of row_blocks. Without them every new length (and batch shape) was a new
    shape: 190 per weight in this test."""
    rng = random.Random(1)
    lengths = rng.sample(range(2, 500), 150)
    batches = [[n] for n in lengths] + [[rng.randrange(2, 120) for _ in range(rng.randrange(2, 5))] for _ in range(60)]
    rows = _matmul_rows(packed, batches)
    assert len(rows) == 5  # qkv, o, gate_up, down, the LM head
    for weight, counts in rows.items():
        assert counts <= ROW_COUNTS, f"weight {weight}: row counts outside the fixed set: {sorted(counts - ROW_COUNTS)}"


def test_the_fixed_shapes_give_bitwise_the_same_logits(packed):
    """A row's result does not depend on the zero rows padded beside it nor on which block it
    runs in: every position's logits equal those of the same engine running every input as it
    comes (one matmul per Linear, no padding), bit for bit."""
    rng = random.Random(2)
    items = [[ForwardItem(_seq(n, rng), n)] for n in (17, 37, 100, 256, 257, 500)]
    items.append([ForwardItem(_seq(n, rng), 3) for n in (5, 90, 200, 31)])  # a ragged batch of 4 x 200 rows

    def logits() -> list[list[torch.Tensor]]:
        out = []
        for batch in items:
            packed.forget_prefixes()
            out.append(packed.run(batch))
        return out

    bounded = logits()
    packed.model.fix_matmul_rows(False)  # every input as it comes
    unbounded = logits()
    for got, want in zip(bounded, unbounded):
        for g, w in zip(got, want):
            assert torch.equal(g, w)


def test_long_prompts_decode_the_same_tokens_speculative_and_target_only(built, monkeypatch):
    """Prefills padded and blocked, decode and verify steps as they come: speculative greedy
    output equals target-only, on prompts whose prefill (4 rows of up to 250 tokens) runs in
    several blocks."""
    dep = built()
    monkeypatch.setenv("TRTSPEC_ONEDNN", "1")
    d = Deployment(dep.loaded, dep.loaded.output_dir())
    assert d.target.kernels.layout == "onednn"
    rng = random.Random(3)
    reqs = [d.request(_seq(n, rng), 24, 4) for n in (40, 130, 200, 250)]
    target_only = [r.output_ids for r in d.generate(reqs, speculative=False)]
    speculative = [r.output_ids for r in d.generate(reqs, speculative=True)]
    assert speculative == target_only
    assert all(len(ids) == 24 for ids in target_only)


def test_the_servers_shape_caches_hold_every_shape_an_engine_stub_meets(packed):
    """tritonserver's environment sizes oneDNN's and ideep's caches to the fixed set: every row
    count, for each of a decoder's packed weight shapes, at each thread count the governor
    compares (oneDNN keys a primitive by its thread count too), so a stub's caches stop growing
    once it has met them instead of evicting and rebuilding."""
    from trtspec.engines.torch.threads import candidates
    from trtspec.triton.server.install import CACHE_ENV, SHAPE_CACHE_CAPACITY

    weights = {tuple(m.weight.shape) for m in packed.model.modules() if isinstance(m, OneDnnLinear)}
    thread_counts = max(len(candidates(n)) for n in range(1, 1025))
    assert len(weights) == 5 and thread_counts == 4
    assert len(ROW_COUNTS) * len(weights) * thread_counts <= SHAPE_CACHE_CAPACITY
    assert set(CACHE_ENV.values()) == {SHAPE_CACHE_CAPACITY}


def test_row_counts_are_every_count_row_blocks_gives():
    for most in (1, 16, 17, 100, 256, 257, 5000):
        given = {r for n in range(1, most + 1) for r in row_blocks(n)}
        assert row_counts(most) == sorted(given)
    assert set(row_counts(10_000)) == ROW_COUNTS


def test_a_load_makes_every_matmul_shape_serving_meets_at_each_thread_count(built, monkeypatch):
    """oneDNN's and ideep's caches keep an entry per matmul shape and thread count, so a served
    engine whose governor probes another count now and then kept adding entries (the demo
    target grew for a whole 10-minute soak). A load makes them all, at every count the
    governor compares: no forward afterwards meets a matmul shape the load did not make.
    Fails without TorchEngine.warm_matmuls."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN")
    monkeypatch.setenv("TRTSPEC_ONEDNN", "1")
    counts_set: list[int] = []
    monkeypatch.setattr(threads, "_governor", threads.Governor(2, set_threads=counts_set.append))
    engine = None

    def load() -> None:
        nonlocal engine
        engine = TorchEngine.load(built().target.folder, warm=True)  # as the Triton engine model loads it

    loaded = _profiled_rows(load)
    assert counts_set[:2] == [2, 1]  # the load's matmuls, at each count in turn
    rng = random.Random(4)
    batches = [[n] for n in rng.sample(range(2, 500), 60)] + [[rng.randrange(2, 200) for _ in range(4)] for _ in range(20)]
    served = _matmul_rows(engine, batches)
    for weight, rows in served.items():
        assert rows <= loaded.get(weight, set()), f"weight {weight}: not made at load: {sorted(rows - loaded.get(weight, set()))}"


def test_the_environment_can_run_the_packed_matmuls_on_the_rows_as_given(built, monkeypatch):
    """TRTSPEC_FIXED_ROWS=0 runs every packed matmul on the rows it is given (1, the default:
    the fixed row counts); anything else is refused naming the setting."""
    from trtspec.engines.torch.model import fixed_rows_setting
    from trtspec.errors import SpecError

    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN")
    monkeypatch.setenv("TRTSPEC_ONEDNN", "1")
    monkeypatch.setenv("TRTSPEC_FIXED_ROWS", "0")
    packed = [m for m in TorchEngine.load(built().target.folder).model.modules() if isinstance(m, OneDnnLinear)]
    assert packed and not any(m.fixed_rows for m in packed)
    monkeypatch.delenv("TRTSPEC_FIXED_ROWS")
    assert fixed_rows_setting() is True
    with pytest.raises(SpecError, match="TRTSPEC_FIXED_ROWS='yes': give 1"):
        fixed_rows_setting("yes")

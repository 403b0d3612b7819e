"""The packed (oneDNN) Linears meet a fixed set of matmul shapes, whatever the prompt lengths:
oneDNN's primitive cache and ideep's keep an entry per shape, so a deployment that met a new
shape with every new prefill length grew until both caches were full (model.py row_blocks).
The fixed shapes change no value: logits bitwise equal, greedy tokens identical."""

from __future__ import annotations

import random

import pytest
import torch

from trtspec.engines.torch.engine import ForwardItem, TorchEngine
from trtspec.engines.torch.model import ROW_BLOCK, ROW_BUCKET, OneDnnLinear, row_blocks
from trtspec.runtime import Deployment


@pytest.fixture
def packed(built, monkeypatch):
    """The tiny target with every Linear packed for oneDNN (4 slots, max_draft_len 8)."""
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
    from torch.profiler import profile

    rng = random.Random(0)
    with profile(record_shapes=True) as prof:
        for lengths in batches:
            engine.forget_prefixes()
            engine.run([ForwardItem(_seq(n, rng), 1) for n in lengths])
    rows: dict[tuple[int, ...], set[int]] = {}
    for event in prof.events():
        if event.name == "mkldnn::_linear_pointwise":
            x, w = event.input_shapes[0], event.input_shapes[1]
            rows.setdefault(tuple(w), set()).add(x[0])
    return rows


def test_row_blocks_pad_to_buckets_and_cap_each_matmul():
    assert row_blocks(36, 36) == [36] and row_blocks(1, 36) == [1]
    assert row_blocks(37, 36) == [64] and row_blocks(64, 36) == [64] and row_blocks(65, 36) == [96]
    assert row_blocks(256, 36) == [256] and row_blocks(257, 36) == [256, 32] and row_blocks(1000, 36) == [256, 256, 256, 256]
    for rows in range(1, 2000):
        blocks = row_blocks(rows, 36)
        assert sum(blocks) >= rows and sum(blocks) - rows < ROW_BUCKET
        assert all(b <= 36 or (b % ROW_BUCKET == 0 and b <= ROW_BLOCK) for b in blocks)


def test_prompts_of_any_length_meet_a_fixed_set_of_matmul_shapes(packed):
    """150 prefill lengths alone and in ragged batches of 2-4: each weight meets at most the
    engine's step row counts (4 slots x 9 verify tokens) plus ROW_BLOCK / ROW_BUCKET padded
    ones. Without the bound every new length (and batch shape) was a new shape."""
    step_rows = 4 * (8 + 1)
    bound = step_rows + ROW_BLOCK // ROW_BUCKET
    rng = random.Random(1)
    lengths = rng.sample(range(2, 500), 150)
    batches = [[n] for n in lengths] + [[rng.randrange(2, 120) for _ in range(rng.randrange(2, 5))] for _ in range(60)]
    rows = _matmul_rows(packed, batches)
    assert len(rows) == 5  # qkv, o, gate_up, down, the LM head
    for weight, counts in rows.items():
        assert len(counts) <= bound, f"weight {weight}: {len(counts)} matmul shapes > {bound}: {sorted(counts)}"
        assert all(r <= step_rows or (r % ROW_BUCKET == 0 and r <= ROW_BLOCK) for r in counts), sorted(counts)
    # And the set is fixed: 100 more new lengths bring no shape outside it.
    more = _matmul_rows(packed, [[n] for n in rng.sample(range(2, 500), 100)])
    for counts in more.values():
        assert all(r <= step_rows or (r % ROW_BUCKET == 0 and r <= ROW_BLOCK) for r in counts), sorted(counts)


def test_the_fixed_shapes_give_bitwise_the_same_logits(packed):
    """A row's result does not depend on the zero rows padded beside it nor on which block it
    runs in: every position's logits equal those of the same engine running every input as it
    comes (one prefill per prompt, no padding), bit for bit."""
    rng = random.Random(2)
    items = [[ForwardItem(_seq(n, rng), n)] for n in (37, 100, 256, 257, 500)]
    items.append([ForwardItem(_seq(n, rng), 3) for n in (5, 90, 200, 31)])  # a ragged batch of 4 x 200 rows

    def logits() -> list[list[torch.Tensor]]:
        out = []
        for batch in items:
            packed.forget_prefixes()
            out.append(packed.run(batch))
        return out

    bounded = logits()
    packed.model.bound_matmul_rows(10**9)  # every input as it comes
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

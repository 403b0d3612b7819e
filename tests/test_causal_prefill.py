"""A prompt's first prefill chunk attends through the attention kernel's own causal path
(``StepInputs.causal``), which skips the masked half instead of reading a mask: only where the
mask is exactly causal, and with the same hidden states, bit for bit, as the masked path, eager
and compiled."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import load_engine

from trtspec.engines.torch.engine import ForwardItem
from trtspec.engines.torch.model import KVCache


@pytest.fixture(scope="module")
def engines(built):
    """The tiny target twice: eager, and every step compiled."""
    folder = built("same").target.folder.parent
    return [load_engine(folder, "target", mode) for mode in ("0", "1")]


@pytest.fixture(scope="module")
def target(engines):
    return engines[0]


def _seq(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 384, (n,), generator=g).tolist()


def _step(engine, items, starts):
    return engine._step_inputs(items, [(slot, None) for slot in range(len(items))], starts)


def test_only_a_first_chunk_of_one_plain_row_is_causal(target):
    seq = _seq(40, 1)
    assert _step(target, [ForwardItem(seq, 1)], [0]).causal
    assert not _step(target, [ForwardItem(seq, 1)], [10]).causal, "a continuation attends to cached keys"
    assert not _step(target, [ForwardItem(seq, 1), ForwardItem(_seq(30, 2), 1)], [0, 0]).causal, "two rows"
    tree = ForwardItem(seq, 4, tree=[-1, 0, 0, 1])
    assert not _step(target, [tree], [0]).causal, "a tree's mask is not causal"
    assert not _step(target, [ForwardItem(seq[:1], 1)], [0]).causal, "one token needs no mask at all"


@pytest.mark.parametrize("n", [2, 17, 64, 200])
def test_the_causal_path_gives_the_masked_paths_hidden_states_bit_for_bit(engines, n):
    target, fast = engines
    assert fast.program is not None
    seq = _seq(n, n)
    step = _step(target, [ForwardItem(seq, 1)], [0])
    assert step.causal and step.mask is not None
    masked = dataclasses.replace(step, causal=False)
    dtype = target.model.model.embed_tokens.weight.dtype
    for name, forward in (("eager", target.model), ("compiled", fast.program)):
        got = []
        for s in (step, masked):
            cache = KVCache(target.model.cfg, 1, n + 1, dtype)
            with torch.inference_mode():
                got.append(forward.hidden_states(s, target.cos, target.sin, cache).clone())
        assert torch.equal(got[0], got[1]), name

"""The engine's label store (serve.capture): the top-k logits of every position a run()
computed logits for, kept per (slot, position) like K/V and features, and nothing else."""

from __future__ import annotations

import pytest
import torch

from trtspec.engines.torch.engine import ForwardItem
from trtspec.errors import EngineError

K = 8


@pytest.fixture
def eng(built):
    engine = built("same").target
    engine.forget_prefixes()
    engine.capture_labels(K)
    yield engine
    engine.labels = None
    engine.forget_prefixes()


def _seq(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 384, (n,), generator=g).tolist()


def _top(logits):
    top = torch.topk(logits, K, dim=-1)
    return top.indices, top.values


def test_labels_are_the_top_k_of_the_logits_each_step_returned_and_none_elsewhere(eng):
    prompt = _seq(20, 1)
    (prefill,) = eng.run([ForwardItem(prompt, 1)])
    drafts = [5, 6, 7]
    (verify,) = eng.run([ForwardItem(prompt + drafts, len(drafts) + 1)])
    ids, logits = eng.labels_of(prompt + drafts, 0, len(prompt) + len(drafts))
    assert (ids[: len(prompt) - 1] == -1).all()  # the prefill computed no logits there
    # the prompt's last position was scored again by the verify step (its n_logits reach it)
    want_ids, want_logits = _top(verify)
    assert torch.equal(ids[len(prompt) - 1 :], want_ids) and torch.equal(logits[len(prompt) - 1 :], want_logits)
    assert torch.equal(_top(prefill)[0], want_ids[:1])  # the same position, the same target


def test_a_rejected_draft_and_a_row_computed_again_without_logits_hold_no_stale_label(eng):
    prompt = _seq(16, 2)
    eng.run([ForwardItem(prompt + [5, 6, 7], 4)])
    (again,) = eng.run([ForwardItem(prompt + [5, 9], 2)])  # 6 and 7 rejected, 9 the target's token
    ids, _ = eng.labels_of(prompt + [5, 9], 0, len(prompt) + 2)
    assert torch.equal(ids[-2:], _top(again)[0])
    eng.run([ForwardItem(prompt, len(prompt))])  # every position scored
    other = prompt[:8] + _seq(8, 3)  # the same slot, its last 8 positions computed again, 1 scored
    (last,) = eng.run([ForwardItem(other, 1)])
    assert eng.last_use[0][0] == 8  # it took the slot, reusing the shared prefix
    ids, _ = eng.labels_of(other, 0, len(other))
    assert (ids[:8] >= 0).all()  # the shared prefix: its labels are the same tokens'
    assert (ids[8:-1] == -1).all() and torch.equal(ids[-1:], _top(last)[0])


def test_a_draft_trees_path_keeps_its_nodes_labels_when_it_settles(eng):
    ctx = _seq(12, 4)
    eng.run([ForwardItem(ctx, 1)])
    tree, parents = [5, 6, 7, 8], (-1, -1, 0, 1)  # 5 -> 7 and 6 -> 8
    (scored,) = eng.run([ForwardItem(ctx + tree, len(tree) + 1, parents)])  # rows: ctx's last, then the nodes
    ids, logits = eng.labels_of(ctx + [6, 8], 0, len(ctx) + 2)  # follows the path 6 -> 8
    want_ids, want_logits = _top(scored[[0, 2, 4]])
    assert torch.equal(ids[len(ctx) - 1 :], want_ids) and torch.equal(logits[len(ctx) - 1 :], want_logits)


def test_labels_of_a_sequence_no_slot_holds_is_none_and_an_engine_without_labels_says_so(eng):
    eng.run([ForwardItem(_seq(10, 5), 1)])
    assert eng.labels_of(_seq(10, 6), 0, 10) is None
    eng.labels = None
    with pytest.raises(EngineError, match="capture_labels"):
        eng.labels_of(_seq(10, 5), 0, 10)


def test_rows_adopted_from_another_engine_hold_no_label(eng):
    from trtspec.engines.torch.engine import TorchEngine

    source = TorchEngine.load(eng.folder, slots=2)
    first = _seq(14, 7)
    eng.run([ForwardItem(first, len(first))])  # every row of its slot labelled
    (slot,) = eng.last_slots
    eng.forget_prefixes()  # the slot is free again, its rows' labels those of ``first``
    seq = _seq(12, 8)
    source.run([ForwardItem(seq, 1)])
    assert eng.kv_mismatch(source) is None and eng.adopt(source, [seq + [3]]) == [len(seq)]
    assert eng.pool.tokens[slot] == seq  # adopted into the slot ``first`` left
    ids, _ = eng.labels_of(seq, 0, len(seq))
    assert (ids == -1).all()


def test_an_engine_keeping_only_wanted_labels_scores_no_other_row(eng, monkeypatch):
    """capture_labels(every_row=False) (the in-process runtime): a step's rows of sequences that
    start with a wanted prompt get labels; the others hold none and go through no top-k."""
    import trtspec.engines.torch.labels as labels

    eng.capture_labels(K, every_row=False)
    kept, other = _seq(12, 9), _seq(12, 10)
    rows = []
    topk = labels.torch.topk
    monkeypatch.setattr(labels.torch, "topk", lambda x, k, dim: rows.append(x.shape[0]) or topk(x, k, dim=dim))
    eng.want_labels([kept])
    eng.run([ForwardItem(kept, 1), ForwardItem(other, 1)])
    (scored, _) = eng.run([ForwardItem(kept + [5, 6], 3), ForwardItem(other + [5, 6], 3)])
    eng.want_labels([kept], wanted=False)  # no longer wanted: later steps label nothing
    eng.run([ForwardItem(kept + [5, 6, 7], 1)])
    assert rows == [1, 3] and eng.labels.prompts == {}  # only the wanted sequence's rows, while wanted
    monkeypatch.setattr(labels.torch, "topk", topk)
    ids, _ = eng.labels_of(kept + [5, 6], 0, len(kept) + 2)
    assert torch.equal(ids[len(kept) - 1 :], _top(scored)[0])
    assert (eng.labels_of(other + [5, 6], 0, len(other) + 2)[0] == -1).all()

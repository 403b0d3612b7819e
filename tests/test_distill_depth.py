"""What distill measures per draft depth (top-1/2/3 recall, chain and tree acceptance) and the
recipe's depth and noise options: the depth-1 phase, uniform feature noise."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_distill import eagle_spec, small_opts

import trtspec.distill.ttt as train
from trtspec.distill.run import distill
from trtspec.distill.ttt import Batch, add_feature_noise, agreement
from trtspec.spec import load_spec

MISS = 5  # a rank outside the top 3


def _logits(targets: torch.Tensor, ranks: dict[int, int], vocab: int) -> torch.Tensor:
    """[1, T, vocab] logits whose ranking puts the target id at position t at rank ranks[t]
    (rank 0 = argmax); positions not in ``ranks`` rank it first."""
    t = targets.shape[1]
    out = torch.zeros(1, t, vocab)
    for p in range(t):
        want = int(targets[0, p])
        others = [i for i in range(vocab) if i != want]
        order = others[:]
        if want >= 0:
            order.insert(ranks.get(p, 0), want)
        for n, i in enumerate(order[:vocab]):
            out[0, p, i] = float(vocab - n)
    return out


def test_per_depth_recall_and_tree_acceptance_from_hand_made_drafts(monkeypatch):
    """Five chains of two drafts (starts 1..5); the target's token at depth 0 ranks
    0, 1, 0, 2, miss and at depth 1 ranks 0, 0, 1, 0, 2 in the head's drafts."""
    tokens = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    labels = torch.tensor([[2, 3, 4, 5, 6, 7, 8, 9]])
    response = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]]).bool()
    batch = Batch(tokens, torch.zeros(1, 8, 4), labels, response)
    targets = train.step_targets(batch, 2)
    assert targets[0].tolist() == [[-1, 4, 5, 6, 7, 8, 9, -1]] and targets[1].tolist() == [[-1, -1, 5, 6, 7, 8, 9, -1]]
    depth0 = _logits(targets[0], {1: 0, 2: 1, 3: 0, 4: 2, 5: MISS, 6: 0}, 10)
    depth1 = _logits(targets[1], {2: 0, 3: 0, 4: 1, 5: 0, 6: 2}, 10)  # chain p drafts depth 1 at p + 1
    monkeypatch.setattr(train, "unrolled_logits", lambda *a: [depth0, depth1])
    head = SimpleNamespace(cfg=SimpleNamespace(draft_vocab_size=10), to_target_ids=lambda ids: ids)
    a = agreement(head, None, [batch], 2, None, None)
    assert a["chains"] == 5
    assert a["top1"] == pytest.approx([3 / 6, 3 / 5])  # every scored position (position 6 starts no chain)
    assert a["accepted"] == pytest.approx([2 / 5, 1 / 2])  # chains 1, 3 right at depth 0; 1 of them at depth 1
    assert a["acceptance_length"] == pytest.approx(1 + 3 / 5)
    assert sum(a["top_r"], []) == pytest.approx([2 / 5, 3 / 5, 4 / 5] + [3 / 5, 4 / 5, 5 / 5])
    # r wide at every depth: depth 1 counted over the chains whose depth-0 token was in the top r
    assert sum(a["top_r_accepted"], []) == pytest.approx([2 / 5, 3 / 5, 4 / 5] + [1 / 2, 3 / 3, 4 / 4])
    assert [d[0] for d in a["top_r_accepted"]] == pytest.approx(a["accepted"])


def test_feature_noise_is_uniform_bounded_and_seeded():
    feats = torch.randn(2, 5, 12)
    batch = Batch(torch.zeros(2, 5, dtype=torch.long), feats, torch.zeros(2, 5, dtype=torch.long), torch.ones(2, 5).bool())
    assert add_feature_noise(batch, 0.0, torch.Generator().manual_seed(1)) is batch
    one = add_feature_noise(batch, 0.05, torch.Generator().manual_seed(1)).features - feats
    two = add_feature_noise(batch, 0.05, torch.Generator().manual_seed(1)).features - feats
    other = add_feature_noise(batch, 0.05, torch.Generator().manual_seed(2)).features - feats
    assert torch.equal(one, two) and not torch.equal(one, other)
    assert float(one.abs().max()) <= 0.05 + 1e-6 and float(one.abs().max()) > 0.04
    assert abs(float(one.mean())) < 0.01  # centred: uniform in [-a, a]


def test_the_depth_1_phase_trains_the_first_step_alone_then_every_step(tmp_path, tiny_ckpts, monkeypatch):
    """--ttt-phase 0.5 of 6 steps with 3 unrolled steps: steps 0-2 train depth 1, 3-5 depth 3;
    the run is deterministic with noise on, and the head reports top-1/2/3 recall per depth."""
    depths = []
    real = train.ttt_loss

    def spy(head, embed, batch, steps, *a, **kw):
        depths.append(steps)
        return real(head, embed, batch, steps, *a, **kw)

    monkeypatch.setattr("trtspec.distill.trainer.ttt_loss", spy)
    runs = []
    for name in ("a", "b"):
        depths.clear()
        spec = load_spec(eagle_spec(tmp_path / name, tiny_ckpts["target"]))
        runs.append(distill(spec, small_opts(tmp_path / name, ttt_steps=3, ttt_phase=0.5, feature_noise=0.05)))
        assert depths == [1, 1, 1, 3, 3, 3]
    a, b = runs
    assert a.metrics == b.metrics  # seeded noise and batches: the same head twice
    top_r = a.metrics["unseen_top_r"]
    assert len(top_r) == 3 and all(len(d) == 3 and d[0] <= d[1] <= d[2] for d in top_r)
    assert [d[0] for d in a.metrics["unseen_top_r_accepted"]] == pytest.approx(a.metrics["unseen_accepted"])

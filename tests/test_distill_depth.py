"""What distill measures per draft depth (top-1/2/3 recall, chain and tree acceptance) and the
recipe's depth and noise options: the depth-1 phase, uniform feature noise, dropout."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import unrolled_as
from test_distill import eagle_spec, small_opts, spy_training_steps

import trtspec.distill.ttt as train
from trtspec.distill.run import distill
from trtspec.distill.ttt import Batch, add_feature_noise, agreement, dropout_mask
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
    monkeypatch.setattr(train, "unrolled_logits", unrolled_as([depth0, depth1]))
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


def test_dropout_masks_are_seeded_inverted_and_absent_at_zero():
    like = torch.zeros(3, dtype=torch.float64)
    assert dropout_mask((4, 50, 64), 0.0, torch.Generator().manual_seed(1), like) is None
    one = dropout_mask((4, 50, 64), 0.2, torch.Generator().manual_seed(1), like)
    two = dropout_mask((4, 50, 64), 0.2, torch.Generator().manual_seed(1), like)
    other = dropout_mask((4, 50, 64), 0.2, torch.Generator().manual_seed(2), like)
    assert one.dtype == torch.float64 and torch.equal(one, two) and not torch.equal(one, other)
    assert set(one.unique().tolist()) == {0.0, 1 / 0.8}  # kept entries scaled: the expected input unchanged
    assert float((one == 0).double().mean()) == pytest.approx(0.2, abs=0.01)  # 12,800 draws


def test_dropout_changes_training_steps_only_and_runs_are_deterministic(tmp_path, tiny_ckpts, monkeypatch):
    """--dropout 0.3: two runs give the same head (masks from the step's seeded generator), a
    different one from no dropout; the held-out and unseen evaluations run without it."""
    seen = []
    real = train.unrolled_logits

    def spy(head, embed, batch, steps, cos, sin, dropout=0.0, gen=None, at=None):
        seen.append((head.training, dropout))
        return real(head, embed, batch, steps, cos, sin, dropout, gen, at)

    monkeypatch.setattr(train, "unrolled_logits", spy)
    runs = {}
    for name, p in (("a", 0.3), ("b", 0.3), ("c", 0.0)):
        seen.clear()
        spec = load_spec(eagle_spec(tmp_path / name, tiny_ckpts["target"]))
        runs[name] = distill(spec, small_opts(tmp_path / name, dropout=p))
        assert {d for training, d in seen if training} == {p} and {d for training, d in seen if not training} == {0.0}
    losses = {name: [row["loss"] for row in r.curve] for name, r in runs.items()}
    assert losses["a"] == losses["b"] and runs["a"].metrics == runs["b"].metrics
    assert all(x != y for x, y in zip(losses["a"], losses["c"]))  # every step's loss saw other inputs


def test_start_decay_pulls_the_trained_weights_back_to_where_they_started(tmp_path, tiny_ckpts, monkeypatch):
    """--start-decay: at lr x rate >= 1 every step ends where the head started; at a moderate
    rate the head ends nearer its start than without (L2-SP toward the anchored start)."""
    from trtspec.distill.trainer import Trainer

    made = []
    real_init = Trainer.__init__

    def keep(self, *a, **kw):
        real_init(self, *a, **kw)
        made.append((self, [p.detach().clone() for p in self.params]))

    monkeypatch.setattr(Trainer, "__init__", keep)

    def distance(name: str, rate: float) -> float:
        made.clear()
        spec = load_spec(eagle_spec(tmp_path / name, tiny_ckpts["target"]))
        distill(spec, small_opts(tmp_path / name, start_decay=rate, lr=1e-2))
        trainer, start = made[-1]
        return sum(float((p.detach() - s).norm()) for p, s in zip(trainer.params, start))

    assert distance("pinned", 1e9) == 0.0
    free, pulled = distance("free", 0.0), distance("pulled", 30.0)
    assert 0.0 < pulled < 0.9 * free, (pulled, free)


def test_the_depth_1_phase_trains_the_first_step_alone_then_every_step(tmp_path, tiny_ckpts, monkeypatch):
    """--ttt-phase 0.5 of 6 steps with 3 unrolled steps: steps 0-2 train depth 1, 3-5 depth 3;
    the run is deterministic with noise on, and the head reports top-1/2/3 recall per depth."""
    depths = spy_training_steps(monkeypatch, lambda a, kw: a[3])  # ttt_loss(head, embed, batch, steps, ...)
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


def test_the_runtime_walk_drafts_where_the_last_step_ended_and_skips_chains_inside_a_run(monkeypatch):
    """The same hand-made drafts walked as greedy generation drafts them (response tokens at
    positions 2..7, and 9, the last position's label: 7 tokens): right first drafts at chain
    starts 1, 3 and 6 (of 1..5 scored), right second drafts at 2, 3 and 5. k=1 drafts from
    chain 1 (right: two tokens), from 3 (right: two), from 5 (wrong: one), then the last token
    comes undrafted: 2 of 3 kept where every chain start keeps 2 of 5. k=2 drafts chain 1 (both
    right: three tokens), chain 4 (wrong), then one draft at chain 5 (wrong)."""
    tokens = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    labels = torch.tensor([[2, 3, 4, 5, 6, 7, 8, 9]])
    response = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]]).bool()
    batch = Batch(tokens, torch.zeros(1, 8, 4), labels, response)
    targets = train.step_targets(batch, 2)
    depth0 = _logits(targets[0], {1: 0, 2: 1, 3: 0, 4: 2, 5: MISS, 6: 0}, 10)
    depth1 = _logits(targets[1], {2: 0, 3: 0, 4: 1, 5: 0, 6: 2}, 10)
    monkeypatch.setattr(train, "unrolled_logits", unrolled_as([depth0, depth1]))
    head = SimpleNamespace(cfg=SimpleNamespace(draft_vocab_size=10), to_target_ids=lambda ids: ids)
    a = agreement(head, None, [batch], 2, None, None)
    assert a["accepted"][0] == pytest.approx(2 / 5)  # over every chain start
    assert a["walk_forwards"] == [3, 3]
    assert a["walk_length"] == pytest.approx([5 / 3, 5 / 3])  # k=1: 2 + 2 + 1 tokens; k=2: 3 + 1 + 1
    assert a["walk_accepted"][0] == pytest.approx([2 / 3])
    assert a["walk_accepted"][1] == pytest.approx([1 / 3, 1 / 1])


def test_the_recommended_k_uses_the_walks_tokens_per_forward_when_given():
    from trtspec.distill.costs import recommend_k

    costs = {"verify": [1.0, 1.0, 1.0], "head": 0.1}
    chain_k, chain_bounds = recommend_k([0.5, 0.5, 0.5], costs)
    assert chain_k == 2 and chain_bounds == pytest.approx([1.5 / 1.1, 1.75 / 1.2, 1.875 / 1.3], abs=1e-3)
    # the same heads walked: runs make k=3's forwards worth far more than the chain formula says
    k, bounds = recommend_k([0.5, 0.5, 0.5], costs, [1.4, 1.9, 2.3])
    assert k == 3 and bounds == pytest.approx([1.4 / 1.1, 1.9 / 1.2, 2.3 / 1.3], abs=1e-3)

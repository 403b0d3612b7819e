"""--ttt-reach: each deeper unrolled step trains on its positions weighted by the head's own
probability that the greedy chain reaches them (the product of its probabilities of the
target's tokens at the chain's earlier steps), with no gradient through the weights."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import unrolled_as
from test_distill import eagle_spec, small_opts, spy_training_steps

import trtspec.distill.ttt as train
from trtspec.distill.run import distill
from trtspec.distill.ttt import Batch, reach_weights, step_targets, ttt_loss
from trtspec.spec import load_spec

VOCAB = 7
OUTSIDE = 9  # a target id outside the draft vocabulary


def _batch() -> tuple[Batch, torch.Tensor]:
    """One 8-token sequence, response from position 1; the label after position 3 is outside
    the draft vocabulary (so is every chain's step-0 draft there). t2d: ids 0..6 map to
    themselves."""
    tokens = torch.tensor([[1, 2, 3, 4, 5, 6, 1, 2]])
    labels = torch.tensor([[2, 3, 4, OUTSIDE, 6, 1, 2, 3]])
    response = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1]]).bool()
    t2d = torch.full((10,), -1, dtype=torch.long)
    t2d[:VOCAB] = torch.arange(VOCAB)
    return Batch(tokens, torch.zeros(1, 8, 4), labels, response), t2d


def _draft_targets(batch: Batch, t2d: torch.Tensor, steps: int) -> list[torch.Tensor]:
    return [torch.where(t >= 0, t2d[t.clamp(min=0)], torch.full_like(t, -1)) for t in step_targets(batch, steps)]


def test_reach_is_the_product_of_the_chains_earlier_probabilities():
    batch, t2d = _batch()
    logits = [torch.randn(1, 8, VOCAB, generator=torch.Generator().manual_seed(j)) for j in range(3)]
    tgts = _draft_targets(batch, t2d, 3)
    at = [t >= 0 for t in step_targets(batch, 3)]
    held = reach_weights([x[m] for x, m in zip(logits, at)], tgts, at)  # at each step's scored positions
    w = []
    for x, m in zip(held, at):  # back to [1, T]: nan where a step is not scored
        full = torch.full(m.shape, float("nan"))
        full[m] = x
        w.append(full)

    def p(j: int, t: int) -> float:  # the head's probability of step j's target at t
        d = int(tgts[j][0, t])
        return float(torch.softmax(logits[j][0, t], -1)[d]) if d >= 0 else 0.0

    assert [int(m.sum()) for m in at] == [7, 6, 5]
    for t in range(8):
        if at[0][0, t]:
            assert float(w[0][0, t]) == 1.0
        if at[1][0, t]:
            assert float(w[1][0, t]) == pytest.approx(p(0, t - 1))
        if at[2][0, t]:  # the chain of step 2 at t: step 0 at t - 2, step 1 at t - 1
            assert float(w[2][0, t]) == pytest.approx(p(0, t - 2) * p(1, t - 1))
    # position 2's step-0 target (the label after position 3) is outside: its chain is dead
    assert int(tgts[0][0, 2]) == -1 and float(w[1][0, 3]) == 0.0 and float(w[2][0, 4]) == 0.0
    assert not any(x.requires_grad for x in w)


@pytest.mark.parametrize("soft", [False, True])
def test_the_reach_weighted_loss_ignores_a_dead_chain_and_weights_the_rest(monkeypatch, soft):
    """Hard labels: the loss is sum_j w_j * sum_t r_jt ce_jt / sum_t r_jt. Either labels: step 1's
    logits at a position whose chain died at step 0 change the loss without --ttt-reach and
    not with it."""
    batch, t2d = _batch()
    if soft:  # the target's top-2: its greedy label and token 0
        batch.top_ids = torch.stack([batch.labels, torch.zeros_like(batch.labels)], dim=-1)
        batch.top_logits = torch.tensor([2.0, 1.0]).expand(1, 8, 2).clone()
    logits = [torch.randn(1, 8, VOCAB, generator=torch.Generator().manual_seed(10 + j), requires_grad=True) for j in range(2)]
    monkeypatch.setattr(train, "unrolled_logits", unrolled_as(logits))
    weights = [0.6, 0.4]

    def loss(reach: bool) -> float:
        return float(ttt_loss(None, None, batch, 2, t2d, None, None, soft=soft, weights=weights, reach=reach)[0].detach())

    if not soft:
        tgts = _draft_targets(batch, t2d, 2)
        at = [t >= 0 for t in step_targets(batch, 2)]
        r = reach_weights([x[m] for x, m in zip(logits, at)], tgts, at)  # [N_j]: step j's scored positions
        want = 0.0
        for j in range(2):
            ok = tgts[j][at[j]] >= 0
            ce = F.cross_entropy(logits[j][at[j]].detach(), tgts[j][at[j]].clamp(min=0), reduction="none")
            want += weights[j] * float((r[j] * ce)[ok].sum() / r[j][ok].sum())
        assert loss(True) == pytest.approx(want, rel=1e-5)
        assert loss(True) != pytest.approx(loss(False), rel=1e-3)
    before = (loss(True), loss(False))
    with torch.no_grad():
        logits[1][0, 3] += torch.arange(VOCAB, dtype=torch.float32)  # step 1 at 3: the chain from step 0 at 2
    assert loss(True) == pytest.approx(before[0], abs=1e-6)
    assert loss(False) != pytest.approx(before[1], abs=1e-4)


def test_distill_trains_with_reach_and_records_it(tmp_path, tiny_ckpts, monkeypatch):
    """--ttt-reach reaches every training step's loss and the head's manifest recipe."""
    seen = spy_training_steps(monkeypatch, lambda a, kw: kw.get("reach"))
    spec = load_spec(eagle_spec(tmp_path, tiny_ckpts["target"]))
    result = distill(spec, small_opts(tmp_path, ttt_steps=2, ttt_reach=True))
    assert seen == [True] * 6
    manifest = json.loads((result.output / "trtspec-head.json").read_text())
    assert manifest["recipe"]["ttt_reach"] is True and manifest["recipe_from"]["ttt_reach"] == "cli"

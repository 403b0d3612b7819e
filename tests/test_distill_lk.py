"""--loss lk: the head trained on -log of the acceptance rate alpha = sum_x min(p_x, q_x) over
the target's captured top-k (LK losses) instead of the KL to it; "kl" stays the default and
the loss it was."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import unrolled_as
from test_distill import eagle_spec, small_opts, spy_training_steps

import trtspec.distill.ttt as train
from trtspec.distill.run import distill
from trtspec.distill.ttt import Batch, soft_lk_loss, step_targets, ttt_loss
from trtspec.recipe import DistillRecipe
from trtspec.spec import load_spec

VOCAB = 4  # draft vocabulary: target ids 0..3 map to themselves
OUTSIDE = 9  # a target id outside it


def _case(q: list[float], ids: list[int], p: list[float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One position: logits whose softmax is ``q``, the target's top-k draft ids and their p."""
    lg = torch.log(torch.tensor(q)).view(1, 1, -1).requires_grad_()
    return lg, torch.tensor(ids).view(1, 1, -1), torch.tensor(p).view(1, 1, -1)


def test_lk_is_minus_log_of_the_acceptance_rate_over_the_captured_top_k():
    """q = (0.5, 0.3, 0.1, 0.1); the target's top-4: ids 1, 0, 2 with p 0.5, 0.3, 0.2 and one
    id outside the draft vocabulary (p 0 after the renormalisation). alpha = min(0.5, 0.3) +
    min(0.3, 0.5) + min(0.2, 0.1) = 0.7; id 3 (q 0.1, outside the top-k) adds nothing."""
    lg, ids, p = _case([0.5, 0.3, 0.1, 0.1], [1, 0, 2, -1], [0.5, 0.3, 0.2, 0.0])
    assert float(soft_lk_loss(lg, ids, p).detach()) == pytest.approx(-math.log(0.7), rel=1e-6)
    # a draft equal to the target on its support: every draft accepted
    same, ids2, p2 = _case([0.5, 0.3, 0.2, 1e-30], [0, 1, 2, 3], [0.5, 0.3, 0.2, 0.0])
    assert float(soft_lk_loss(same, ids2, p2).detach()) == pytest.approx(0.0, abs=1e-6)
    # no id inside the draft vocabulary: 0, finite (the position is not scored)
    none = soft_lk_loss(lg, torch.full_like(ids, -1), torch.zeros_like(p))
    assert float(none.detach()) == 0.0


def test_the_lk_gradient_is_the_acceptance_rates_and_a_step_raises_it():
    """alpha's tokens where the draft is below the target (ids 1 and 2 above) carry the
    gradient: d(-log alpha)/dz_i = -q_i (1[i limited by q] - q(limited)) / alpha; ids where the
    draft already covers the target only lose mass through the softmax."""
    q = torch.tensor([0.5, 0.3, 0.1, 0.1])
    lg, ids, p = _case(q.tolist(), [1, 0, 2, -1], [0.5, 0.3, 0.2, 0.0])
    soft_lk_loss(lg, ids, p).sum().backward()
    limited = torch.tensor([0.0, 1.0, 1.0, 0.0])  # q_x < p_x
    want = -q * (limited - (q * limited).sum()) / 0.7
    assert torch.allclose(lg.grad.view(-1), want, rtol=1e-5, atol=1e-7), (lg.grad, want)
    with torch.no_grad():
        stepped = lg - 0.5 * lg.grad
        alpha = lambda z: torch.minimum(torch.softmax(z.view(-1), -1)[:3], torch.tensor([0.3, 0.5, 0.2])).sum()  # noqa: E731
    assert float(alpha(stepped)) > float(alpha(lg.detach())) == pytest.approx(0.7)


def _batch() -> tuple[Batch, torch.Tensor]:
    """One 6-token sequence, response from position 1, soft labels: each position's top-3 are
    its greedy label, token 0 and an id outside the draft vocabulary."""
    tokens = torch.tensor([[1, 2, 3, 1, 2, 3]])
    labels = torch.tensor([[2, 3, 1, 2, 3, 1]])
    response = torch.tensor([[0, 1, 1, 1, 1, 1]]).bool()
    top_ids = torch.stack([labels, torch.zeros_like(labels), torch.full_like(labels, OUTSIDE)], dim=-1)
    top_logits = torch.tensor([2.0, 1.0, 1.5]).expand(1, 6, 3).clone()
    t2d = torch.full((10,), -1, dtype=torch.long)
    t2d[:VOCAB] = torch.arange(VOCAB)
    return Batch(tokens, torch.zeros(1, 6, 4), labels, response, top_ids, top_logits), t2d


@pytest.fixture
def logits(monkeypatch) -> list[torch.Tensor]:
    out = [torch.randn(1, 6, VOCAB, generator=torch.Generator().manual_seed(20 + j), requires_grad=True) for j in range(2)]
    monkeypatch.setattr(train, "unrolled_logits", unrolled_as(out))
    return out


def test_ttt_loss_lk_averages_minus_log_alpha_over_the_scored_positions(logits):
    """Per step, the mean over the positions the KL scores of -log alpha, with p the target's
    top-k restricted to the draft vocabulary and renormalised (the outside id drops out)."""
    batch, t2d = _batch()
    weights = [0.7, 0.3]
    got = ttt_loss(None, None, batch, 2, t2d, None, None, soft=True, weights=weights, loss="lk")[0]
    p_in = torch.softmax(torch.tensor([2.0, 1.0]), -1)  # the label and token 0, renormalised
    want = 0.0
    for j, tgt in enumerate(step_targets(batch, 2)):
        per_pos = []
        for t in range(6):
            if tgt[0, t] < 0:
                continue
            q = torch.softmax(logits[j][0, t].detach(), -1)
            label = int(batch.labels[0, t + 1])
            per_pos.append(-math.log(float(torch.minimum(q[[label, 0]], p_in).sum())))
        want += weights[j] * sum(per_pos) / len(per_pos)
    assert float(got.detach()) == pytest.approx(want, rel=1e-5)
    got.backward()
    assert all(lg.grad is not None and torch.isfinite(lg.grad).all() and lg.grad.abs().sum() > 0 for lg in logits)


def test_kl_stays_the_default_loss_and_hard_labels_ignore_the_choice(logits):
    """The recipe's default is kl; ttt_loss without the argument is the kl loss bit for bit, the
    cross-entropy to the renormalised top-k; lk is another objective. With hard labels the
    acceptance rate is the draft's probability of the greedy token: both losses are its
    cross-entropy, the same tensor."""
    assert DistillRecipe().loss == "kl"
    batch, t2d = _batch()

    def loss(**kw) -> torch.Tensor:
        return ttt_loss(None, None, batch, 2, t2d, None, None, **kw)[0].detach()

    assert torch.equal(loss(soft=True), loss(soft=True, loss="kl"))
    p_in = torch.softmax(torch.tensor([2.0, 1.0]), -1)
    want = 0.0
    for j, tgt in enumerate(step_targets(batch, 2)):
        rows = [t for t in range(6) if tgt[0, t] >= 0]
        logq = torch.log_softmax(logits[j][0].detach(), -1)
        ce = [-(p_in * logq[t, [int(batch.labels[0, t + 1]), 0]]).sum() for t in rows]
        want += 0.5 * float(sum(ce)) / len(ce)
    assert float(loss(soft=True)) == pytest.approx(want, rel=1e-6)
    assert float(loss(soft=True, loss="lk")) != pytest.approx(want, rel=1e-3)
    assert torch.equal(loss(soft=False, loss="lk"), loss(soft=False))
    hard = [F.cross_entropy(lg[0].detach(), batch.labels[0].roll(-1), reduction="none") for lg in logits]
    rows = [[t for t in range(6) if tgt[0, t] >= 0] for tgt in step_targets(batch, 2)]
    assert float(loss(soft=False)) == pytest.approx(sum(0.5 * float(h[r].mean()) for h, r in zip(hard, rows)), rel=1e-6)


def test_distill_trains_with_the_chosen_loss_and_records_it(tmp_path, tiny_ckpts, monkeypatch):
    """The default run's every training step uses kl; --loss lk reaches every step's loss and
    the head's manifest recipe, and trains to a finite loss."""
    seen = spy_training_steps(monkeypatch, lambda a, kw: kw.get("loss"))
    spec = load_spec(eagle_spec(tmp_path / "a", tiny_ckpts["target"]))
    distill(spec, small_opts(tmp_path / "a"))
    assert seen == ["kl"] * 6
    seen.clear()
    spec = load_spec(eagle_spec(tmp_path / "b", tiny_ckpts["target"]))
    result = distill(spec, small_opts(tmp_path / "b", loss="lk"))
    assert seen == ["lk"] * 6 and all(math.isfinite(r["loss"]) for r in result.curve)
    manifest = json.loads((result.output / "trtspec-head.json").read_text())
    assert manifest["recipe"]["loss"] == "lk" and manifest["recipe_from"]["loss"] == "cli"


def test_label_temperature_softens_both_distributions_and_scales_the_kl_by_t_squared(logits):
    """At T = 2 each scored position's loss is 4 x the cross-entropy of softmax(target top-k / 2)
    (renormalised over the draft vocabulary) to log_softmax(head logits / 2); T = 1 is the
    default loss bit for bit. The recipe takes T only with soft labels under the KL."""
    batch, t2d = _batch()

    def loss(**kw) -> torch.Tensor:
        return ttt_loss(None, None, batch, 2, t2d, None, None, soft=True, **kw)[0].detach()

    assert torch.equal(loss(temperature=1.0), loss())
    p_in = torch.softmax(torch.tensor([2.0, 1.0]) / 2, -1)
    want = 0.0
    for j, tgt in enumerate(step_targets(batch, 2)):
        rows = [t for t in range(6) if tgt[0, t] >= 0]
        logq = torch.log_softmax(logits[j][0].detach() / 2, -1)
        ce = [-4 * (p_in * logq[t, [int(batch.labels[0, t + 1]), 0]]).sum() for t in rows]
        want += 0.5 * float(sum(ce)) / len(ce)
    assert float(loss(temperature=2.0)) == pytest.approx(want, rel=1e-6)
    assert DistillRecipe(label_temperature=2.0).label_temperature == 2.0
    for bad in ({"labels": "hard"}, {"loss": "lk"}):
        with pytest.raises(ValueError, match="label_temperature 2 softens soft labels under the KL"):
            DistillRecipe(label_temperature=2.0, **bad)

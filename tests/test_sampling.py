"""Speculative sampling is lossless: the loop's rejection sampling against exactly known
distributions (a Markov 'target' and 'draft' over a small vocabulary), and the statistical
test verify --sampling uses, including a deliberately biased sampler it must catch."""

from __future__ import annotations

import math

import pytest
import torch

from trtspec.errors import RequestError
from trtspec.speculative import loop
from trtspec.speculative.capabilities import Drafter
from trtspec.speculative.loop import GenerationRequest, NoDrafter, generate
from trtspec.speculative.sampling import SamplingParams, nucleus, warp
from trtspec.testing.markov_pair import TARGET, MarkovDrafter, MarkovVerifier, T, V, accept_all, markov_pit


class LookupDrafter(Drafter):
    """No distribution: proposes the previous token again (a point mass)."""

    def propose(self, contexts, ks):
        return [[c[-1]] * k for c, k in zip(contexts, ks)]


def joint_counts(drafter, n: int, params: SamplingParams, k: int = 3) -> torch.Tensor:
    reqs = [
        GenerationRequest([0], T, k, sampling=SamplingParams(params.temperature, params.top_k, params.top_p, params.seed + i))
        for i in range(n)
    ]
    counts = torch.zeros((V,) * T, dtype=torch.float64)
    for res in generate(reqs, drafter, MarkovVerifier()):
        counts[tuple(res.output_ids)] += 1
    return counts


def exact_joint(params: SamplingParams) -> torch.Tensor:
    p = warp(TARGET, params)  # [V, V] rows: p(next | prev)
    return p[0][:, None, None] * p[:, :, None] * p[None, :, :]  # P(x1, x2, x3) = p(x1|0) p(x2|x1) p(x3|x2)


def joint_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness of fit over the cells with >= 5 expected (the rest pooled)."""
    n = counts.sum()
    expected = (probs * n).flatten()
    observed = counts.flatten()
    big = expected >= 5
    e = torch.cat([expected[big], expected[~big].sum().view(1)])
    o = torch.cat([observed[big], observed[~big].sum().view(1)])
    keep = e > 0
    chi2 = float(((o[keep] - e[keep]) ** 2 / e[keep]).sum())
    dof = int(keep.sum()) - 1
    return float(
        torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), torch.tensor(chi2 / 2, dtype=torch.float64))
    )


PARAMS = [SamplingParams(1.0, seed=1), SamplingParams(0.7, top_k=4, seed=2), SamplingParams(1.3, top_p=0.8, seed=3)]


@pytest.mark.parametrize(
    "drafter, params",
    [
        (MarkovDrafter(), PARAMS[0]),
        (MarkovDrafter(), PARAMS[1]),
        (MarkovDrafter(), PARAMS[2]),
        (LookupDrafter(), PARAMS[0]),
        (NoDrafter(), PARAMS[0]),
    ],
    ids=["draft-t1", "draft-t0.7-topk4", "draft-t1.3-topp0.8", "point-mass-t1", "target-only-t1"],
)
def test_speculative_sampling_draws_the_target_joint(drafter, params):
    counts = joint_counts(drafter, 2000, params)
    # Seeded, so deterministic; at level 0.001 a correct sampler fails 1 seed in 1000.
    assert joint_p_value(counts, exact_joint(params)) > 1e-3


def test_sampler_without_rejection_step_is_caught(monkeypatch):
    params = PARAMS[0]
    monkeypatch.setattr(loop, "accept_or_resample", accept_all)
    counts = joint_counts(MarkovDrafter(), 2000, params)
    assert joint_p_value(counts, exact_joint(params)) < 1e-6


def test_same_seed_same_sample_and_acceptance_counts():
    a = joint_counts(MarkovDrafter(), 50, PARAMS[1])
    b = joint_counts(MarkovDrafter(), 50, PARAMS[1])
    assert torch.equal(a, b)


def test_warp_top_k_and_top_p():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    assert (warp(logits, SamplingParams(top_k=2))[0] > 0).tolist() == [True, True, False, False, False]
    full = torch.softmax(logits.double(), -1)[0]  # 0.636, 0.234, 0.086, ...
    nucleus = warp(logits, SamplingParams(top_p=0.85))[0]
    assert (nucleus > 0).tolist() == [True, True, False, False, False]
    assert math.isclose(float(nucleus[0]), float(full[0] / (full[0] + full[1])), rel_tol=1e-12)
    cold = warp(logits, SamplingParams(temperature=0.5))[0]
    assert math.isclose(float(cold[0]), float(torch.softmax(logits.double() / 0.5, -1)[0, 0]), rel_tol=1e-12)


def _nucleus_by_full_sort(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """The nucleus by definition: sort every token (value descending, lowest index first among
    ties), keep the prefix whose mass ranked above each token is still below top_p."""
    order = torch.argsort(x, dim=-1, descending=True, stable=True)
    sorted_p = torch.softmax(x.gather(-1, order), dim=-1)
    kept_sorted = torch.cumsum(sorted_p, dim=-1) - sorted_p < top_p
    return torch.zeros_like(kept_sorted).scatter(-1, order, kept_sorted)


@pytest.mark.parametrize("vocab", [5, 300, 3000, 49152])
@pytest.mark.parametrize("kind", ["peaked", "flat", "ties", "masked"])
def test_nucleus_found_among_candidates_is_the_full_sorts(vocab, kind):
    # Flat rows need the candidates grown (nuclei of thousands of tokens); integer logits tie
    # across the candidates' edge, where a lower index must win; -inf rows are top-k's.
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(6, vocab, generator=gen, dtype=torch.float64)
    x = {"peaked": x * 8, "flat": x * 0.01, "ties": torch.randint(-2, 2, x.shape, generator=gen).double(), "masked": x}[kind]
    if kind == "masked":
        x[:, : vocab // 2] = float("-inf")
    for top_p in (0.05, 0.5, 0.9, 0.95, 0.999999):
        assert torch.equal(nucleus(x, top_p), _nucleus_by_full_sort(x, top_p)), (kind, top_p)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": 0.0}, "temperature must be > 0"),
        ({"top_k": -1}, "top_k must be 0 (off)"),
        ({"top_p": 0.0}, "top_p must be in (0, 1]"),
        ({"seed": -3}, "seed must be in 0..2**63-1"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(RequestError, match=message.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        SamplingParams(**kwargs)


def test_pit_test_false_alarm_and_power(monkeypatch):
    """The PIT test's false alarms stay near its level (100 seeded runs with an exact
    sampler), and a sampler without the rejection step is caught in every one of 40 runs."""
    false_alarms = sum(markov_pit(MarkovDrafter(), 100, s) < 0.01 for s in range(1000, 1100))
    assert false_alarms <= 5  # level 0.01: P(Binomial(100, 0.01) > 5) < 0.001
    monkeypatch.setattr(loop, "accept_or_resample", accept_all)
    caught = sum(markov_pit(MarkovDrafter(), 100, s) < 0.01 for s in range(40))
    assert caught == 40


def test_draw_follows_its_weights_and_never_a_zero_one():
    """The inverse-CDF draw: each token as often as its weight says (weights need not sum to
    one), a zero-weight token never; invalid weights are refused."""
    from trtspec.speculative.sampling import draw

    weights = torch.zeros(1000, dtype=torch.float64)
    weights[[3, 500, 998]] = torch.tensor([2.0, 1.0, 5.0], dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.tensor([draw(weights, gen) for _ in range(8000)]), minlength=1000).double()
    assert counts.sum() == counts[[3, 500, 998]].sum()
    expected = weights[[3, 500, 998]] / 8 * 8000
    chi2 = float(((counts[[3, 500, 998]] - expected) ** 2 / expected).sum())
    assert chi2 < 13.8  # 2 degrees of freedom, p = 0.001
    for bad in (torch.zeros(5), torch.tensor([0.5, float("nan"), 0.5]), torch.tensor([1.0, -0.1])):
        with pytest.raises(ValueError):
            draw(bad, gen)

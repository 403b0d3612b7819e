"""The sampling test's false-alarm rate and power, measured over many seeds.

    python -m lab.sampling_level                       # 2000 runs per sampler (~1 s per run on 2 cores)
    python -m lab.sampling_level --runs 200 --which biased
    python -m lab.sampling_level --prompts 3 [--shared-seeds] --runs 1000 --first-seed 1 --which draft

The setting is trtspec/testing/markov_pair.py's (tests/test_sampling.py's): a Markov target and draft over 6 tokens whose
distributions are known exactly, 100 generations of 2 tokens per run (k = 3), each run one
`verify --sampling` test (randomized PIT of every token under the target's exact
conditional, chi-square over 10 bins, level 0.01). An exact sampler (speculative with the
draft, or target-only) should be flagged in about 1% of runs: that is the false-alarm rate;
the biased sampler (drafts accepted without the rejection step) should be flagged in nearly
all: that is the power. Prints each rate with its exact (Clopper-Pearson) 95% interval;
writes JSON with --out.

--prompts P: each run tests P prompts (Markov start tokens 0..P-1) x 34 generations, each
generation on its own seed, or with --shared-seeds on the seeds every prompt shares (sample i
of each prompt on the same seed: the old verify --sampling seeding).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from lab._common import command_line, write_result
from trtspec.speculative import loop
from trtspec.speculative.loop import GenerationRequest, NoDrafter
from trtspec.speculative.sampling import SamplingParams, accept_or_resample, warp
from trtspec.testing.markov_pair import TARGET, MarkovDrafter, accept_all, markov_pit, pit_values
from trtspec.verify.sampling import ALPHA, chi_square_uniform


def clopper_pearson(k: int, n: int, conf: float = 0.95) -> tuple[float, float]:
    """Exact binomial interval for k successes in n (bisection on the binomial tails)."""

    def cdf(j: int, p: float) -> float:  # P(X <= j)
        if p <= 0:
            return 1.0
        if p >= 1:
            return 0.0 if j < n else 1.0
        terms = (
            math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * math.log(p) + (n - i) * math.log1p(-p)
            for i in range(j + 1)
        )
        return sum(math.exp(t) for t in terms)

    def solve(f, target: float) -> float:  # f increasing in p
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
        return (lo + hi) / 2

    a = (1 - conf) / 2
    lower = 0.0 if k == 0 else solve(lambda p: 1 - cdf(k - 1, p), a)  # P(X >= k) = a
    upper = 1.0 if k == n else solve(lambda p: 1 - cdf(k, p), 1 - a)  # P(X <= k) = a
    return lower, upper


def prompts_pit(drafter, prompts: int, seed: int, shared: bool, per_prompt: int = 34) -> float:
    """The p-value of one test over several prompts (start tokens), as markov_pit otherwise."""
    p = warp(TARGET, SamplingParams())
    g = torch.Generator().manual_seed(seed)
    us = []
    for j in range(prompts):
        seeds = [seed * 100_000 + i + (0 if shared else j * per_prompt) for i in range(per_prompt)]
        us += pit_values(drafter, [GenerationRequest([j], 2, 3, sampling=SamplingParams(seed=sd)) for sd in seeds], p, g)
    return chi_square_uniform(us)[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=2000)
    ap.add_argument("--first-seed", type=int, default=1000)
    ap.add_argument("--which", nargs="+", default=["draft", "target-only", "biased"], choices=["draft", "target-only", "biased"])
    ap.add_argument("--prompts", type=int, default=1, help="prompts (Markov start tokens) per test")
    ap.add_argument("--shared-seeds", action="store_true", help="with --prompts: every prompt on the same seeds")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    seeds = range(args.first_seed, args.first_seed + args.runs)
    out = {
        "alpha": ALPHA,
        "runs": args.runs,
        "first_seed": args.first_seed,
        "prompts": args.prompts,
        "shared_seeds": args.shared_seeds,
    }
    for which in args.which:
        loop.accept_or_resample = accept_all if which == "biased" else accept_or_resample
        drafter = NoDrafter() if which == "target-only" else MarkovDrafter()
        start = time.perf_counter()
        if args.prompts > 1:
            flagged = sum(prompts_pit(drafter, args.prompts, s, args.shared_seeds) < ALPHA for s in seeds)
        else:
            flagged = sum(markov_pit(drafter, 100, s) < ALPHA for s in seeds)
        lo, hi = clopper_pearson(flagged, args.runs)
        what = "power" if which == "biased" else "false-alarm rate"
        print(f"{which:12s} {what}: {flagged}/{args.runs} = {flagged / args.runs:.4f} (95% CI {lo:.4f}-{hi:.4f})", flush=True)
        out[which] = {"flagged": flagged, "rate": flagged / args.runs, "ci95": [lo, hi], "seconds": time.perf_counter() - start}
    loop.accept_or_resample = accept_or_resample
    if args.out:
        write_result(args.out, command_line("sampling_level.py"), out)


if __name__ == "__main__":
    main()

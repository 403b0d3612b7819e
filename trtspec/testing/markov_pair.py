"""The Markov pair whose distributions are known exactly: a 'target' and a 'draft' over a
6-token vocabulary, as a verifier and a drafter for the one loop, `verify --sampling`'s test
(randomized PIT + chi-square) run on it, and a deliberately wrong sampler it must catch. tests/test_sampling.py proves the loop's
speculative sampling lossless on it; lab/sampling_level.py measures the test's level and
power over many seeds."""

from __future__ import annotations

import torch

from trtspec.speculative.capabilities import Capabilities, Drafter
from trtspec.speculative.loop import GenerationRequest, Verdict, generate
from trtspec.speculative.sampling import SamplingParams, draw, warp
from trtspec.verify.sampling import chi_square_uniform

V = 6  # vocabulary
# Tokens per generation: the first comes from the target's prefill (a sequence's first step
# drafts nothing), so 3 tokens give one drafted step (1 draft + the bonus) to test.
T = 3


def markov(seed: int, peak: float) -> torch.Tensor:
    """Logits [V, V]: row a = next-token logits after token a."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn((V, V), generator=g, dtype=torch.float64) * peak


TARGET = markov(0, 1.0)
DRAFT = markov(1, 1.5)  # a different distribution: rejections matter


class MarkovVerifier:
    """The exact target, scoring chains and draft trees alike: a position's logits depend only on
    the token before it, which for node i of a tree is node i itself, whatever its parent."""

    def verify(self, contexts, drafts, want_logits=None, context_phase=None, trees=None):
        out = []
        for j, (ctx, d) in enumerate(zip(contexts, drafts)):
            if trees is not None and trees[j] is not None:
                assert len(trees[j]) == len(d), "a tree's parents name each of its nodes"
            prev = [ctx[-1]] + list(d)  # the token before each scored position
            logits = TARGET[prev]  # [len(d) + 1, V]
            out.append(Verdict(torch.argmax(logits, -1).tolist(), None, logits))
        return out


class MarkovDrafter(Drafter):
    capabilities = Capabilities(samples=True)

    def propose(self, contexts, draft_lens):
        return [[int(torch.argmax(DRAFT[c[-1]]))] * n for c, n in zip(contexts, draft_lens)]

    def propose_sampled(self, contexts, draft_lens, params, gens):
        out = []
        for ctx, n, prm, g in zip(contexts, draft_lens, params, gens):
            tok, toks, qs = ctx[-1], [], []
            for _ in range(n):
                q = warp(DRAFT[tok].unsqueeze(0), prm)[0]
                tok = int(torch.multinomial(q, 1, generator=g))
                toks.append(tok)
                qs.append(q)
            out.append((toks, torch.stack(qs)))
        return out


def pit_values(drafter, reqs: list[GenerationRequest], p: torch.Tensor, g: torch.Generator) -> list[float]:
    """The randomized PIT of every generated token under the target's exact conditional
    ``p`` [V, V] (row: the previous token), in request order, drawing from ``g``."""
    us = []
    for req, res in zip(reqs, generate(reqs, drafter, MarkovVerifier())):
        prev = req.prompt_ids[-1]
        for x in res.output_ids:
            row = p[prev]
            before = row[row > row[x]].sum() + row[:x][row[:x] == row[x]].sum()
            us.append(float(before + torch.rand((), generator=g, dtype=torch.float64) * row[x]))
            prev = x
    return us


def markov_pit(drafter, n: int, seed: int) -> float:
    """verify --sampling's test (randomized PIT + chi-square) on the Markov pair."""
    reqs = [GenerationRequest([0], T, 3, sampling=SamplingParams(1.0, seed=seed * 100_000 + i)) for i in range(n)]
    us = pit_values(drafter, reqs, warp(TARGET, SamplingParams(1.0, seed=seed)), torch.Generator().manual_seed(seed))
    return chi_square_uniform(us)[2]


def accept_all(draft: list[int], q, p: torch.Tensor, gen: torch.Generator) -> tuple[list[int], int]:
    """A deliberately WRONG sampler, in place of the loop's accept_or_resample: every draft token
    is accepted without the rejection step, so drafted positions follow q, not p."""
    return list(draft) + [draw(p[len(draft)], gen)], len(draft)

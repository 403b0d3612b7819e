"""Lossless speculative sampling: rejection sampling against the draft's distribution.

With sampling, a step does not compare tokens: each draft token x (drawn from the draft's
distribution q) is accepted with probability min(1, p(x) / q(x)), p the target's; at the first
rejection a token is drawn from the residual norm(max(0, p - q)); after a fully accepted
draft the bonus is drawn from p. Every emitted token is then distributed exactly as the target
alone would sample it (Leviathan et al. 2023, Chen et al. 2023). A drafter without a
distribution (prompt lookup) is a point mass: q = 1 at its token, so acceptance is p(x) and
the residual is p without x.

A draft tree (speculative/tree.py) is verified the same way node by node, SpecInfer's
multi-candidate rejection (Miao et al. 2024; EAGLE's recursive rejection): at a node the
children are tried in order, each against the current distribution r (p at first); a
rejected child x replaces r by the residual norm(max(0, r - q)), so the next child is tried
against what is left; an accepted child moves the walk down to it (its own row of p); after
the last rejected child the token is drawn from the residual. Each candidate must be drawn
independently from its q, or be a point mass: tree drafters propose their top-k candidates,
point masses (distinct siblings), so a rejected x just leaves r without x. By the one-step
argument applied to each residual in turn, every emitted token is distributed as p.

p and q are the warped distributions (temperature, then top-k, then top-p), computed in
float64 so acceptance ratios are not rounded. Each request owns a torch.Generator seeded
from its ``seed``: a run is reproducible, and the two paths draw from the same distribution,
not the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trtspec.errors import RequestError
from trtspec.speculative.tree import ROOT, DraftTree


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0  # 1: no nucleus cut
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise RequestError(
                f"temperature must be > 0 to sample (got {self.temperature}); for greedy decoding leave sampling off"
            )
        if self.top_k < 0:
            raise RequestError(f"top_k must be 0 (off) or a positive count (got {self.top_k})")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1] (got {self.top_p})")
        if not 0 <= self.seed < 2**63:
            raise RequestError(f"seed must be in 0..2**63-1 (got {self.seed})")

    def generator(self) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed)


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Sampling distribution [n, vocab] (float64) from logits [n, vocab]."""
    x = logits.double() / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[:, -1:]  # [n, 1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1:
        x = x.masked_fill(~nucleus(x, params.top_p), float("-inf"))
    return torch.softmax(x, dim=-1)


# Candidates a nucleus is first looked for among; grown 8x while a row's nucleus may reach past them.
_NUCLEUS_CANDIDATES = 256


def nucleus(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """[n, vocab] bool: the smallest prefix of each row's tokens, ranked by x descending (the
    lowest index first among equal values), whose probability reaches top_p.

    A full sort of the vocabulary costs ~5 ms a row at 49k tokens, an eighth of a decode step
    of the demo's target at batch 1; the nucleus is found among each row's top candidates instead and
    the set grown only for a row where it may not hold the whole nucleus: where every candidate
    is kept, or where the last kept value ties a value outside the candidates (a tied token
    with a lower index would rank before it). The result is the full sort's.
    """
    vocab = x.shape[-1]
    p = torch.softmax(x, dim=-1)
    m = min(vocab, _NUCLEUS_CANDIDATES)
    while True:
        vals, idx = torch.topk(x, m, dim=-1)  # [n, m] descending; ties in no fixed order
        idx, by_index = torch.sort(idx, dim=-1)  # ties are ranked by index: index order first,
        order = torch.argsort(vals.gather(-1, by_index), dim=-1, descending=True, stable=True)  # then value
        idx = idx.gather(-1, order)
        sorted_x = x.gather(-1, idx)
        sorted_p = p.gather(-1, idx)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass ranked strictly above
        kept = before < top_p  # a prefix: before only grows
        count = kept.sum(dim=-1)  # >= 1 (before of the first is 0)
        last = sorted_x.gather(-1, (count - 1).unsqueeze(-1)).squeeze(-1)
        whole = (count < m) & (last > sorted_x[:, -1])
        if m == vocab or bool(whole.all()):
            return torch.zeros(x.shape, dtype=torch.bool, device=x.device).scatter(-1, idx, kept)
        m = min(vocab, m * 8)


def draw(probs: torch.Tensor, gen: torch.Generator) -> int:
    """One token from probs [vocab] (non-negative weights, not all zero): the inverse CDF of
    the tokens with a weight, at one uniform draw of ``gen``.

    torch.multinomial draws one exponential per vocabulary entry (1.2 ms a row at 49k tokens,
    as much as the warp); a warped distribution holds a handful of tokens (its nucleus), so the
    cumulative sum runs over those only. The same distribution, not the same stream of draws."""
    if not bool((probs >= 0).all()):  # a NaN compares False too
        raise ValueError("draw: probabilities must be non-negative numbers")
    idx = torch.nonzero(probs > 0).flatten()
    if not len(idx):
        raise ValueError("draw: every probability is zero")
    cdf = torch.cumsum(probs[idx].double(), dim=0)
    u = float(torch.rand((), generator=gen, dtype=torch.float64)) * float(cdf[-1])
    return int(idx[min(int(torch.searchsorted(cdf, torch.tensor(u, dtype=torch.float64), right=True)), len(idx) - 1)])


def accept_or_resample(
    draft: list[int],
    q: torch.Tensor | None,
    p: torch.Tensor,
    gen: torch.Generator,
) -> tuple[list[int], int]:
    """(tokens to emit, drafts accepted) for one step of a chain.

    draft: k tokens; q: [k, vocab_q] the draft's distributions they were drawn from (None: a
    point mass at each token); p: [k+1, vocab] the target's at the same positions.
    """
    tokens, path = accept_tree(DraftTree.chain(draft), q, p, gen)
    return tokens, len(path)


def accept_tree(
    tree: DraftTree,
    q: torch.Tensor | None,
    p: torch.Tensor,
    gen: torch.Generator,
) -> tuple[list[int], list[int]]:
    """(tokens to emit, accepted nodes) for one step of a draft tree.

    p: [len(tree) + 1, vocab], the target's after the context (row 0) and after each node's
    path (row j + 1). q: None (every candidate a point mass), or for a chain [k, vocab_q],
    row j the distribution node j was drawn from (a tree's candidates are point masses).
    """
    if q is not None and not tree.is_chain:
        raise ValueError("a draft tree's candidates are point masses: pass q None")
    vocab = p.shape[-1]
    if q is not None and q.shape[-1] < vocab:  # draft vocabulary narrower: q is 0 beyond it
        q = torch.nn.functional.pad(q, (0, vocab - q.shape[-1]))
    path: list[int] = []
    node = ROOT
    while True:
        r = p[node + 1]  # [vocab]: the target after this node's path
        nxt = None
        for child in tree.children(node):
            x = tree.tokens[child]
            qx = float(q[child, x]) if q is not None else 1.0
            u = float(torch.rand((), generator=gen, dtype=torch.float64))
            if qx > 0 and u * qx < float(r[x]):  # accept with probability min(1, r(x)/q(x))
                nxt = child
                break
            if q is not None:
                residual = (r - q[child]).clamp(min=0)
            else:
                residual = r.clone()
                residual[x] = 0
            total = float(residual.sum())
            # total == 0 only when r(x) = 1 for a rejected x, which cannot be rejected; guard anyway.
            r = residual / total if total > 0 else r
        if nxt is None:
            return [tree.tokens[c] for c in path] + [draw(r, gen)], path
        path.append(nxt)
        node = nxt

"""Verifier over an engine that returns logits: one target forward per step."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from trtspec.engines.torch.engine import ForwardItem, RunFn
from trtspec.speculative.loop import TokenRows, Verdict, VerifyAsks

if TYPE_CHECKING:
    from typing_extensions import Unpack


def greedy_with_margins(logits: torch.Tensor) -> tuple[list[int], list[float]]:
    """Argmax ids and top-1 minus top-2 logit margins for logits [n, vocab]."""
    top = torch.topk(logits, k=2, dim=-1)  # values/indices [n, 2]
    # torch.argmax picks the lowest index among exact ties; topk's order among ties is not
    # specified, so the id comes from argmax to keep greedy deterministic.
    ids = torch.argmax(logits, dim=-1).tolist()
    margins = (top.values[:, 0] - top.values[:, 1]).tolist()
    return ids, margins


class LogitsVerifier:
    """Scores context + draft in ONE forward and returns the target's greedy tokens at all
    len(draft) + 1 positions, with their top-2 margins. A draft tree goes to the engine with
    its parents (ForwardItem.tree): the same forward, under a tree attention mask."""

    def __init__(self, run: RunFn, vocab_limit: int | None = None):
        self.run = run
        # Rows beyond this (a draft model's embedding padding) are never chosen.
        self.vocab_limit = vocab_limit

    def verify(self, contexts: TokenRows, drafts: TokenRows, **asks: Unpack[VerifyAsks]) -> list[Verdict]:
        """Every verdict carries its logits (they are at hand), so ``want_logits`` is not
        needed; no KV-cache block counts, so neither is ``context_phase``."""
        trees = asks.get("trees") or [None] * len(drafts)
        items = [ForwardItem(list(c) + list(d), len(d) + 1, t) for c, d, t in zip(contexts, drafts, trees)]
        out = []
        for logits in self.run(items):  # each [len(draft) + 1, vocab]
            logits = logits[:, : self.vocab_limit]
            ids, margins = greedy_with_margins(logits)
            out.append(Verdict(ids, margins, logits))
        return out

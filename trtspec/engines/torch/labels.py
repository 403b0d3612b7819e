"""The target's top-k logits per (slot, position), kept as a step computes them (serve.capture).

A served request's labels (what `distill` trains a head on: the target's most likely next
tokens and their logits after each position) are exactly the logits serving already computed:
the prefill's last position and, in every decode or verify step, the positions fed then. The
engine keeps their top ``k`` here, by cache row, as it keeps K/V and features: a row computed
again is forgotten first (a rejected draft's, a prefix taken over by another sequence), so a
row holds either the label of the tokens its slot holds before it, or none (id -1).

Which rows: every row a step scored (``every_row``: the Triton engine model, whose steps do not
say which request they serve), or only the rows of sequences that start with a prompt the
caller said it may keep (``want``: the in-process runtime, which knows before generating which
requests serve.capture keeps); a step's other rows pay no top-k and hold no label.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch


class LabelStore:
    """[slots, rows, k] top ids (int32, -1: none) and logits (float32), on the CPU."""

    def __init__(self, slots: int, rows: int, k: int, every_row: bool = True):
        self.k = k
        self.ids = torch.full((slots, rows, k), -1, dtype=torch.int32)
        self.logits = torch.zeros((slots, rows, k), dtype=torch.float32)
        self.every_row = every_row
        self.prompts: Counter[tuple[int, ...]] = Counter()  # the wanted prompts (not every_row), each as often as it was wanted
        self.lengths: Counter[int] = Counter()  # their lengths, the same way

    def want(self, prompts: Sequence[Sequence[int]]) -> None:
        """Sequences that start with one of ``prompts`` get labels from now on (until unwant)."""
        for p in prompts:
            self.prompts[tuple(p)] += 1
            self.lengths[len(p)] += 1

    def unwant(self, prompts: Sequence[Sequence[int]]) -> None:
        """The end of a want of ``prompts`` (labels already kept stay)."""
        for p in prompts:
            key = tuple(p)
            if self.prompts[key] > 0:
                self.prompts[key] -= 1
                self.lengths[len(key)] -= 1
        self.prompts, self.lengths = +self.prompts, +self.lengths  # drop the zero counts

    def wants(self, tokens: Sequence[int]) -> bool:
        """Whether a sequence of ``tokens`` gets labels."""
        return self.every_row or any(tuple(tokens[:n]) in self.prompts for n in self.lengths if n <= len(tokens))

    def forget(self, slot: int, start: int, stop: int) -> None:
        """Rows start..stop-1 of ``slot`` are about to be computed again: they hold no label."""
        self.ids[slot, start:stop] = -1

    def keep(self, rows: list[tuple[int, int, int]], logits: torch.Tensor, seqs: Sequence[Sequence[int]]) -> None:
        """``logits`` [sum n, vocab] (any device) are rows first..first+n-1 of each (slot, first, n)
        of ``rows``, in order, scored at the end of the sequence ``seqs[i]``: the top k of those
        of wanted sequences kept, in one topk for the whole step (none when no row is wanted)."""
        chosen = [self.wants(seq) for seq in seqs]
        if not any(chosen):
            return
        if not all(chosen):  # only the wanted rows' logits go through the top-k
            index, at = [], 0
            for (_, _, n), c in zip(rows, chosen):
                index += range(at, at + n) if c else []
                at += n
            logits = logits[torch.tensor(index, device=logits.device)]
            rows = [r for r, c in zip(rows, chosen) if c]
        top = torch.topk(logits.float(), self.k, dim=-1)
        ids, values = top.indices.to(torch.int32).cpu(), top.values.cpu()
        at = 0
        for slot, first, n in rows:
            self.ids[slot, first : first + n] = ids[at : at + n]
            self.logits[slot, first : first + n] = values[at : at + n]
            at += n

    def move(self, slot: int, src: torch.Tensor, dst: slice) -> None:
        """Rows ``src`` of ``slot`` moved to ``dst`` (a draft tree's path settled into place)."""
        src = src.cpu()
        self.ids[slot, dst] = self.ids[slot, src]
        self.logits[slot, dst] = self.logits[slot, src]

    def copy(self, src: int, dst: torch.Tensor, n: int) -> None:
        """Slots ``dst`` hold the first ``n`` rows of slot ``src``."""
        self.ids[dst, :n] = self.ids[src : src + 1, :n]
        self.logits[dst, :n] = self.logits[src : src + 1, :n]

    def read(self, slot: int, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(top ids [n, k] int64, -1 where none; their logits [n, k] float32) of rows start..stop-1."""
        return self.ids[slot, start:stop].long(), self.logits[slot, start:stop].clone()

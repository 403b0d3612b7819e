"""One captured training sequence: tokens, features, labels, and which positions are response
text (what data.py produces, store.py keeps on disk, and training reads)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

# The target's top SOFT_TOP_K logits at each position are kept with the greedy label: soft
# labels (--labels soft) train the head on the target's distribution, not only its argmax.
SOFT_TOP_K = 32


@dataclass
class Sample:
    tokens: torch.Tensor  # [T] int64: prompt + the target's response
    prompt_len: int
    features: torch.Tensor | None  # [T, n_layers * hidden]; None: rows row..row+T-1 of a FeatureStore
    labels: torch.Tensor  # [T] int64: the target's greedy next token after each position (-1: not known)
    row: int = -1
    top_ids: torch.Tensor | None = None  # [T, SOFT_TOP_K] int: the target's most likely next tokens
    top_logits: torch.Tensor | None = None  # [T, SOFT_TOP_K] float32: their logits
    response: torch.Tensor | None = None  # [T] bool: response text (None: positions >= prompt_len)

    def response_mask(self) -> torch.Tensor:
        """[T] bool: the positions whose token is response text (what the runtime drafts after)."""
        if self.response is not None:
            return self.response
        return torch.arange(len(self.tokens)) >= self.prompt_len


class FeatureRows(Protocol):
    """Where samples captured to disk keep their features (distill/store.py's FeatureStore)."""

    width: int
    dtype: torch.dtype

    def read_into(self, out: torch.Tensor, row: int) -> None: ...  # out [n, width] <- rows row..row+n-1

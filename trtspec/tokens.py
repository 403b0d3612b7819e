"""The one check of token ids that arrive from outside (prompts, drafts, end/pad ids).

It sits below every layer that takes ids, so the engine, the request rules and the Triton
models all say "outside the vocabulary" the same way.
"""

from __future__ import annotations

from collections.abc import Iterable

from trtspec.errors import RequestError


def check_token_ids(ids: Iterable[int], vocab_size: int, what: str = "token id") -> None:
    """RequestError naming the first id outside 0..vocab_size-1."""
    for t in ids:
        if not 0 <= t < vocab_size:
            raise RequestError(f"{what} {t} is outside the vocabulary (0..{vocab_size - 1})")

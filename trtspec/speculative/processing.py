"""Logits processing: penalties, min_tokens, bad words and embedding bias, as TensorRT-LLM
applies them, position by position over a speculative step.

A step scores len(draft) + 1 positions at once; position j continues context + draft[:j],
so its penalties count the draft tokens before it exactly as token-by-token decoding would
have counted them once emitted. The processed logits then decide everything: the greedy
token (argmax), the sampling distribution (sampling.warp) and the log probs. Speculation
stays lossless: a draft token is accepted only where the processed target picks it (greedy)
or by rejection sampling against the processed target distribution.

Order and formulas follow TensorRT-LLM's penalty and ban-words kernels
(cpp/tensorrt_llm/kernels/penaltyKernels.cu ``batchApplyPenalty`` and banBadWords.cu
``ban_bad_words``, 1.2-era main; tests/data/trtllm/NOTES.md): embedding bias added; then,
when the request has a temperature other than 1, logits scaled by 1 / (T + 1e-6) — before
the penalties, as upstream, so a sampled request's warp then uses temperature 1 (the Triton
endpoints put the request's temperature here; in process, a caller that wants upstream's
order sets Processing.temperature, else SamplingParams.temperature applies after); repetition
penalty on every token present in prompt or output (a negative logit multiplied, any other
divided); presence penalty subtracted once per present token and frequency penalty once
per occurrence (prompt tokens count: upstream's prompt_ignore_length defaults to 0); end ids
banned while fewer than min_tokens tokens were generated; a bad word's last token banned
where the sequence (prompt included) ends with the word's other tokens.

One deliberate difference: upstream bans the request's single end_id before min_tokens; a
trtspec request may end on several ids (a chat model's generation_config lists more than
one), and all of them are banned, or min_tokens would not hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from trtspec.errors import RequestError

NEG_INF = float("-inf")


@dataclass(frozen=True)
class Processing:
    repetition_penalty: float = 1.0  # 1: off
    presence_penalty: float = 0.0  # 0: off
    frequency_penalty: float = 0.0  # 0: off
    min_tokens: int = 0  # end ids banned while fewer tokens were generated (0 and 1: off)
    bad_words: tuple[tuple[int, ...], ...] = ()  # token sequences never generated
    bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), summed per id
    temperature: float = 1.0  # applied here, before the penalties, when anything else is on
    # Banned before min_tokens besides the request's end ids: an engine model's end_id, which
    # it emits (a stop sequence there, not an end id).
    end_ids: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not torch.isfinite(torch.tensor(v)):
                raise RequestError(f"{name} must be a finite number (got {v})")
        if not self.repetition_penalty > 0:
            raise RequestError(f"repetition_penalty must be > 0 (got {self.repetition_penalty}); 1 turns it off")
        if self.min_tokens < 0:
            raise RequestError(f"min_tokens must be >= 0 (got {self.min_tokens})")
        if any(len(w) == 0 for w in self.bad_words):
            raise RequestError("a bad word tokenized to nothing; leave empty strings out of bad_words")
        if not (self.temperature > 0 and torch.isfinite(torch.tensor(self.temperature))):
            raise RequestError(f"temperature must be a finite number > 0 here (got {self.temperature})")
        if any(not torch.isfinite(torch.tensor(w)) for _, w in self.bias):
            raise RequestError("embedding bias weights must be finite numbers")

    @property
    def active(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.min_tokens > 1
            or bool(self.bad_words)
            or any(w != 0 for _, w in self.bias)
        )

    def check_ids(self, vocab_size: int) -> None:
        ids = [t for w in self.bad_words for t in w] + [t for t, _ in self.bias]
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"bad_words / embedding bias name token id {bad[0]}, outside the vocabulary (0..{vocab_size - 1})")

    def apply(
        self,
        logits: torch.Tensor,
        tokens: Sequence[int],
        generated: int,
        draft: Sequence[int] = (),
        end_ids: frozenset[int] = frozenset(),
    ) -> torch.Tensor:
        """Processed logits [n, vocab] (float32) for raw logits [n, vocab].

        Row j continues ``tokens`` (prompt + output so far, of which the last ``generated``
        are output) + draft[:j]; n <= len(draft) + 1.
        """
        n, vocab = logits.shape
        x = logits.float().clone()
        if self.bias:
            b = torch.zeros(vocab)
            for t, w in self.bias:
                if t < vocab:
                    b[t] += w
            x += b
        x = scaled(x, self.temperature)
        seen = self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        if seen:
            counts = torch.bincount(torch.tensor(list(tokens), dtype=torch.long), minlength=vocab)[:vocab].float()
        for j in range(n):
            row = x[j]
            if seen:
                if j > 0 and draft[j - 1] < vocab:
                    counts[draft[j - 1]] += 1
                present = counts > 0
                if self.repetition_penalty != 1.0:
                    pen = torch.where(row < 0, row * self.repetition_penalty, row / self.repetition_penalty)
                    row = torch.where(present, pen, row)
                if self.presence_penalty != 0.0:
                    row = row - present.float() * self.presence_penalty
                if self.frequency_penalty != 0.0:
                    row = row - counts * self.frequency_penalty
            if self.min_tokens > 1 and generated + j < self.min_tokens:
                for e in end_ids | self.end_ids:
                    if 0 <= e < vocab:
                        row[e] = NEG_INF
            if self.bad_words:
                history = list(tokens) + list(draft[:j])
                for word in self.bad_words:
                    head = word[:-1]
                    if len(history) >= len(head) and tuple(history[len(history) - len(head) :]) == head and 0 <= word[-1] < vocab:
                        row[word[-1]] = NEG_INF
            x[j] = row
        return x


class RowRules(NamedTuple):
    """One sequence's processing as a drafter mirrors it: the rules, tokens generated so far
    (min_tokens counts from there) and the request's end ids."""

    processing: Processing
    generated: int
    end_ids: frozenset[int]

    def apply(self, logits: torch.Tensor, tokens: Sequence[int], drafted: int) -> torch.Tensor:
        """Logits [n, vocab] of the next token after ``tokens`` (context + ``drafted`` draft
        tokens), processed as the target's would be there."""
        return self.processing.apply(logits, tokens, self.generated + drafted, (), self.end_ids)


def scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Logits at ``temperature`` as TensorRT-LLM scales them (x 1 / (T + 1e-6); T = 1: as is)."""
    return logits if temperature == 1.0 else logits * (1.0 / (temperature + 1e-6))


def log_prob_logits(logits: torch.Tensor, processing: Processing | None, sampling_temperature: float | None) -> torch.Tensor:
    """The logits log probs are read from: after the request's processing and temperature,
    as upstream's sampling layer computes them. ``logits`` are already processed when the
    processing is active (its temperature included); otherwise the temperature is applied
    here — the processing's (a request that carries only a temperature) or the sampler's."""
    if processing is not None and processing.active:
        return logits
    t = processing.temperature if processing is not None else (sampling_temperature or 1.0)
    return scaled(logits, t)


def warp_params(params, processing: Processing | None):
    """The SamplingParams to warp already-processed logits with: temperature 1 where the
    processing applied the temperature itself (before its penalties, as upstream)."""
    if processing is not None and processing.active and processing.temperature != 1.0:
        return replace(params, temperature=1.0)
    return params


def processed(
    logits: torch.Tensor,
    processing: Processing | None,
    tokens: Sequence[int],
    generated: int,
    draft: Sequence[int] = (),
    end_ids: frozenset[int] = frozenset(),
) -> torch.Tensor:
    """``logits`` as the request's processing leaves them (unchanged when there is none)."""
    if processing is None or not processing.active:
        return logits
    return processing.apply(logits, tokens, generated, draft, end_ids)

"""Tie-aware verdicts: is a divergence a near-tie flipped by numerics, or a bug?

Batched verification runs the target over k+1 tokens in one forward while target-only
decoding runs it one token at a time. Different kernel shapes round differently, so where the
target's top two logits nearly tie, the two paths can pick different tokens with no bug
anywhere. At the first divergence (output index i) the target ALONE is replayed over the
tokens both paths share, from an empty prefix cache, both ways:

    shared prefix   prompt + out[:s-1] in one forward (s: where the speculative step that
                    produced token i began; out[:i] is common to both paths)
    control shape   then one token at a time from position s-1 up to i   (like target-only)
    verifier shape  then ONE forward over out[s-1:i] + filler, k+1 rows (like that step)

Only the last forward's shape differs between the two replays. The divergence is

    numerical    the verifier-shape replay yields the speculative path's token, the
                 control-shape replay yields the target-only token, and the two tokens'
                 logit gap (control replay) is below epsilon: the flip reproduces from the
                 forward's shape alone, at a near-tie;
    algorithmic  anything else: the speculative machinery changed the output.

A path that ended at i (EOS) counts as "the target's argmax is an end id". Rows after i in
the verifier-shape forward hold filler tokens: causal attention keeps them out of row i, and
they keep the forward's shape (k+1 rows) exactly as the verifier ran it.

Default epsilon per target dtype (logits, float32): the largest logit change between the two
shapes on the demo and tiny specs was measured and each default sits well above it (README).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from trtspec.engines.torch.engine import ForwardItem, RunFn

VerdictClass = Literal["numerical", "algorithmic", "unclassified"]

# Logit gap below which a flip reproduced by shape alone is called a tie (see module doc).
DEFAULT_EPSILON = {"float32": 1e-2, "float16": 0.25, "bfloat16": 1.0}


@dataclass
class Replay:
    """The target's logits at the divergent position, replayed both ways."""

    control: torch.Tensor  # [vocab] one token at a time
    verifier: torch.Tensor  # [vocab] one (k+1)-row forward
    step_start: int  # s
    rows: int  # k + 1


@dataclass
class DivergenceVerdict:
    verdict: VerdictClass
    reason: str
    epsilon: float | None
    evidence: dict = field(default_factory=dict)


def replay(
    run: RunFn,
    forget: Callable[[], None],
    prompt_ids: Sequence[int],
    shared: Sequence[int],
    filler: Sequence[int],
    step_start: int,
    n_drafted: int,
) -> Replay:
    """Logits for output index i = len(shared), replayed in both shapes from an empty cache.

    ``shared``: the output tokens both paths agree on (out[:i]); ``step_start`` (s <= i) and
    ``n_drafted`` (k >= i - s) describe the speculative step that produced token i.
    """
    i = len(shared)
    if not 0 <= step_start <= i or n_drafted < i - step_start:
        raise ValueError(f"step (start {step_start}, {n_drafted} drafts) cannot produce token {i}")
    seq = list(prompt_ids) + list(shared)  # tokens before output i
    base = len(prompt_ids) + step_start - 1  # the step recomputed positions base.. (its context's last token)

    def prefill() -> None:
        forget()
        if base > 0:
            run([ForwardItem(seq[:base], 1)])

    prefill()
    logits = None
    for end in range(base + 1, len(seq) + 1):  # one new token per forward
        (logits,) = run([ForwardItem(seq[:end], 1)])  # [1, vocab]
    control = logits[-1]

    prefill()
    rows = n_drafted + 1
    pad = list(filler) + [seq[-1]] * rows  # only the count matters after row i
    block = seq + pad[: rows - (len(seq) - base)]
    (logits,) = run([ForwardItem(block, rows)])  # [k+1, vocab]
    verifier = logits[i - step_start]
    forget()  # leave no replay state behind for timed runs
    return Replay(control.float(), verifier.float(), step_start, rows)


def classify(
    rep: Replay,
    target_id: int | None,
    spec_id: int | None,
    end_ids: frozenset[int],
    epsilon: float,
) -> DivergenceVerdict:
    """Apply the rule in the module doc to one replay. ``None`` ids: that path had ended."""
    c_arg = int(torch.argmax(rep.control))
    v_arg = int(torch.argmax(rep.verifier))
    evidence = {
        "step_start": rep.step_start,
        "forward_rows": rep.rows,
        "control_replay_id": c_arg,
        "verifier_replay_id": v_arg,
        "max_logit_change": float((rep.control - rep.verifier).abs().max()),
    }

    def outcome(arg: int) -> int | None:
        return None if arg in end_ids else arg

    def logit(vec: torch.Tensor, tok: int | None) -> float:
        if tok is not None:
            return float(vec[tok])
        ends = [e for e in end_ids if e < vec.shape[-1]]
        return float(vec[ends].max()) if ends else float("-inf")

    gap = logit(rep.control, target_id) - logit(rep.control, spec_id)
    evidence["control_gap"] = gap  # target-only token's logit minus the speculative one's
    if outcome(c_arg) != target_id:
        why = f"the target alone, one token at a time, gives {_name(outcome(c_arg))}, not the target-only path's {_name(target_id)}"
        return DivergenceVerdict("algorithmic", why, epsilon, evidence)
    if outcome(v_arg) != spec_id:
        why = (
            f"the target alone in the verifier's {rep.rows}-row forward gives {_name(outcome(v_arg))}, "
            f"not the speculative path's {_name(spec_id)}: the flip does not come from the forward's shape"
        )
        return DivergenceVerdict("algorithmic", why, epsilon, evidence)
    if not gap < epsilon:
        why = f"the flip reproduces from the forward's shape, but the logit gap {gap:.4g} is not below epsilon {epsilon:g}"
        return DivergenceVerdict("algorithmic", why, epsilon, evidence)
    why = f"near-tie (logit gap {gap:.4g} < epsilon {epsilon:g}) flipped by the verifier's {rep.rows}-row forward alone"
    return DivergenceVerdict("numerical", why, epsilon, evidence)


def _name(tok: int | None) -> str:
    return "<end>" if tok is None else f"token {tok}"


def step_producing(steps: Sequence[tuple[int, int]], index: int) -> tuple[int, int] | None:
    """The (start, drafts) step whose forward produced output ``index``."""
    found = None
    for start, n in steps:
        if start <= index:
            found = (start, n)
    return found if found is not None and index <= found[0] + found[1] else None

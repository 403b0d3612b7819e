"""Tie-aware verdicts: is a divergence a near-tie flipped by numerics, or a bug?

Batched verification runs the target over k+1 tokens in one forward while target-only
decoding runs it one token at a time. Different kernel shapes round differently, so where the
target's top two logits nearly tie, the two paths can pick different tokens with no bug
anywhere. At the first divergence (output index i) the target ALONE is replayed from an
empty prefix cache over the tokens both paths share, both ways:

    control shape   the prompt in one forward, then one token at a time up to i: exactly the
                    forwards target-only decoding ran;
    verifier shape  the speculative run's own steps (recorded (start, drafts) pairs): each a
                    forward over context + k tokens with k+1 rows, up to the step that
                    produced token i: exactly the target forwards the verifier ran.

Rows past the accepted drafts hold filler (the run's own later tokens): causal attention keeps
them out of every kept row, their K/V is rewritten by the next step, and they keep each
forward's shape. A step that verified a draft tree is replayed as that tree (its recorded
parents): the accepted nodes hold the run's tokens, the other nodes filler, which the tree
mask keeps out of the accepted path's rows. The draft model is not involved: only forward shapes differ between the
replays. The divergence is

    numerical    the verifier-shape replay yields the speculative path's token, the
                 control-shape replay yields the target-only token, and the two tokens'
                 logit gap (control replay) is below epsilon: the flip reproduces from the
                 forwards' shapes alone, at a near-tie;
    algorithmic  anything else: the speculative machinery changed the output.

A path that ended at i (EOS) counts as "the target's argmax is an end id". Rows after i in
the verifier-shape forward hold filler tokens: causal attention keeps them out of row i, and
they keep the forward's shape (k+1 rows) exactly as the verifier ran it.

Default epsilon per target dtype (in logits): set from each format's precision (bfloat16
keeps 8 significant bits, float16 11, float32 24; logits of magnitude 10-30), not fitted to a
data set. The flip must also reproduce from the forward's shape alone, so a generous epsilon
cannot by itself turn a real bug into a tie.
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
    verifier: torch.Tensor  # [vocab] row of the verifier-shaped forward that produced it
    step_start: int  # s
    rows: int  # k + 1
    steps_replayed: int


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
    spec_ids: Sequence[int],
    steps: Sequence[tuple[int, int]],
    index: int,
    trees: dict | None = None,
) -> Replay:
    """Logits for output ``index`` replayed in both shapes (module doc). ``spec_ids``: the
    speculative output (its first ``index`` tokens are shared with target-only); ``steps``:
    its GenerationResult.steps; ``trees``: its GenerationResult.step_trees."""
    trees = trees or {}
    prompt, out = list(prompt_ids), list(spec_ids)
    mine = [(s, k) for s, k in steps if s <= index]
    if not mine or index > mine[-1][0] + mine[-1][1]:
        raise ValueError(f"no recorded step produced output {index}")
    forget()
    logits = None
    for t in range(index + 1):  # t = 0 is the prompt's prefill, as target-only ran it
        (logits,) = run([ForwardItem(prompt + out[:t], 1)])  # [1, vocab]
    control = logits[-1]

    forget()
    for step, (start, k) in enumerate(mine):
        filler = (out or prompt)[-1]
        if step in trees:  # a draft tree: the accepted path's tokens at its nodes, filler elsewhere
            parents, path = trees[step]
            block = [filler] * k
            for j, node in enumerate(path[: len(out) - start]):
                block[node] = out[start + j]
            item = ForwardItem(prompt + out[:start] + block, k + 1, tuple(parents))
        else:
            block = out[start : start + k]
            block += [filler] * (k - len(block))  # filler past the run's end
            item = ForwardItem(prompt + out[:start] + block, k + 1)
        (logits,) = run([item])  # [k+1, vocab]
    start, k = mine[-1]
    row = index - start  # the row after the step's first index - start tokens
    if len(mine) - 1 in trees and row > 0:
        row = trees[len(mine) - 1][1][row - 1] + 1  # after the accepted node that emitted them
    forget()  # leave no replay state behind for timed runs
    return Replay(control.float(), logits[row].float(), start, k + 1, len(mine))


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
        "steps_replayed": rep.steps_replayed,
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
        why = (
            f"the target alone, one token at a time, gives {_name(outcome(c_arg))}, not the target-only path's {_name(target_id)}"
        )
        return DivergenceVerdict("algorithmic", why, epsilon, evidence)
    if outcome(v_arg) != spec_id:
        why = (
            f"the target alone in the speculative run's forward shapes ({rep.steps_replayed} steps, the last "
            f"{rep.rows} rows) gives {_name(outcome(v_arg))}, not the speculative path's {_name(spec_id)}: "
            "the flip does not come from forward shapes"
        )
        return DivergenceVerdict("algorithmic", why, epsilon, evidence)
    if not gap < epsilon:
        why = f"the flip reproduces from forward shapes, but the logit gap {gap:.4g} is not below epsilon {epsilon:g}"
        return DivergenceVerdict("algorithmic", why, epsilon, evidence)
    why = (
        f"near-tie (logit gap {gap:.4g} < epsilon {epsilon:g}) flipped by the speculative run's "
        f"forward shapes alone (the last {rep.rows} rows)"
    )
    return DivergenceVerdict("numerical", why, epsilon, evidence)


def _name(tok: int | None) -> str:
    return "<end>" if tok is None else f"token {tok}"

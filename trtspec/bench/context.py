"""`trtspec bench --context-sweep`: what each role's one-row decode step, and the target's
verify of k+1 tokens, cost as the context the step attends to grows.

For each context length L (increasing), on the loaded engines as they run (compiled or eager
as their kernel choice made them; the report says which): the engine's KV cache is filled
with a real prefill of L tokens (the first prompt's tokens, repeated), untimed; then steps that
continue it are timed, each one's new tokens replacing the last one's (the pool takes back a
sequence that changes at most its last max_draft_len + 1 tokens), so every timed step attends
to exactly L cached positions and computes only its own; the first step is a warm-up and the
median of the rest is kept. That for the target's decode step (one new token), its verify of
k + 1 tokens and a draft model's decode step. An EAGLE-3 head's step is measured as the costs
line measures it (measure.head_step): per drafted token of k chained head steps after L + TAIL
tokens. A step that did not reuse its L-token context is an error, never a timing.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence

from trtspec.bench.measure import TAIL, Bandwidth, ContextPoint, Costs, head_step, step_busy, step_paths
from trtspec.errors import RequestError, RuntimeFailure

REPEATS = 7  # timed steps per context length and kind (the median is kept)


def room(k: int, head: bool) -> int:
    """Positions a measured step needs past its context: the verify's k + 1 tokens, and for an
    EAGLE-3 head the TAIL tokens before its k drafted ones."""
    return k + 1 + (TAIL if head else 0)


def check_contexts(contexts: Sequence[int], max_seq_len: int, k: int, head: bool) -> None:
    """Refuse a context length whose measured steps would not fit the engines' KV cache."""
    top = max_seq_len - room(k, head)
    over = [n for n in contexts if n > top]
    if over:
        raise RequestError(
            f"--context-sweep {over[0]}: the engines hold {max_seq_len} positions (build.max_seq_len) and a "
            f"step at k={k} needs {room(k, head)} past its context; use context lengths up to {top}"
        )


def context_ids(prompt_ids: list[int], n: int) -> list[int]:
    """``n`` tokens: ``prompt_ids`` repeated (each context then starts with every shorter one)."""
    if not prompt_ids:
        raise RequestError("--context-sweep repeats the first prompt's tokens, and it has none; pass a prompt with -p")
    return (prompt_ids * (n // len(prompt_ids) + 1))[:n]


def context_points(
    dep, prompt_ids: list[int], contexts: Sequence[int], k: int, bandwidth: Bandwidth | None, progress: Callable[[str], None]
) -> Iterator[ContextPoint]:
    """One ContextPoint per context length, as each is measured (an interruption keeps those
    yielded). ``bandwidth``: the machine's, from the costs line, for the floor at each length."""
    for n in contexts:
        progress(f"context sweep: {n} tokens")
        yield ContextPoint(n, context_costs(dep, context_ids(prompt_ids, n), k, bandwidth))


def context_costs(dep, ctx: list[int], k: int, bandwidth: Bandwidth | None, repeats: int = REPEATS) -> Costs:
    """The step costs with ``ctx`` in the KV cache: target and draft decode steps, the verify of
    k + 1 tokens, and the bytes a target decode step reads there."""
    target_step = step_seconds(dep.target, ctx, 1, repeats)
    verify_step = step_seconds(dep.target, ctx, k + 1, repeats)
    draft_step = step_seconds(dep.draft, ctx, 1, repeats) if dep.draft is not None else None
    if dep.head is not None:
        draft_step = head_step(dep, ctx, k, repeats)
    weights, kv = dep.target.step_bytes(len(ctx))
    return Costs(target_step, draft_step, verify_step, k, weights, kv, bandwidth, {}, step_paths(dep), step_busy(dep))


def step_seconds(engine, ctx: list[int], n_new: int, repeats: int) -> float:
    """Median seconds of one forward over ``n_new`` new tokens with exactly ``ctx`` cached."""
    from trtspec.engines.torch.engine import ForwardItem

    engine.run([ForwardItem(ctx, 1)])  # the cache holds the context now (a real prefill of what it lacked)
    times = []
    for r in range(repeats + 1):  # r = 0: a warm-up at this shape
        seq = ctx + [(7 * r + j) % 100 + 10 for j in range(n_new)]  # a first new token unlike the last step's
        t0 = time.perf_counter()
        engine.run([ForwardItem(seq, n_new)])
        seconds = time.perf_counter() - t0
        reused = engine.last_use[0][0]
        if reused < len(ctx):
            raise RuntimeFailure(
                f"context sweep: a step after {len(ctx)} tokens reused only {reused} of them from the "
                "prefix cache, so its time would include a prefill; please report this"
            )
        if r:
            times.append(seconds)
    return statistics.median(times)

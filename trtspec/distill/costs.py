"""What a head costs next to its target, measured, and the draft length it should use.

Speedup of drafting k tokens per target forward (the Leviathan bound, with measured costs):

    tokens per forward(k) = 1 + a_1 + a_1 a_2 + ... + a_1 ... a_k
    bound(k)              = tokens per forward(k) / (verify(k) + k * c)

a_j: per-position acceptance (P(draft j right | drafts before it right), measured on unseen
prompts); verify(k): a target forward over k + 1 new tokens in target decode steps; c: one
head step in target decode steps. All on this machine, in this process, at one context length,
on the target's device (every timed call ends by reading its result on the CPU, so a GPU's
queued work is inside the time).
"""

from __future__ import annotations

import time

import torch

from trtspec.engines.torch.eagle3_head import Eagle3Head, HeadEngine, HeadRow
from trtspec.engines.torch.engine import ForwardItem, TorchEngine
from trtspec.speculative.metrics import tree_speedup_bound

CONTEXT = 128  # positions before the timed step (fewer when the engine holds fewer)
REPEATS = 9


def best_seconds(fn, repeats: int = REPEATS) -> float:
    """The fastest of ``repeats`` timed calls after a warm one: on a machine shared with other
    work the minimum is the machine's cost, a median its load."""
    fn()  # warm
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure_costs(target: TorchEngine, head: Eagle3Head, depth: int) -> dict:
    """Target decode step (ms), verify(k) for k = 1..depth and c, each the best of REPEATS."""
    vocab = min(target.vocab_size, 1000)
    n = max(1, min(CONTEXT, target.max_seq_len - depth - 3))  # distill sizes the engine to its data
    ctx = [(7 * i) % (vocab - 8) + 1 for i in range(n)]
    target.run([ForwardItem(ctx, 1)])
    flip = [0]

    def forward(n_new: int):
        def run():
            flip[0] ^= 1  # another token each time: the slot keeps ctx and recomputes n_new positions
            target.run([ForwardItem(ctx + [3 + flip[0] + i for i in range(n_new)], n_new)])

        return run

    decode = best_seconds(forward(1))
    verify = [best_seconds(forward(k + 1)) / decode for k in range(1, depth + 1)]
    engine = HeadEngine(head, target.model.model.embed_tokens, target.cos, target.sin, n + 2, torch.float32, 1)
    h = head.cfg.hidden_size
    engine.extend([HeadRow(0, 0, torch.zeros(n, h), ctx)])
    state = torch.zeros(1, h, device=engine.device)  # on the head's device: the timed step copies nothing in

    def head_step():
        out = engine.extend([HeadRow(0, n, state, [5])])  # rewritten in place each time
        engine.next_ids(out[0][-1:])

    c = best_seconds(head_step) / decode
    return {"decode_ms": round(decode * 1e3, 2), "verify": [round(v, 3) for v in verify], "head": round(c, 4)}


def recommend_k(accepted: list[float], costs: dict) -> tuple[int, list[float]]:
    """(the k with the highest bound, 0 when none beats target-only; the bound of each k)."""
    bounds = []
    for k in range(1, min(len(accepted), len(costs["verify"])) + 1):
        tokens, run = 1.0, 1.0
        for a in accepted[:k]:
            run *= a
            tokens += run
        bounds.append(round(tree_speedup_bound(tokens, k, costs["head"], costs["verify"][k - 1]), 3))
    best = max(range(len(bounds)), key=lambda i: bounds[i], default=-1)
    return (best + 1 if best >= 0 and bounds[best] > 1.0 else 0), bounds

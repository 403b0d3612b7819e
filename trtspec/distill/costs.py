"""What a head costs next to its target, measured, and the draft length it should use.

Speedup of drafting k tokens per target forward (the Leviathan bound, with measured costs):

    tokens per forward(k) = 1 + a_1 + a_1 a_2 + ... + a_1 ... a_k
    bound(k)              = tokens per forward(k) / (verify(k) + k * c)

a_j: per-position acceptance (P(draft j right | drafts before it right), measured on unseen
prompts). distill gives the tokens per forward of each k directly, from walking the unseen
responses as greedy generation drafts them (ttt.agreement's walk_length): right drafts come in
runs the runtime steps over, so over every chain start the formula above counts more than
the runtime gets. verify(k): a target forward over k + 1 new tokens in target decode steps (never less
than verify(k - 1): a longer verify does a shorter one's work and more); c: one
head step in target decode steps. All on this machine, in this process, at one context length,
on the target's device (every timed call ends by reading its result on the CPU, so a GPU's
queued work is inside the time).
"""

from __future__ import annotations

import contextlib
import itertools
import json
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
    # A verify of more tokens does the work of a shorter one and more: costs that fall with k are
    # the machine's noise (a neighbour during one timing), and would recommend a longer k for it.
    verify = list(itertools.accumulate((best_seconds(forward(k + 1)) / decode for k in range(1, depth + 1)), max))
    engine = HeadEngine(head, target.model.model.embed_tokens, target.cos, target.sin, n + 2, torch.float32, 1)
    h = head.cfg.hidden_size
    engine.extend([HeadRow(0, 0, torch.zeros(n, h), ctx)])
    state = torch.zeros(1, h, device=engine.device)  # on the head's device: the timed step copies nothing in

    def head_step():
        out = engine.extend([HeadRow(0, n, state, [5])])  # rewritten in place each time
        engine.next_ids(out[0][-1:])

    c = best_seconds(head_step) / decode
    return {"decode_ms": round(decode * 1e3, 2), "verify": [round(v, 3) for v in verify], "head": round(c, 4)}


LONGER_K_GAIN = 1.02  # a longer k is recommended only if its bound beats every shorter one's by 2%


def recommend_k(accepted: list[float], costs: dict, tokens: list[float] | None = None) -> tuple[int, list[float]]:
    """(the shortest k whose bound is within LONGER_K_GAIN of the highest, 0 when none beats
    target-only; the bound of each k). A draft position right 3% of the time adds almost
    nothing to the bound, and on a loaded machine the verify costs flatten out: a longer k must
    win clearly, not by the timing's noise. ``tokens``: the tokens per forward of each k where
    they were measured (distill's walk of the unseen responses as the runtime drafts them);
    otherwise the chain formula over ``accepted``."""
    bounds = []
    for k in range(1, min(len(tokens or accepted), len(costs["verify"])) + 1):
        if tokens:
            per_forward = tokens[k - 1]
        else:
            per_forward, run = 1.0, 1.0
            for a in accepted[:k]:
                run *= a
                per_forward += run
        bounds.append(round(tree_speedup_bound(per_forward, k, costs["head"], costs["verify"][k - 1]), 3))
    if not bounds or max(bounds) <= 1.0:
        return 0, bounds
    best = next(i for i, b in enumerate(bounds) if b * LONGER_K_GAIN >= max(bounds))
    return best + 1, bounds


# -- generation batch ---------------------------------------------------------------------------

GEN_ROWS_CANDIDATES = (16, 32, 64, 128)  # rows per decode step tried on a CPU
GEN_ROWS_CONTEXT = 32  # positions before the timed decode step
GEN_ROWS_TIE = 0.97  # a smaller batch within 3% of the fastest is kept (less memory, same speed)
GEN_ROWS_FILE = "generation-rows.json"


def fastest_rows(tokens_per_s: dict[int, float]) -> int:
    """The rows with the most tokens per second, or the fewest rows within GEN_ROWS_TIE of it."""
    top = max(tokens_per_s.values())
    return min(rows for rows, rate in tokens_per_s.items() if rate >= GEN_ROWS_TIE * top)


def measure_generation_rows(folder, device, candidates: tuple[int, ...] = GEN_ROWS_CANDIDATES) -> dict[int, float]:
    """Target tokens per second of one batched decode step at each of ``candidates`` rows
    (best of 3 after a warm one), on an engine of ``folder`` loaded for it: past ~16-32 rows a
    CPU step is bound by compute, and where depends on the CPU (a 2-core AVX-512 EPYC peaked at
    32 rows, a 2-core Xeon with AMX still gained at 128)."""
    target = TorchEngine.load(folder, slots=max(candidates), max_seq_len=GEN_ROWS_CONTEXT + 4, device=device)
    vocab = min(target.vocab_size, 1000)
    contexts = [[(7 * i + 13 * r) % (vocab - 8) + 1 for i in range(GEN_ROWS_CONTEXT)] for r in range(max(candidates))]
    for n in range(0, len(contexts), min(candidates)):  # prefill every slot, a few rows a forward
        target.run([ForwardItem(c, 1) for c in contexts[n : n + min(candidates)]])
    flip = [0]

    def step(rows: int):
        def run():
            flip[0] ^= 1  # another token each time: each slot keeps its context and recomputes one position
            target.run([ForwardItem(c + [3 + flip[0]], 1) for c in contexts[:rows]])

        return run

    return {rows: round(rows / best_seconds(step(rows), repeats=3), 1) for rows in candidates}


def generation_key(folder, hf) -> str:
    """What a measured generation batch depends on: this CPU and its threads (the kernel
    choice's signature), torch, and the model's shape, dtype and quantization."""
    from trtspec.engines.manifest import read_manifest
    from trtspec.engines.torch.kernels import cpu_signature

    manifest = read_manifest(folder)
    parts = cpu_signature() | {
        "threads": str(torch.get_num_threads()),
        "torch": torch.__version__,
        "model": f"{hf.hidden_size}x{hf.intermediate_size}x{hf.num_hidden_layers}x{hf.vocab_size}",
        "dtype": manifest.dtype,
        "quantization": getattr(manifest, "quantization", "none"),
        "candidates": ",".join(map(str, GEN_ROWS_CANDIDATES)),
    }
    return json.dumps(parts, sort_keys=True)


def generation_rows_for(folder, device, key: str, cache_dir) -> tuple[int, dict[int, float], str]:
    """(rows, tokens per second per candidate, "measured" | "cached"): the batch a CPU generates
    at, measured once per machine and model (``key``: the engine's kernel-choice key) and cached
    in ``cache_dir``, so the same command on the same machine generates the same batches (the
    data, and so the head, do not depend on the load of the moment)."""
    from trtspec.files import write_json_atomic

    path = cache_dir / GEN_ROWS_FILE
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        entries = {}
    cached = entries.get(key) if isinstance(entries, dict) else None
    if isinstance(cached, dict) and isinstance(cached.get("rows"), int) and cached["rows"] > 0:
        return cached["rows"], {int(r): v for r, v in cached.get("tokens_per_s", {}).items()}, "cached"
    rates = measure_generation_rows(folder, device)
    rows = fastest_rows(rates)
    entries = entries if isinstance(entries, dict) else {}
    entries[key] = {"rows": rows, "tokens_per_s": rates, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    with contextlib.suppress(OSError):  # a read-only cache: measure again next time
        write_json_atomic(path, entries)
    return rows, rates, "measured"

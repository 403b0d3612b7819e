"""What running a ragged step as forwards of similar length buys (engine.py forward_groups),
against one forward with every row padded to the longest, on one built torch engine:

1. distill's generation: one batch of ``--batch`` of the shipped distill prompts (chat template,
   in file order: mixed lengths), 64 greedy tokens each, captured as distill captures them
   (features and top-k labels), each way twice, alternating, each run in a fresh process; the
   prefill's seconds, the decode steps' and the response tokens per second.
2. serving: a step in which ``--decoding`` sequences decode one token (context 300) while a new
   request's prompt of each ``--prompts`` length is prefilled beside them (continuous batching:
   one engine call); the median step over ``--rounds`` rounds, the two ways alternating.

    .venv/bin/python -m lab.ragged_forwards engines/smollm2-135m-eagle3-demo/target --json ragged-forwards

The two ways are the same engine with ``forward_rows`` (a forward's cost in tokens) at its
default or so large that a step is never split. Timings: run it on a quiet machine only.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lab._common import RESULTS, command_line, write_result

ONE_FORWARD = 10**9  # forward_rows that never splits a step


def generation(engine, batch: int, tokens: int) -> dict:
    """One distill generation batch: prefill seconds, decode seconds, response tokens/s."""
    from transformers import AutoTokenizer

    from trtspec.distill.data import SHIPPED_PROMPTS, distill_prompts, generated
    from trtspec.speculative.loop import GenerationRequest
    from trtspec.speculative.requests import encode_prompt, end_token_ids

    tok = AutoTokenizer.from_pretrained(engine.folder)
    ids = [encode_prompt(tok, p, True) for p in distill_prompts(SHIPPED_PROMPTS)[:batch]]
    ends = end_token_ids(tok, engine.folder)
    calls: list[float] = []
    run = engine.run

    def timed(items):
        t0 = time.perf_counter()
        out = run(items)
        calls.append(time.perf_counter() - t0)
        return out

    engine.run = timed
    try:
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as parts:
            samples = list(generated(engine, [GenerationRequest(list(i), tokens, 0, ends) for i in ids], Path(parts)))
        total = time.perf_counter() - t0
    finally:
        del engine.run
    made = sum(len(s.tokens) + 1 - len(i) for s, i in zip(samples, ids))
    return {
        "prompt_tokens": sum(map(len, ids)),
        "padded_prompt_tokens": max(map(len, ids)) * len(ids),
        "prefill_s": round(calls[0], 2),
        "decode_s": round(sum(calls[1:]), 2),
        "total_s": round(total, 2),
        "tokens": made,
        "tok_s": round(made / total, 1),
    }


def mixed_step(engine, decoding: int, prompt: int, rounds: int, rng: random.Random) -> dict[str, float]:
    """Median ms of one step: ``decoding`` rows decode while a ``prompt``-token prompt is prefilled."""
    from trtspec.engines.torch.engine import FORWARD_ROWS, ForwardItem

    times: dict[str, list[float]] = {"one": [], "grouped": []}
    contexts = [[rng.randrange(100, 20000) for _ in range(300)] for _ in range(decoding)]
    for r in range(rounds + 1):
        for name in ("one", "grouped") if r % 2 else ("grouped", "one"):
            engine.forward_rows = ONE_FORWARD if name == "one" else FORWARD_ROWS
            engine.forget_prefixes()
            engine.run([ForwardItem(c, 1) for c in contexts])  # the decoding sequences' prefixes
            new = [rng.randrange(100, 20000) for _ in range(prompt)]
            items = [ForwardItem(c + [rng.randrange(100, 20000)], 1) for c in contexts] + [ForwardItem(new, 1)]
            t0 = time.perf_counter()
            engine.run(items)
            if r:  # round 0 makes each shape's primitives: untimed
                times[name].append(time.perf_counter() - t0)
    engine.forward_rows = FORWARD_ROWS
    return {name: round(statistics.median(t) * 1e3, 1) for name, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engine", help="a built torch engine folder (e.g. engines/smollm2-135m-eagle3-demo/target)")
    ap.add_argument("--batch", type=int, default=128, help="generation batch (distill's measured best on 2 cores)")
    ap.add_argument("--tokens", type=int, default=64, help="response tokens (the demo's max_tokens)")
    ap.add_argument("--decoding", type=int, default=3, help="sequences decoding beside the new prompt")
    ap.add_argument("--prompts", default="64,512", help="new prompts' lengths, comma-separated")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--skip-generation", action="store_true")
    ap.add_argument("--only", choices=["one", "grouped"], help=argparse.SUPPRESS)  # one generation run (a child process)
    ap.add_argument(
        "--max-seq-len", type=int, default=256, help="the generating engine's KV positions (distill: longest prompt + tokens)"
    )
    ap.add_argument("--json", help="also write a result file lab/results/NAME.json")
    args = ap.parse_args(argv)

    from trtspec.engines.eagle3_checkpoint import distill_layer_ids
    from trtspec.engines.torch.engine import FORWARD_ROWS, TorchEngine

    if args.only:  # one generation batch in this process, as distill runs it; its figures as JSON
        engine = TorchEngine.load(args.engine, slots=args.batch, max_seq_len=args.max_seq_len)
        engine.capture_features(distill_layer_ids(engine.config.num_layers))  # the layers distill captures
        engine.forward_rows = ONE_FORWARD if args.only == "one" else FORWARD_ROWS
        print(json.dumps(generation(engine, args.batch, args.tokens)))
        return 0
    values: dict = {"forward_rows": FORWARD_ROWS}
    if not args.skip_generation:
        rows = []
        for name in ("one", "grouped", "one", "grouped"):  # each in a fresh process, alternating: the host's drift shows
            run = subprocess.run(
                [sys.executable, __file__, args.engine, "--only", name, "--batch", str(args.batch), "--tokens", str(args.tokens)],
                check=True,
                capture_output=True,
                text=True,
            )
            got = json.loads(run.stdout.strip().splitlines()[-1])
            print(f"generation, {name:7s}: {got}", flush=True)
            rows.append([name, got["prefill_s"], got["decode_s"], got["total_s"], got["tok_s"]])
        values["generation"] = {
            "prompt_tokens": got["prompt_tokens"],
            "padded_prompt_tokens": got["padded_prompt_tokens"],
            "tokens": got["tokens"],
            "table": {"columns": ["forwards", "prefill s", "decode s", "total s", "response tok/s"], "rows": rows},
        }
    engine = TorchEngine.load(args.engine, slots=args.decoding + 1, max_seq_len=1024)
    rng = random.Random(0)
    steps = []
    for n in (int(x) for x in args.prompts.split(",")):
        got = mixed_step(engine, args.decoding, n, args.rounds, rng)
        print(
            f"{args.decoding} decoding + a {n}-token prompt: one forward {got['one']} ms, grouped {got['grouped']} ms", flush=True
        )
        steps.append([n, got["one"], got["grouped"], round(got["one"] / got["grouped"], 2)])
    values["mixed_step"] = {
        "decoding": args.decoding,
        "table": {"columns": ["new prompt tokens", "one forward ms", "grouped ms", "speedup"], "rows": steps},
    }
    if args.json:
        print(f"wrote {write_result(RESULTS / f'{args.json}.json', command_line('ragged_forwards.py'), values)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

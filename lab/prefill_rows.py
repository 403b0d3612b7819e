"""What the packed Linears' fixed row counts cost a prefill: the same prefills with the fixed
counts (engines/torch/model.py row_blocks: above 16 rows, zero rows padded to one of four sizes
per doubling, at most 256 rows a matmul) and with every input run as it comes (as before).

    .venv/bin/python -m lab.prefill_rows engines/smollm2-135m-cpu/target --json prefill-rows

Loads one built torch engine in this process (its kernel choice as served), then times a fresh
prefill (no cached prefix) of each ``--lengths`` for one row and for ``--rows`` rows at once,
``--rounds`` times, the two settings alternating within a round, after one untimed round (the
first call of each shape builds its oneDNN primitive). Reports the median seconds of each and
their ratio (fixed / as given). Timings: run it on a quiet machine only.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from lab._common import RESULTS, command_line, write_result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engine", help="a built torch engine folder (e.g. engines/smollm2-135m-cpu/target)")
    ap.add_argument("--lengths", default="40,70,100,130,200,300,500,1000", help="prompt lengths, comma-separated")
    ap.add_argument("--rows", type=int, default=4, help="the batched prefill's rows (at most the engine's max batch)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", help="also write a result file lab/results/NAME.json")
    args = ap.parse_args(argv)

    from trtspec.engines.torch.engine import ForwardItem, TorchEngine

    engine = TorchEngine.load(args.engine)
    if engine.kernels is not None:
        print(f"kernels: {engine.kernels.layout} ({engine.kernels.source})", flush=True)
    rng = random.Random(0)
    lengths = [int(x) for x in args.lengths.split(",")]
    cases = [(1, n) for n in lengths] + [(min(args.rows, engine.max_batch_size), n) for n in lengths]
    prompts = {case: [[rng.randrange(100, 20000) for _ in range(case[1])] for _ in range(case[0])] for case in cases}
    samples: dict[tuple[int, int], dict[str, list[float]]] = {case: {"fixed": [], "as_given": []} for case in cases}
    for r in range(args.rounds + 1):
        for case in cases:
            order = ["fixed", "as_given"] if r % 2 else ["as_given", "fixed"]
            for name in order:
                engine.model.fix_matmul_rows(name == "fixed")
                engine.forget_prefixes()
                t0 = time.perf_counter()
                engine.run([ForwardItem(p, 1) for p in prompts[case]])
                if r:  # round 0 builds each shape's primitives: untimed
                    samples[case][name].append(time.perf_counter() - t0)
    rows = []
    for (b, n), s in samples.items():
        fixed, given = statistics.median(s["fixed"]), statistics.median(s["as_given"])
        rows.append([b, n, round(given * 1e3, 1), round(fixed * 1e3, 1), round(fixed / given, 3)])
        print(f"{b} x {n:5d} tokens: as given {given * 1e3:8.1f} ms, fixed rows {fixed * 1e3:8.1f} ms ({fixed / given:.3f}x)")
    if args.json:
        values = {
            "kernels": engine.kernels.layout if engine.kernels else None,
            "table": {"columns": ["rows", "prompt tokens", "as given ms", "fixed rows ms", "ratio"], "rows": rows},
            "worst_ratio": max(row[4] for row in rows),
        }
        write_result(RESULTS / f"{args.json}.json", command_line("prefill_rows.py"), values)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What one training step of distill's trainer costs, on a head's own captured batches: the
training-time-test loss and its backward (Trainer.step_loss) at each depth, over the batches the
trainer draws at steps 0..N-1 (the seeded draw of Trainer.fit), after one untimed step.

    python -m lab.train_step engine_specs/smollm2-135m-eagle3-demo.yaml \
        --head weights/smollm2-135m-eagle3-head-demo --steps 20 --depths 1,3 [--json NAME]

It times whatever trtspec it imports: run it with PYTHONPATH pointing at a checkout of another
commit to compare two versions of the trainer on the same batches (the same head, data and
seed). The head's work folder (its .NAME.distill capture) must still be there; nothing is
generated. Prints, per depth, the median seconds a step and the CPU seconds of all steps; the
thread count is the trainer's (its governor's, as in a distill run). Quiet machine only.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from lab._common import RESULTS, command_line, write_result
from lab.distill_peers import distill_options, load_head


def time_steps(spec: Path, head_dir: Path, steps: int, depths: list[int]) -> list[dict]:
    import torch

    import trtspec
    from trtspec.distill.data import collate
    from trtspec.distill.run import prepare, work_folder, work_lock
    from trtspec.distill.trainer import Trainer
    from trtspec.engines.torch import threads
    from trtspec.spec import load_spec

    print(f"trtspec from {Path(trtspec.__file__).parent}", flush=True)
    opts = distill_options(head_dir)
    with work_lock(work_folder(head_dir)):
        data = prepare(load_spec(spec), opts, work_folder(head_dir))
    soft = opts.labels == "soft"
    rows = []
    for depth in depths:
        head = load_head(head_dir, data.target_hf)
        draft_ids = head.to_target_ids(torch.arange(head.cfg.draft_vocab_size)).tolist()
        trainer = Trainer(head, data.target, draft_ids, opts, depth, data.store)
        head.train()
        seconds, cpu = [], 0.0
        # The batch draw is Trainer.fit's, written out here rather than called, so that this
        # script also runs against commits whose trainer predates any helper for it.
        for step in range(-1, steps):  # step -1: untimed (first calls allocate)
            gen = torch.Generator().manual_seed(opts.seed * 1_000_003 + max(step, 0))
            idx = torch.randint(len(data.train), (min(opts.batch_size, len(data.train)),), generator=gen).tolist()
            batch = collate([data.train[i] for i in idx], opts.max_len, data.store, soft=soft)
            with threads.governor().pinned():
                t0, c0 = time.perf_counter(), time.process_time()
                loss = trainer.step_loss(batch, step=-1)
                head.zero_grad()
                loss.backward()
                t1, c1 = time.perf_counter(), time.process_time()
            if step >= 0:
                seconds.append(t1 - t0)
                cpu += c1 - c0
        rows.append(
            {
                "depth": depth,
                "steps": steps,
                "median_s": round(statistics.median(seconds), 4),
                "cpu_s": round(cpu, 2),
                "threads": torch.get_num_threads(),
            }
        )
        print(f"depth {depth}: median {rows[-1]['median_s']:.3f} s a step, {cpu:.1f} CPU s over {steps} steps", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec", type=Path)
    ap.add_argument("--head", type=Path, required=True, help="a head `trtspec distill` wrote, its work folder still there")
    ap.add_argument("--steps", type=int, default=20, help="timed training steps per depth")
    ap.add_argument("--depths", default="1,3", help="training-time-test depths timed (comma-separated)")
    ap.add_argument("--json", help="also write a result file lab/results/NAME.json")
    args = ap.parse_args(argv)
    rows = time_steps(args.spec, args.head, args.steps, [int(d) for d in args.depths.split(",")])
    if args.json:
        path = write_result(RESULTS / f"{args.json}.json", command_line("lab/train_step.py", argv), {"rows": rows})
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What one EAGLE-3 head step costs on each kernel layout: c of the speed-up bound.

    .venv/bin/python -m lab.head_step engines/smollm2-135m-eagle3-demo/target --json head-step

Builds a head of make demo's shape for the target (distill's anchored start: one layer, three
feature layers, an 8,192-token draft vocabulary; the weights' values do not change the time),
then one HeadEngine per layout (engines/torch/kernels.py: dense, onednn, head) and one on the
layout this machine chooses, and times a k=1 draft step (``fc`` over one position's target
features, the layer at a 128-token context, the draft LM head and its argmax) ``--repeats``
times, the engines interleaved, with the target's decode step at the same context in between.
Reports the minimum and median milliseconds of each and c = head step / target decode step
(medians); with ``--acceptance A --verify V`` (a measured k=1 acceptance and 2-token verify in
target decode steps, e.g. from `trtspec bench --methods`) also each layout's k=1 bound,
(1 + A) / (V + c). Timings: run it on a quiet machine only.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from lab._common import RESULTS, command_line, write_result

CONTEXT = 128


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engine", help="a built torch target engine folder (e.g. engines/smollm2-135m-eagle3-demo/target)")
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=300)
    ap.add_argument("--acceptance", type=float, help="a measured k=1 acceptance, for the bound")
    ap.add_argument("--verify", type=float, help="a measured 2-token verify in target decode steps, for the bound")
    ap.add_argument("--json", help="also write a result file lab/results/NAME.json")
    args = ap.parse_args(argv)
    if (args.acceptance is None) != (args.verify is None):
        ap.error("--acceptance and --verify go together (the bound needs both)")

    import torch
    from transformers import AutoConfig

    from trtspec.distill.heads import new_head
    from trtspec.engines.eagle3_checkpoint import distill_layer_ids
    from trtspec.engines.torch import eagle3_head, kernels
    from trtspec.engines.torch.eagle3_head import HeadEngine, HeadRow
    from trtspec.engines.torch.engine import ForwardItem, TorchEngine

    folder = Path(args.engine)
    hf = AutoConfig.from_pretrained(folder)
    stride = hf.vocab_size // args.draft_vocab
    head, _ = new_head(hf, folder, distill_layer_ids(hf.num_hidden_layers), list(range(0, stride * args.draft_vocab, stride)), 0)
    head.eval()
    target = TorchEngine.load(folder, slots=1, max_seq_len=CONTEXT + 8)
    ctx = [(7 * i) % 1000 + 1 for i in range(CONTEXT)]
    target.run([ForwardItem(ctx, 1)])

    def engine(layout: str | None) -> HeadEngine:
        """A HeadEngine on ``layout`` (None: the machine's choice, as every HeadEngine makes it)."""
        real = eagle3_head.choose_head_kernels
        if layout is not None:
            eagle3_head.choose_head_kernels = lambda h, *a: (
                kernels.apply_layout(h, layout),
                kernels.KernelChoice(layout, "forced"),
            )[1]
        try:
            e = HeadEngine(head, target.model.model.embed_tokens, target.cos, target.sin, CONTEXT + 8, torch.float32, 1)
        finally:
            eagle3_head.choose_head_kernels = real
        e.extend([HeadRow(0, 0, torch.zeros(CONTEXT, head.cfg.hidden_size), ctx)])
        return e

    engines = {name: engine(name) for name in kernels.LAYOUTS} | {"chosen": engine(None)}
    chosen = engines["chosen"].kernels
    features = torch.randn(1, head.cfg.n_features * head.cfg.target_hidden_size)

    def head_step(e: HeadEngine) -> None:
        out = e.extend([HeadRow(0, CONTEXT, e.fuse(features), [7])])
        e.next_ids(out[0][-1:])

    def decode() -> None:
        target.run([ForwardItem([*ctx, 3 + len(times["target"]) % 2], 1)])

    times: dict[str, list[float]] = {name: [] for name in engines} | {"target": []}
    for r in range(args.repeats + 1):
        for name, e in engines.items():
            t0 = time.perf_counter()
            head_step(e)
            if r:  # the first round builds each shape's kernels: untimed
                times[name].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        decode()
        if r:
            times["target"].append(time.perf_counter() - t0)
    med = {name: statistics.median(t) for name, t in times.items()}
    rows, bounds = [], {}
    columns = ["head layout", "min ms", "median ms", "c"] + (["k=1 bound"] if args.acceptance is not None else [])
    for name in engines:
        c = med[name] / med["target"]
        row = [name, f"{min(times[name]) * 1e3:.2f}", f"{med[name] * 1e3:.2f}", f"{c:.4f}"]
        if args.acceptance is not None:
            bounds[name] = round((1 + args.acceptance) / (args.verify + c), 3)
            row.append(f"{bounds[name]:.3f}x")
        rows.append(row)
        print("  ".join(f"{col} {cell}" for col, cell in zip(columns, row)))
    print(f"target decode step: median {med['target'] * 1e3:.2f} ms; the machine chose {chosen.layout} ({chosen.source})")
    if args.json:
        values = {
            "table": {"columns": columns, "rows": rows, "align": "l" + "r" * (len(columns) - 1)},
            "median_ms": {name: round(v * 1e3, 3) for name, v in med.items()},
            "c": {name: round(med[name] / med["target"], 4) for name in engines},
            "chosen": chosen.layout,
            "repeats": args.repeats,
        } | ({"bound": bounds, "acceptance": args.acceptance, "verify": args.verify} if bounds else {})
        print(f"wrote {write_result(RESULTS / f'{args.json}.json', command_line('head_step.py', argv), values)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

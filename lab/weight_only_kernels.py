"""Which CPU kernel runs a weight-only quantized Linear fastest here, per activation dtype:
the measurement behind docs/quantization.md's kernel table.

    python -m lab.weight_only_kernels --rows 1,6 --out lab/weight_only_kernels.json

For each of SmolLM2-135M's Linear shapes (the engine's fused q/k/v and gate/up, o, down, the
LM head), one input of ``rows`` rows through:
  onednn_f32 / onednn_bf16   the float engines' layout (weights reordered for oneDNN)
  int8_f32 / int8_bf16       _weight_int8pack_mm (int8_wo's kernel)
  int4_f32 / int4_bf16       _weight_int4pack_mm_for_cpu (int4_wo's kernel, groups of 32)
the candidates interleaved in a rotated order each round, the median of ``--rounds`` rounds of
``--reps`` calls, in microseconds per call. Weights are random (the time does not depend on
their values). Use the engine's thread count (OMP_NUM_THREADS / torch default) and a quiet
machine: the figures are only comparable within one run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from lab._common import command_line, write_result
from trtspec.engines.torch.quant import GROUP, WeightOnlyLinear, quantize

# SmolLM2-135M, as the engine runs it (q/k/v and gate/up fused): name -> (out, in)
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def candidates(out: int, cols: int) -> dict[str, tuple]:
    """name -> (callable on an input, its activation dtype)."""
    weight = torch.randn(out, cols) * 0.05
    found = {}
    for tag, dtype in DTYPES.items():
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(dtype))
        found[f"onednn_{tag}"] = (lambda x, p=packed: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""), dtype)
        for scheme in ("int8_wo", "int4_wo"):
            linear = WeightOnlyLinear(quantize(weight, scheme).cast(dtype), None, dtype)
            linear.pack()
            found[f"{scheme[:4]}_{tag}"] = (linear, dtype)
    return found


def measure(rows: int, rounds: int, reps: int) -> dict[str, dict[str, float]]:
    results = {}
    for shape, (out, cols) in SHAPES.items():
        assert cols % GROUP == 0
        cands = candidates(out, cols)
        inputs = {dtype: torch.randn(rows, cols).to(dtype) for dtype in DTYPES.values()}
        names = list(cands)
        for name in names:  # warm-up
            fn, dtype = cands[name]
            fn(inputs[dtype])
        samples: dict[str, list[float]] = {name: [] for name in names}
        n = max(1, reps // 10) if shape == "lm_head" else reps
        with torch.inference_mode():
            for r in range(rounds):
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    fn, dtype = cands[name]
                    t0 = time.perf_counter()
                    for _ in range(n):
                        fn(inputs[dtype])
                    samples[name].append((time.perf_counter() - t0) / n * 1e6)
        results[shape] = {name: round(statistics.median(s), 1) for name, s in samples.items()}
        print(f"{shape:8s} rows {rows}: " + "  ".join(f"{k} {v:.0f}us" for k, v in results[shape].items()), flush=True)
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,6", help="input rows to measure, e.g. 1,6 (a decode and a k=5 verify step)")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    from trtspec.machine import description

    print(f"machine: {description()}")
    record = {"us_per_call": {rows: measure(int(rows), args.rounds, args.reps) for rows in args.rows.split(",")}}
    if args.out is not None:
        write_result(args.out, command_line("weight_only_kernels.py", argv), record)


if __name__ == "__main__":
    main()

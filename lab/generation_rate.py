"""distill's data rate: response tokens per second of the target generating and capturing its
own responses as `trtspec distill` does (data.generated: batches of ``--rows`` sequences, the
shared prompt prefix computed once, features and top-k labels captured as generated), on the
first ``--prompts`` shipped prompts, each answered greedily and once sampled (make demo's mix:
temperature 0.8, top-p 0.95), cut at ``--max-tokens``.

    .venv/bin/python -m lab.generation_rate engines/smollm2-135m-eagle3-demo/target --rounds 3

Runs ``--rounds`` times after one untimed warm batch and reports each round's tokens per second
and their median. It times whatever trtspec it imports: run it with PYTHONPATH pointing at a
checkout of another commit to compare two versions of the code on the same engine.

With ``--profile``, one more round under torch.profiler: seconds per group of ops (matmuls,
attention, the label recorder's top-k and the greedy picks, the rest) and outside any op, and the
packed matmuls' GFLOP/s against a 2048^3 float32 matmul on the same threads: how near the
machine's compute the data is made.

Then (``--step-repeats``, 0: not at all) one decode step of a batch a quarter of whose sequences
finished (96 live rows spread over 128 slots, 100-token contexts), the rows attending over a
view of their slots' range (engines/torch/model.py RANGE_ROWS) and gathering their K/V
(RANGE_ROWS 0), interleaved in this process: the medians of each. Timings: run it on a quiet
machine only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from lab._common import RESULTS, command_line, write_result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engine", help="a built torch target engine folder (e.g. engines/smollm2-135m-eagle3-demo/target)")
    ap.add_argument("--prompts", type=int, default=128, help="shipped prompts answered (each greedily and once sampled)")
    ap.add_argument("--rows", type=int, default=128, help="sequences generated at once (distill's --gen-batch)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--step-repeats", type=int, default=12, help="timed decode steps per attention form (0: none)")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="one more round under torch.profiler: where its time goes, and its matmuls' rate against this machine's sgemm",
    )
    ap.add_argument("--json", help="also write a result file lab/results/NAME.json")
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoConfig, AutoTokenizer

    import trtspec
    from trtspec.distill.data import SHIPPED_PROMPTS, generated
    from trtspec.engines.eagle3_checkpoint import distill_layer_ids
    from trtspec.engines.torch.engine import TorchEngine
    from trtspec.speculative.loop import GenerationRequest
    from trtspec.speculative.requests import encode_prompt
    from trtspec.speculative.sampling import SamplingParams

    folder = Path(args.engine)
    tok = AutoTokenizer.from_pretrained(folder)
    lines = [json.loads(line)["prompt"] for line in SHIPPED_PROMPTS.read_text().splitlines() if line.strip()]
    prompts = [encode_prompt(tok, p, True) for p in lines[: args.prompts]]
    end = frozenset({tok.eos_token_id})
    requests = [GenerationRequest(prompt_ids=p, max_tokens=args.max_tokens, end_ids=end) for p in prompts] + [
        GenerationRequest(
            prompt_ids=p, max_tokens=args.max_tokens, end_ids=end, sampling=SamplingParams(temperature=0.8, top_p=0.95, seed=i)
        )
        for i, p in enumerate(prompts)
    ]
    hf = AutoConfig.from_pretrained(folder)
    target = TorchEngine.load(folder, slots=args.rows, max_seq_len=max(map(len, prompts)) + args.max_tokens + 1)
    target.capture_features(distill_layer_ids(hf.num_hidden_layers))
    print(f"trtspec from {Path(trtspec.__file__).parent}; kernels {target.kernels.layout if target.kernels else '-'}", flush=True)
    list(generated(target, requests[: min(8, args.rows)]))  # warm: the first call of each shape builds its kernels
    rates = []
    for r in range(args.rounds):
        t0 = time.perf_counter()
        tokens = sum(len(s.tokens) - s.prompt_len + 1 for s in generated(target, requests))
        seconds = time.perf_counter() - t0
        rates.append(tokens / seconds)
        print(f"round {r + 1}: {tokens} response tokens in {seconds:.1f} s, {tokens / seconds:.1f} tok/s", flush=True)
    values: dict = {"rows": args.rows, "sequences": len(requests), "threads": torch.get_num_threads()}
    if rates:
        values |= {"tok_s": [round(x, 1) for x in rates], "median_tok_s": round(statistics.median(rates), 1)}
        print(f"median {values['median_tok_s']} tok/s ({args.rows} rows, {len(requests)} sequences)")
    if args.profile:
        values["profile"] = _profile(target, requests)
    if args.step_repeats:
        values["finished_quarter_step_ms"] = _range_step(folder, args.step_repeats)
    if args.json:
        print(f"wrote {write_result(RESULTS / f'{args.json}.json', command_line('generation_rate.py', argv), values)}")
    return 0


# ATen ops by what they do in a generation round (self time; everything else is other_ops).
# labels: the label recorder's top-k and the greedy picks.
OP_GROUPS = {
    "matmuls": ("mkldnn::_linear_pointwise", "aten::addmm", "aten::mm", "aten::bmm"),
    "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math"),
    "labels": ("aten::topk", "aten::argmax", "aten::sort"),
}


def _profile(target, requests) -> dict:
    """One generation round under torch.profiler: seconds per op group (self time; OP_GROUPS,
    the rest other_ops), the time outside any op (outside_ops: Python, dispatch), and the packed
    matmuls' GFLOP/s (2 x rows x in x out of each call, padding rows included: the work run)
    against a 2048^3 float32 matmul's here."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from trtspec.distill.data import generated
    from trtspec.engines.torch.model import OneDnnLinear

    flop = [0]
    real = OneDnnLinear._matmul

    def counted(self, flat):
        flop[0] += 2 * flat.shape[0] * self.in_features * self.out_features
        return real(self, flat)

    OneDnnLinear._matmul = counted
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            tokens = sum(len(s.tokens) - s.prompt_len + 1 for s in generated(target, requests))
            wall = time.perf_counter() - t0
    finally:
        OneDnnLinear._matmul = real
    groups = dict.fromkeys([*OP_GROUPS, "other_ops"], 0.0)
    for ev in prof.key_averages():
        name = next((g for g, ops in OP_GROUPS.items() if ev.key in ops), "other_ops")
        groups[name] += ev.self_cpu_time_total / 1e6
    groups["outside_ops"] = max(0.0, wall - sum(groups.values()))
    a = torch.randn(2048, 2048)
    a @ a
    t0 = time.perf_counter()
    for _ in range(5):
        a @ a
    sgemm = 5 * 2 * 2048**3 / (time.perf_counter() - t0) / 1e9
    out = {
        "wall_s": round(wall, 1),
        "tokens": tokens,
        "seconds": {k: round(v, 1) for k, v in groups.items()},
        "share": {k: round(v / wall, 3) for k, v in groups.items()},
        "matmul_gflop_s": round(flop[0] / groups["matmuls"] / 1e9, 1) if flop[0] and groups["matmuls"] else None,
        "sgemm_2048_gflop_s": round(sgemm, 1),
    }
    print(
        f"profiled round: {tokens} tokens in {wall:.1f} s (the profiler's own cost included); "
        + ", ".join(f"{k} {v:.1f} s ({out['share'][k]:.0%})" for k, v in groups.items())
    )
    if out["matmul_gflop_s"]:
        print(f"packed matmuls {out['matmul_gflop_s']} GFLOP/s; a 2048^3 float32 matmul here {out['sgemm_2048_gflop_s']} GFLOP/s")
    return out


def _range_step(folder: Path, repeats: int) -> dict[str, float]:
    """Median ms of a decode step of 96 live rows among 128 slots: range view vs gather."""
    from trtspec.engines.torch import model
    from trtspec.engines.torch.engine import ForwardItem, TorchEngine

    slots, context = 128, 100
    engine = TorchEngine.load(folder, slots=slots, max_seq_len=context + 8)
    contexts = [[(7 * i + 13 * r) % 990 + 1 for i in range(context)] for r in range(slots)]
    for n in range(0, slots, 32):
        engine.run([ForwardItem(c, 1) for c in contexts[n : n + 32]])
    live = [c for r, c in enumerate(contexts) if r % 4 != 1]  # every fourth sequence finished
    samples: dict[int, list[float]] = {model.RANGE_ROWS: [], 0: []}
    default = model.RANGE_ROWS
    try:
        for r in range(repeats + 2):
            for rows in (default, 0) if r % 2 else (0, default):  # alternating which goes first
                model.RANGE_ROWS = rows
                t0 = time.perf_counter()
                engine.run([ForwardItem([*c, 3 + r % 2], 1) for c in live])  # another token each round: one position computed
                if r >= 2:  # the first two rounds build the kernels: untimed
                    samples[rows].append(time.perf_counter() - t0)
    finally:
        model.RANGE_ROWS = default
    out = {
        "range_view": round(statistics.median(samples[default]) * 1e3, 1),
        "gather": round(statistics.median(samples[0]) * 1e3, 1),
    }
    print(
        f"decode step, 96 live rows of 128 slots: range view {out['range_view']} ms, gather {out['gather']} ms (medians of {repeats})"
    )
    return out


if __name__ == "__main__":
    raise SystemExit(main())

"""Engine speed floor: trtspec target-only vs transformers' eager forward, same weights, same
prompts, same machine, one run.

    python -m lab.engine_floor --spec engine_specs/tiny-llama.yaml
    python -m lab.engine_floor --spec engine_specs/smollm2-135m-cpu.yaml --limit 3 --max-tokens 32
    # an AVX2-only CPU, emulated on a newer one (ATen, oneDNN and MKL capped at AVX2):
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 python -m lab.engine_floor ...

Build the spec's engines first (`trtspec build SPEC`). Paths, batch 1, greedy, each prompt's
paths in an order rotated per prompt (machine noise hits all alike), one warm-up each:
  ours          the target engine as it loads: Linear kernels chosen by measurement
                (engines/torch/kernels.py; the choice and its timings are printed)
  ours_dense    the same engine forced to PyTorch's kernels (TRTSPEC_ONEDNN=0)
  ours_onednn   forced to oneDNN's blocked weights (TRTSPEC_ONEDNN=1)
  hf            transformers AutoModelForCausalLM.generate(do_sample=False), eager PyTorch
tokens/s = generated tokens (EOS excluded) / wall seconds, prefill included, summed over the
prompts; each trtspec run starts with an empty prefix cache, as each HF call does. The floor
holds when ours / hf >= 1. Token ids are compared with ours on every path.

Then where a decode step's time goes (the target as it loads, batch 1, after a 64-token
context): the step unprofiled (median), and under torch.profiler each ATen op's own time per
step, grouped — Linear kernels (with the bytes of weights they read and the bandwidth that
makes), attention, and the rest — and the time outside any ATen op (Python, dispatch), against
the memory floor: the step's bytes at this machine's copy bandwidth (trtspec bench's floor).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from lab._common import ROOT, command_line, write_result
from lab.figures import markdown_table


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", type=Path, default=ROOT / "engine_specs" / "tiny-llama.yaml")
    ap.add_argument("--prompts", type=Path, default=ROOT / "trtspec" / "bench" / "prompts.jsonl")
    ap.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1, help="runs per prompt and path; the fastest counts")
    ap.add_argument("--out", type=Path, default=None, help="JSON results (default: print only)")
    ap.add_argument("--profile-only", action="store_true", help="only the decode step's profile (no HF comparison)")
    ap.add_argument("--profile-steps", type=int, default=30, help="decode steps timed and profiled")
    args = ap.parse_args(argv)
    if args.max_tokens < 1 or args.repeats < 1 or (args.limit is not None and args.limit < 1):
        ap.error("--max-tokens, --repeats and --limit must be at least 1")
    return args


def load_engine(folder: Path, force: str | None):
    """The target engine; ``force`` '0'/'1' sets TRTSPEC_ONEDNN for this load only."""
    from trtspec.engines.torch.engine import TorchEngine

    saved = os.environ.pop("TRTSPEC_ONEDNN", None)
    try:
        if force is not None:
            os.environ["TRTSPEC_ONEDNN"] = force
        return TorchEngine.load(folder, slots=1)
    finally:
        os.environ.pop("TRTSPEC_ONEDNN", None)
        if saved is not None:
            os.environ["TRTSPEC_ONEDNN"] = saved


# ATen ops that are a Linear layer's kernel (dense, oneDNN-packed, weight-only quantized).
LINEAR_KERNELS = (
    "aten::mm",
    "aten::addmm",
    "mkldnn::_linear_pointwise",
    "aten::_weight_int8pack_mm",
    "aten::_weight_int4pack_mm_for_cpu",
)


def profile_step(engine, steps: int) -> dict:
    """Where one decode step's time goes (see the module doc); times in seconds per step."""
    import statistics

    from torch.profiler import ProfilerActivity, profile

    from trtspec.bench.measure import measure_bandwidth
    from trtspec.engines.torch.engine import ForwardItem

    context = list(range(1000, 1064))

    def decode(n: int) -> list[float]:
        times = []
        for _ in range(n):
            context.append(2000 + len(context) % 1000)
            t0 = time.perf_counter()
            engine.run([ForwardItem(list(context), 1)])
            times.append(time.perf_counter() - t0)
        return times

    engine.forget_prefixes()
    decode(5)  # warm-up: the prefix and this shape's thread count
    wall = statistics.median(decode(steps))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        decode(steps)
        profiled = (time.perf_counter() - t0) / steps
    groups = {"linear": 0.0, "attention": 0.0, "other ops": 0.0}
    calls = dict.fromkeys(groups, 0)
    ops = []
    for ev in prof.key_averages():
        self_s = ev.self_cpu_time_total / 1e6 / steps
        group = (
            "linear"
            if ev.key in LINEAR_KERNELS
            else "attention"
            if "scaled_dot_product" in ev.key or "attention" in ev.key
            else "other ops"
        )
        groups[group] += self_s
        calls[group] += ev.count // steps
        ops.append((self_s, ev.key, ev.count // steps))
    ops.sort(reverse=True)
    kv = engine.step_bytes(len(context))[1]
    bw = measure_bandwidth()
    step_bytes = engine.weight_bytes + kv
    return {
        "steps": steps,
        "step_s": wall,
        "profiled_step_s": profiled,
        "groups_s": groups,
        "calls_per_step": calls,
        "outside_ops_s": max(0.0, profiled - sum(groups.values())),
        "top_ops": [{"op": k, "self_s": t, "calls": c} for t, k, c in ops[:12]],
        "weight_bytes": engine.weight_bytes,
        "kv_bytes": kv,
        "linear_gbps": engine.weight_bytes / groups["linear"] / 1e9 if groups["linear"] else None,
        "copy_gbps": bw.copy_gbps,
        "read_gbps": bw.read_gbps,
        "floor_step_s": step_bytes / (bw.copy_gbps * 1e9),
        "of_floor": step_bytes / (bw.copy_gbps * 1e9) / wall,
    }


def print_profile(p: dict) -> None:
    ms = 1e3
    print(
        f"decode step: {p['step_s'] * ms:.1f} ms (median of {p['steps']}); profiled {p['profiled_step_s'] * ms:.1f} ms, of which:"
    )
    for name, t in p["groups_s"].items():
        extra = ""
        if name == "linear" and p["linear_gbps"]:
            extra = f" — {p['weight_bytes'] / 1e9:.3f} GB of weights at {p['linear_gbps']:.1f} GB/s"
        print(f"  {name:<10} {t * ms:6.1f} ms in {p['calls_per_step'][name]} calls{extra}")
    print(f"  {'outside ops':<10} {p['outside_ops_s'] * ms:6.1f} ms (Python, dispatch, profiler)")
    print(
        "  top ops (self time per step): "
        + ", ".join(f"{o['op']} {o['self_s'] * ms:.2f} ms x{o['calls']}" for o in p["top_ops"][:8])
    )
    print(
        f"memory floor: the step moves {(p['weight_bytes'] + p['kv_bytes']) / 1e9:.3f} GB; copy {p['copy_gbps']:.1f} GB/s "
        f"(read {p['read_gbps']:.1f}) -> floor step {p['floor_step_s'] * ms:.1f} ms: {p['of_floor']:.2f} of the floor"
    )


def kernel_timings(choice) -> dict | None:
    """The kernel choice's timings at load as a table (ms per layout and step size) and the
    chosen layout's sum over those steps against the best single layout's; None when the
    choice was not timed (forced, fallback, quantized)."""
    from trtspec.engines.torch.kernels import split

    if not choice.steps or not choice.sizes:
        return None
    steps = {name: [round(s * 1e3, 1) for s in row] for name, row in choice.steps.items()}
    one, many, threshold = split(choice.layout)
    chosen = sum(steps[one if n < threshold else many][i] for i, n in enumerate(choice.sizes))
    return {
        "table": {
            "columns": ["layout"] + [f"{n} token{'s' if n > 1 else ''}" for n in choice.sizes],
            "rows": [[name] + [f"{v:.1f}" for v in row] for name, row in steps.items()],
        },
        "sizes": list(choice.sizes),
        "chosen_ms": round(chosen, 1),
        "best_single_ms": round(min(sum(row) for row in steps.values()), 1),
    }


def main(argv=None) -> int:
    from lab.peers import _cut_at_end, encode_prompts, load_hf, read_kinded_prompts
    from trtspec.engines.torch.kernels import cpu_signature
    from trtspec.machine import description as machine_description
    from trtspec.runtime import Deployment
    from trtspec.spec import load_spec
    from trtspec.speculative.loop import NoDrafter, generate
    from trtspec.speculative.verifier import LogitsVerifier

    args = parse_args(argv)
    loaded = load_spec(args.spec)
    dep = Deployment(loaded, loaded.output_dir(), slots=1)
    if args.profile_only:
        print(f"machine: {machine_description()}")
        choice = dep.target.kernels
        print(f"kernels chosen at load: {choice.layout} ({choice.source})")
        timings = kernel_timings(choice)
        if timings:
            print(markdown_table(timings["table"]))
            print(
                f"the choice: {timings['chosen_ms']} ms over these steps; the best single layout: {timings['best_single_ms']} ms"
            )
        return _profiled(dep, args, {"kernels": choice.layout, "kernel_choice": timings})
    prompts = encode_prompts(dep, read_kinded_prompts(args.prompts))
    room = dep.limits.max_input_len or dep.limits.max_seq_len
    fits = [p for p in prompts if len(p.ids) <= room and len(p.ids) + args.max_tokens <= dep.limits.max_seq_len]
    if len(fits) < len(prompts):
        print(f"{len(prompts) - len(fits)} prompts skipped: longer than the engines' build limits", file=sys.stderr)
    prompts = fits[: args.limit] if args.limit else fits
    if not prompts:
        sys.exit("Error: no prompt fits the engines' build.max_input_len; use shorter --prompts")
    engines = {
        "ours": dep.target,
        "ours_dense": load_engine(dep.target.folder, "0"),
        "ours_onednn": load_engine(dep.target.folder, "1"),
    }
    hf = load_hf(dep.target.folder, dep.target.manifest.dtype)
    end_ids = sorted(dep.end_ids)
    pad = dep.tokenizer.pad_token_id if dep.tokenizer.pad_token_id is not None else end_ids[0]

    def ours(engine):
        def run(ids: list[int]) -> list[int]:
            engine.forget_prefixes()
            req = dep.request(ids, args.max_tokens, 0)
            (res,) = generate([req], NoDrafter(), LogitsVerifier(engine.run))
            return res.output_ids

        return run

    def hf_run(ids: list[int]) -> list[int]:
        x = torch.tensor([ids], dtype=torch.long)
        with torch.inference_mode():
            out = hf.generate(
                input_ids=x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=args.max_tokens,
                do_sample=False,
                eos_token_id=end_ids,
                pad_token_id=pad,
            )
        return _cut_at_end(out[0, len(ids) :].tolist(), dep.end_ids)

    paths = {name: ours(engine) for name, engine in engines.items()} | {"hf": hf_run}
    names = list(paths)
    for name in names:  # warm-up, not timed
        paths[name](prompts[0].ids)
    tokens = dict.fromkeys(names, 0)
    seconds = dict.fromkeys(names, 0.0)
    identical = dict.fromkeys(names, 0)
    for n, prompt in enumerate(prompts):
        order = names[n % len(names) :] + names[: n % len(names)]
        outs = {}
        for name in order:
            best = None
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                ids = paths[name](prompt.ids)
                dt = time.perf_counter() - t0
                best = dt if best is None else min(best, dt)
            outs[name], seconds[name] = ids, seconds[name] + best
            tokens[name] += len(ids)
        for name in names:
            identical[name] += outs[name] == outs["ours"]
        print(f"prompt {n + 1}/{len(prompts)}: {len(outs['ours'])} tokens", file=sys.stderr, flush=True)

    rate = {name: tokens[name] / seconds[name] for name in names}
    choice = dep.target.kernels
    sig = cpu_signature()
    print(f"machine: {machine_description()}")
    print(f"cpu: {sig['cpu']}; ATen capability {sig['capability']}; ISA caps: {sig['isa_env'] or 'none'}")
    print(
        f"kernels chosen at load: {choice.layout} ({choice.source}; "
        + ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in choice.seconds.items())
        + " per decode + verify step)"
    )
    print(f"{len(prompts)} prompts x up to {args.max_tokens} tokens, spec {loaded.spec.name}, target {dep.target.manifest.dtype}")
    print("| path | tokens | seconds | tokens/s | vs hf | identical to ours |")
    print("|---|---|---|---|---|---|")
    for name in names:
        print(
            f"| {name} | {tokens[name]} | {seconds[name]:.2f} | {rate[name]:.1f} | "
            f"{rate[name] / rate['hf']:.3f}x | {identical[name]}/{len(prompts)} |"
        )
    floor = rate["ours"] / rate["hf"]
    print(f"floor (ours / hf tokens/s): {floor:.3f} -> {'held' if floor >= 1 else 'MISSED'}")
    return _profiled(
        dep,
        args,
        {
            "cpu": sig,
            "kernels": {"layout": choice.layout, "source": choice.source, "seconds": choice.seconds},
            "kernel_choice": kernel_timings(choice),
            "spec": loaded.spec.name,
            "prompts": len(prompts),
            "max_tokens": args.max_tokens,
            "tokens": tokens,
            "seconds": seconds,
            "tokens_per_s": rate,
            "identical_to_ours": identical,
            "floor": floor,
            "load_average": os.getloadavg()[0],
        },
    )


def _profiled(dep, args, values: dict) -> int:
    """Profile a decode step, print it and write ``values`` with the profile to --out."""
    profile = profile_step(dep.target, args.profile_steps)
    print_profile(profile)
    if args.out:
        write_result(args.out, command_line("engine_floor.py"), values | {"profile": profile})
    return 0


if __name__ == "__main__":
    sys.exit(main())

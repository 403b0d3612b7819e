"""Does torch.compile make the reference engine's decode faster on this CPU? Measured, not assumed.

    python -m lab.compile_probe --spec engine_specs/smollm2-135m-cpu.yaml --limit 3 --max-tokens 64

Build the spec's engines first (`trtspec build SPEC`). Target-only greedy generation, batch 1,
through the one speculative loop (no drafter), on these engines, each loaded on its own:
  eager           the target engine as it loads (Linear kernels chosen by measurement)
  eager_dense     forced to PyTorch's dense kernels (TRTSPEC_ONEDNN=0): what inductor compiles
  compiled_mlp    eager_dense with every layer's MLP (gate_up matmul, SiLU * up, down matmul)
                  and norms under torch.compile (inductor, dynamic=True: one graph for
                  prefill and decode shapes)
  compiled_frozen compiled_mlp with inductor's freezing (weights folded as constants and
                  prepacked for oneDNN: the CPU inference recipe of PyTorch's docs)
  compiled_layers eager_dense with every decoder layer under torch.compile(dynamic=True): the
                  attention's cache write and read are in the graph too
A layer's attention reads the K/V up to the current position, so its graph is guarded on it
(dynamic=True lets one graph serve). Compile time is reported apart: every prompt runs once
untimed first (each new shape compiles there), then once timed. tokens/s = generated tokens / wall seconds over the
prompts, each path's prompts interleaved with the others'; token ids compared with eager's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from lab._common import ROOT
from lab.engine_floor import load_engine  # the target engine with a forced kernel layout

PATHS = ("eager", "eager_dense", "compiled_mlp", "compiled_frozen", "compiled_layers")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", type=Path, default=ROOT / "engine_specs" / "tiny-llama.yaml")
    ap.add_argument("--prompts", type=Path, default=ROOT / "trtspec" / "bench" / "prompts.jsonl")
    ap.add_argument("--limit", type=int, default=3, help="use only the first N prompts")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated subset of {','.join(PATHS)}")
    args = ap.parse_args(argv)
    args.paths = [p for p in args.paths.split(",") if p]
    unknown = sorted(set(args.paths) - set(PATHS))
    if unknown:
        ap.error(f"unknown --paths {unknown}; choose from {', '.join(PATHS)}")
    if args.max_tokens < 1 or args.limit < 1:
        ap.error("--max-tokens and --limit must be at least 1")
    return args


def compile_parts(engine, whole_layers: bool) -> None:
    """Wrap the engine's modules in torch.compile in place (the weights are shared, not copied)."""
    layers = engine.model.model.layers
    for i, layer in enumerate(layers):
        if whole_layers:
            layers[i] = torch.compile(layer, dynamic=True)
        else:
            layer.mlp = torch.compile(layer.mlp, dynamic=True)
            layer.input_layernorm = torch.compile(layer.input_layernorm, dynamic=True)
            layer.post_attention_layernorm = torch.compile(layer.post_attention_layernorm, dynamic=True)


def main(argv=None) -> int:
    from lab.peers import encode_prompts, read_kinded_prompts
    from trtspec.machine import description as machine_description
    from trtspec.runtime import Deployment
    from trtspec.spec import load_spec
    from trtspec.speculative.loop import NoDrafter, generate
    from trtspec.speculative.verifier import LogitsVerifier

    args = parse_args(argv)
    loaded = load_spec(args.spec)
    dep = Deployment(loaded, loaded.output_dir(), slots=1)
    prompts = encode_prompts(dep, read_kinded_prompts(args.prompts))[: args.limit]
    folder = dep.target.folder
    engines = {}
    for name in args.paths:
        engine = dep.target if name == "eager" else load_engine(folder, "0")
        if name.startswith("compiled"):
            compile_parts(engine, whole_layers=name == "compiled_layers")
        engines[name] = engine

    def run(engine, ids: list[int]) -> list[int]:
        engine.forget_prefixes()
        (res,) = generate([dep.request(ids, args.max_tokens, 0)], NoDrafter(), LogitsVerifier(engine.run))
        return res.output_ids

    warm = {}
    for name, engine in engines.items():  # every shape compiles here: timed apart
        import torch._inductor.config as inductor

        t0 = time.perf_counter()
        with inductor.patch(freezing=name == "compiled_frozen"):
            for prompt in prompts:
                run(engine, prompt.ids)
        warm[name] = time.perf_counter() - t0
        print(f"{name}: untimed pass (compile included) {warm[name]:.1f} s", file=sys.stderr, flush=True)
    tokens = dict.fromkeys(engines, 0)
    seconds = dict.fromkeys(engines, 0.0)
    same = dict.fromkeys(engines, 0)
    names = list(engines)
    for n, prompt in enumerate(prompts):
        outs = {}
        for name in names[n % len(names) :] + names[: n % len(names)]:
            t0 = time.perf_counter()
            outs[name] = run(engines[name], prompt.ids)
            seconds[name] += time.perf_counter() - t0
            tokens[name] += len(outs[name])
        reference = outs.get("eager", outs[names[0]])
        for name in names:
            same[name] += outs[name] == reference
        print(f"prompt {n + 1}/{len(prompts)}: {len(reference)} tokens", file=sys.stderr, flush=True)
    print(f"machine: {machine_description()}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; load average {os.getloadavg()[0]:.2f}")
    print(f"{len(prompts)} prompts x up to {args.max_tokens} tokens, spec {loaded.spec.name}, batch 1, target-only")
    base = tokens[names[0]] / seconds[names[0]]
    print(f"| path | untimed pass s (compile) | tokens | seconds | tokens/s | vs {names[0]} | ms/token | identical |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in names:
        rate = tokens[name] / seconds[name]
        print(
            f"| {name} | {warm[name]:.1f} | {tokens[name]} | {seconds[name]:.2f} | {rate:.1f} | {rate / base:.3f}x | "
            f"{1000 / rate:.1f} | {same[name]}/{len(prompts)} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Memory an engine keeps per matmul shape: oneDNN's primitive cache and PyTorch's ideep cache.

Loads one built torch engine in this process, runs prefills of N distinct lengths, then
repeats some of them, and prints the process's RssAnon growth as it goes. The engine runs its
packed matmuls in its fixed row counts (engines/torch/model.py row_blocks); with
``--as-given`` on the rows each prefill has, so each length is a new matmul shape for every
packed weight (as before those counts). Run it with the server's allocator preloaded to see
what a stub keeps, once per setting:

  LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 python -m lab.shape_cache_memory \\
      engines/smollm2-135m-cpu/target --onednn 0 --ideep 1024
  ... --onednn 0 --ideep 16        # ideep's cache bounded
  ... --onednn 256 --ideep 256     # what `trtspec serve` sets (triton/server/install.py)
  ... --onednn 256 --ideep 256 --as-given --peak-first   # against the same without --as-given
  ... --onednn 640 --ideep 640 --peak-first --alternate-threads   # against 256: two thread counts

Both caches read their capacity when first used, so the values are set here before any
forward runs. ``--peak-first`` runs the longest prefill once before the baseline: the growth
then leaves out the activations' high-water mark (the lengths come shuffled, so without it
the baseline rises with the longest prefill run so far). Memory only: timings taken here mean
nothing.
"""

from __future__ import annotations

import argparse
import os
import random
import sys

from lab._common import RESULTS, command_line, write_result


def rss_anon_mib() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon"):
            return int(line.split()[1]) // 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def jemalloc_mib() -> dict[str, int] | None:
    """jemalloc's own accounting (MiB) when it is the process's allocator: ``allocated`` (live
    blocks), ``resident`` (pages it holds) and ``retained``; None under another allocator. Live
    blocks that grow are objects something keeps; resident growing alone is the allocator's."""
    import ctypes

    mallctl = getattr(ctypes.CDLL(None), "mallctl", None)
    if mallctl is None:
        return None
    epoch = ctypes.c_uint64(1)
    mallctl(b"epoch", None, None, ctypes.byref(epoch), ctypes.c_size_t(8))
    out = {}
    for name in ("allocated", "resident", "retained"):
        value, size = ctypes.c_size_t(0), ctypes.c_size_t(ctypes.sizeof(ctypes.c_size_t))
        if mallctl(f"stats.{name}".encode(), ctypes.byref(value), ctypes.byref(size), None, ctypes.c_size_t(0)):
            return None
        out[name] = value.value >> 20
    return out


def _sample(base: int, base_je: dict[str, int] | None) -> dict[str, int]:
    """Growth since the baseline: RssAnon and, under jemalloc, its own counts (MiB)."""
    out = {"rss_anon": rss_anon_mib() - base}
    je = jemalloc_mib()
    if je is not None and base_je is not None:
        out |= {k: je[k] - base_je[k] for k in je}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engine", help="a built torch engine folder (e.g. engines/smollm2-135m-cpu/target)")
    ap.add_argument("--onednn", type=int, default=256, help="ONEDNN_PRIMITIVE_CACHE_CAPACITY")
    ap.add_argument("--ideep", type=int, default=256, help="LRU_CACHE_CAPACITY (ideep's cache)")
    ap.add_argument("--lengths", type=int, default=200, help="distinct prefill lengths (2, 4, ...)")
    ap.add_argument("--repeats", type=int, default=100, help="lengths run again at the end")
    ap.add_argument("--passes", type=int, default=1, help="passes over the distinct lengths (a bounded set stops growing)")
    ap.add_argument(
        "--peak-first",
        action="store_true",
        help="run the longest prefill once before the baseline, so the growth leaves out the activations' peak",
    )
    ap.add_argument(
        "--as-given",
        action="store_true",
        help="run every matmul on the rows it is given (the engine's fixed row counts off: as before them)",
    )
    ap.add_argument(
        "--alternate-threads",
        action="store_true",
        help="run the prefills at 1 and 2 threads in turn, as the thread governor's probes do on 2 cores",
    )
    ap.add_argument(
        "--warm",
        action="store_true",
        help="make every packed matmul shape before the baseline, as a load does (the engine is loaded without)",
    )
    ap.add_argument("--json", help="also write a result file lab/results/NAME.json")
    args = ap.parse_args(argv)
    os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = str(args.onednn)
    os.environ["LRU_CACHE_CAPACITY"] = str(args.ideep)
    if args.alternate_threads:  # the thread governor fixed at 2, so that the counts set here hold
        os.environ["TRTSPEC_THREADS"] = "2"

    import torch

    from trtspec.engines.torch.engine import ForwardItem, TorchEngine

    engine = TorchEngine.load(args.engine, slots=4, warm=False)
    engine.model.fix_matmul_rows(not args.as_given)
    warmed = []  # [threads, matmuls run, RssAnon growth MiB since the load]
    if args.warm:  # what a load does (engine.py warm_matmuls), at every count this run sets
        loaded = rss_anon_mib()
        for n in (2, 1) if args.alternate_threads else (torch.get_num_threads(),):
            torch.set_num_threads(n)
            warmed.append([n, engine.warm_matmuls(), rss_anon_mib() - loaded])
            print(f"warmed {warmed[-1][1]} matmuls at {n} threads: RssAnon +{warmed[-1][2]} MiB since the load", flush=True)
    rng = random.Random(0)
    lengths = list(range(2, 2 * args.lengths + 2, 2))
    if args.peak_first:  # the largest activations once; its shapes are met again below anyway
        peak = random.Random(1)  # not the lengths' generator: the same order with or without
        engine.run([ForwardItem([peak.randrange(100, 20000) for _ in range(lengths[-1])], 1)])
        engine.forget_prefixes()
    base, base_je = rss_anon_mib(), jemalloc_mib()
    print(f"loaded: RssAnon {base} MiB; oneDNN cache {args.onednn}, ideep cache {args.ideep}; jemalloc {base_je}", flush=True)
    rng.shuffle(lengths)
    growth, passes = [], []
    for p in range(args.passes):
        for i, n in enumerate(lengths, 1):
            if args.alternate_threads:  # oneDNN keys a primitive by its thread count too
                torch.set_num_threads(1 + i % 2)
            engine.run([ForwardItem([rng.randrange(100, 20000) for _ in range(n)], 1)])
            if p == 0 and (i % 25 == 0 or i == len(lengths)):
                growth.append([i, rss_anon_mib() - base])
                print(f"{i} distinct lengths: +{growth[-1][1]} MiB", flush=True)
        passes.append(_sample(base, base_je))
        print(f"after pass {p + 1} over the lengths: {passes[-1]}", flush=True)
    for i, n in enumerate(lengths[: args.repeats], 1):
        if args.alternate_threads:
            torch.set_num_threads(1 + i % 2)
        engine.run([ForwardItem([rng.randrange(100, 20000) for _ in range(n)], 1)])
    after = rss_anon_mib() - base
    print(f"after {args.repeats} lengths again: +{after} MiB")
    if args.json:
        values = {"onednn": args.onednn, "ideep": args.ideep, "growth_mib": growth, "after_repeats_mib": after}
        values["peak_first"], values["fixed_rows"] = args.peak_first, not args.as_given
        values["alternate_threads"] = args.alternate_threads
        values["passes"], values["warmed"] = passes, warmed
        values["preload"] = os.environ.get("LD_PRELOAD", "")
        write_result(RESULTS / f"{args.json}.json", command_line("shape_cache_memory.py"), values)
    return 0


if __name__ == "__main__":
    sys.exit(main())

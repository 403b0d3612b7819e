"""What refused oversized inputs leave behind in the server's processes.

    .venv/bin/python -m lab.refused_memory engine_specs/smollm2-135m-cpu.yaml --allocator jemalloc

Starts its own tritonserver on free 127.0.0.1 ports for the spec's built engines with the
chosen allocator (install.find_allocator: auto, glibc, jemalloc, tcmalloc), sends --warm
ordinary requests, then records each process's memory (lab/server_memory.py: Pss, RssAnon,
RssShmem, /dev/shm mappings) before, after --oversized requests each carrying --mib MiB of
``image_bytes_input`` (an input trtspec does not serve; each must be refused), and after
--ordinary more ordinary requests (unary, 4 at a time, each identical to the first answer).
Reports what the tree holds more than before (held memory, Pss_Anon + Pss_Shmem, summed:
shared pages counted once) and per process. Exit status 0 when every oversized request was refused, every ordinary one answered
identically, and the tree's held memory after the ordinary requests is at most --max-held MiB above
before; 1 otherwise. Writes --json.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from lab._common import command_line, start_server, totals_mib, write_result

MODEL = "tensorrt_llm_bls"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec", nargs="?", default="engine_specs/smollm2-135m-cpu.yaml")
    ap.add_argument("--allocator", default="auto", choices=["auto", "glibc", "jemalloc", "tcmalloc"])
    ap.add_argument("--mib", type=int, default=256, help="MiB of image_bytes_input per oversized request (default 256)")
    ap.add_argument("--oversized", type=int, default=2, help="oversized requests (default 2)")
    ap.add_argument("--ordinary", type=int, default=32, help="ordinary requests after them (default 32)")
    ap.add_argument("--warm", type=int, default=4, help="ordinary requests before the baseline (default 4)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--max-held", type=float, default=128.0, help="MiB the tree may hold more at the end (default 128)")
    ap.add_argument("--server-arg", action="append", default=[], help="extra tritonserver option (repeatable)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    import tritonclient.grpc as grpcclient

    from lab.server_memory import compact, growth, total
    from trtspec.spec import load_spec
    from trtspec.testing.process_memory import tree_memory
    from trtspec.triton.request import infer_inputs

    loaded = load_spec(args.spec)
    prompts = loaded.verify_prompts()
    chat = loaded.spec.verify.chat_template
    server = start_server(loaded, allocator=args.allocator, extra_args=args.server_arg)
    url = server.grpc_endpoint
    values = {"text_input": prompts[0], "max_tokens": args.max_tokens, "apply_chat_template": chat}

    def ordinary(_: int) -> list[int]:
        r = grpcclient.InferenceServerClient(url).infer(MODEL, infer_inputs(values), client_timeout=600)
        return r.as_numpy("output_ids")[0, : r.as_numpy("sequence_length")[0, 0]].tolist()

    refusals: list[str] = []
    try:
        expected = ordinary(0)
        with ThreadPoolExecutor(4) as pool:
            same = all(got == expected for got in pool.map(ordinary, range(args.warm)))
        time.sleep(1.0)
        before = tree_memory(server.pid)
        for _ in range(args.oversized):
            image = grpcclient.InferInput("image_bytes_input", [1, 1, 1, args.mib, 1 << 20], "UINT8")
            image.set_data_from_numpy(np.ones((1, 1, 1, args.mib, 1 << 20), np.uint8))
            try:
                grpcclient.InferenceServerClient(url).infer(MODEL, [*infer_inputs(values), image], client_timeout=600)
                refusals.append("answered instead of refused")
            except Exception as err:
                refusals.append(str(err).splitlines()[0][:300])
            del image
        time.sleep(1.0)
        after_refused = tree_memory(server.pid)
        with ThreadPoolExecutor(4) as pool:
            same = same and all(got == expected for got in pool.map(ordinary, range(args.ordinary)))
        time.sleep(1.0)
        after = tree_memory(server.pid)
    finally:
        server.stop()

    held_mib = (total(after) - total(before)) / 1024
    report = {
        "spec": loaded.spec.name,
        "allocator": args.allocator,
        "ld_preload": server.env.get("LD_PRELOAD", ""),
        "server_args": args.server_arg,
        "oversized": f"{args.oversized} x {args.mib} MiB image_bytes_input",
        "refusals": refusals,
        "ordinary_identical": same,
        "held_total_mib": totals_mib(before=before, after_oversized=after_refused, after_ordinary=after),
        "rss_anon_total_mib": totals_mib("rss_anon", before=before, after_oversized=after_refused, after_ordinary=after),
        "held_mib": round(held_mib, 1),
        "per_process": {"before": compact(before), "after_oversized": compact(after_refused), "after_ordinary": compact(after)},
        "growth": growth(before, after),
    }
    print(json.dumps(report, indent=2))
    if args.json:
        write_result(args.json, command_line("refused_memory.py"), report)
    refused = all(r != "answered instead of refused" for r in refusals)
    return 0 if refused and same and held_mib <= args.max_held else 1


if __name__ == "__main__":
    raise SystemExit(main())

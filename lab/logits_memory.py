"""What concurrent generation-logits requests make the server's processes hold.

    .venv/bin/python -m lab.logits_memory engine_specs/smollm2-135m-cpu.yaml

Starts its own tritonserver on free 127.0.0.1 ports for the spec's built engines, sends --warm
ordinary requests, records each process's memory (lab/server_memory.py: Pss, RssAnon,
RssShmem, /dev/shm mappings), then sends --concurrency unary requests at once, each asking
--max-tokens tokens with return_generation_logits, sampling the tree's memory every
--every seconds while they run. Reports the tree's Pss (shared pages counted once) above the
baseline at its peak and after, per process, and their ratio to the answers' own size
(sequences x tokens x vocab x 4 bytes, what the requests could not do without).

What the tree holds is memory.py's ``held`` (Pss_Anon + Pss_Shmem: heap and the Python
backend's shared-memory pool, shared pages divided among the processes mapping them, so it
adds up; file-backed pages such as mapped weights are page cache and are left out), read at
the peak, 1 s after the answers and again after --settle seconds (an allocator may keep freed
pages for a while before it returns them). Every answer's tokens must equal a plain greedy
request's, and its logits rows must pick them. Exit status 0 when they do and the peak is at
most --max-ratio times the answers' size; 1 otherwise. Writes --json.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from lab._common import command_line, start_server, totals_mib, write_result

MODEL = "tensorrt_llm_bls"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec", nargs="?", default="engine_specs/smollm2-135m-cpu.yaml")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--warm", type=int, default=4, help="ordinary requests before the baseline (default 4)")
    ap.add_argument("--every", type=float, default=0.2, help="seconds between memory samples (default 0.2)")
    ap.add_argument("--max-ratio", type=float, default=4.0, help="peak growth / answers' size allowed (default 4)")
    ap.add_argument("--settle", type=float, default=15.0, help="seconds before the last reading (default 15)")
    ap.add_argument("--allocator", default="auto", choices=["auto", "glibc", "jemalloc", "tcmalloc"])
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
    server = start_server(loaded, allocator=args.allocator)
    url = server.grpc_endpoint

    def ask(i: int, logits: bool):
        values = {
            "text_input": prompts[i % len(prompts)],
            "max_tokens": args.max_tokens,
            "apply_chat_template": chat,
            "exclude_input_in_output": True,  # output_ids are the generated tokens, one per logits row
        }
        if logits:
            values["return_generation_logits"] = True
        r = grpcclient.InferenceServerClient(url).infer(MODEL, infer_inputs(values), client_timeout=1200)
        ids = r.as_numpy("output_ids")[0, : r.as_numpy("sequence_length")[0, 0]].tolist()
        return ids, (r.as_numpy("generation_logits") if logits else None)

    samples: list[dict] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append(tree_memory(server.pid))
            stop.wait(args.every)

    try:
        expected = [ask(i, False)[0] for i in range(args.concurrency)]
        with ThreadPoolExecutor(args.concurrency) as pool:
            list(pool.map(lambda i: ask(i, False), range(args.warm)))
        time.sleep(1.0)
        before = tree_memory(server.pid)
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        with ThreadPoolExecutor(args.concurrency) as pool:
            answers = list(pool.map(lambda i: ask(i, True), range(args.concurrency)))
        stop.set()
        sampler.join(10)
        time.sleep(1.0)
        after = tree_memory(server.pid)
        time.sleep(max(0.0, args.settle - 1.0))
        settled = tree_memory(server.pid)
    finally:
        stop.set()
        server.stop()

    same = all(ids == want for (ids, _), want in zip(answers, expected))
    picks = all(lg[0, 0, : len(ids)].argmax(-1).tolist() == ids for ids, lg in answers)
    answer_bytes = sum(int(lg[0, 0, : len(ids)].nbytes) for ids, lg in answers)
    peak = max(samples, key=total) if samples else after
    peak_mib, after_mib, settled_mib = ((total(m) - total(before)) / 1024 for m in (peak, after, settled))
    report = {
        "spec": loaded.spec.name,
        "allocator": args.allocator,
        "ld_preload": server.env.get("LD_PRELOAD", ""),
        "requests": f"{args.concurrency} concurrent x {args.max_tokens} tokens, return_generation_logits",
        "identical_tokens": same,
        "logits_pick_the_tokens": picks,
        "answers_mib": round(answer_bytes / 2**20, 1),
        "held_mib": totals_mib(before=before, peak=peak, after=after, settled=settled),
        "pss_total_mib": totals_mib("pss", before=before, peak=peak, after=after),
        "peak_growth_mib": round(peak_mib, 1),
        "after_growth_mib": round(after_mib, 1),
        "peak_ratio": round(peak_mib * 2**20 / max(answer_bytes, 1), 2),
        "after_ratio": round(after_mib * 2**20 / max(answer_bytes, 1), 2),
        "settled_growth_mib": round(settled_mib, 1),
        "samples": len(samples),
        "per_process": {"before": compact(before), "peak": compact(peak), "after": compact(after), "settled": compact(settled)},
        "growth_at_peak": growth(before, peak),
    }
    print(json.dumps(report, indent=2))
    if args.json:
        write_result(args.json, command_line("logits_memory.py"), report)
    return 0 if same and picks and peak_mib * 2**20 <= args.max_ratio * answer_bytes else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""Speculative tokens/s over gRPC (Triton) vs in process, and time to first token streaming.

    .venv/bin/python -m lab.grpc_vs_inprocess engine_specs/smollm2-135m-cpu.yaml

Builds nothing: the spec's engines must exist (`trtspec build SPEC`). Starts its own server on
free loopback ports (or uses --url HOST:PORT), runs the same prompts through the same loop in
process and through `tensorrt_llm_bls`, checks the tokens are identical, and prints a markdown
table. Paths run in blocks (in process, then gRPC, then streaming) so neither competes with the
other for the CPU; --rounds repeats the blocks and the median is reported.
"""

from __future__ import annotations

import argparse
import queue
import statistics
import time

from lab._common import served_or_given


def _inputs(prompt: str, max_tokens: int, chat: bool, stream: bool = False):
    from trtspec.triton.request import infer_inputs

    values = {"text_input": prompt, "max_tokens": max_tokens, "apply_chat_template": chat, "exclude_input_in_output": True}
    return infer_inputs(values | ({"stream": True} if stream else {}))


def in_process(dep, prompts, max_tokens):
    """(tokens per prompt, seconds per prompt, time to first token per prompt)."""
    ids, secs, ttft = [], [], []
    for p in prompts:
        req = dep.request(dep.encode(p), max_tokens)
        first: list[float] = []
        start = time.perf_counter()
        (res,) = dep.generate([req], speculative=True, on_step=lambda i, e, d: first or first.append(time.perf_counter()))
        secs.append(time.perf_counter() - start)
        ttft.append(first[0] - start)
        ids.append(res.output_ids)
    return ids, secs, ttft


def grpc_unary(client, prompts, max_tokens, chat):
    ids, secs = [], []
    for p in prompts:
        start = time.perf_counter()
        r = client.infer("tensorrt_llm_bls", _inputs(p, max_tokens, chat))
        secs.append(time.perf_counter() - start)
        ids.append(r.as_numpy("output_ids")[0, : r.as_numpy("sequence_length")[0, 0]].tolist())
    return ids, secs


def grpc_stream(client, prompts, max_tokens, chat):
    ids, secs, ttft = [], [], []
    for p in prompts:
        got: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: got.put((result, error, time.perf_counter())))
        toks: list[int] = []
        first = None
        start = time.perf_counter()
        client.async_stream_infer("tensorrt_llm_bls_streaming", _inputs(p, max_tokens, chat, stream=True))
        while True:
            result, error, at = got.get(timeout=600)
            if error is not None:
                raise error
            new = result.as_numpy("output_ids")[0].tolist()
            if new and first is None:
                first = at - start
            toks += new
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
        secs.append(time.perf_counter() - start)
        client.stop_stream()
        ids.append(toks)
        ttft.append(first)
    return ids, secs, ttft


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec", nargs="?", default="engine_specs/smollm2-135m-cpu.yaml")
    ap.add_argument("--max-tokens", type=int, default=None, help="default: verify.max_tokens")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--url", default=None, help="use a running server (gRPC HOST:PORT)")
    args = ap.parse_args()

    import tritonclient.grpc as grpcclient

    from trtspec.runtime import Deployment
    from trtspec.spec import load_spec

    loaded = load_spec(args.spec)
    prompts = loaded.verify_prompts()
    max_tokens = args.max_tokens or loaded.spec.verify.max_tokens
    chat = loaded.spec.verify.chat_template
    server, url = served_or_given(loaded, args.url)
    try:
        dep = Deployment(loaded, loaded.output_dir())
        client = grpcclient.InferenceServerClient(url)
        # Warm-up (untimed) on every path.
        in_process(dep, prompts[:1], 8)
        grpc_unary(client, prompts[:1], 8, chat)
        grpc_stream(client, prompts[:1], 8, chat)
        rows = {"in-process": [], "gRPC unary": [], "gRPC streaming": []}
        ttfts = {"in-process": [], "gRPC streaming": []}
        for _ in range(args.rounds):
            ref, secs, ttft = in_process(dep, prompts, max_tokens)
            rows["in-process"].append((sum(map(len, ref)), sum(secs)))
            ttfts["in-process"] += ttft
            time.sleep(1.0)  # let the in-process OpenMP threads go idle
            ids, secs = grpc_unary(client, prompts, max_tokens, chat)
            assert ids == ref, "gRPC tokens differ from in-process tokens"
            rows["gRPC unary"].append((sum(map(len, ids)), sum(secs)))
            ids, secs, ttft = grpc_stream(client, prompts, max_tokens, chat)
            assert ids == ref, "streamed tokens differ from in-process tokens"
            rows["gRPC streaming"].append((sum(map(len, ids)), sum(secs)))
            ttfts["gRPC streaming"] += ttft
    finally:
        if server is not None:
            server.stop()

    base = statistics.median(t / s for t, s in rows["in-process"])
    print(
        f"\n{loaded.spec.name}: {len(prompts)} prompts x {max_tokens} tokens, speculative, "
        f"median of {args.rounds} rounds; outputs token-identical on every path\n"
    )
    print("| path | tokens/round | tokens/s | vs in-process | TTFT median (ms) | TTFT max (ms) |")
    print("|---|---|---|---|---|---|")
    for name, runs in rows.items():
        tps = statistics.median(t / s for t, s in runs)
        tt = ttfts.get(name)
        ttft_cols = f"{statistics.median(tt) * 1000:.0f} | {max(tt) * 1000:.0f}" if tt else "- | -"
        print(f"| {name} | {runs[0][0]} | {tps:.1f} | {tps / base:.1%} | {ttft_cols} |")


if __name__ == "__main__":
    main()

"""Time to first token over gRPC at concurrency 1: speculative vs target-only.

    .venv/bin/python -m lab.ttft engine_specs/tiny-llama.yaml --rounds 5

`trtspec bench --url` streams only the speculative path (the control endpoint is unary, so
its first token is not observable there); this script measures three paths, one request at a
time, on one server:

  speculative        tensorrt_llm_bls_streaming, the spec's default k: time to the first
                     streamed response that carries a token
  target-only (loop) the same endpoint with num_draft_tokens 0: the same loop drafting nothing
  target-only (ctrl) the independent `target_only` control asked for max_tokens 1: the time of
                     its one-token answer (prefill + first token on its own engine)

Paths alternate per prompt within each round, so machine noise hits all three alike. Streamed
speculative tokens are checked identical to the target-only ones. Builds nothing: the spec's
engines must exist (`trtspec build SPEC`). Starts its own server on free loopback ports unless
--url HOST:PORT is given. Prints a markdown table and writes --json.
"""

from __future__ import annotations

import argparse
import queue
import statistics
import time
from pathlib import Path

import numpy as np

from lab._common import command_line, served_or_given, write_result


def _inputs(prompt: str, max_tokens: int, chat: bool, k: int | None, stream: bool):
    from trtspec.triton.request import infer_inputs

    values = {"text_input": prompt, "max_tokens": max_tokens, "apply_chat_template": chat, "exclude_input_in_output": True}
    return infer_inputs(values | {"stream": stream} | ({"num_draft_tokens": k} if k is not None else {}))


def streamed(url: str, prompt: str, max_tokens: int, chat: bool, k: int | None) -> tuple[float, list[int]]:
    """(seconds to the first token, all tokens) of one streamed request."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    got: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((time.perf_counter(), result, error)))
    tokens: list[int] = []
    first = None
    try:
        start = time.perf_counter()
        client.async_stream_infer(
            "tensorrt_llm_bls_streaming", _inputs(prompt, max_tokens, chat, k, True), enable_empty_final_response=True
        )
        while True:
            at, result, error = got.get(timeout=600)
            if error is not None:
                raise RuntimeError(f"streamed request failed: {error}")
            new = result.as_numpy("output_ids")
            if new is not None and new.size:
                first = at - start if first is None else first
                tokens += new[0].tolist()
            if result.get_response().parameters["triton_final_response"].bool_param:
                return first, tokens
    finally:
        client.stop_stream()


def control_first_token(url: str, prompt: str, chat: bool) -> float:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    start = time.perf_counter()
    client.infer("target_only", _inputs(prompt, 1, chat, None, False))
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec", nargs="?", default="engine_specs/tiny-llama.yaml")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens per streamed request (default 32)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--url", default=None, help="use a running server (gRPC HOST:PORT)")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = ap.parse_args()

    from trtspec.spec import load_spec

    loaded = load_spec(args.spec)
    prompts = loaded.verify_prompts()
    chat = loaded.spec.verify.chat_template
    server, url = served_or_given(loaded, args.url)
    ttft: dict[str, list[float]] = {"speculative": [], "target-only (loop, k=0)": [], "target-only (control)": []}
    try:
        for p in prompts[:1]:  # warm-up, untimed
            streamed(url, p, 4, chat, None)
            streamed(url, p, 4, chat, 0)
            control_first_token(url, p, chat)
        for _ in range(args.rounds):
            for p in prompts:
                t_spec, spec_ids = streamed(url, p, args.max_tokens, chat, None)
                t_loop, loop_ids = streamed(url, p, args.max_tokens, chat, 0)
                if spec_ids != loop_ids:
                    raise SystemExit(f"speculative tokens differ from target-only for {p!r}")
                ttft["speculative"].append(t_spec)
                ttft["target-only (loop, k=0)"].append(t_loop)
                ttft["target-only (control)"].append(control_first_token(url, p, chat))
    finally:
        if server is not None:
            server.stop()

    n = len(ttft["speculative"])
    print(
        f"\n{loaded.spec.name}: {len(prompts)} prompts x {args.rounds} rounds, concurrency 1, "
        f"k={loaded.spec.speculative.default_draft_tokens}; speculative tokens identical to target-only\n"
    )
    print("| path | TTFT p50 (ms) | TTFT p95 (ms) | speculative p50 / this p50 |")
    print("|---|---|---|---|")
    spec50 = statistics.median(ttft["speculative"])
    figures = {}
    for name, xs in ttft.items():
        p50 = statistics.median(xs)
        p95 = float(np.percentile(xs, 95))
        figures[name] = {"p50_ms": p50 * 1000, "p95_ms": p95 * 1000, "n": n}
        print(f"| {name} | {p50 * 1000:.1f} | {p95 * 1000:.1f} | {spec50 / p50:.2f}x |")
    if args.json:
        write_result(args.json, command_line("ttft.py"), {"spec": loaded.spec.name, "rounds": args.rounds, "ttft": figures})


if __name__ == "__main__":
    main()

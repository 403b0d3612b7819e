"""Tokens/s through the OpenAI front (`trtspec openai`) vs straight gRPC, same deployment.

    .venv/bin/python -m lab.openai_vs_grpc engine_specs/smollm2-135m-cpu.yaml -c 1,4

Builds nothing: the spec's engines must exist (`trtspec build SPEC`). Starts its own Triton
server and the OpenAI front on free loopback ports, then at each concurrency streams the
spec's verify prompts (raw text, greedy, speculative) through `tensorrt_llm_bls_streaming` over
gRPC and through /v1/completions (SSE) with the official `openai` client, checks the texts are
identical, and prints completion tokens per second of wall time for both and their ratio.
The two paths run in alternating blocks (--rounds, median), never at the same time.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time
from contextlib import contextmanager

from lab._common import start_server


async def _drain(prompts, concurrency: int, one) -> tuple[dict, int, float]:
    """Every prompt through ``one`` (async: prompt -> (text, completion tokens)) by
    ``concurrency`` workers sharing one queue: (texts by prompt, tokens, seconds)."""
    queue, texts, tokens = list(prompts), {}, 0

    async def worker():
        nonlocal tokens
        while queue:
            p = queue.pop()
            texts[p], n = await one(p)
            tokens += n

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return texts, tokens, time.perf_counter() - start


def _grpc_block(url, prompts, max_tokens, concurrency):
    """(texts, tokens, seconds) streaming over gRPC with ``concurrency`` clients."""
    from trtspec.openai.triton import Generation, TritonText

    async def run():
        backend = TritonText(url)

        async def one(p):
            text, last = "", None
            async for piece in backend.stream(Generation(text=p, max_tokens=max_tokens)):
                text += piece.text
                last = piece
            return text, last.completion_tokens

        out = await _drain(prompts, concurrency, one)
        await backend.close()
        return out

    return asyncio.run(run())


def _openai_block(base_url, model, prompts, max_tokens, concurrency):
    import openai

    async def run():
        client = openai.AsyncOpenAI(
            base_url=base_url,
            api_key="unused",
            max_retries=0,
            timeout=600,
            http_client=openai.DefaultAsyncHttpxClient(trust_env=False),
        )

        async def one(p):
            text, usage = "", None
            stream = await client.completions.create(
                model=model,
                prompt=p,
                max_tokens=max_tokens,
                stream=True,
                temperature=0,
                stream_options={"include_usage": True},
            )
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].text
                if chunk.usage:
                    usage = chunk.usage
            return text, usage.completion_tokens

        out = await _drain(prompts, concurrency, one)
        await client.close()
        return out

    return asyncio.run(run())


@contextmanager
def served_with_front(loaded):
    """A Triton server for ``loaded``'s built engines and the OpenAI front beside it, both on
    free loopback ports: yields (server, the front's /v1 base URL); stops both after."""
    import uvicorn

    from trtspec.openai.run import make_app
    from trtspec.triton.server.process import free_ports

    server = start_server(loaded)
    try:
        (port,) = free_ports(1)
        app = make_app(server.command.model_repository, server.grpc_endpoint)
        front = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=front.run, daemon=True)
        thread.start()
        while not front.started:
            time.sleep(0.05)
        try:
            yield server, f"http://127.0.0.1:{port}/v1"
        finally:
            front.should_exit = True
            thread.join(30)
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec", nargs="?", default="engine_specs/smollm2-135m-cpu.yaml")
    ap.add_argument("-c", "--concurrency", default="1,4")
    ap.add_argument("--max-tokens", type=int, default=None, help="default: verify.max_tokens")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    from trtspec.spec import load_spec

    loaded = load_spec(args.spec)
    prompts = loaded.verify_prompts()
    max_tokens = args.max_tokens or loaded.spec.verify.max_tokens
    rows = []
    with served_with_front(loaded) as (server, base_url):
        _grpc_block(server.grpc_endpoint, prompts[:1], 4, 1)  # warm both paths
        _openai_block(base_url, loaded.spec.name, prompts[:1], 4, 1)
        for c in [int(x) for x in args.concurrency.split(",")]:
            grpc_rates, oai_rates = [], []
            for _ in range(args.rounds):
                g_texts, g_tok, g_secs = _grpc_block(server.grpc_endpoint, prompts, max_tokens, c)
                o_texts, o_tok, o_secs = _openai_block(base_url, loaded.spec.name, prompts, max_tokens, c)
                if g_texts != o_texts or g_tok != o_tok:
                    raise SystemExit(f"concurrency {c}: the OpenAI front's texts differ from gRPC's")
                grpc_rates.append(g_tok / g_secs)
                oai_rates.append(o_tok / o_secs)
            g, o = statistics.median(grpc_rates), statistics.median(oai_rates)
            rows.append((c, g, o, o / g))
    print(f"\n{len(prompts)} prompts, max_tokens {max_tokens}, median of {args.rounds} rounds, streamed, speculative\n")
    print("| concurrency | gRPC tok/s | OpenAI front tok/s | front / gRPC |")
    print("|---|---|---|---|")
    for c, g, o, r in rows:
        print(f"| {c} | {g:.1f} | {o:.1f} | {r:.1%} |")


if __name__ == "__main__":
    main()

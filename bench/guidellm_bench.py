"""vLLM's serving benchmark client, GuideLLM, against `trtspec serve` + `trtspec openai`.

    python bench/guidellm_bench.py engine_specs/smollm2-135m-cpu.yaml -c 1,4,8
    python bench/guidellm_bench.py SPEC --guidellm /path/to/venv/bin/guidellm --requests 24

GuideLLM (PyPI `guidellm==0.8.1`) is run as a command from its own environment, like AIPerf
(bench/aiperf_bench.py), never imported here:

    python -m venv .venv-guidellm && .venv-guidellm/bin/pip install 'guidellm==0.8.1'

Builds nothing: the spec's engines must exist (`trtspec build SPEC`). Starts its own Triton
server and the OpenAI front on free loopback ports, then for the speculative model (the spec's
name) and the control (`<name>-target-only`), at each concurrency, runs `guidellm run` on
/v1/completions with synthetic prompts (64 tokens) and fixed-length outputs (32 tokens).
GuideLLM sends every request with `ignore_eos: true` and, streamed,
`stream_options.continuous_usage_stats: true` (the two fields trtspec used to refuse with
400). Writes GuideLLM's JSON per run and a summary (--out): requests completed and errored,
output tokens per second, TTFT and inter-token latency medians where GuideLLM's report has
them. Loopback only. The same command works against vLLM's own server (`--target` on
`guidellm run`), for the side by side of issue 23.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from openai_vs_grpc import served_with_front  # noqa: E402  (server + front on free loopback ports)


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
        "--output", f"kind=json,output_path={out_json}",
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
    """The figures this bench prints, read from GuideLLM's JSON report where present."""
    bench = (report.get("benchmarks") or [{}])[0]
    metrics = bench.get("metrics") or {}
    totals = bench.get("request_totals") or metrics.get("request_totals") or {}

    def median(name: str):
        m = metrics.get(name) or {}
        s = m.get("successful") or m
        return s.get("median") if isinstance(s, dict) else None

    return {
        "completed": totals.get("successful"),
        "errored": totals.get("errored"),
        "output_tokens_per_s": median("output_tokens_per_second"),
        "ttft_median_ms": median("time_to_first_token_ms"),
        "itl_median_ms": median("inter_token_latency_ms"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec", nargs="?", default="engine_specs/smollm2-135m-cpu.yaml")
    ap.add_argument("-c", "--concurrency", default="1,4,8")
    ap.add_argument("--requests", type=int, default=None, help="per run (default: 4 x concurrency, at least 8)")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--guidellm", default=str(ROOT / ".venv-guidellm" / "bin" / "guidellm"))
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "guidellm.json")
    args = ap.parse_args()
    if shutil.which(args.guidellm) is None:
        raise SystemExit(
            f"{args.guidellm}: GuideLLM not found; python -m venv .venv-guidellm && "
            ".venv-guidellm/bin/pip install 'guidellm==0.8.1' (or pass --guidellm)"
        )

    from trtspec.files import write_json_atomic
    from trtspec.layout import tokenizer_folder
    from trtspec.machine import description as machine_description
    from trtspec.spec import load_spec

    loaded = load_spec(args.spec)
    tokenizer = tokenizer_folder(loaded.output_dir(), loaded.spec.backend)
    work = Path(tempfile.mkdtemp(prefix="trtspec-guidellm-"))
    rows = []
    with served_with_front(loaded, work) as (_, base_url):
        for c in [int(x) for x in args.concurrency.split(",")]:
            n = args.requests or max(8, 4 * c)
            for model in (loaded.spec.name, loaded.spec.name + "-target-only"):
                print(f"concurrency {c}: {model}: guidellm ({n} requests)", flush=True)
                out_json = work / f"guidellm-{model}-c{c}.json"
                row = guidellm_run(
                    args.guidellm, base_url, model, tokenizer, c, n, args.prompt_tokens, args.output_tokens, out_json
                )
                rows.append({"concurrency": c, "model": model} | row)
    write_json_atomic(
        args.out,
        {
            "machine": machine_description(),
            "spec": str(args.spec),
            "prompt_tokens": args.prompt_tokens,
            "output_tokens": args.output_tokens,
            "command": "python bench/guidellm_bench.py " + " ".join(sys.argv[1:]),
            "rows": rows,
        },
    )
    print(f"\n{machine_description()}\n")
    print("| concurrency | model | completed | errored | output tok/s | TTFT p50 ms | ITL p50 ms |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['concurrency']} | {r['model']} | guidellm failed (exit {r['returncode']}) | | | | |")
            continue
        cells = [r.get(k) for k in ("completed", "errored", "output_tokens_per_s", "ttft_median_ms", "itl_median_ms")]
        print(f"| {r['concurrency']} | {r['model']} | " + " | ".join("-" if v is None else f"{v:g}" for v in cells) + " |")
    print(f"\nwrote {args.out}")
    if any("error" in r for r in rows):
        raise SystemExit("some guidellm runs failed: see 'error' in " + str(args.out))


if __name__ == "__main__":
    main()

"""`trtspec bench SPEC`: speedup, acceptance, latency and the analytic bound, measured."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from trtspec import console
from trtspec.cli.common import OutputOpt, SpecArg, handle_errors
from trtspec.errors import EXIT_INTERRUPTED, RequestError
from trtspec.spec import load_spec, read_prompts_file


def _int_list(text: str, what: str) -> list[int]:
    """'1-8' or '1,2,4' -> [ints]; '' or 'none' -> []."""
    text = text.strip().lower()
    if text in ("", "none"):
        return []
    try:
        if "-" in text:
            lo, hi = (int(x) for x in text.split("-", 1))
            return list(range(lo, hi + 1))
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise RequestError(f"{what} '{text}' is not a list like '1,2,4' or a range like '1-8'") from None


@handle_errors
def bench(
    spec: SpecArg,
    output: OutputOpt = None,
    url: Annotated[str | None, typer.Option("--url", help="Benchmark a served repository at HOST:PORT (gRPC) instead of in process.")] = None,
    prompt: Annotated[list[str] | None, typer.Option("--prompt", "-p", help="Prompt (repeatable); default: the spec's verify prompts.")] = None,
    prompts_file: Annotated[Path | None, typer.Option("--prompts-file", help='JSONL file of {"prompt": ...}.')] = None,
    max_tokens: Annotated[int | None, typer.Option("--max-tokens", min=1, help="Tokens per request (default: verify.max_tokens).")] = None,
    k: Annotated[int | None, typer.Option("--num-draft-tokens", "-k", help="Draft length for the main comparison (default: the spec's).")] = None,
    sweep: Annotated[str, typer.Option("--sweep", help="Draft lengths to sweep, e.g. 1-8 or 2,4,6; 'none' to skip.")] = "1-8",
    concurrency: Annotated[str | None, typer.Option("--concurrency", "-c", help="Concurrency levels (default 1,2,4 in process; 1,2,4,8 with --url).")] = None,
    rounds: Annotated[int, typer.Option("--rounds", min=1, help="Repeat the interleaved main comparison.")] = 1,
    out: Annotated[Path | None, typer.Option("--out", help="Folder for bench.json and plots (default bench/results/<name>).")] = None,
) -> None:
    """Measure speculative vs target-only on SPEC's pair, prompts and load.

    Reports tokens/s, TTFT, ITL, latency p50/p95, acceptance (rate, mean acceptance length,
    per position), the cost ratio c and the analytic speedup bound with efficiency, a k sweep
    with a recommended k, and concurrency scaling. Writes bench.json and PNG plots. Ctrl-C
    keeps what was measured so far.

    Examples:
      trtspec bench engine_specs/smollm2-135m-cpu.yaml
      trtspec bench engine_specs/smollm2-135m-cpu.yaml --url 127.0.0.1:8001 -c 1,4
    """
    from trtspec import bench as b

    loaded = load_spec(spec)
    prompts = list(prompt or [])
    if prompts_file:
        prompts += read_prompts_file(prompts_file)
    prompts = prompts or loaded.verify_prompts()
    if not prompts:
        raise RequestError("no prompts: add verify.prompts to the spec or pass --prompt/--prompts-file")
    n_tokens = max_tokens or loaded.spec.verify.max_tokens
    kk = k if k is not None else loaded.spec.speculative.default_draft_tokens
    levels = _int_list(concurrency if concurrency is not None else ("1,2,4,8" if url else "1,2,4"), "--concurrency")
    ks = _int_list(sweep, "--sweep")
    b.validate_args(kk, ks, levels, loaded.spec.speculative.max_draft_len)
    if url:
        from trtspec.triton.client import GrpcBench, measure_grpc_costs

        backend = GrpcBench(url, loaded.spec.verify.chat_template)
        measure_costs, mode = (lambda kk_: measure_grpc_costs(url, kk_)), f"grpc://{url}"
    else:
        from trtspec.runtime import Deployment

        with console.step("loading engines"):
            dep = Deployment(loaded, loaded.output_dir(output), slots=max([*levels, 1]) if levels else None)
        backend = b.InProcessBench(dep)
        measure_costs, mode = (lambda kk_: b.measure_engine_costs(dep, prompts[0], kk_)), "in-process"
    report = b.BenchReport(loaded.spec.name, mode, b.machine_description(), len(prompts), n_tokens, kk)
    out_dir = out or Path("bench") / "results" / loaded.spec.name
    interrupted = False
    with console.err.status("benchmarking") as status:
        try:
            b.run_bench(backend, report, prompts, ks, levels, measure_costs,
                        progress=lambda s: status.update(f"benchmarking: {s}"), rounds=rounds)
        except KeyboardInterrupt:
            interrupted = True
    b.render(report, console.out)
    for f in b.write_outputs(report, out_dir):
        console.info(f"wrote {f}")
    if interrupted:
        raise typer.Exit(EXIT_INTERRUPTED)

"""`trtspec bench SPEC`: speedup, acceptance, latency and the analytic bound, measured."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from trtspec import console
from trtspec.bench.run import BenchOptions
from trtspec.cli.common import DeviceOpt, JsonFileOpt, JsonOpt, LlmapiOpt, OutputOpt, SpecArg, for_run, handle_errors
from trtspec.cli.options import declared
from trtspec.cli.output import emit
from trtspec.errors import EXIT_INTERRUPTED
from trtspec.speculative.llmapi import TENSORRT_LLM


@handle_errors
@declared(BenchOptions)
def bench(
    spec: SpecArg,
    opts: BenchOptions,
    output: OutputOpt = None,
    out: Annotated[
        Path | None, typer.Option("--out", help="Folder for bench.json and plots (default .trtspec/bench/<name>).")
    ] = None,
    as_json: JsonOpt = False,
    json_file: JsonFileOpt = None,
    llmapi_impl: LlmapiOpt = TENSORRT_LLM,
    device: DeviceOpt = None,
) -> None:
    """Measure speculative vs target-only on SPEC's pair, prompts and load.

    Reports tokens/s, TTFT, ITL, latency p50/p95, acceptance (rate, mean acceptance length,
    per position), the cost ratio c and the analytic speedup bound with efficiency, a k sweep
    with a recommended k, and concurrency scaling. Writes bench.json and PNG plots. Ctrl-C
    keeps what was measured so far. An llmapi spec runs in process through the LLM API
    (--llmapi): tokens/s, TTFT, latency, whole-request acceptance and concurrency; no step
    costs and no sweep (the LLM API exposes neither; its draft length is fixed at build).

    Examples:
      trtspec bench engine_specs/smollm2-135m-cpu.yaml
      trtspec bench engine_specs/smollm2-135m-cpu.yaml --url 127.0.0.1:8001 -c 1,4
      trtspec bench engine_specs/smollm2-135m-cpu.yaml --sweep none -c 1 \\
        --neighbour 1
      trtspec bench engine_specs/smollm2-135m-eagle3.yaml \\
        --methods eagle3,draft_target,ngram \\
        --draft-from engine_specs/smollm2-135m-cpu.yaml
      trtspec bench engine_specs/smollm2-135m-cpu-suffix.yaml \\
        --methods suffix,ngram --sweep none -c 1 \\
        --methods-prompts trtspec/bench/prompts.jsonl \\
        --methods-prompts trtspec/bench/repeat_prompts.jsonl
      trtspec bench engine_specs/smollm2-135m-eagle3.yaml --trees --sweep none \\
        -c 1
    """
    from trtspec.bench import plot, render, run

    loaded, opts = for_run(spec, device, opts, llmapi_impl)
    with console.err.status("benchmarking") as status:
        report, interrupted = run.run(
            loaded, loaded.output_dir(output), opts, progress=lambda s: status.update(f"benchmarking: {s}")
        )
    emit(report, lambda o: render.render(report, o), as_json=as_json, json_file=json_file)
    for f in plot.write_outputs(report, out or Path(".trtspec") / "bench" / loaded.spec.name):
        console.info(f"wrote {f}")
    if interrupted:
        raise typer.Exit(EXIT_INTERRUPTED)

"""`trtspec bench SPEC`: speedup, acceptance, latency and the analytic bound, measured."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from trtspec import console
from trtspec.cli.common import (
    DeviceOpt,
    JsonFileOpt,
    JsonOpt,
    LlmapiOpt,
    OutputOpt,
    SpecArg,
    UrlOpt,
    handle_errors,
    with_device,
)
from trtspec.cli.output import emit
from trtspec.errors import EXIT_INTERRUPTED
from trtspec.spec import load_spec, read_prompts
from trtspec.speculative.llmapi import TENSORRT_LLM
from trtspec.triton.client import parse_url


@handle_errors
def bench(
    spec: SpecArg,
    output: OutputOpt = None,
    url: UrlOpt = None,
    prompt: Annotated[
        list[str] | None, typer.Option("--prompt", "-p", help="Prompt (repeatable); default: the spec's verify prompts.")
    ] = None,
    prompts_file: Annotated[Path | None, typer.Option("--prompts-file", help='JSONL file of {"prompt": ...}.')] = None,
    max_tokens: Annotated[
        int | None, typer.Option("--max-tokens", min=1, help="Tokens per request (default: verify.max_tokens).")
    ] = None,
    k: Annotated[
        int | None, typer.Option("--num-draft-tokens", "-k", help="Draft length for the main comparison (default: the spec's).")
    ] = None,
    sweep: Annotated[
        str | None,
        typer.Option("--sweep", help="Draft lengths to sweep, e.g. 1-8 or 2,4,6; 'none' to skip (default 1-8; none for llmapi)."),
    ] = None,
    concurrency: Annotated[
        str | None, typer.Option("--concurrency", "-c", help="Concurrency levels (default 1,2,4 in process; 1,2,4,8 with --url).")
    ] = None,
    rounds: Annotated[int, typer.Option("--rounds", min=1, help="Repeat the interleaved main comparison.")] = 1,
    methods: Annotated[
        str | None,
        typer.Option(
            "--methods",
            help="Also compare drafting methods over the same target, e.g. eagle3,draft_target,ngram "
            "(in process; target-only is always included).",
        ),
    ] = None,
    methods_prompts: Annotated[
        list[Path] | None,
        typer.Option(
            "--methods-prompts",
            help="A JSONL prompt set to compare --methods on, reported as its own set (repeatable; "
            "default: the bench's prompts), e.g. bench/prompts.jsonl and bench/repeat_prompts.jsonl.",
        ),
    ] = None,
    draft_from: Annotated[
        Path | None,
        typer.Option(
            "--draft-from",
            help="A built spec with the same target weights whose draft (engine or EAGLE-3 head) "
            "supplies a method this spec lacks.",
        ),
    ] = None,
    schedule: Annotated[
        bool,
        typer.Option(
            "--schedule",
            help="Also measure tokens/s for each --sweep k and target-only at each --concurrency, and "
            "recommend a load-aware schedule (speculative.schedule; TensorRT-LLM and vLLM shapes too).",
        ),
    ] = False,
    trees: Annotated[
        bool,
        typer.Option(
            "--trees",
            help="Also measure acceptance per draft-tree node (a wide probe tree) and the verify cost of n "
            "nodes, and recommend a tree or a chain by expected tokens per second, timed against the best "
            "chain (in process; methods draft_target and eagle3).",
        ),
    ] = False,
    neighbour: Annotated[
        int,
        typer.Option(
            "--neighbour",
            min=0,
            help="Measure beside N busy processes (one core each), as on a shared machine; the machine line says so.",
        ),
    ] = 0,
    out: Annotated[
        Path | None, typer.Option("--out", help="Folder for bench.json and plots (default bench/results/<name>).")
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
      trtspec bench engine_specs/smollm2-135m-cpu.yaml --sweep none -c 1 --neighbour 1
      trtspec bench engine_specs/smollm2-135m-eagle3.yaml --methods eagle3,draft_target,ngram \\
        --draft-from engine_specs/smollm2-135m-cpu.yaml
      trtspec bench engine_specs/smollm2-135m-cpu-suffix.yaml --methods suffix,ngram --sweep none -c 1 \\
        --methods-prompts bench/prompts.jsonl --methods-prompts bench/repeat_prompts.jsonl
      trtspec bench engine_specs/smollm2-135m-eagle3.yaml --trees --sweep none -c 1
    """
    from trtspec.bench import plot, render, run

    loaded = with_device(load_spec(spec), device)
    url = parse_url(url)
    llmapi_spec = loaded.spec.backend == "trtllm" and loaded.spec.trtllm.runtime == "llmapi"
    prompts = list(prompt or [])
    if prompts_file:
        prompts += read_prompts(prompts_file)
    opts = run.BenchOptions(
        prompts=prompts or loaded.verify_prompts(),
        max_tokens=max_tokens or loaded.spec.verify.max_tokens,
        k=k,
        sweep=run.int_list(sweep if sweep is not None else ("none" if llmapi_spec else "1-8"), "--sweep"),
        concurrency=run.int_list(concurrency if concurrency is not None else ("1,2,4,8" if url else "1,2,4"), "--concurrency"),
        rounds=rounds,
        url=url,
        methods=[x.strip() for x in methods.split(",") if x.strip()] if methods else [],
        method_prompts=[(f.stem, read_prompts(f, "--methods-prompts")) for f in methods_prompts or []],
        draft_from=load_spec(draft_from) if draft_from else None,
        llmapi_impl=llmapi_impl,
        schedule=schedule,
        neighbours=neighbour,
        trees=trees,
    )
    with console.err.status("benchmarking") as status:
        report, interrupted = run.run(
            loaded, loaded.output_dir(output), opts, progress=lambda s: status.update(f"benchmarking: {s}")
        )
    emit(report, lambda o: render.render(report, o), as_json=as_json, json_file=json_file)
    for f in plot.write_outputs(report, out or Path("bench") / "results" / loaded.spec.name):
        console.info(f"wrote {f}")
    if interrupted:
        raise typer.Exit(EXIT_INTERRUPTED)

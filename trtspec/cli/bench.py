"""`trtspec bench SPEC`: speedup, acceptance, latency and the analytic bound, measured."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from trtspec import console
from trtspec.bench.run import BenchOptions
from trtspec.cli.common import (
    DeviceOpt,
    EnginesOpt,
    JsonFileOpt,
    JsonOpt,
    LlmapiOpt,
    MaxTokensOpt,
    NumDraftTokensOpt,
    PromptOpt,
    SpecArg,
    UrlOpt,
    handle_errors,
    spec_and_engines,
    spec_with,
)
from trtspec.cli.options import from_flags
from trtspec.cli.output import emit
from trtspec.errors import EXIT_INTERRUPTED, RequestError
from trtspec.layout import engine_folder
from trtspec.spec import LoadedSpec

Opt = typer.Option
OutputOpt = Annotated[Path | None, Opt("--output", "-o", help="Folder for bench.json and plots (default .trtspec/bench/<name>).")]
PromptsFileOpt = Annotated[Path | None, Opt("--prompts-file", help='JSONL file of {"prompt": ...}.')]
SweepOpt = Annotated[
    str | None, Opt("--sweep", help="Draft lengths to sweep, e.g. 1-8 or 2,4,6; 'none' to skip (default 1-8; none for llmapi).")
]
ConcurrencyOpt = Annotated[
    str | None, Opt("--concurrency", "-c", help="Concurrency levels (default 1,2,4 in process; 1,2,4,8 with --url).")
]
RoundsOpt = Annotated[int, Opt("--rounds", help="Repeat the interleaved main comparison.")]
MethodsOpt = Annotated[
    str | None,
    Opt(
        "--methods",
        help="Also compare drafting methods over the same target, e.g. eagle3,draft_target,ngram (in process; target-only is always included).",
    ),
]
MethodsPromptsOpt = Annotated[
    list[Path] | None,
    Opt(
        "--methods-prompts",
        help="A JSONL prompt set to compare --methods on, reported as its own set (repeatable; default: the bench's prompts), e.g. the two sets trtspec ships: trtspec/bench/prompts.jsonl (chat) and trtspec/bench/repeat_prompts.jsonl (text that repeats), in its install folder.",
    ),
]
DraftFromOpt = Annotated[
    Path | None,
    Opt(
        "--draft-from",
        help="A built spec with the same target weights whose draft (engine or EAGLE-3 head) supplies a method this spec lacks.",
    ),
]
ScheduleOpt = Annotated[
    bool,
    Opt(
        "--schedule",
        help="Also measure tokens/s for each --sweep k and target-only at each --concurrency, and recommend a load-aware schedule (speculative.schedule; TensorRT-LLM and vLLM shapes too).",
    ),
]
TreesOpt = Annotated[
    bool,
    Opt(
        "--trees",
        help="Also measure acceptance per draft-tree node (a wide probe tree) and the verify cost of n nodes, and recommend a tree or a chain by expected tokens per second, timed against the best chain (in process; methods draft_target and eagle3).",
    ),
]
ContextSweepOpt = Annotated[
    str | None,
    Opt(
        "--context-sweep",
        help="Also time each role's one-row decode step and the verify of k+1 tokens with this many tokens in the KV cache, e.g. 64,256,512,1024 (increasing, each at most max_seq_len minus what a step needs; in process): step ms and c by context, in the report and context.png.",
    ),
]
DraftKvOpt = Annotated[
    str | None,
    Opt(
        "--draft-kv",
        help="In place of the spec's speculative.draft_kv: target (a self-draft takes the target's K/V for the prompt) or own (the draft prefills it itself); run both on long prompts to see what adopting saves (in process).",
    ),
]
NeighboursOpt = Annotated[
    int,
    Opt("--neighbour", help="Measure beside N busy processes (one core each), as on a shared machine; the machine line says so."),
]

HELP = """Measure speculative vs target-only on SPEC's pair, prompts and load.

    Reports tokens/s, TTFT, ITL, latency p50/p95, acceptance (rate, mean acceptance length,
    per position), the cost ratio c and the analytic speedup bound with efficiency, a k sweep
    with a recommended k, and concurrency scaling (--context-sweep: the step costs by context
    length). Writes bench.json and PNG plots. Ctrl-C keeps what was measured so far. An
    llmapi spec runs in process through the LLM API (--llmapi): tokens/s, TTFT, latency,
    whole-request acceptance and concurrency; no step costs and no sweep (the LLM API exposes
    neither; its draft length is fixed at build).

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
      trtspec bench engine_specs/smollm2-135m-cpu.yaml --sweep none -c 1 \\
        --context-sweep 64,256,512,1024
      trtspec bench engine_specs/smollm2-135m-cpu.yaml --sweep none -c 1 \\
        --prompts-file long_prompts.jsonl --draft-kv target
"""


# An option that names a BenchOptions field defaults to the field's default, declared there once.
DEFAULTS = BenchOptions()


@handle_errors
def bench(
    ctx: typer.Context,
    spec: SpecArg,
    prompts: PromptOpt = DEFAULTS.prompts,
    prompts_file: PromptsFileOpt = DEFAULTS.prompts_file,
    max_tokens: MaxTokensOpt = DEFAULTS.max_tokens,
    num_draft_tokens: NumDraftTokensOpt = DEFAULTS.num_draft_tokens,
    sweep: SweepOpt = DEFAULTS.sweep,
    concurrency: ConcurrencyOpt = DEFAULTS.concurrency,
    rounds: RoundsOpt = DEFAULTS.rounds,
    url: UrlOpt = DEFAULTS.url,
    methods: MethodsOpt = DEFAULTS.methods,
    methods_prompts: MethodsPromptsOpt = DEFAULTS.methods_prompts,
    draft_from: DraftFromOpt = DEFAULTS.draft_from,
    schedule: ScheduleOpt = DEFAULTS.schedule,
    trees: TreesOpt = DEFAULTS.trees,
    context_sweep: ContextSweepOpt = DEFAULTS.context_sweep,
    neighbours: NeighboursOpt = DEFAULTS.neighbours,
    draft_kv: DraftKvOpt = None,
    engines: EnginesOpt = None,
    output: OutputOpt = None,
    as_json: JsonOpt = False,
    json_file: JsonFileOpt = None,
    llmapi_impl: LlmapiOpt = DEFAULTS.llmapi_impl,
    device: DeviceOpt = None,
) -> None:
    from trtspec.bench import plot, render, run

    opts = from_flags(BenchOptions, ctx)
    folder = report_folder(output)
    loaded, engines_folder = spec_and_engines(spec, device, engines, num_draft_tokens, url)
    if draft_kv is not None:
        loaded = with_draft_kv(loaded, draft_kv, opts.url)
    with console.err.status("benchmarking") as status:
        report, interrupted = run.run(loaded, engines_folder, opts, progress=lambda s: status.update(f"benchmarking: {s}"))
    emit(report, lambda o: render.render(report, o), as_json=as_json, json_file=json_file)
    for f in plot.write_outputs(report, folder or Path(".trtspec") / "bench" / loaded.spec.name):
        console.info(f"wrote {f}")
    if interrupted:
        raise typer.Exit(EXIT_INTERRUPTED)


def report_folder(folder: Path | None) -> Path | None:
    """-o/--output, refused where it holds built engines: bench once read its engine folder
    there, and writing bench.json and plots into it would mix a report into the engines."""
    if folder is not None and engine_folder(folder, "target").is_dir():
        raise RequestError(
            f"-o/--output is the folder for bench.json and plots, and {folder} holds built engines: "
            f"name the engines with --engines {folder} and the report folder with -o"
        )
    return folder


def with_draft_kv(loaded: LoadedSpec, value: str, url: str | None) -> LoadedSpec:
    """The spec with --draft-kv in place of its speculative.draft_kv (the spec's own rules
    refuse a bad value, exit 2); refused with --url: a served draft computes its own K/V."""
    if url is not None:
        raise RequestError(
            "--draft-kv applies in process; a served deployment's draft runs in its own engine model "
            "and computes its own K/V: drop --draft-kv or --url"
        )
    speculative = loaded.spec.speculative.model_dump(exclude_unset=True) | {"draft_kv": value}
    return spec_with(loaded, f"--draft-kv {value}", speculative=speculative)

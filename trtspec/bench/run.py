"""`trtspec bench` as one library call: choose the backend (in process or a served
repository), measure, and return the report; the CLI only parses and prints."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from trtspec import console, machine
from trtspec.bench import measure as m
from trtspec.bench.neighbour import busy_neighbours
from trtspec.errors import RequestError
from trtspec.spec import LoadedSpec
from trtspec.speculative.llmapi import DOUBLE, TENSORRT_LLM
from trtspec.speculative.requests import draft_tokens


def int_list(text: str, what: str) -> list[int]:
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


@dataclass
class BenchOptions:
    prompts: list[str]
    max_tokens: int
    k: int | None  # the main comparison's draft length; None: the spec's (speculative.requests)
    sweep: list[int]
    concurrency: list[int]
    rounds: int = 1
    url: str | None = None  # HOST:PORT of a served repository; None: in process
    llmapi_impl: str = TENSORRT_LLM  # trtllm.runtime llmapi in process: the library or DOUBLE
    methods: list[str] = field(default_factory=list)  # also compare these drafting methods (in process)
    # The prompt sets the methods are compared on, each reported on its own: (name, prompts).
    # Empty: the bench's own prompts, as one set.
    method_prompts: list[tuple[str, list[str]]] = field(default_factory=list)
    draft_from: LoadedSpec | None = None  # the source of a method that is not the spec's own
    schedule: bool = False  # also the k x concurrency grid and a recommended schedule (in process)
    neighbours: int = 0  # busy processes beside the measurement, one core each (bench/neighbour.py)
    trees: bool = False  # also choose a draft tree from measured node acceptance and verify costs (in process)


def run(
    loaded: LoadedSpec, engines_dir: Path, opts: BenchOptions, progress: Callable[[str], None] | None = None
) -> tuple[m.BenchReport, bool]:
    """Measure; returns the report and whether Ctrl-C cut it short (what was measured stays)."""
    if not opts.prompts:
        raise RequestError("no prompts: add verify.prompts to the spec or pass --prompt/--prompts-file")
    opts = replace(opts, k=draft_tokens(opts.k, loaded.spec.speculative.default_draft_tokens))
    m.validate_args(opts.k, opts.sweep, opts.concurrency, loaded.spec.speculative.max_draft_len)
    if opts.schedule and opts.url:
        raise RequestError(
            "--schedule measures the k x concurrency grid in process (a served deployment applies "
            "its own schedule); drop --url, then put the recommendation in speculative.schedule and serve"
        )
    if opts.method_prompts and not opts.methods:
        raise RequestError("--methods-prompts chooses the prompts --methods compares on; add --methods (e.g. suffix,ngram)")
    if opts.trees and opts.url:
        raise RequestError(
            "--trees measures acceptance per tree node and verify costs in process; drop --url, then put "
            "the recommended speculative.tree in the spec and serve"
        )
    if (opts.methods or opts.draft_from) and opts.url:
        raise RequestError(
            "--methods compares drafters over one target in process; drop --url (a served repository runs one method)"
        )
    if loaded.spec.backend == "trtllm" and loaded.spec.trtllm.runtime == "llmapi" and not opts.url:
        return _run_llmapi(loaded, engines_dir, opts, progress)
    if opts.url:
        from trtspec.bench.grpc import GrpcBench, measure_grpc_costs

        backend = GrpcBench(opts.url, loaded.spec.verify.chat_template)
        url = opts.url
        measure_costs, mode = (lambda k: measure_grpc_costs(url, k)), f"grpc://{url}"
    else:
        from trtspec.runtime import Deployment

        with console.step("loading engines"):
            slots = max([*opts.concurrency, 1]) if opts.concurrency else None
            dep = Deployment(loaded, engines_dir, slots=slots)
        backend = m.InProcessBench(dep)
        sweeper = m.InProcessBench(dep, use_schedule=False)
        first = opts.prompts[0]
        measure_costs, mode = (lambda k: m.measure_engine_costs(dep, first, k)), "in-process"
    described = machine.description()
    if opts.neighbours:
        described += f"; {opts.neighbours} busy neighbour process{'es' if opts.neighbours > 1 else ''}"
    report = m.BenchReport(loaded.spec.name, mode, described, len(opts.prompts), opts.max_tokens, opts.k)
    report.max_batch_size = loaded.spec.build.max_batch_size
    methods = None
    if opts.methods:
        from trtspec.bench.methods import method_set

        methods = method_set(dep, opts.methods, opts.k, opts.draft_from)
    try:
        with busy_neighbours(opts.neighbours):
            m.run_bench(
                backend,
                report,
                opts.prompts,
                opts.sweep,
                opts.concurrency,
                measure_costs,
                progress=progress,
                rounds=opts.rounds,
                sweep_backend=None if opts.url else sweeper,
                grid=opts.schedule,
            )
            if methods is not None:
                _compare(dep, methods, opts, report, progress)
            if opts.trees:
                from trtspec.bench.trees import measure_trees

                report.trees = measure_trees(dep, opts.prompts, opts.max_tokens, True, opts.rounds, progress).to_dict()
    except KeyboardInterrupt:
        return report, True
    return report, False


def _compare(dep, methods, opts: BenchOptions, report: m.BenchReport, progress) -> None:
    """Every method over the same target and prompts, interleaved per prompt (bench/methods.py)."""
    from trtspec.bench.methods import compare_methods, methods_table

    report.methods = []
    for name, prompts in opts.method_prompts or [("prompts", opts.prompts)]:
        requests = [dep.request(dep.encode(p), opts.max_tokens, 0) for p in prompts]
        say = (lambda s, n=name: progress(f"{n}: {s}")) if progress else (lambda s: None)
        stats = compare_methods(dep.verifier(), methods.drafters, requests, methods.forget, opts.rounds, say)
        report.methods += [{"prompt_set": name, "prompts": len(prompts)} | row for row in methods_table(stats)]


def _run_llmapi(loaded: LoadedSpec, engines_dir: Path, opts: BenchOptions, progress) -> tuple[m.BenchReport, bool]:
    """In process through the LLM API: no step costs and no sweep (bench/llmapi.py says why)."""
    from trtspec.bench.llmapi import LlmapiBench
    from trtspec.runtime import LlmapiDeployment

    k = loaded.spec.speculative.max_draft_len
    if opts.sweep or opts.methods or opts.draft_from or opts.trees:
        raise RequestError(
            "an llmapi build drafts a fixed k (speculative_config.max_draft_len) and one method: "
            "pass --sweep none and no --methods/--draft-from/--trees"
        )
    if opts.k != k:
        raise RequestError(f"-k {opts.k}: this llmapi build drafts {k} (speculative.max_draft_len); pass -k {k} or rebuild")
    with console.step("loading the LLM API (speculative and control)"):
        dep = LlmapiDeployment(loaded, engines_dir, opts.llmapi_impl)
    label = "llmapi conformance double, not TensorRT-LLM" if opts.llmapi_impl == DOUBLE else "TensorRT-LLM LLM API"
    report = m.BenchReport(
        loaded.spec.name, f"in-process ({label})", machine.description(), len(opts.prompts), opts.max_tokens, k
    )
    try:
        m.run_bench(LlmapiBench(dep), report, opts.prompts, [], opts.concurrency, None, progress=progress, rounds=opts.rounds)
    except KeyboardInterrupt:
        return report, True
    finally:
        dep.shutdown()
    return report, False

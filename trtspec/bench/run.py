"""`trtspec bench` as one library call: choose the backend (in process or a served
repository), measure, and return the report; the CLI only parses and prints."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from trtspec import console, machine
from trtspec.bench import measure as m
from trtspec.bench.context import check_contexts, context_points
from trtspec.bench.neighbour import busy_neighbours
from trtspec.errors import RequestError
from trtspec.spec import LoadedSpec
from trtspec.speculative.llmapi import DOUBLE, TENSORRT_LLM
from trtspec.triton.client import parse_url


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


class BenchOptions(BaseModel):
    """What `trtspec bench` is asked: each value's type, default and bounds (the command's flags,
    trtspec/cli/bench.py, are validated into it). ``for_spec`` fills what the spec decides."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    prompts: list[str] | None = None
    prompts_file: Path | None = None
    max_tokens: Annotated[int | None, Field(ge=1)] = None
    # the main comparison's draft length; None: the spec's (speculative.requests)
    num_draft_tokens: int | None = None
    sweep: list[int] | None = None
    concurrency: list[int] | None = None
    rounds: Annotated[int, Field(ge=1)] = 1
    url: str | None = None
    methods: list[str] | None = None
    methods_prompts: list[Path] | None = None
    draft_from: Path | None = None
    schedule: bool = False
    trees: bool = False
    neighbours: Annotated[int, Field(ge=0)] = 0
    # context lengths at which to time each role's steps (bench/context.py); [] or None: none
    context_sweep: list[int] | None = None
    llmapi_impl: str = TENSORRT_LLM  # trtllm.runtime llmapi in process: the library or DOUBLE
    # Filled by for_spec: the prompt sets --methods compares on, (name, prompts), and the spec
    # --draft-from names.
    method_sets: list[tuple[str, list[str]]] = []
    draft_spec: LoadedSpec | None = None

    @field_validator("url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        return parse_url(v)

    @field_validator("sweep", "concurrency", "context_sweep", mode="before")
    @classmethod
    def _ints(cls, v, info):
        return int_list(v, "--" + info.field_name.replace("_", "-")) if isinstance(v, str) else v

    @field_validator("context_sweep")
    @classmethod
    def _increasing(cls, v: list[int] | None) -> list[int] | None:
        if v and (v[0] < 1 or any(b <= a for a, b in zip(v, v[1:]))):
            raise ValueError(f"context lengths must be positive and increasing, e.g. 64,256,1024; got {','.join(map(str, v))}")
        return v

    @field_validator("methods", mode="before")
    @classmethod
    def _names(cls, v):
        return [x.strip() for x in v.split(",") if x.strip()] if isinstance(v, str) else v

    @model_validator(mode="after")
    def _in_process_only(self) -> BenchOptions:
        if self.methods_prompts and not self.methods:
            raise RequestError("--methods-prompts chooses the prompts --methods compares on; add --methods (e.g. suffix,ngram)")
        if self.url is None:
            return self
        if self.schedule:
            raise RequestError(
                "--schedule measures the k x concurrency grid in process (a served deployment applies "
                "its own schedule); drop --url, then put the recommendation in speculative.schedule and serve"
            )
        if self.trees:
            raise RequestError(
                "--trees measures acceptance per tree node and verify costs in process; drop --url, then put "
                "the recommended speculative.tree in the spec and serve"
            )
        if self.methods or self.draft_from:
            raise RequestError(
                "--methods compares drafters over one target in process; drop --url (a served repository runs one method)"
            )
        if self.context_sweep:
            raise RequestError("--context-sweep times each engine's steps in process; drop --url")
        return self

    def for_spec(self, loaded: LoadedSpec) -> BenchOptions:
        """Every value the spec or the mode decides, filled in: prompts, tokens, sweep,
        concurrency, the methods' prompt sets and the --draft-from spec."""
        from trtspec.spec import load_spec, read_prompts

        llmapi = loaded.spec.backend == "trtllm" and loaded.spec.trtllm.runtime == "llmapi"
        prompts = list(self.prompts or []) + (read_prompts(self.prompts_file) if self.prompts_file else [])
        default_sweep = [] if llmapi else list(range(1, 9))
        return self.model_copy(
            update={
                "prompts": prompts or loaded.verify_prompts(),
                "max_tokens": self.max_tokens or loaded.spec.verify.max_tokens,
                "sweep": default_sweep if self.sweep is None else self.sweep,
                "concurrency": self.concurrency if self.concurrency is not None else [1, 2, 4, 8] if self.url else [1, 2, 4],
                "methods": self.methods or [],
                "method_sets": [(f.stem, read_prompts(f, "--methods-prompts")) for f in self.methods_prompts or []],
                "draft_spec": load_spec(self.draft_from) if self.draft_from else None,
            }
        )


def run(
    loaded: LoadedSpec, engines_dir: Path, opts: BenchOptions, progress: Callable[[str], None] | None = None
) -> tuple[m.BenchReport, bool]:
    """Measure; returns the report and whether Ctrl-C cut it short (what was measured stays)."""
    opts = opts.for_spec(loaded)
    if not opts.prompts:
        raise RequestError("no prompts: add verify.prompts to the spec or pass --prompt/--prompts-file")
    max_draft_len = loaded.spec.speculative.max_draft_len
    m.validate_args(None, opts.sweep, opts.concurrency, max_draft_len)  # k: once the deployment decided it
    _check_grid(opts, loaded.spec.build.max_batch_size)
    if opts.context_sweep:  # in process (refused with --url), before the engines load: the k the
        # deployment will decide is -k, else the default_draft_tokens of the spec it is loaded from
        asked = opts.num_draft_tokens
        k = loaded.spec.speculative.default_draft_tokens if asked is None else asked
        check_contexts(opts.context_sweep, loaded.spec.build.max_seq_len, k, loaded.spec.speculative.model_draft == "eagle3")
    if loaded.spec.backend == "trtllm" and loaded.spec.trtllm.runtime == "llmapi" and not opts.url:
        return _run_llmapi(loaded, engines_dir, opts, progress)
    backend, sweeper, dep, measure_costs, mode, k = _open(loaded, engines_dir, opts)
    # From here on, k is the draft length the deployment decided for the bench's requests.
    m.validate_args(k, [], [], max_draft_len)
    opts = opts.model_copy(update={"num_draft_tokens": k})
    described = machine.description()
    if opts.neighbours:
        described += f"; {opts.neighbours} busy neighbour process{'es' if opts.neighbours > 1 else ''}"
    report = m.BenchReport(loaded.spec.name, mode, described, len(opts.prompts), opts.max_tokens, opts.num_draft_tokens)
    report.max_batch_size = loaded.spec.build.max_batch_size
    methods = None
    if opts.methods:
        from trtspec.bench.methods import method_set

        methods = method_set(dep, opts.methods, opts.num_draft_tokens, opts.draft_spec)
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
                sweep_backend=sweeper,
                grid=opts.schedule,
            )
            _in_process_extras(dep, methods, opts, report, progress)
    except KeyboardInterrupt:
        return report, True
    return report, False


def _open(loaded: LoadedSpec, engines_dir: Path, opts: BenchOptions):
    """The bench's backends, the deployment in process (None over --url), the step-cost
    measurement, the mode line, and num_draft_tokens as the deployment decided it for the
    bench's requests (-k, else its default: in process the request rules', over --url the
    served endpoint's own)."""
    if opts.url:
        from trtspec.bench.grpc import GrpcBench, measure_grpc_costs

        backend = GrpcBench(opts.url, loaded.spec.verify.chat_template)
        url = opts.url
        k = backend.decided_draft_tokens(opts.num_draft_tokens)
        return backend, None, None, (lambda k: measure_grpc_costs(url, k)), f"grpc://{url}", k
    from trtspec.runtime import Deployment

    with console.step("loading engines"):
        slots = max([*opts.concurrency, 1]) if opts.concurrency else None
        dep = Deployment(loaded, engines_dir, slots=slots)
    first = opts.prompts[0]
    k = dep.decided_draft_tokens(opts.num_draft_tokens)
    backend, sweeper = m.InProcessBench(dep), m.InProcessBench(dep, use_schedule=False)
    return backend, sweeper, dep, (lambda k: m.measure_engine_costs(dep, first, k)), "in-process", k


def _check_grid(opts: BenchOptions, batch: int) -> None:
    """--schedule recommends from the concurrencies a served batch can run (schedule.recommend)."""
    if opts.schedule and not any(c <= batch for c in opts.concurrency):
        raise RequestError(
            f"--schedule recommends from concurrencies <= build.max_batch_size ({batch}); add one, e.g. -c 1,2,{batch}"
        )


def _in_process_extras(dep, methods, opts: BenchOptions, report: m.BenchReport, progress) -> None:
    """What --methods, --trees and --context-sweep add after the main comparison (in process)."""
    if methods is not None:
        _compare(dep, methods, opts, report, progress)
    if opts.trees:
        from trtspec.bench.trees import measure_trees

        report.trees = measure_trees(dep, opts.prompts, opts.max_tokens, True, opts.rounds, progress).to_dict()
    if opts.context_sweep:
        bandwidth = report.costs.bandwidth if report.costs else None
        ids, say = dep.encode(opts.prompts[0]), progress or (lambda s: None)
        for point in context_points(dep, ids, opts.context_sweep, opts.num_draft_tokens, bandwidth, say):
            report.context_sweep.append(point)  # one by one: an interruption keeps those measured


def _compare(dep, methods, opts: BenchOptions, report: m.BenchReport, progress) -> None:
    """Every method over the same target and prompts, interleaved per prompt (bench/methods.py)."""
    from trtspec.bench.methods import compare_methods, methods_table

    report.methods = []
    for name, prompts in opts.method_sets or [("prompts", opts.prompts)]:
        requests = [dep.request(dep.encode(p), opts.max_tokens, 0) for p in prompts]
        say = (lambda s, n=name: progress(f"{n}: {s}")) if progress else (lambda s: None)
        stats = compare_methods(dep.verifier(), methods.drafters, requests, methods.forget, opts.rounds, say)
        report.methods += [{"prompt_set": name, "prompts": len(prompts)} | row for row in methods_table(stats)]


def _run_llmapi(loaded: LoadedSpec, engines_dir: Path, opts: BenchOptions, progress) -> tuple[m.BenchReport, bool]:
    """In process through the LLM API: no step costs and no sweep (bench/llmapi.py says why)."""
    from trtspec.bench.llmapi import LlmapiBench
    from trtspec.runtime import LlmapiDeployment

    k = loaded.spec.speculative.max_draft_len
    if opts.sweep or opts.methods or opts.draft_spec or opts.trees or opts.context_sweep:
        raise RequestError(
            "an llmapi build drafts a fixed k (speculative_config.max_draft_len) and one method: "
            "pass --sweep none and no --methods/--draft-from/--trees/--context-sweep"
        )
    if opts.num_draft_tokens not in (None, k):  # none asked: the build's k, all the LLM API drafts
        raise RequestError(
            f"-k {opts.num_draft_tokens}: this llmapi build drafts {k} (speculative.max_draft_len); pass -k {k} or rebuild"
        )
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

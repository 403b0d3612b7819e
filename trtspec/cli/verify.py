"""`trtspec verify SPEC`: speculative vs target-only, token by token."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.progress import Progress

from trtspec import console
from trtspec.cli.common import DeviceOpt, JsonFileOpt, JsonOpt, LlmapiOpt, OutputOpt, SpecArg, for_run, handle_errors
from trtspec.cli.options import declared
from trtspec.cli.output import emit
from trtspec.errors import EXIT_DIVERGED, EXIT_OK
from trtspec.speculative.llmapi import TENSORRT_LLM
from trtspec.verify.run import VerifyOptions, run


@handle_errors
@declared(VerifyOptions)
def verify(
    spec: SpecArg,
    opts: VerifyOptions,
    output: OutputOpt = None,
    as_json: JsonOpt = False,
    json_file: JsonFileOpt = None,
    junit_file: Annotated[
        Path | None, typer.Option("--junit", help="Also write a JUnit XML report (one testcase per prompt).")
    ] = None,
    llmapi_impl: LlmapiOpt = TENSORRT_LLM,
    device: DeviceOpt = None,
) -> None:
    """Prove greedy speculative outputs are token-identical to target-only outputs.

    Each divergence is replayed on the target alone in both forward shapes and classed
    numerical (a near-tie flipped by the verifier's batched forward) or algorithmic.

    Exit codes: 0 passed (--fail-on), 1 a failing divergence, 2 bad spec or usage.

    Examples:
      trtspec verify engine_specs/smollm2-135m-cpu.yaml
      trtspec verify my-spec.yaml --json-file report.json --junit verify.xml \\
        --html report.html
      trtspec verify half-precision.yaml --fail-on algorithmic
      trtspec verify engine_specs/tiny-llama.yaml --sampling 200 \\
        --temperature 0.8 --top-p 0.95
      trtspec verify engine_specs/tiny-llama.yaml \\
        --sampling 200 --url 127.0.0.1:8001
      trtspec verify my-spec.yaml --baseline previous.json \\
        --max-acceptance-drop 5% --min-acceptance-length 3
      trtspec verify engine_specs/smollm2-135m-cpu.yaml --url 127.0.0.1:8001 \\
        --stream
      trtspec verify my-llmapi-spec.yaml                  # LLM API, on a GPU
      trtspec verify my-llmapi-spec.yaml --llmapi double  # CPU conformance double
      trtspec verify my-spec.yaml --device cuda           # torch engines on a GPU
    """
    loaded, opts = for_run(spec, device, opts, llmapi_impl)
    html_file = opts.html_file
    bars = _Bars()
    try:
        outcome = run(loaded, loaded.output_dir(output), opts, progress=bars.update)
    finally:
        bars.close()
    emit(outcome, outcome.render, as_json=as_json, json_file=json_file)
    if junit_file:
        outcome.write_junit(junit_file)
    if html_file:
        from trtspec.machine import description as machine_description

        outcome.write_html(html_file, machine_description())
        console.info(f"wrote {html_file}")
    raise typer.Exit(EXIT_OK if outcome.passed else EXIT_DIVERGED)


class _Bars:
    """One transient progress bar per phase of the run (rich shows one live display at a
    time, and loading the engines shows its own)."""

    def __init__(self):
        self.phase, self.bar, self.task = None, None, None

    def update(self, phase: str, done: int, total: int) -> None:
        if phase != self.phase:
            self.close()
            self.phase, self.bar = phase, Progress(console=console.err, transient=True)
            self.bar.start()
            self.task = self.bar.add_task(phase, total=total)
        self.bar.update(self.task, completed=done)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
        self.phase, self.bar = None, None

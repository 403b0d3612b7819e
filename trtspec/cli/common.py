"""What every command shares: the options several commands take, each declared once as a typed
``Annotated`` alias (a command's own options sit at the top of its module), and one way to
report errors."""

from __future__ import annotations

import functools
import os
import traceback
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

from trtspec import console
from trtspec.device import check_name as check_device_name
from trtspec.errors import EXIT_INTERRUPTED, RequestError, TrtspecError
from trtspec.spec import EngineSpec, LoadedSpec, load_spec
from trtspec.speculative.requests import decide_num_draft_tokens
from trtspec.triton.client import URL_HELP

SpecArg = Annotated[Path, typer.Argument(help="Engine spec YAML (engine_specs/*.yaml).", show_default=False)]
AllowPickleOpt = Annotated[
    bool,
    typer.Option("--allow-pickle", help="Also load pickle weights (.bin/.pt). Pickle can run code: only for trusted sources."),
]
EnginesOpt = Annotated[
    Path | None,
    typer.Option("--engines", help="Engine folder (default: the spec's output_dir, else engines/<name>)."),
]
LlmapiOpt = Annotated[
    str,
    typer.Option(
        "--llmapi",
        help="trtllm.runtime llmapi: run the files with `tensorrt_llm` (GPU) or `double`, "
        "trtspec's CPU conformance double (checks the files and request path; not a TensorRT-LLM result).",
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the report as JSON on stdout instead of the table.")]
JsonFileOpt = Annotated[Path | None, typer.Option("--json-file", help="Also write the report as JSON to this file.")]
DeviceOpt = Annotated[
    str | None,
    typer.Option(
        "--device",
        help="Where the torch backend runs: cpu, cuda, cuda:N or auto (a GPU if this torch sees one); "
        "default: the spec's device (cpu unless set).",
        show_default=False,
    ),
]
PromptOpt = Annotated[
    list[str] | None, typer.Option("--prompt", "-p", help="Prompt (repeatable); default: the spec's verify prompts.")
]
NumDraftTokensOpt = Annotated[
    int | None,
    typer.Option(
        "--num-draft-tokens", "-k", help="Draft length k each request sends (default: the spec's default_draft_tokens)."
    ),
]
MaxTokensOpt = Annotated[int | None, typer.Option("--max-tokens", help="Tokens per prompt (default: verify.max_tokens).")]
UrlOpt = Annotated[str | None, typer.Option("--url", help=URL_HELP)]
PidFileOpt = Annotated[Path, typer.Option("--pid-file", help="The pid file of a server started with `trtspec serve --detach`.")]
MetricsPortOpt = Annotated[
    int | None,
    typer.Option("--metrics-port", min=1, max=65535, help="Triton's metrics port (default: serve.metrics_port, 8002)."),
]


def spec_and_engines(
    spec: Path, device: str | None, engines: Path | None, num_draft_tokens: int | None, url: str | None
) -> tuple[LoadedSpec, Path]:
    """What a command that runs a spec's built engines (verify, bench) loads: the spec with
    --device in place, and its engine folder (--engines). In process, -k is checked against
    the spec before any engine loads (a minute on a real pair); over --url the served
    deployment's bound is the one that holds, checked there."""
    loaded = with_device(load_spec(spec), device)
    if url is None:
        check_draft_tokens(loaded, num_draft_tokens)
    return loaded, loaded.output_dir(engines)


def check_draft_tokens(loaded: LoadedSpec, num_draft_tokens: int | None) -> None:
    """-k/--num-draft-tokens against the spec's speculative.max_draft_len (the bound the
    engines are built for), by the request rules' own decision; RequestError (exit 2) naming
    the range and the fix."""
    s = loaded.spec.speculative
    try:
        decide_num_draft_tokens(num_draft_tokens, s.default_draft_tokens, s.max_draft_len)
    except RequestError:
        raise RequestError(
            f"-k/--num-draft-tokens {num_draft_tokens} is outside 0..{s.max_draft_len} ({loaded.path.name}'s "
            f"speculative.max_draft_len); pass -k 0..{s.max_draft_len}, or rebuild with a larger max_draft_len"
        ) from None


def engines_dir(loaded: LoadedSpec, engines: Path | None, old_name: Path | None) -> Path:
    """The engine folder of --engines, or of its old name -o/--output (said once on stderr)."""
    if old_name is not None:
        if engines is not None:
            raise RequestError("give the engine folder once: --engines DIR (-o/--output is its old name)")
        console.err.print("-o/--output names the engine folder here under its old name; use --engines", markup=False)
    return loaded.output_dir(engines if engines is not None else old_name)


def with_device(loaded: LoadedSpec, device: str | None) -> LoadedSpec:
    """The spec with --device in place of its ``device`` (unchanged without --device);
    RequestError (exit 2) for a name that is not a device or a backend that takes none."""
    if device is None:
        return loaded
    try:
        name = check_device_name(device)
    except ValueError as e:
        raise RequestError(f"--device: {e}") from None
    if loaded.spec.backend != "torch":
        raise RequestError(
            f"--device applies to backend: torch; {loaded.path.name} is backend {loaded.spec.backend} "
            "(TensorRT-LLM picks its GPUs with gpu_device_ids): drop --device"
        )
    return spec_with(loaded, f"--device {name}", device=name)


def spec_with(loaded: LoadedSpec, flag: str, **values) -> LoadedSpec:
    """The spec with a flag's ``values`` in place, validated again by the spec's own rules (they
    hold for a flag as for the YAML); a refusal is RequestError naming ``flag``."""
    given = {k: getattr(loaded.spec, k) for k in loaded.spec.model_fields_set}
    try:
        spec = EngineSpec.model_validate({**given, **values})
    except ValidationError as e:
        reasons = "; ".join(str(err["msg"]).removeprefix("Value error, ") for err in e.errors())
        raise RequestError(f"{flag}: {reasons}") from None
    return LoadedSpec(spec=spec, path=loaded.path)


def handle_errors(fn):
    """Turn TrtspecError into `Error: <message>` on stderr and its exit code.

    TRTSPEC_DEBUG=1 prints the traceback as well.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except TrtspecError as e:
            if os.environ.get("TRTSPEC_DEBUG"):
                traceback.print_exc()
            console.err.print(f"[red]Error:[/red] {e}", markup=True)
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt:
            console.err.print("Interrupted.")
            raise typer.Exit(EXIT_INTERRUPTED) from None

    return wrapper

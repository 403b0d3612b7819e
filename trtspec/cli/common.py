"""What every command shares: option aliases and one way to report errors."""

from __future__ import annotations

import functools
import os
import traceback
from pathlib import Path
from typing import Annotated, TypeVar

import typer
from pydantic import BaseModel

from trtspec import console
from trtspec.device import check_name as check_device_name
from trtspec.errors import EXIT_INTERRUPTED, RequestError, TrtspecError
from trtspec.spec import LoadedSpec, load_spec

SpecArg = Annotated[Path, typer.Argument(help="Engine spec YAML (engine_specs/*.yaml).", show_default=False)]
OutputOpt = Annotated[
    Path | None,
    typer.Option("--output", "-o", help="Engine folder (default: the spec's output_dir, else engines/<name>)."),
]
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
    return loaded.model_copy(update={"spec": loaded.spec.model_copy(update={"device": name})})


M = TypeVar("M", bound=BaseModel)


def for_run(spec: Path, device: str | None, opts: M, llmapi_impl: str) -> tuple[LoadedSpec, M]:
    """What a command that runs a spec's pair starts from (verify, bench): the spec with
    --device applied, and the command's options with --llmapi in them."""
    return with_device(load_spec(spec), device), opts.model_copy(update={"llmapi_impl": llmapi_impl})


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

"""`trtspec build SPEC`: build one engine folder per role."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from trtspec.cli.common import AllowPickleOpt, DeviceOpt, JsonFileOpt, JsonOpt, SpecArg, handle_errors, with_device
from trtspec.cli.output import emit
from trtspec.engines import build as builder
from trtspec.spec import load_spec

Opt = typer.Option
OutputOpt = Annotated[
    Path | None, Opt("--output", "-o", help="Where to write the engines (default: the spec's output_dir, else engines/<name>).")
]
ForceOpt = Annotated[bool, Opt("--force", help="Rebuild even if the engines are up to date.")]
DryRunOpt = Annotated[bool, Opt("--dry-run", help="Print the plan; write nothing.")]


@handle_errors
def build(
    spec: SpecArg,
    output: OutputOpt = None,
    force: ForceOpt = False,
    dry_run: DryRunOpt = False,
    allow_pickle: AllowPickleOpt = False,
    device: DeviceOpt = None,
    as_json: JsonOpt = False,
    json_file: JsonFileOpt = None,
) -> None:
    """Build the engines of SPEC (target/ and draft/ under the output folder).

    Atomic: each engine is built in a temp folder and renamed into place. Re-running with
    the same spec and weights does nothing unless --force.

    Examples:
      trtspec build engine_specs/smollm2-135m-cpu.yaml
      trtspec build engine_specs/tiny-llama.yaml -o /tmp/engines --force
      trtspec build my-spec.yaml --device cuda    # refused at once without a GPU
    """
    loaded = with_device(load_spec(spec), device)
    out_dir = loaded.output_dir(output)
    if dry_run:
        plan = builder.dry_run(loaded, out_dir, force)
        emit(
            plan,
            lambda out: [out.print(line, markup=False, highlight=False) for line in plan.lines()],
            as_json=as_json,
            json_file=json_file,
        )
        return
    result = builder.build(loaded, out_dir, force=force, allow_pickle=allow_pickle)

    def human(out) -> None:
        if result.built:
            out.print(f"built {', '.join(result.built)} in {out_dir}")
        else:
            out.print(f"nothing to do: engines in {out_dir} are up to date")

    emit(result, human, as_json=as_json, json_file=json_file)

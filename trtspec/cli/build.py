"""`trtspec build SPEC`: build one engine folder per role."""

from __future__ import annotations

import typer

from trtspec import console
from trtspec.cli.common import AllowPickleOpt, OutputOpt, SpecArg, handle_errors
from trtspec.engines import build as builder
from trtspec.spec import load_spec


@handle_errors
def build(
    spec: SpecArg,
    output: OutputOpt = None,
    force: bool = typer.Option(False, "--force", help="Rebuild even if the engines are up to date."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan; write nothing."),
    allow_pickle: AllowPickleOpt = False,
) -> None:
    """Build the engines of SPEC (target/ and draft/ under the output folder).

    Atomic: each engine is built in a temp folder and renamed into place. Re-running with
    the same spec and weights does nothing unless --force.

    Examples:
      trtspec build engine_specs/smollm2-135m-cpu.yaml
      trtspec build engine_specs/tiny-llama.yaml -o /tmp/engines --force
    """
    loaded = load_spec(spec)
    out_dir = loaded.output_dir(output)
    if dry_run:
        if loaded.spec.backend != "torch":
            from trtspec.engines.trtllm.build import print_plan

            print_plan(loaded, out_dir, force)
            return
        console.out.print(f"plan for {loaded.spec.name} (backend torch) -> {out_dir}")
        for p in builder.plan(loaded, out_dir, force):
            action = "up to date unless the source weights changed" if p.action == "up to date?" else p.action
            console.out.print(f"  {p.role}: {p.source} as {p.dtype} -> {p.folder}  [{action}]", markup=False)
        console.out.print("dry run: nothing written")
        return
    result = builder.build(loaded, out_dir, force=force, allow_pickle=allow_pickle)
    if result.built:
        console.out.print(f"built {', '.join(result.built)} in {out_dir}")
    else:
        console.out.print(f"nothing to do: engines in {out_dir} are up to date")

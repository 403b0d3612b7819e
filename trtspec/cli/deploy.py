"""`trtspec deploy k8s SPEC --out DIR`: Kubernetes manifests for the spec's deployment."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from trtspec import console
from trtspec.cli.common import EnginesOpt, SpecArg, handle_errors
from trtspec.cli.options import declared
from trtspec.deploy.options import K8sOptions
from trtspec.deploy.output import deploy_k8s, dry_run_text
from trtspec.spec import load_spec

app = typer.Typer(help="Generate deployment artefacts from a spec.", no_args_is_help=True)


@app.command("k8s")
@handle_errors
@declared(K8sOptions)
def k8s(
    spec: SpecArg,
    options: K8sOptions,
    out: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="Folder for the manifests and kustomization.yaml (replaced whole with --force)."),
    ] = None,
    engines: EnginesOpt = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing --out folder.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the manifests; write nothing.")] = False,
) -> None:
    """Write Kubernetes manifests (kustomize-ready) that serve SPEC on Triton.

    Deployment (StatefulSet with --engines-from build), Service (HTTP, gRPC, metrics),
    probes on /v2/health/ready and /v2/health/live, HPA, PodDisruptionBudget, a NetworkPolicy
    (HTTP/gRPC from --clients-label pods, metrics from Prometheus), the spec as a ConfigMap; nvidia.com/gpu from the spec's GPU counts for trtllm specs. Every manifest is
    validated against the Kubernetes schemas of --kube-version before anything is written.

    Examples:
      trtspec deploy k8s engine_specs/smollm2-135m-cpu.yaml --out deploy/smollm2 \\
        && kubectl apply -k deploy/smollm2
      trtspec deploy k8s engine_specs/llama3.1-8b-instruct-trtllm.yaml --dry-run \\
        --max-replicas 8
      trtspec deploy k8s my-spec.yaml -o k8s/ --engines-from build \\
        --image registry/trtspec-cpu:0.1.0 --force
    """
    loaded = load_spec(spec)
    plan, files, written = deploy_k8s(loaded, options, out, force=force, dry_run=dry_run, engines_dir=loaded.output_dir(engines))
    summary = (
        f"{plan.workload} {plan.name}: {len(files)} files, valid for Kubernetes {options.kube_version}; "
        f"GPUs per pod {plan.gpus}; startup probe {plan.startup_seconds}s ({plan.startup_basis})"
    )
    if written is None:
        console.out.print(dry_run_text(files), end="", markup=False)
        console.err.print(f"dry run: {summary}; nothing written", markup=False)
        return
    console.err.print(summary, markup=False)
    console.out.print(f"wrote {written}; apply with: kubectl apply -k {written}", markup=False)

"""`trtspec deploy k8s SPEC --out DIR`: Kubernetes manifests for the spec's deployment."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from trtspec import console
from trtspec.cli.common import EnginesOpt, SpecArg, handle_errors
from trtspec.deploy.options import DEFAULT_KUBE_VERSION
from trtspec.deploy.output import deploy_k8s, dry_run_text, options_from
from trtspec.spec import load_spec

app = typer.Typer(help="Generate deployment artefacts from a spec.", no_args_is_help=True)


@app.command("k8s")
@handle_errors
def k8s(
    spec: SpecArg,
    out: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="Folder for the manifests and kustomization.yaml (replaced whole with --force)."),
    ] = None,
    kube_version: Annotated[
        str, typer.Option("--kube-version", help="Kubernetes version whose schemas the manifests must pass.")
    ] = DEFAULT_KUBE_VERSION,
    name: Annotated[str | None, typer.Option("--name", help="Object names (default: the spec name, DNS-safe).")] = None,
    namespace: Annotated[
        str | None, typer.Option("--namespace", "-n", help="Namespace set in kustomization.yaml (default: kubectl's).")
    ] = None,
    image: Annotated[
        str | None,
        typer.Option(
            "--image", help="Server image (default: trtspec-cpu:<version> or trtspec-trtllm:<version>, built from docker/)."
        ),
    ] = None,
    engines_from: Annotated[
        str,
        typer.Option(
            "--engines-from",
            help="pvc: a claim holding built engines | image: init container copies /engines from --engines-image | build: StatefulSet building in the pod.",
        ),
    ] = "pvc",
    pvc: Annotated[str | None, typer.Option("--pvc", help="Claim with the engines (default <name>-engines).")] = None,
    engines_image: Annotated[
        str | None, typer.Option("--engines-image", help="Image holding the built engines under /engines.")
    ] = None,
    storage_size: Annotated[str | None, typer.Option("--storage-size", help="Per-pod claim size in build mode (50Gi).")] = None,
    storage_class: Annotated[str | None, typer.Option("--storage-class", help="StorageClass of that claim.")] = None,
    min_replicas: Annotated[
        int | None, typer.Option("--min-replicas", help="Autoscaler floor (1); the replica count with --no-hpa.")
    ] = None,
    max_replicas: Annotated[int | None, typer.Option("--max-replicas", help="Autoscaler ceiling (4).")] = None,
    hpa: Annotated[
        bool, typer.Option("--hpa/--no-hpa", help="HorizontalPodAutoscaler on queue depth with a CPU fallback.")
    ] = True,
    queue_target: Annotated[
        int | None,
        typer.Option("--queue-target", help="Pending requests per pod to scale at (default: the spec's max_batch_size)."),
    ] = None,
    cpu_target: Annotated[int | None, typer.Option("--cpu-target", help="CPU utilisation % the fallback scales at (80).")] = None,
    service_monitor: Annotated[
        bool, typer.Option("--service-monitor", help="Also write a prometheus-operator ServiceMonitor.")
    ] = False,
    cpu: Annotated[str | None, typer.Option("--cpu", help="CPU request (torch 2, trtllm 4).")] = None,
    memory: Annotated[str | None, typer.Option("--memory", help="Memory request and limit (torch 8Gi, trtllm 32Gi).")] = None,
    shm_size: Annotated[
        str | None, typer.Option("--shm-size", help="In-memory /dev/shm for the Python backend and NCCL (1Gi).")
    ] = None,
    gpus_per_node: Annotated[
        int | None, typer.Option("--gpus-per-node", help="GPUs a node offers; a spec needing more is refused (8).")
    ] = None,
    startup_seconds: Annotated[
        int | None, typer.Option("--startup-seconds", help="Startup probe budget (default: sized from the engines).")
    ] = None,
    network_policy: Annotated[
        bool,
        typer.Option("--network-policy/--no-network-policy", help="NetworkPolicy: only the clients and Prometheus get in."),
    ] = True,
    clients_label: Annotated[
        str | None,
        typer.Option(
            "--clients-label", help="Pods that may call HTTP/gRPC (key=value; app.kubernetes.io/component=trtspec-front)."
        ),
    ] = None,
    clients_namespace: Annotated[
        str | None, typer.Option("--clients-namespace", help="Their namespace (default: the deployment's).")
    ] = None,
    metrics_label: Annotated[
        str | None,
        typer.Option("--metrics-label", help="Pods that may scrape metrics (key=value; app.kubernetes.io/name=prometheus)."),
    ] = None,
    metrics_namespace: Annotated[str | None, typer.Option("--metrics-namespace", help="Their namespace (monitoring).")] = None,
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
      trtspec deploy k8s engine_specs/smollm2-135m-cpu.yaml --out deploy/smollm2 && kubectl apply -k deploy/smollm2
      trtspec deploy k8s engine_specs/llama3.1-8b-instruct-trtllm.yaml --dry-run --max-replicas 8
      trtspec deploy k8s my-spec.yaml -o k8s/ --engines-from build --image registry/trtspec-cpu:0.1.0 --force
    """
    options = options_from(
        {
            "kube_version": kube_version,
            "name": name,
            "namespace": namespace,
            "image": image,
            "engines_from": engines_from,
            "pvc": pvc,
            "engines_image": engines_image,
            "storage_size": storage_size,
            "storage_class": storage_class,
            "min_replicas": min_replicas,
            "max_replicas": max_replicas,
            "hpa": hpa,
            "queue_target": queue_target,
            "cpu_target": cpu_target,
            "service_monitor": service_monitor,
            "cpu": cpu,
            "memory": memory,
            "shm_size": shm_size,
            "gpus_per_node": gpus_per_node,
            "startup_seconds": startup_seconds,
            "network_policy": network_policy,
            "clients_label": clients_label,
            "clients_namespace": clients_namespace,
            "metrics_label": metrics_label,
            "metrics_namespace": metrics_namespace,
        }
    )
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

"""`trtspec deploy k8s SPEC -o DIR`: Kubernetes manifests for the spec's deployment."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from trtspec import console
from trtspec.cli.common import EnginesOpt, SpecArg, handle_errors
from trtspec.cli.options import from_flags
from trtspec.deploy.options import K8sOptions
from trtspec.deploy.output import deploy_k8s, dry_run_text
from trtspec.spec import load_spec

app = typer.Typer(help="Generate deployment artefacts from a spec.", no_args_is_help=True)

Opt = typer.Option
OutputOpt = Annotated[
    Path | None, Opt("--output", "-o", help="Folder for the manifests and kustomization.yaml (replaced whole with --force).")
]
ForceOpt = Annotated[bool, Opt("--force", help="Replace an existing -o/--output folder.")]
DryRunOpt = Annotated[bool, Opt("--dry-run", help="Print the manifests; write nothing.")]
# How the deployment runs on the cluster: K8sOptions' fields, validated into it.
KubeVersionOpt = Annotated[str, Opt("--kube-version", help="Kubernetes version whose schemas the manifests must pass.")]
NameOpt = Annotated[str | None, Opt("--name", help="Object names (default: the spec name, DNS-safe).")]
NamespaceOpt = Annotated[str | None, Opt("--namespace", "-n", help="Namespace set in kustomization.yaml (default: kubectl's).")]
ImageOpt = Annotated[
    str | None,
    Opt("--image", help="Server image (default: trtspec-cpu or trtspec-trtllm, tagged with this version, built from docker/)."),
]
EnginesFromOpt = Annotated[
    str,
    Opt(
        "--engines-from",
        help="Where the engines come from (pvc: a claim holding built engines; image: an init container copies /engines from --engines-image; build: a StatefulSet building in the pod). One of: pvc, image, build.",
    ),
]
PvcOpt = Annotated[str | None, Opt("--pvc", help="Claim with the engines (default <name>-engines).")]
EnginesImageOpt = Annotated[str | None, Opt("--engines-image", help="Image holding the built engines under /engines.")]
StorageSizeOpt = Annotated[str, Opt("--storage-size", help="Per-pod claim size in build mode.")]
StorageClassOpt = Annotated[str | None, Opt("--storage-class", help="StorageClass of that claim.")]
HpaOpt = Annotated[bool, Opt("--hpa/--no-hpa", help="Autoscale on queue depth, with a CPU fallback (an HPA).")]
MinReplicasOpt = Annotated[int, Opt("--min-replicas", help="Autoscaler floor; the replica count with --no-hpa.")]
MaxReplicasOpt = Annotated[int, Opt("--max-replicas", help="Autoscaler ceiling.")]
QueueTargetOpt = Annotated[
    int | None, Opt("--queue-target", help="Pending requests per pod to scale at (default: the spec's max_batch_size).")
]
CpuTargetOpt = Annotated[int, Opt("--cpu-target", help="CPU utilisation % the fallback scales at.")]
ServiceMonitorOpt = Annotated[bool, Opt("--service-monitor", help="Also write a prometheus-operator ServiceMonitor.")]
CpuOpt = Annotated[str | None, Opt("--cpu", help="CPU request (default: torch 2, trtllm 4).")]
CpuLimitOpt = Annotated[
    str | None, Opt("--cpu-limit", help="CPU limit, >= the request; its whole cores set the thread count (default: the request).")
]
MemoryOpt = Annotated[str | None, Opt("--memory", help="Memory request and limit (default: torch 8Gi, trtllm 32Gi).")]
ShmSizeOpt = Annotated[str, Opt("--shm-size", help="In-memory /dev/shm for the Python backend and NCCL.")]
NetworkPolicyOpt = Annotated[
    bool, Opt("--network-policy/--no-network-policy", help="NetworkPolicy: only the clients and Prometheus get in.")
]
ClientsLabelOpt = Annotated[str, Opt("--clients-label", help="Pods that may call HTTP/gRPC (key=value).")]
ClientsNamespaceOpt = Annotated[str | None, Opt("--clients-namespace", help="Their namespace (default: the deployment's).")]
MetricsLabelOpt = Annotated[str, Opt("--metrics-label", help="Pods that may scrape metrics (key=value).")]
MetricsNamespaceOpt = Annotated[str, Opt("--metrics-namespace", help="Their namespace.")]
GpusPerNodeOpt = Annotated[int, Opt("--gpus-per-node", help="GPUs a node offers; a spec needing more is refused.")]
StartupSecondsOpt = Annotated[
    int | None, Opt("--startup-seconds", help="Startup probe budget (default: sized from the engines).")
]
RefreshScheduleOpt = Annotated[
    str | None,
    Opt(
        "--refresh-schedule",
        help="With serve.capture: when the refresh CronJob runs a round (cron, e.g. '0 3 * * *'; default every 6 hours).",
    ),
]
RefreshCpuOpt = Annotated[str, Opt("--refresh-cpu", help="CPU request and limit of the refresh job's pod.")]
RefreshMemoryOpt = Annotated[str, Opt("--refresh-memory", help="Memory request and limit of the refresh job's pod.")]
LoopSizeOpt = Annotated[
    str, Opt("--loop-size", help="With serve.capture: size of the ReadWriteMany claim the server and the job share.")
]

HELP = """Write Kubernetes manifests (kustomize-ready) that serve SPEC on Triton.

    Deployment (StatefulSet with --engines-from build), Service (HTTP, gRPC, metrics),
    probes on /v2/health/ready and /v2/health/live, HPA, PodDisruptionBudget, a NetworkPolicy
    (HTTP/gRPC from --clients-label pods, metrics from Prometheus), the spec as a ConfigMap; nvidia.com/gpu from the spec's GPU counts for trtllm specs.
    With serve.capture in the spec: a claim shared with a CronJob that runs one `trtspec refresh`
    round per --refresh-schedule (one replica only). Every manifest is
    validated against the Kubernetes schemas of --kube-version before anything is written.

    Examples:
      trtspec deploy k8s engine_specs/smollm2-135m-cpu.yaml -o deploy/smollm2 \\
        && kubectl apply -k deploy/smollm2
      trtspec deploy k8s engine_specs/llama3.1-8b-instruct-trtllm.yaml --dry-run \\
        --max-replicas 8
      trtspec deploy k8s my-spec.yaml -o k8s/ --engines-from build \\
        --image registry/trtspec-cpu:0.1.0 --force
"""


# An option that names a K8sOptions field defaults to the field's default, declared there once.
DEFAULTS = K8sOptions()


@app.command("k8s", help=HELP)
@handle_errors
def k8s(
    ctx: typer.Context,
    spec: SpecArg,
    kube_version: KubeVersionOpt = DEFAULTS.kube_version,
    name: NameOpt = DEFAULTS.name,
    namespace: NamespaceOpt = DEFAULTS.namespace,
    image: ImageOpt = DEFAULTS.image,
    engines_from: EnginesFromOpt = DEFAULTS.engines_from,
    pvc: PvcOpt = DEFAULTS.pvc,
    engines_image: EnginesImageOpt = DEFAULTS.engines_image,
    storage_size: StorageSizeOpt = DEFAULTS.storage_size,
    storage_class: StorageClassOpt = DEFAULTS.storage_class,
    hpa: HpaOpt = DEFAULTS.hpa,
    min_replicas: MinReplicasOpt = DEFAULTS.min_replicas,
    max_replicas: MaxReplicasOpt = DEFAULTS.max_replicas,
    queue_target: QueueTargetOpt = DEFAULTS.queue_target,
    cpu_target: CpuTargetOpt = DEFAULTS.cpu_target,
    service_monitor: ServiceMonitorOpt = DEFAULTS.service_monitor,
    cpu: CpuOpt = DEFAULTS.cpu,
    cpu_limit: CpuLimitOpt = DEFAULTS.cpu_limit,
    memory: MemoryOpt = DEFAULTS.memory,
    shm_size: ShmSizeOpt = DEFAULTS.shm_size,
    network_policy: NetworkPolicyOpt = DEFAULTS.network_policy,
    clients_label: ClientsLabelOpt = DEFAULTS.clients_label,
    clients_namespace: ClientsNamespaceOpt = DEFAULTS.clients_namespace,
    metrics_label: MetricsLabelOpt = DEFAULTS.metrics_label,
    metrics_namespace: MetricsNamespaceOpt = DEFAULTS.metrics_namespace,
    gpus_per_node: GpusPerNodeOpt = DEFAULTS.gpus_per_node,
    startup_seconds: StartupSecondsOpt = DEFAULTS.startup_seconds,
    refresh_schedule: RefreshScheduleOpt = DEFAULTS.refresh_schedule,
    refresh_cpu: RefreshCpuOpt = DEFAULTS.refresh_cpu,
    refresh_memory: RefreshMemoryOpt = DEFAULTS.refresh_memory,
    loop_size: LoopSizeOpt = DEFAULTS.loop_size,
    output: OutputOpt = None,
    engines: EnginesOpt = None,
    force: ForceOpt = False,
    dry_run: DryRunOpt = False,
) -> None:
    options = from_flags(K8sOptions, ctx)
    loaded = load_spec(spec)
    plan, files, written = deploy_k8s(
        loaded, options, output, force=force, dry_run=dry_run, engines_dir=loaded.output_dir(engines)
    )
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

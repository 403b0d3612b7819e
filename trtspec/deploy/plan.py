"""Every manifest of a spec's deployment, by file name: the server's (trtspec.deploy.k8s) and,
with serve.capture, the co-design loop's (trtspec.deploy.refresh_job). Bad input raises
TrtspecError (exit 2) before anything exists; trtspec.deploy.output renders, validates, parses
back and writes the plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from trtspec.deploy import k8s, loop, refresh_job
from trtspec.deploy.checks import check_build_sources, check_ports, object_name, pod_gpus, startup_budget
from trtspec.deploy.options import K8sOptions
from trtspec.spec import LoadedSpec


@dataclass(frozen=True)
class Plan:
    """Manifests by file name, plus the figures a user wants to see before applying them."""

    manifests: dict[str, dict]
    name: str
    workload: str  # Deployment | StatefulSet
    gpus: int
    startup_seconds: int
    startup_basis: str  # how startup_seconds was sized


def plan_manifests(loaded: LoadedSpec, options: K8sOptions, engines_dir: Path | None = None) -> Plan:
    """Every manifest for ``loaded`` under ``options``; TrtspecError (exit 2) on bad input.

    ``engines_dir`` (a local engine folder, if any) only sizes the startup probe.
    """
    from trtspec.deploy.schemas import check_version

    check_version(options.kube_version)
    check_ports(loaded)
    name = object_name(loaded, options)
    gpus = pod_gpus(loaded, options)
    if options.engines_from == "build":
        check_build_sources(loaded)
    schedule = loop.schedule(loaded, options)
    startup_s, basis = startup_budget(loaded, options, engines_dir)
    work = k8s.workload(name, loaded, options, gpus, startup_s)
    manifests = {
        "configmap.yaml": k8s.config_map(name, loaded),
        f"{work['kind'].lower()}.yaml": work,
        "service.yaml": k8s.service(name, loaded),
    }
    if work["kind"] == "StatefulSet":
        manifests["service-headless.yaml"] = k8s.service(name, loaded, headless=True)
    if options.hpa:
        manifests["hpa.yaml"] = k8s.autoscaler(name, loaded, options, work["kind"])
    manifests["pdb.yaml"] = k8s.disruption_budget(name)
    if options.network_policy:
        manifests["networkpolicy.yaml"] = k8s.network_policy(name, loaded, options)
    if options.service_monitor:
        manifests["servicemonitor.yaml"] = k8s.service_monitor(name)
    if schedule is not None:
        manifests |= _loop_manifests(name, loaded, options, schedule)
    manifests["kustomization.yaml"] = k8s.kustomization(list(manifests), options.namespace)
    return Plan(manifests, name, work["kind"], gpus, startup_s, basis)


def _loop_manifests(name: str, loaded: LoadedSpec, options: K8sOptions, schedule: str) -> dict[str, dict]:
    """serve.capture's loop (trtspec.deploy.loop): the shared claim and the refresh CronJob."""
    manifests = {
        "pvc-loop.yaml": refresh_job.loop_claim(name, options),
        "cronjob-refresh.yaml": refresh_job.cron_job(name, loaded, options, schedule),
    }
    if options.network_policy:
        manifests["networkpolicy-refresh.yaml"] = refresh_job.job_network_policy(name, loaded, options)
    return manifests

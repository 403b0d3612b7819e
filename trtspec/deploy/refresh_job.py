"""The co-design loop's objects (trtspec.deploy.loop says what they share and when they exist):
the claim the server pods and the job share, the CronJob that runs one `trtspec refresh` round
per schedule, and the NetworkPolicy that lets its pod reach only the server and the Hub.

One round: `trtspec refresh SPEC --url <service>:<grpc> --every 1h --rounds 1` (one round, no
wait) trains the live head on the captured requests at the lowest CPU priority (`nice -n 19`,
one thread, a CPU and memory limit of its own), and swaps the new head in through the control
file only when it is better and `verify --url` stays identical. No admin key: the swap goes
through the control file on the shared volume, not Triton's model control.
"""

from __future__ import annotations

from trtspec.deploy import loop
from trtspec.deploy.k8s import (
    ENGINES_DIR,
    SCRATCH_DIR,
    SPEC_DIR,
    _env,
    _labels,
    _meta,
    _security_context,
    dns_egress,
    hub_egress,
    init_containers,
    pod_security_context,
)
from trtspec.deploy.options import K8sOptions, default_image, thread_count
from trtspec.machine import THREADS_ENV
from trtspec.spec import LoadedSpec

ROUND_DEADLINE_S = 4 * 3600  # a round stuck longer is ended; the next schedule starts afresh
NICE = "19"
CLAIM_DIR = "/models/engines-claim"  # pvc mode: the served claim, read-only, copied from


def loop_claim(name: str, options: K8sOptions) -> dict:
    # ReadWriteMany: the server pod and the job's pod write it, on whichever nodes they run.
    spec: dict = {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": options.loop_size}}}
    if options.storage_class:
        spec["storageClassName"] = options.storage_class
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": _meta(name, "-loop"), "spec": spec}


def refresh_command(name: str, loaded: LoadedSpec) -> list[str]:
    url = f"{name}:{loaded.spec.serve.grpc_port}"  # the Service, in the job's own namespace
    return [
        *("nice", "-n", NICE, "trtspec", "refresh", f"{SPEC_DIR}/spec.yaml", "--url", url),
        *("--every", "1h", "--rounds", "1", "--engines", ENGINES_DIR, "--refresh-dir", loop.REFRESH_DIR),
    ]


def refresh_container(name: str, loaded: LoadedSpec, options: K8sOptions) -> dict:
    threads = str(thread_count(options.refresh_cpu))
    secret = {"secretKeyRef": {"name": options.hf_token_secret, "key": "HF_TOKEN", "optional": True}}
    limits = {"cpu": options.refresh_cpu, "memory": options.refresh_memory}
    return {
        "name": "refresh",
        "image": options.image or default_image(loaded.spec.backend),
        "imagePullPolicy": options.image_pull_policy,
        "command": refresh_command(name, loaded),
        "env": _env(
            {"name": THREADS_ENV, "value": threads},
            {"name": "OMP_NUM_THREADS", "value": threads},
            {"name": "HF_HOME", "value": loop.HF_CACHE},
            {"name": "HF_TOKEN", "valueFrom": secret},
            loop.control_env(),
        ),
        "resources": {"requests": dict(limits), "limits": limits},
        "securityContext": _security_context(),
        "volumeMounts": [
            {"name": "spec", "mountPath": SPEC_DIR, "readOnly": True},
            {"name": "engines", "mountPath": ENGINES_DIR},  # a copy: distill writes beside the head
            loop.mount(),
            {"name": "scratch", "mountPath": SCRATCH_DIR},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }


def _job_volumes(name: str, options: K8sOptions) -> list[dict]:
    claim = []
    if options.engines_from == "pvc":
        engines = {"persistentVolumeClaim": {"claimName": options.pvc or f"{name}-engines", "readOnly": True}}
        claim = [{"name": "engines-claim", **engines}]
    return [
        {"name": "spec", "configMap": {"name": f"{name}-spec"}},
        *claim,
        # The engines, copied in (build mode is refused: loop._check_loop): the first round
        # continues the served head engine, and distill keeps its data beside the head it continues.
        {"name": "engines", "emptyDir": {"sizeLimit": options.storage_size}},
        loop.volume(name),
        # distill --from-capture's own target engine and training data live here for a round.
        {"name": "scratch", "emptyDir": {"sizeLimit": options.storage_size}},
        {"name": "tmp", "emptyDir": {"sizeLimit": options.tmp_size}},
    ]


def _claim_copy(loaded: LoadedSpec, options: K8sOptions) -> dict:
    """pvc mode: the claim's engines (mounted read-only) copied into the job's own volume."""
    limits = {"cpu": "500m", "memory": "256Mi"}
    return {
        "name": "engines",
        "image": options.image or default_image(loaded.spec.backend),
        "imagePullPolicy": options.image_pull_policy,
        "command": ["cp", "-R", f"{CLAIM_DIR}/.", f"{ENGINES_DIR}/"],
        "resources": {"requests": dict(limits), "limits": limits},
        "securityContext": _security_context(),
        "volumeMounts": [
            {"name": "engines-claim", "mountPath": CLAIM_DIR, "readOnly": True},
            {"name": "engines", "mountPath": ENGINES_DIR},
        ],
    }


def refresh_pod(name: str, loaded: LoadedSpec, options: K8sOptions) -> dict:
    pod: dict = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "restartPolicy": "Never",  # a failed round waits for the next schedule
        "securityContext": pod_security_context(),
        "containers": [refresh_container(name, loaded, options)],
        "volumes": _job_volumes(name, options),
    }
    pod["initContainers"] = init_containers(name, loaded, options, 0) or [_claim_copy(loaded, options)]
    return {"metadata": {"labels": loop.job_labels(name)}, "spec": pod}


def cron_job(name: str, loaded: LoadedSpec, options: K8sOptions, schedule: str) -> dict:
    job = {
        "backoffLimit": 0,
        "activeDeadlineSeconds": ROUND_DEADLINE_S,
        "template": refresh_pod(name, loaded, options),
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "CronJob",
        "metadata": _meta(name, "-refresh"),
        "spec": {
            "schedule": schedule,
            "concurrencyPolicy": "Forbid",  # one round at a time: two would race on the control file
            "startingDeadlineSeconds": 600,
            "successfulJobsHistoryLimit": 3,
            "failedJobsHistoryLimit": 3,
            "jobTemplate": {"metadata": {"labels": loop.job_labels(name)}, "spec": job},
        },
    }


def job_network_policy(name: str, loaded: LoadedSpec, options: K8sOptions) -> dict:
    """The job's pod: nothing gets in; out, DNS, the server pods' gRPC (refresh, verify) and
    metrics (the swap's check) ports, and HTTPS on public addresses (the target from the Hub)."""
    s = loaded.spec.serve
    server = [{"podSelector": {"matchLabels": _labels(name)}}]
    ports = [{"protocol": "TCP", "port": p} for p in (s.grpc_port, s.metrics_port)]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(name, "-refresh"),
        "spec": {
            "podSelector": {"matchLabels": loop.job_labels(name)},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [],
            "egress": [dns_egress(), {"to": server, "ports": ports}, hub_egress()],
        },
    }

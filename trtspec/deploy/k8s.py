"""Kubernetes manifests for a spec's Triton deployment: typed spec + options in, dicts out.

One pod runs `trtspec serve` on the spec (mounted from a ConfigMap): it writes the model
repository into a scratch volume against the engines volume, starts tritonserver and forwards
SIGTERM. Everything the manifests say about the server comes from the spec: ports
(serve.*_port), GPUs (tp_size x pp_size and gpu_device_ids of every TensorRT-LLM engine), the
endpoint models the autoscaler watches, and the batch size its queue target defaults to.

trtspec.deploy.plan assembles them into {file name: manifest}; trtspec.deploy.output renders,
validates, parses back and writes them.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

from trtspec import __version__
from trtspec.deploy import loop
from trtspec.deploy.options import DEFAULT_MEMORY, K8sOptions, default_image, thread_count
from trtspec.layout import BLS_MODEL, BLS_STREAMING_MODEL
from trtspec.machine import THREADS_ENV
from trtspec.spec import LoadedSpec
from trtspec.triton.server.process import ADMIN_KEY_ENV, ADMIN_KEY_FILE_ENV

# Paths inside the pod.
SPEC_DIR = "/etc/trtspec"
ENGINES_DIR = "/models/engines"
SCRATCH_DIR = "/var/lib/trtspec"  # model repository, trtspec cache
REPO_DIR = f"{SCRATCH_DIR}/model_repo"
HF_HOME = "/models/hf-cache"  # build mode: checkpoints downloaded beside the engines
ADMIN_KEY_DIR = "/etc/trtspec-admin"  # the admin-key Secret, mounted read-only
ADMIN_KEY_FILE = f"{ADMIN_KEY_DIR}/key"
RUN_AS = 1000  # the user both images (docker/*.Dockerfile) create and switch to

HEALTH_READY = "/v2/health/ready"
HEALTH_LIVE = "/v2/health/live"
METRICS_PATH = "/metrics"
# The load the autoscaler reads: the scheduler's gauges (triton/backend/metrics.py), per model
# and instance. Triton's own nv_inference_pending_request_count stays 0 for these endpoints:
# their execute() hands each request to the scheduler and returns at once.
QUEUE_METRIC = "trtspec_queue_depth"  # requests held, not started yet
ACTIVE_METRIC = "trtspec_active_sequences"  # sequences in the decoding loop
ACTIVE_SHARE = 0.8  # aim at 80% of the pod's batch places busy
STARTUP_PERIOD_S = 10
GPU_RESOURCE = "nvidia.com/gpu"
COMPONENT = "app.kubernetes.io/component"


# --------------------------------------------------------------------------------------------
# Builders: one function per object
# --------------------------------------------------------------------------------------------


def _labels(name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "trtspec", "app.kubernetes.io/instance": name}


def _meta(instance: str, suffix: str = "", **extra) -> dict:
    labels = {**_labels(instance), "app.kubernetes.io/version": __version__}
    return {"name": instance + suffix, "labels": labels, **extra}


def _scrape_annotations(port: int) -> dict[str, str]:
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(port), "prometheus.io/path": METRICS_PATH}


def config_map(name: str, loaded: LoadedSpec) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(name, "-spec"),
        "data": {"spec.yaml": loop.spec_text(loaded)},
    }


def _security_context() -> dict:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "privileged": False,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


def pod_security_context() -> dict:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS,
        "runAsGroup": RUN_AS,
        "fsGroup": RUN_AS,  # volumes (claims included) writable by the pod's group
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _resources(options: K8sOptions, backend: str, gpus: int) -> dict:
    # A CPU limit equal to the request by default: the pod gets exactly the cores it asked for,
    # and its thread pools are sized to them (_thread_env), so the quota does not throttle them.
    memory = options.memory or DEFAULT_MEMORY[backend]
    requests = {"cpu": options.cpu_request(backend), "memory": memory}
    limits = {"cpu": options.cpu_ceiling(backend), "memory": memory}
    if gpus:
        requests[GPU_RESOURCE] = str(gpus)
        limits[GPU_RESOURCE] = str(gpus)
    return {"requests": requests, "limits": limits}


def _http_probe(path: str, period: int, failures: int, timeout: int = 5) -> dict:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failures,
    }


def server_container(name: str, loaded: LoadedSpec, options: K8sOptions, gpus: int, startup_s: int) -> dict:
    s = loaded.spec.serve
    return {
        "name": "triton",
        "image": options.image or default_image(loaded.spec.backend),
        "imagePullPolicy": options.image_pull_policy,
        # 0.0.0.0 inside the pod: kubelet probes, the Service and port-forward all reach it;
        # the Service is ClusterIP, nothing is exposed outside the cluster by default.
        "command": [
            "trtspec",
            "serve",
            f"{SPEC_DIR}/spec.yaml",
            "--host",
            "0.0.0.0",
            "--engines",
            ENGINES_DIR,
            "--repo",
            REPO_DIR,
            "--timeout",
            str(startup_s),
            "--log-file",
            "-",  # Triton's log on the container's stdout: `kubectl logs`, no file to grow
        ],
        "ports": [
            {"name": "http", "containerPort": s.http_port, "protocol": "TCP"},
            {"name": "grpc", "containerPort": s.grpc_port, "protocol": "TCP"},
            {"name": "metrics", "containerPort": s.metrics_port, "protocol": "TCP"},
        ],
        "env": _env(
            *_thread_env(options, loaded.spec.backend), {"name": ADMIN_KEY_FILE_ENV, "value": ADMIN_KEY_FILE}, *_loop_env(loaded)
        ),
        "resources": _resources(options, loaded.spec.backend, gpus),
        "startupProbe": _http_probe(HEALTH_READY, STARTUP_PERIOD_S, math.ceil(startup_s / STARTUP_PERIOD_S)),
        "readinessProbe": _http_probe(HEALTH_READY, 5, 3),
        "livenessProbe": _http_probe(HEALTH_LIVE, 10, 3),
        "securityContext": _security_context(),
        "volumeMounts": [
            {"name": "spec", "mountPath": SPEC_DIR, "readOnly": True},
            _engines_mount(options),
            {"name": "scratch", "mountPath": SCRATCH_DIR},
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "admin-key", "mountPath": ADMIN_KEY_DIR, "readOnly": True},
            *([loop.mount()] if loop.enabled(loaded) else []),
        ],
    }


def _loop_env(loaded: LoadedSpec) -> list[dict]:
    """With capture on: the head control file on the volume the refresh job writes it on."""
    return [loop.control_env()] if loop.enabled(loaded) else []


def _engines_mount(options: K8sOptions) -> dict:
    # build mode: the claim holds engines/ and hf-cache/ side by side, mounted at /models.
    path = str(Path(ENGINES_DIR).parent) if options.engines_from == "build" else ENGINES_DIR
    return {"name": "engines", "mountPath": path, "readOnly": True}


def _env(*extra: dict) -> list[dict]:
    return [
        {"name": "HOME", "value": "/tmp"},  # the root filesystem is read-only
        {"name": "TRTSPEC_CACHE", "value": f"{SCRATCH_DIR}/cache"},
        {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        *extra,
    ]


def _thread_env(options: K8sOptions, backend: str) -> list[dict]:
    """Kernel threads = the CPU limit's whole cores (at least 1): OpenMP would otherwise size its
    pool to the node's cores, and the quota would throttle every thread past the limit."""
    n = str(thread_count(options.cpu_ceiling(backend)))
    return [{"name": THREADS_ENV, "value": n}, {"name": "OMP_NUM_THREADS", "value": n}]


def _admin_key_volume(name: str, options: K8sOptions) -> dict:
    """The key that opens Triton's restricted admin APIs (logging, trace, shared memory, model
    repository): the optional Secret's TRTSPEC_ADMIN_KEY as a file readable by the pod's group
    only (no environment variable: the value never shows in the pod's environment); without
    the Secret, serve picks a random key nobody knows."""
    secret = options.admin_key_secret or f"{name}-triton-admin"
    items = [{"key": ADMIN_KEY_ENV, "path": Path(ADMIN_KEY_FILE).name}]
    return {"name": "admin-key", "secret": {"secretName": secret, "optional": True, "defaultMode": 0o440, "items": items}}


def init_containers(name: str, loaded: LoadedSpec, options: K8sOptions, gpus: int) -> list[dict]:
    mounts = [{"name": "engines", "mountPath": ENGINES_DIR}]
    if options.engines_from == "image":
        return [
            {
                "name": "engines",
                "image": options.engines_image,
                "imagePullPolicy": options.image_pull_policy,
                "command": ["sh", "-c", f"cp -R /engines/. {ENGINES_DIR}/"],
                "resources": {"requests": {"cpu": "500m", "memory": "256Mi"}, "limits": {"cpu": "500m", "memory": "256Mi"}},
                "securityContext": _security_context(),
                "volumeMounts": mounts,
            }
        ]
    if options.engines_from == "build":
        # `trtspec build` is a no-op when the engines on the claim are up to date, so only
        # the first start of each pod (or a changed spec) pays for the build.
        secret = {"secretKeyRef": {"name": options.hf_token_secret, "key": "HF_TOKEN", "optional": True}}
        return [
            {
                "name": "build",
                "image": options.image or default_image(loaded.spec.backend),
                "imagePullPolicy": options.image_pull_policy,
                "command": ["trtspec", "build", f"{SPEC_DIR}/spec.yaml", "--output", ENGINES_DIR],
                "env": _env(
                    *_thread_env(options, loaded.spec.backend),
                    {"name": "HF_HOME", "value": HF_HOME},
                    {"name": "HF_TOKEN", "valueFrom": secret},
                ),
                "resources": _resources(options, loaded.spec.backend, gpus),
                "securityContext": _security_context(),
                "volumeMounts": [
                    {"name": "spec", "mountPath": SPEC_DIR, "readOnly": True},
                    {"name": "engines", "mountPath": str(Path(ENGINES_DIR).parent)},  # engines/ + hf-cache/
                    {"name": "tmp", "mountPath": "/tmp"},
                    {"name": "scratch", "mountPath": SCRATCH_DIR},
                ],
            }
        ]
    return []


def pod_template(name: str, loaded: LoadedSpec, options: K8sOptions, gpus: int, startup_s: int) -> dict:
    s = loaded.spec.serve
    spec_sha = hashlib.sha256(loaded.path.read_bytes()).hexdigest()[:16]
    volumes = [
        {"name": "spec", "configMap": {"name": f"{name}-spec"}},
        # Bounded: a pod that fills one is evicted instead of filling the node's disk.
        {"name": "scratch", "emptyDir": {"sizeLimit": options.scratch_size}},
        {"name": "tmp", "emptyDir": {"sizeLimit": options.tmp_size}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": options.shm_size}},
        _admin_key_volume(name, options),
    ]
    if options.engines_from == "pvc":
        claim = options.pvc or f"{name}-engines"
        volumes.append({"name": "engines", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
    elif options.engines_from == "image":
        volumes.append({"name": "engines", "emptyDir": {"sizeLimit": options.storage_size}})
    # build: the StatefulSet's volumeClaimTemplate supplies "engines"
    if loop.enabled(loaded):
        volumes.append(loop.volume(name))
    pod: dict = {
        "automountServiceAccountToken": False,  # the server never talks to the API server
        "enableServiceLinks": False,
        # serve forwards SIGTERM; Triton drains in-flight requests (--exit-timeout-secs 30).
        "terminationGracePeriodSeconds": 60,
        "securityContext": pod_security_context(),
        "containers": [server_container(name, loaded, options, gpus, startup_s)],
        "volumes": volumes,
    }
    inits = init_containers(name, loaded, options, gpus)
    if inits:
        pod["initContainers"] = inits
    if gpus:
        pod["tolerations"] = [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
    return {
        "metadata": {
            "labels": _labels(name),
            # A changed spec changes the template, so `kubectl apply` rolls the pods.
            "annotations": {**_scrape_annotations(s.metrics_port), "trtspec.dev/spec-sha256": spec_sha},
        },
        "spec": pod,
    }


def workload(name: str, loaded: LoadedSpec, options: K8sOptions, gpus: int, startup_s: int) -> dict:
    template = pod_template(name, loaded, options, gpus, startup_s)
    spec: dict = {"selector": {"matchLabels": _labels(name)}, "template": template}
    if not options.hpa:  # with an HPA, a replica count here would fight it on every apply
        spec["replicas"] = options.min_replicas
    if options.engines_from != "build":
        spec["strategy"] = {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
        return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(name), "spec": spec}
    claim: dict = {
        "metadata": {"name": "engines"},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": options.storage_size}}},
    }
    if options.storage_class:
        claim["spec"]["storageClassName"] = options.storage_class
    spec |= {
        "serviceName": f"{name}-headless",
        "podManagementPolicy": "Parallel",  # replicas build and load independently
        "volumeClaimTemplates": [claim],
    }
    return {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": _meta(name), "spec": spec}


def service(name: str, loaded: LoadedSpec, headless: bool = False) -> dict:
    s = loaded.spec.serve
    spec: dict = {
        "type": "ClusterIP",
        "selector": _labels(name),
        "ports": [
            {"name": "http", "port": s.http_port, "targetPort": "http", "protocol": "TCP", "appProtocol": "http"},
            {"name": "grpc", "port": s.grpc_port, "targetPort": "grpc", "protocol": "TCP", "appProtocol": "grpc"},
            {"name": "metrics", "port": s.metrics_port, "targetPort": "metrics", "protocol": "TCP", "appProtocol": "http"},
        ],
    }
    meta = _meta(name, "-headless" if headless else "")
    # The ServiceMonitor selects this label, so the headless twin is not scraped twice.
    # Prometheus annotations sit on the pods only, for the same reason.
    meta["labels"][COMPONENT] = "triton-headless" if headless else "triton"
    if headless:  # the StatefulSet's governing service: stable per-pod DNS names
        spec["clusterIP"] = "None"
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta, "spec": spec}


def endpoint_models(loaded: LoadedSpec) -> list[str]:
    """The speculative endpoints clients queue on (the control endpoint is for verify)."""
    return [BLS_MODEL, BLS_STREAMING_MODEL] if loaded.spec.serve.streaming else [BLS_MODEL]


def autoscaler(name: str, loaded: LoadedSpec, options: K8sOptions, kind: str) -> dict:
    """Scale on the scheduler's load at the speculative endpoints, CPU as the fallback signal.

    Two custom metrics, each summed over the endpoint models and instances of a pod and
    averaged over pods: queued requests (aiming at ``queue_target``, default one full batch
    waiting) and sequences decoding (aiming at 80% of the pod's batch places). The HPA takes
    the largest replica count any metric asks for; while the custom metrics are unavailable
    (no adapter yet) it still scales up on CPU alone.
    """
    s = loaded.spec.serve
    batch = loaded.spec.limits("target").max_batch_size
    places = batch * s.instance_count * len(endpoint_models(loaded))
    queue_target = options.queue_target or batch
    active_target = options.active_target or max(1, math.floor(ACTIVE_SHARE * batch * s.instance_count))
    active_target = min(active_target, places)

    def pods_metric(metric: str, target: int) -> dict:
        selector = {"matchExpressions": [{"key": "model", "operator": "In", "values": endpoint_models(loaded)}]}
        return {
            "type": "Pods",
            "pods": {
                "metric": {"name": metric, "selector": selector},
                "target": {"type": "AverageValue", "averageValue": str(target)},
            },
        }

    cpu = {
        "type": "Resource",
        "resource": {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": options.cpu_target}},
    }
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": _meta(name),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": kind, "name": name},
            "minReplicas": options.min_replicas,
            "maxReplicas": options.max_replicas,
            "metrics": [pods_metric(QUEUE_METRIC, queue_target), pods_metric(ACTIVE_METRIC, active_target), cpu],
            # Engines take minutes to load: scale up at once, scale down slowly.
            "behavior": {
                "scaleUp": {"stabilizationWindowSeconds": 0, "policies": [{"type": "Pods", "value": 2, "periodSeconds": 60}]},
                "scaleDown": {
                    "stabilizationWindowSeconds": 600,
                    "policies": [{"type": "Pods", "value": 1, "periodSeconds": 300}],
                },
            },
        },
    }


def disruption_budget(name: str) -> dict:
    # maxUnavailable, not minAvailable: with one replica minAvailable 1 would block every drain.
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(name),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": _labels(name)}},
    }


def service_monitor(name: str) -> dict:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": _meta(name),
        "spec": {
            "selector": {"matchLabels": {**_labels(name), COMPONENT: "triton"}},
            "endpoints": [{"port": "metrics", "path": METRICS_PATH, "interval": "15s"}],
        },
    }


def _peers(label: str, namespace: str | None) -> dict:
    """A NetworkPolicy peer: pods with ``label`` ("key=value") in ``namespace`` (None: the
    policy's own namespace)."""
    key, _, value = label.partition("=")
    peer: dict = {"podSelector": {"matchLabels": {key: value}}}
    if namespace is not None:
        peer["namespaceSelector"] = {"matchLabels": {"kubernetes.io/metadata.name": namespace}}
    return peer


# Egress a pod may still make: name lookups (the cluster's DNS), and in build mode HTTPS to
# the model hub on public addresses (its addresses change; private ranges stay closed, so
# the build step reaches no service inside the cluster).
DNS_PORT = 53
HTTPS_PORT = 443
PRIVATE_RANGES = ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "169.254.0.0/16", "100.64.0.0/10")


def dns_egress() -> dict:
    return {"ports": [{"protocol": p, "port": DNS_PORT} for p in ("UDP", "TCP")]}


def hub_egress() -> dict:
    public = {"ipBlock": {"cidr": "0.0.0.0/0", "except": list(PRIVATE_RANGES)}}
    return {"to": [public], "ports": [{"protocol": "TCP", "port": HTTPS_PORT}]}


def _egress(options: K8sOptions) -> list[dict]:
    return [dns_egress(), hub_egress()] if options.engines_from == "build" else [dns_egress()]


def network_policy(name: str, loaded: LoadedSpec, options: K8sOptions) -> dict:
    """Ingress to the server pods: HTTP and gRPC from the clients only (the OpenAI front or the
    pods the options name), metrics from Prometheus only; nothing else, engine models included
    (every model Triton serves is reachable on the same ports). Kubelet probes come from the
    pod's node, which a NetworkPolicy always admits. Egress: DNS only, plus HTTPS to public
    addresses where the pod builds its engines from the Hub (_egress)."""
    s = loaded.spec.serve
    tcp = lambda port: {"protocol": "TCP", "port": port}  # noqa: E731
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(name),
        "spec": {
            "podSelector": {"matchLabels": _labels(name)},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [
                {
                    "from": [_peers(options.clients_label, options.clients_namespace)],
                    "ports": [tcp(s.http_port), tcp(s.grpc_port)],
                },
                {"from": [_peers(options.metrics_label, options.metrics_namespace)], "ports": [tcp(s.metrics_port)]},
                *_refresh_ingress(name, loaded),
            ],
            "egress": _egress(options),
        },
    }


def _refresh_ingress(name: str, loaded: LoadedSpec) -> list[dict]:
    """With capture on, the refresh job's pod reaches gRPC (refresh, verify) and the metrics
    port (the swap's check); it carries the refresh job's labels, not the server's."""
    if not loop.enabled(loaded):
        return []
    s = loaded.spec.serve
    job = {"podSelector": {"matchLabels": loop.job_labels(name)}}
    return [{"from": [job], "ports": [{"protocol": "TCP", "port": p} for p in (s.grpc_port, s.metrics_port)]}]


def kustomization(files: list[str], namespace: str | None) -> dict:
    doc: dict = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization"}
    if namespace:
        doc["namespace"] = namespace
    doc["resources"] = files
    return doc

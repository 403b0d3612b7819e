"""What `trtspec deploy k8s` needs beyond the engine spec: typed, checked before anything is built.

The spec says what to serve (ports, engines, GPUs per engine); these options say how the
cluster runs it (image, where the engines come from, scaling bounds, resources).
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from trtspec import __version__
from trtspec.deploy.cron import check_schedule

DEFAULT_KUBE_VERSION = "1.33"
# Kubernetes quantities as users write them ("500m", "2", "8Gi", "1.5G").
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|Ki|Mi|Gi|Ti|Pi)?$")
# CPU as users write it: cores ("2", "1.5") or millicores ("500m").
_CPU = re.compile(r"^([0-9]+(\.[0-9]+)?)(m?)$")
# DNS-1035 label: what a Service name must be (the strictest name among our objects).
_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
# A label key (optional DNS prefix + "/" + name) and value, as Kubernetes accepts them.
_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
# Suffix room inside the 63-character limit ("-headless").
MAX_NAME_LEN = 50

# Host resources per pod. trtllm: the server process holds tokenizers, MPI ranks and
# engine files in host memory while it deserializes them onto the GPUs.
DEFAULT_CPU = {"torch": "2", "trtllm": "4"}
DEFAULT_MEMORY = {"torch": "8Gi", "trtllm": "32Gi"}

EnginesFrom = Literal["pvc", "image", "build"]


def default_image(backend: str) -> str:
    """The image `docker build` makes from this checkout (see docker/*.Dockerfile)."""
    return f"trtspec-{'cpu' if backend == 'torch' else 'trtllm'}:{__version__}"


def k8s_name(spec_name: str) -> str | None:
    """The spec name as a Kubernetes object name, or None when it cannot be one."""
    name = re.sub(r"[._]+", "-", spec_name.lower()).strip("-")
    return name if _DNS_LABEL.match(name) and len(name) <= MAX_NAME_LEN else None


def _quantity(value: str) -> str:
    if not _QUANTITY.match(value):
        raise ValueError(f"'{value}' is not a Kubernetes quantity (examples: 500m, 2, 8Gi)")
    return value


def cpu_cores(value: str) -> float:
    """A CPU quantity ("2", "1.5", "500m") in cores; ValueError for anything else."""
    match = _CPU.match(value)
    if not match:
        raise ValueError(f"'{value}' is not a CPU quantity: cores (2, 1.5) or millicores (500m)")
    return float(match.group(1)) / (1000 if match.group(3) else 1)


def thread_count(cpu_limit: str) -> int:
    """Threads a pod limited to ``cpu_limit`` runs its kernels with: its whole cores, at least 1
    (a pool wider than the quota spends its periods throttled)."""
    return max(1, int(cpu_cores(cpu_limit)))


Quantity = Annotated[str, Field(min_length=1)]


class K8sOptions(BaseModel):
    """How the spec's deployment runs on a cluster. Unknown keys are rejected."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kube_version: str = DEFAULT_KUBE_VERSION
    name: str | None = None
    namespace: str | None = None
    image: str | None = None
    image_pull_policy: Literal["IfNotPresent", "Always", "Never"] = "IfNotPresent"
    # pvc: a claim already holding `trtspec build` output (ReadOnlyMany, or one replica)
    # image: an init container copies /engines out of an image built with the engines in it
    # build: a StatefulSet whose init container builds into a per-pod volume (Hub sources)
    engines_from: EnginesFrom = "pvc"
    pvc: str | None = None
    engines_image: str | None = None
    storage_size: Quantity = "50Gi"
    storage_class: str | None = None
    hf_token_secret: str = "hf-token"  # optional Secret with key HF_TOKEN (build mode)
    hpa: bool = True
    min_replicas: Annotated[int, Field(ge=1, le=1000)] = 1
    max_replicas: Annotated[int, Field(ge=1, le=1000)] = 4
    queue_target: Annotated[int | None, Field(ge=1)] = None
    # Decoding sequences per pod it aims at; default: 80% of max_batch_size x instance_count.
    active_target: Annotated[int, Field(ge=1)] | None = None
    cpu_target: Annotated[int, Field(ge=1, le=100)] = 80
    service_monitor: bool = False
    cpu: Quantity | None = None
    cpu_limit: Quantity | None = None
    memory: Quantity | None = None
    shm_size: Quantity = "1Gi"
    scratch_size: Quantity = "4Gi"  # emptyDir: model repository, trtspec cache
    tmp_size: Quantity = "1Gi"  # emptyDir: /tmp (HOME)
    # Secret (key TRTSPEC_ADMIN_KEY) opening Triton's admin APIs, mounted as a file; default
    # <name>-triton-admin
    admin_key_secret: str | None = None
    # NetworkPolicy: only pods labelled clients_label ("key=value"; default: trtspec's OpenAI
    # front) in clients_namespace (default: the deployment's own) reach HTTP and gRPC; only
    # pods labelled metrics_label in metrics_namespace reach the metrics port.
    network_policy: bool = True
    clients_label: str = "app.kubernetes.io/component=trtspec-front"
    clients_namespace: str | None = None
    metrics_label: str = "app.kubernetes.io/name=prometheus"
    metrics_namespace: str = "monitoring"
    gpus_per_node: Annotated[int, Field(ge=1, le=64)] = 8
    startup_seconds: Annotated[int | None, Field(ge=10, le=86400)] = None
    # The co-design loop (a spec with serve.capture only): the refresh CronJob's schedule
    # (cron; default every six hours), its pod's resources, the claim the server and it share.
    refresh_schedule: str | None = None
    refresh_cpu: Quantity = "1"
    refresh_memory: Quantity = "8Gi"
    loop_size: Quantity = "20Gi"

    @field_validator("memory", "shm_size", "storage_size", "scratch_size", "tmp_size", "refresh_memory", "loop_size")
    @classmethod
    def _is_quantity(cls, v: str | None) -> str | None:
        return v if v is None else _quantity(v)

    @field_validator("refresh_schedule")
    @classmethod
    def _is_schedule(cls, v: str | None) -> str | None:
        return v if v is None else check_schedule(v)

    @field_validator("cpu", "cpu_limit", "refresh_cpu")
    @classmethod
    def _is_cpu(cls, v: str | None) -> str | None:
        if v is not None and cpu_cores(v) <= 0:
            raise ValueError(f"'{v}' is no CPU at all; give at least 1m")
        return v

    @field_validator("clients_label", "metrics_label")
    @classmethod
    def _is_label(cls, v: str) -> str:
        key, eq, value = v.partition("=")
        if not eq or not _LABEL_KEY.match(key) or not _LABEL_VALUE.match(value):
            raise ValueError(f"'{v}' is not a pod label selector; write it as key=value, e.g. app.kubernetes.io/name=my-front")
        return v

    @field_validator("name", "pvc", "hf_token_secret", "namespace", "admin_key_secret", "clients_namespace", "metrics_namespace")
    @classmethod
    def _is_dns_label(cls, v: str | None) -> str | None:
        if v is not None and (not _DNS_LABEL.match(v) or len(v) > MAX_NAME_LEN):
            raise ValueError(
                f"'{v}' is not a usable Kubernetes name: lowercase letters, digits and '-', "
                f"starting with a letter, at most {MAX_NAME_LEN} characters"
            )
        return v

    @model_validator(mode="after")
    def _consistent(self) -> K8sOptions:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) exceeds max_replicas ({self.max_replicas})")
        if self.engines_from == "image" and not self.engines_image:
            raise ValueError("engines_from image needs engines_image: an image holding /engines")
        if self.engines_from != "image" and self.engines_image:
            raise ValueError("engines_image only applies to engines_from image")
        if self.engines_from != "pvc" and self.pvc:
            raise ValueError("pvc only applies to engines_from pvc")
        if self.cpu_limit is not None and self.cpu is not None and cpu_cores(self.cpu_limit) < cpu_cores(self.cpu):
            raise ValueError(f"cpu_limit ({self.cpu_limit}) is below the cpu request ({self.cpu}); Kubernetes refuses that")
        return self

    def cpu_request(self, backend: str) -> str:
        """--cpu, else the backend's default (never above --cpu-limit: a limit alone lowers it)."""
        default = DEFAULT_CPU[backend]
        if self.cpu is not None:
            return self.cpu
        if self.cpu_limit is not None and cpu_cores(self.cpu_limit) < cpu_cores(default):
            return self.cpu_limit
        return default

    def cpu_ceiling(self, backend: str) -> str:
        """The pod's CPU limit: --cpu-limit, else the request (a guaranteed, unshared share)."""
        return self.cpu_limit or self.cpu_request(backend)

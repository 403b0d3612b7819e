"""What a cluster would refuse later (or run badly), refused before any manifest exists (exit 2)."""

from __future__ import annotations

import math
from pathlib import Path

from trtspec.deploy.options import K8sOptions, k8s_name
from trtspec.errors import TrtspecError
from trtspec.spec import LoadedSpec

# Startup budget: fixed cost (process start, repository write, MPI ranks and KV-cache
# allocation for TensorRT-LLM) plus reading the engines at a conservative disk rate.
_STARTUP_BASE_S = {"torch": 120, "trtllm": 600}
_STARTUP_NO_ENGINES_S = {"torch": 300, "trtllm": 1800}  # engines not on this machine to weigh
_LOAD_BYTES_PER_S = 100 * 2**20


def object_name(loaded: LoadedSpec, options: K8sOptions) -> str:
    if options.name is not None:
        return options.name
    name = k8s_name(loaded.spec.name)
    if name is None:
        raise TrtspecError(
            f"spec name '{loaded.spec.name}' cannot be a Kubernetes object name (it must start "
            "with a letter; at most 50 characters); pass one with --name"
        )
    return name


def pod_gpus(loaded: LoadedSpec, options: K8sOptions) -> int:
    """GPUs the pod requests: every device id the trtllm engines use; 0 for torch.

    A pod sees its GPUs renumbered 0..N-1, so the spec's device ids must be exactly that range
    (a gap would leave a GPU requested and idle), and N must fit on one node.
    """
    spec = loaded.spec
    if spec.backend != "trtllm":
        return 0
    from trtspec.layout import ENGINE_KINDS
    from trtspec.triton.repository.trtllm_models import gpu_ids

    used = sorted({g for kind in ENGINE_KINDS for g in gpu_ids(spec, kind)})
    if used != list(range(len(used))):
        raise TrtspecError(
            f"the spec's engines use GPU ids {used}, but a pod sees its GPUs as 0..N-1; "
            f"renumber gpu_device_ids to 0..{len(used) - 1} (or drop them for the defaults)"
        )
    if len(used) > options.gpus_per_node:
        raise TrtspecError(
            f"the spec needs {len(used)} GPUs in one pod (tp_size x pp_size of its engines) but a "
            f"node has {options.gpus_per_node} (--gpus-per-node); lower tp_size/pp_size or use "
            "larger nodes"
        )
    return len(used)


def check_ports(loaded: LoadedSpec) -> list[int]:
    """The spec's three ports, refused when they need root to bind (ServeSpec already
    refuses ports that collide, when the spec is loaded)."""
    s = loaded.spec.serve
    ports = {"http_port": s.http_port, "grpc_port": s.grpc_port, "metrics_port": s.metrics_port}
    low = {k: v for k, v in ports.items() if v < 1024}
    if low:
        raise TrtspecError(
            f"{loaded.path}: serve {', '.join(f'{k} {v}' for k, v in low.items())}: ports below "
            "1024 need root, and the pod runs as a non-root user with no capabilities; use "
            "ports >= 1024 in the spec (the Service may still be exposed on any port)"
        )
    return list(ports.values())


def check_build_sources(loaded: LoadedSpec) -> None:
    """In-pod builds can only fetch Hub checkpoints: local paths do not exist in the pod."""
    local = [role for role, m in loaded.spec.models().items() if m.path is not None]
    if local:
        raise TrtspecError(
            f"engines_from build downloads checkpoints in the pod, but {', '.join(local)} "
            "come(s) from a local path; use `repo` + `revision` in the spec, or build here and "
            "use --engines-from pvc or image"
        )


def startup_budget(loaded: LoadedSpec, options: K8sOptions, engines_dir: Path | None) -> tuple[int, str]:
    """Seconds the startup probe allows, and how they were sized."""
    if options.startup_seconds is not None:
        return options.startup_seconds, "--startup-seconds"
    backend = loaded.spec.backend
    if engines_dir is not None and engines_dir.is_dir():
        size = sum(p.stat().st_size for p in engines_dir.rglob("*") if p.is_file())
        if size:
            secs = _STARTUP_BASE_S[backend] + math.ceil(size / _LOAD_BYTES_PER_S)
            return secs, f"{size / 2**30:.2f} GiB of engines in {engines_dir} at 100 MiB/s + {_STARTUP_BASE_S[backend]} s"
    return _STARTUP_NO_ENGINES_S[backend], f"no engines at {engines_dir} to weigh: {backend} default"

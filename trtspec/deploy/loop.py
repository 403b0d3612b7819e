"""What the continuous co-design loop adds to a Kubernetes deployment whose spec has serve.capture.

The server pods and the refresh CronJob's pod share one volume (a ReadWriteMany claim,
``<name>-loop``) mounted at LOOP_DIR in both: the capture folder the server writes and the job
trains on, the head control file (TRTSPEC_HEAD_CONTROL) the job writes and every server
instance watches, and the refresh folder where the job builds the heads the server then loads
by the path the control file names. The spec in the ConfigMap has serve.capture.dir set to the
capture folder on that volume (a relative dir would resolve under the read-only ConfigMap).

The loop is refused, by name, where it cannot work: more than one server replica (refresh
checks the swap on the metrics port it reaches: one pod of several), engines built per pod
(the job cannot see them), a target not from the Hub (distill --from-capture builds its own
target engine from the checkpoint, and the job's pod has only what it downloads).
"""

from __future__ import annotations

import yaml

from trtspec.deploy.cron import check_schedule
from trtspec.deploy.options import K8sOptions
from trtspec.errors import TrtspecError
from trtspec.spec import LoadedSpec
from trtspec.triton.backend.head_swap import CONTROL_ENV, CONTROL_FILE

LOOP_DIR = "/var/lib/trtspec-loop"  # the shared claim, in the server pods and the job's
CAPTURE_DIR = f"{LOOP_DIR}/capture"
CONTROL_PATH = f"{LOOP_DIR}/{CONTROL_FILE}"
REFRESH_DIR = f"{LOOP_DIR}/refresh"  # heads trained and built by the job, loaded by the server
HF_CACHE = f"{LOOP_DIR}/hf-cache"  # the target checkpoint distill --from-capture reads
DEFAULT_SCHEDULE = "0 */6 * * *"  # a round every six hours, on the hour


def enabled(loaded: LoadedSpec) -> bool:
    return loaded.spec.serve.capture is not None


def schedule(loaded: LoadedSpec, options: K8sOptions) -> str | None:
    """The refresh CronJob's schedule (None: no loop); TrtspecError where the loop cannot work."""
    if not enabled(loaded):
        if options.refresh_schedule is not None:
            raise TrtspecError(
                "--refresh-schedule runs the refresh loop on what serve.capture keeps, and the spec has no "
                "serve.capture; add serve.capture to the spec (docs/capture.md) or drop --refresh-schedule"
            )
        return None
    _check_loop(loaded, options)
    return check_schedule(options.refresh_schedule or DEFAULT_SCHEDULE)


def _check_loop(loaded: LoadedSpec, options: K8sOptions) -> None:
    if options.min_replicas > 1 or (options.hpa and options.max_replicas > 1):
        raise TrtspecError(
            "serve.capture's refresh job swaps the head of one server: refresh checks the swap on the metrics "
            "port it reaches, one pod of several behind the Service; deploy one replica (--no-hpa "
            "--min-replicas 1), or remove serve.capture to scale out"
        )
    if options.engines_from == "build":
        raise TrtspecError(
            "serve.capture's refresh job reads the served engines, which --engines-from build keeps on each "
            "pod's own claim; use --engines-from pvc or image"
        )
    if loaded.spec.target.repo is None:
        raise TrtspecError(
            "serve.capture's refresh job runs distill --from-capture, which builds its own target engine "
            "from the checkpoint, and the job's pod has only what it downloads; give the target as "
            "repo + revision in the spec, or remove serve.capture"
        )


def job_labels(name: str) -> dict[str, str]:
    """The refresh job's pod labels; not the server's: the Service and the server's
    NetworkPolicy select those, and must not select the job."""
    return {"app.kubernetes.io/name": "trtspec-refresh", "app.kubernetes.io/instance": name}


def spec_text(loaded: LoadedSpec) -> str:
    """The spec as the pods read it: with capture on, serve.capture.dir on the shared volume."""
    text = loaded.path.read_text(encoding="utf-8")
    if not enabled(loaded):
        return text
    data = yaml.safe_load(text)
    data["serve"]["capture"]["dir"] = CAPTURE_DIR
    return yaml.safe_dump(data, sort_keys=False)


def volume(name: str) -> dict:
    return {"name": "loop", "persistentVolumeClaim": {"claimName": f"{name}-loop"}}


def mount() -> dict:
    return {"name": "loop", "mountPath": LOOP_DIR}


def control_env() -> dict:
    return {"name": CONTROL_ENV, "value": CONTROL_PATH}

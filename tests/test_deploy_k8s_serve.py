"""The pod's own command, run here: what the manifests promise is what `trtspec serve` does.

The generated container command is run with the pod's paths mapped to temp folders and the
bind address to 127.0.0.1; the probes' paths and ports, and the metric the autoscaler scales
on, are then read from the manifests and checked against the real tritonserver.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import processes_mentioning, write_spec

from trtspec.deploy.k8s import ENGINES_DIR, QUEUE_METRIC, REPO_DIR, SCRATCH_DIR, SPEC_DIR, plan_manifests
from trtspec.deploy.options import K8sOptions
from trtspec.errors import ServerError
from trtspec.layout import BLS_MODEL as BLS
from trtspec.spec import load_spec
from trtspec.triton.server.install import find_tritonserver
from trtspec.triton.server.process import free_ports

pytest.importorskip("kubernetes_validate", reason="needs the deploy extra: pip install 'trtspec[deploy]'")
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _get(url: str) -> tuple[int, str]:
    try:
        with _NO_PROXY.open(url, timeout=2) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""
    except OSError:
        return 0, ""


@pytest.mark.server
def test_pod_command_serves_the_probes_and_exports_the_hpa_metric(tmp_path, tiny_ckpts):
    try:
        find_tritonserver()
    except ServerError as err:
        pytest.skip(str(err))
    from trtspec.engines.build import build

    http, grpc, metrics = free_ports(3)
    spec = write_spec(tmp_path, tiny_ckpts, **{"serve.http_port": http, "serve.grpc_port": grpc, "serve.metrics_port": metrics})
    loaded = load_spec(spec)
    build(loaded, loaded.output_dir())
    plan = plan_manifests(loaded, K8sOptions(startup_seconds=300))
    pod = plan.manifests["deployment.yaml"]["spec"]["template"]
    c = pod["spec"]["containers"][0]

    scratch = tmp_path / "scratch"
    mapping = {
        f"{SPEC_DIR}/spec.yaml": str(spec),
        "0.0.0.0": "127.0.0.1",
        ENGINES_DIR: str(loaded.output_dir()),
        REPO_DIR: str(scratch / "model_repo"),
        f"{SCRATCH_DIR}/tritonserver.log": str(scratch / "tritonserver.log"),
    }
    assert set(mapping) <= set(c["command"]), "the pod command changed: update this mapping"
    argv = [mapping.get(a, a) for a in c["command"]]
    argv[0] = str(Path(sys.executable).with_name("trtspec"))
    env = {**os.environ, **{e["name"]: e["value"] for e in c["env"]}}
    env["TRTSPEC_CACHE"], env["HOME"] = os.environ["TRTSPEC_CACHE"], str(tmp_path)

    def url(probe: str) -> str:
        get = c[probe]["httpGet"]
        port = next(p["containerPort"] for p in c["ports"] if p["name"] == get["port"])
        return f"http://127.0.0.1:{port}{get['path']}"

    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        startup = c["startupProbe"]
        deadline = time.monotonic() + startup["periodSeconds"] * startup["failureThreshold"]
        while _get(url("startupProbe"))[0] != 200:
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "not ready within the startup probe's budget"
            time.sleep(0.5)
        assert _get(url("readinessProbe"))[0] == 200
        assert _get(url("livenessProbe"))[0] == 200

        annotations = pod["metadata"]["annotations"]
        status, text = _get(f"http://127.0.0.1:{annotations['prometheus.io/port']}{annotations['prometheus.io/path']}")
        assert status == 200
        selector = plan.manifests["hpa.yaml"]["spec"]["metrics"][0]["pods"]["metric"]
        assert selector["name"] == QUEUE_METRIC
        for model in selector["selector"]["matchExpressions"][0]["values"]:  # both endpoints
            assert any(line.startswith(f'{QUEUE_METRIC}{{model="{model}"') for line in text.splitlines()), (model, text[:2000])

        # the other series the README says to watch
        for name in (
            "nv_inference_request_success",
            "nv_inference_request_failure",
            "nv_inference_queue_duration_us",
            "nv_inference_compute_infer_duration_us",
        ):
            assert any(line.startswith(f'{name}{{model="{BLS}"') for line in text.splitlines()), name

        # Kubernetes stops a pod with SIGTERM: serve must stop the server and every stub in time.
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(pod["spec"]["terminationGracePeriodSeconds"]) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert processes_mentioning(str(scratch)) == []

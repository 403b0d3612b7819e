"""The pod's own command, run here: what the manifests promise is what `trtspec serve` does.

The generated container command is run with the pod's paths mapped to temp folders and the
bind address to 127.0.0.1; the probes' paths and ports, and the metrics the autoscaler scales
on, are then read from the manifests and checked against the real tritonserver: saturated with
more requests than its batch holds, the server's /metrics must show the load the HPA reads.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from conftest import processes_mentioning, write_spec

from trtspec.deploy.k8s import ACTIVE_METRIC, ADMIN_KEY_FILE, ENGINES_DIR, QUEUE_METRIC, REPO_DIR, SPEC_DIR
from trtspec.deploy.options import K8sOptions
from trtspec.deploy.plan import plan_manifests
from trtspec.errors import ServerError
from trtspec.layout import BLS_MODEL as BLS
from trtspec.spec import load_spec
from trtspec.triton.server.install import find_tritonserver
from trtspec.triton.server.process import free_ports

pytest.importorskip("kubernetes_validate", reason="needs the deploy extra: pip install 'trtspec[deploy]'")
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _get(url: str, headers: dict | None = None) -> tuple[int, str]:
    try:
        with _NO_PROXY.open(urllib.request.Request(url, headers=headers or {}), timeout=2) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""
    except OSError:
        return 0, ""


def _gauge(text: str, name: str, models: list[str]) -> float:
    """A gauge summed over the series of ``models`` (every instance), as the HPA's adapter sums it per pod."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"{name}{{(.*)}} (\S+)$", line)
        if m and re.search(r'model="([^"]+)"', m.group(1)).group(1) in models:
            total += float(m.group(2))
    return total


def _saturate(grpc_url: str, n: int, tokens: int) -> list:
    """``n`` unary requests at once to the speculative endpoint, each made to run ``tokens``
    tokens (min_tokens bans EOS until then); returns the threads."""
    import tritonclient.grpc as grpcclient

    def one(i: int) -> None:
        client = grpcclient.InferenceServerClient(grpc_url)
        inputs = []
        for name, arr in (
            ("text_input", np.array([[f"prompt {i}".encode()]], dtype=np.object_)),
            ("max_tokens", np.array([[tokens]], dtype=np.int32)),
            ("min_tokens", np.array([[tokens]], dtype=np.int32)),
        ):
            t = grpcclient.InferInput(name, list(arr.shape), "BYTES" if arr.dtype == np.object_ else "INT32")
            t.set_data_from_numpy(arr)
            inputs.append(t)
        client.infer(BLS, inputs, client_timeout=300)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return threads


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
    }
    assert set(mapping) <= set(c["command"]), "the pod command changed: update this mapping"
    argv = [mapping.get(a, a) for a in c["command"]]
    argv[0] = str(Path(sys.executable).with_name("trtspec"))
    admin_key = "test-admin-key"  # what the optional Secret the manifest names would hold
    (tmp_path / "admin-key").write_text(admin_key)  # mounted at ADMIN_KEY_FILE in the pod
    env = {**os.environ, **{e["name"]: e["value"] for e in c["env"]}}
    assert env["TRTSPEC_ADMIN_KEY_FILE"] == ADMIN_KEY_FILE
    env["TRTSPEC_ADMIN_KEY_FILE"] = str(tmp_path / "admin-key")
    env.pop("TRTSPEC_ADMIN_KEY", None)
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
        queue, active = (m["pods"] for m in plan.manifests["hpa.yaml"]["spec"]["metrics"][:2])
        assert (queue["metric"]["name"], active["metric"]["name"]) == (QUEUE_METRIC, ACTIVE_METRIC)
        models = queue["metric"]["selector"]["matchExpressions"][0]["values"]
        for name in (QUEUE_METRIC, ACTIVE_METRIC):
            for model in models:  # both endpoints
                assert any(line.startswith(name + "{") and f'model="{model}"' in line for line in text.splitlines()), (
                    name,
                    model,
                )

        # Saturate: three batches' worth of long requests. The HPA's metrics must show a full
        # batch decoding and the rest queued; Triton's pending count never sees them.
        metrics_url = f"http://127.0.0.1:{annotations['prometheus.io/port']}{annotations['prometheus.io/path']}"
        batch = loaded.spec.build.max_batch_size
        threads = _saturate(f"127.0.0.1:{grpc}", 3 * batch, 200)
        names = (QUEUE_METRIC, ACTIVE_METRIC, "nv_inference_pending_request_count")
        seen = {name: 0.0 for name in names}
        queued = None  # the last scrape while a batch's worth waited in the scheduler
        while any(t.is_alive() for t in threads):
            page = _get(metrics_url)[1]
            now = {name: _gauge(page, name, models) for name in names}
            seen = {name: max(seen[name], now[name]) for name in names}
            if now[QUEUE_METRIC] >= batch:
                queued = now
            time.sleep(0.05)
        assert seen[ACTIVE_METRIC] == batch, seen  # a full batch decoding
        assert seen[QUEUE_METRIC] >= batch, seen  # the rest waiting
        # Why the HPA cannot use Triton's count: execute() takes each request at once, so it counts
        # only the requests caught between arrival and execute() (the burst's first moments, up to
        # all of them on a fast machine), never the scheduler's queue, which holds them for the
        # rest of the run.
        assert queued["nv_inference_pending_request_count"] < queued[QUEUE_METRIC], queued
        assert float(active["target"]["averageValue"]) < seen[ACTIVE_METRIC]  # so the HPA scales up
        assert float(queue["target"]["averageValue"]) <= seen[QUEUE_METRIC]
        idle = _get(metrics_url)[1]
        assert _gauge(idle, QUEUE_METRIC, models) == 0 and _gauge(idle, ACTIVE_METRIC, models) == 0

        # Triton's admin APIs answer only with the key; inference and health stay open.
        logging_url = f"http://127.0.0.1:{http}/v2/logging"
        assert _get(logging_url)[0] == 403
        assert _get(logging_url, {"triton-admin-key": "wrong"})[0] == 403
        assert _get(logging_url, {"triton-admin-key": admin_key})[0] == 200
        assert _get(f"http://127.0.0.1:{http}/v2/trace/setting")[0] == 403
        assert _get(f"http://127.0.0.1:{http}/v2/systemsharedmemory/status")[0] == 403
        # ... which no process's command line shows (/proc/PID/cmdline is world-readable)
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            with contextlib.suppress(OSError):
                assert admin_key.encode() not in cmdline.read_bytes(), cmdline

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
        # Triton's own log went to the container's stdout (kubectl logs), not a file.
        out = proc.stdout.read().decode(errors="replace")
        assert "Started GRPCInferenceService" in out, out[-2000:]
        assert not list(scratch.rglob("*.log"))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert processes_mentioning(str(scratch)) == []

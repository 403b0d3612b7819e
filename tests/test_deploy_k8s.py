"""`trtspec deploy k8s`: manifests follow the spec, pass the Kubernetes schemas, write atomically.

Schema checks use kubernetes-validate's strict schemas (unknown fields are errors) for the
default version and the oldest and newest ones installed. A mutated manifest must fail them,
so the validation cannot silently pass everything.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from conftest import ROOT
from typer.testing import CliRunner

from trtspec.cli.app import app
from trtspec.cli.options import validated
from trtspec.deploy import schemas
from trtspec.deploy.cron import check_schedule
from trtspec.deploy.k8s import (
    ACTIVE_METRIC,
    ENGINES_DIR,
    GPU_RESOURCE,
    HEALTH_LIVE,
    HEALTH_READY,
    QUEUE_METRIC,
    RUN_AS,
)
from trtspec.deploy.options import DEFAULT_KUBE_VERSION, K8sOptions
from trtspec.deploy.output import NO_SCHEMA, rendered_files
from trtspec.deploy.plan import plan_manifests
from trtspec.errors import TrtspecError
from trtspec.layout import BLS_MODEL as BLS
from trtspec.layout import BLS_STREAMING_MODEL as BLS_STREAMING
from trtspec.spec import load_spec

pytest.importorskip("kubernetes_validate", reason="needs the deploy extra: pip install 'trtspec[deploy]'")
runner = CliRunner()
SHIPPED = sorted((ROOT / "engine_specs").glob("*.yaml"))
HUB_PAIR = {
    "target": {"repo": "org/target", "revision": "0123456789abcdef", "dtype": "bfloat16"},
    "draft": {"repo": "org/draft", "revision": "0123456789abcdef", "dtype": "bfloat16"},
}


def spec_file(tmp_path: Path, backend: str = "trtllm", name: str = "pair", **sections) -> Path:
    """A spec with Hub sources (nothing is downloaded: deploy never reads checkpoints)."""
    data = {"name": name, "backend": backend, **copy.deepcopy(HUB_PAIR)}
    for key, value in sections.items():
        if key in ("target", "draft"):
            data[key].update(value)
        else:
            data[key] = value
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def plan(path: Path, **options):
    return plan_manifests(load_spec(path), K8sOptions(**options))


def container(p) -> dict:
    return p.manifests[f"{p.workload.lower()}.yaml"]["spec"]["template"]["spec"]["containers"][0]


def named_port(c: dict, name: str) -> int:
    return next(p["containerPort"] for p in c["ports"] if p["name"] == name)


# --- every manifest validates ----------------------------------------------------------------


def _versions() -> list[str]:
    known = schemas.supported_versions()
    return sorted({known[0], DEFAULT_KUBE_VERSION, known[-1]})


MODES = [
    {},
    {"engines_from": "image", "engines_image": "registry/engines:1"},
    {"engines_from": "build", "service_monitor": True},
    {"hpa": False, "min_replicas": 3, "clients_label": "team=chat", "clients_namespace": "apps"},
]


@pytest.mark.parametrize("version", _versions())
@pytest.mark.parametrize("mode", MODES, ids=["pvc", "image", "build", "no-hpa"])
@pytest.mark.parametrize("backend", ["torch", "trtllm"])
def test_every_manifest_passes_the_kubernetes_schemas(tmp_path, backend, mode, version):
    p = plan(spec_file(tmp_path, backend), kube_version=version, **mode)
    checked = 0
    for m in p.manifests.values():
        if m["kind"] in NO_SCHEMA:
            continue
        schemas.validate(m, version)
        checked += 1
    assert checked == len(p.manifests) - 1 - mode.get("service_monitor", False)  # all but those two kinds
    rendered_files(p, version)  # the writer's own path: validates and parses back


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_shipped_specs_render_valid_manifests(path):
    p = plan_manifests(load_spec(path), K8sOptions())
    files = rendered_files(p, DEFAULT_KUBE_VERSION)
    assert {yaml.safe_load(t)["kind"] for t in files.values()} >= {
        "Deployment",
        "Service",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
        "ConfigMap",
    }


@pytest.mark.parametrize(
    "mutate, message",
    [
        (
            lambda d: d["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"].update(pth="/x"),
            "'pth' was unexpected",
        ),
        (
            lambda d: d["spec"]["template"]["spec"]["containers"][0]["ports"][0].update(containerPort="8000"),
            "is not of type 'integer'",
        ),
        (lambda d: d["spec"].pop("selector"), "'selector' is a required property"),
    ],
)
def test_the_validator_rejects_a_broken_manifest(tmp_path, mutate, message):
    d = copy.deepcopy(plan(spec_file(tmp_path, "torch")).manifests["deployment.yaml"])
    mutate(d)
    with pytest.raises(schemas.ManifestInvalid, match=message):
        schemas.validate(d, DEFAULT_KUBE_VERSION)


@pytest.mark.parametrize("version", ["1.12", "2.0", "latest", "1.99"])
def test_unknown_kubernetes_version_is_refused(tmp_path, version):
    with pytest.raises(TrtspecError, match=f"unknown Kubernetes version '{version}'"):
        plan(spec_file(tmp_path, "torch"), kube_version=version)


# --- probes, ports and scraping follow the spec -------------------------------------------------


def test_probes_and_ports_follow_the_spec(tmp_path):
    serve = {"http_port": 9100, "grpc_port": 9101, "metrics_port": 9102, "streaming": False}
    p = plan(spec_file(tmp_path, "torch", serve=serve), startup_seconds=95)
    c = container(p)
    assert [(x["name"], x["containerPort"]) for x in c["ports"]] == [("http", 9100), ("grpc", 9101), ("metrics", 9102)]
    for probe, path in [("readinessProbe", HEALTH_READY), ("livenessProbe", HEALTH_LIVE), ("startupProbe", HEALTH_READY)]:
        get = c[probe]["httpGet"]
        assert (get["path"], named_port(c, get["port"])) == (path, 9100)
    startup = c["startupProbe"]
    assert (
        startup["periodSeconds"] * startup["failureThreshold"]
        >= 95
        > startup["periodSeconds"] * (startup["failureThreshold"] - 1)
    )
    svc = p.manifests["service.yaml"]["spec"]
    assert [(x["name"], x["port"], named_port(c, x["targetPort"])) for x in svc["ports"]] == [
        ("http", 9100, 9100),
        ("grpc", 9101, 9101),
        ("metrics", 9102, 9102),
    ]
    annotations = p.manifests["deployment.yaml"]["spec"]["template"]["metadata"]["annotations"]
    assert (annotations["prometheus.io/port"], annotations["prometheus.io/path"]) == ("9102", "/metrics")
    # serve gets the spec from the ConfigMap and waits as long as the startup probe allows
    assert c["command"][:3] == ["trtspec", "serve", "/etc/trtspec/spec.yaml"]
    assert c["command"][c["command"].index("--timeout") + 1] == "95"
    assert p.manifests["configmap.yaml"]["data"]["spec.yaml"] == (tmp_path / "pair.yaml").read_text()


def test_startup_probe_is_sized_from_the_engines_on_disk(tmp_path):
    engines = tmp_path / "engines"
    (engines / "target").mkdir(parents=True)
    (engines / "target" / "rank0.engine").write_bytes(b"\0" * (3 * 2**20))
    loaded = load_spec(spec_file(tmp_path, "torch"))
    p = plan_manifests(loaded, K8sOptions(), engines)
    assert p.startup_seconds == 120 + 1  # base + ceil(3 MiB / 100 MiB/s)
    assert p.startup_basis.startswith("0.00 GiB of engines")
    assert plan_manifests(loaded, K8sOptions(), tmp_path / "absent").startup_seconds == 300


def test_security_context_is_hardened(tmp_path):
    p = plan(spec_file(tmp_path, "torch"), engines_from="build")
    pod = p.manifests["statefulset.yaml"]["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == RUN_AS
    assert pod["automountServiceAccountToken"] is False
    for c in pod["containers"] + pod["initContainers"]:
        sc = c["securityContext"]
        assert sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"] and sc["capabilities"]["drop"] == ["ALL"]
        # every path a process writes is a volume, since the root filesystem is read-only
        writable = {m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")}
        assert "/tmp" in writable


def test_privileged_port_is_refused(tmp_path):
    with pytest.raises(TrtspecError, match="http_port 80: ports below 1024 need root"):
        plan(spec_file(tmp_path, "torch", serve={"http_port": 80}))


def test_service_monitor_scrapes_the_metrics_port_of_one_service(tmp_path):
    p = plan(spec_file(tmp_path, "torch"), engines_from="build", service_monitor=True)
    sm = p.manifests["servicemonitor.yaml"]["spec"]
    selected = [
        m
        for m in p.manifests.values()
        if m["kind"] == "Service" and sm["selector"]["matchLabels"].items() <= m["metadata"]["labels"].items()
    ]
    assert [s["metadata"]["name"] for s in selected] == ["pair"]  # not the headless twin
    assert sm["endpoints"][0]["port"] in {x["name"] for x in selected[0]["spec"]["ports"]}


# --- GPUs follow the spec ----------------------------------------------------------------------


def gpu_counts(p) -> tuple[str | None, str | None]:
    r = container(p)["resources"]
    return r["requests"].get(GPU_RESOURCE), r["limits"].get(GPU_RESOURCE)


def test_torch_specs_request_no_gpu(tmp_path):
    p = plan(spec_file(tmp_path, "torch"))
    assert gpu_counts(p) == (None, None) and "tolerations" not in p.manifests["deployment.yaml"]["spec"]["template"]["spec"]


@pytest.mark.parametrize(
    "target, draft, gpus",
    [
        ({}, {}, 1),  # target, control and draft share GPU 0
        ({"tp_size": 2}, {}, 2),
        ({"tp_size": 2, "gpu_device_ids": [0, 1]}, {"gpu_device_ids": [2]}, 3),
        ({"tp_size": 4, "pp_size": 2}, {"tp_size": 2}, 8),
    ],
)
def test_trtllm_gpus_follow_tp_pp_and_device_ids(tmp_path, target, draft, gpus):
    # The legacy engine runtime places the draft on its own GPUs (the LLM API runs it in the
    # target's ranks, so a draft with its own parallelism exists only there).
    p = plan(spec_file(tmp_path, target=target, draft=draft, trtllm={"runtime": "engine", "line": "1.2"}))
    assert p.gpus == gpus and gpu_counts(p) == (str(gpus), str(gpus))


def test_build_init_container_gets_the_same_gpus(tmp_path):
    p = plan(spec_file(tmp_path, target={"tp_size": 2}), engines_from="build")
    init = p.manifests["statefulset.yaml"]["spec"]["template"]["spec"]["initContainers"][0]
    assert init["resources"]["limits"][GPU_RESOURCE] == "2"


@pytest.mark.parametrize(
    "target, draft, options, message",
    [
        ({"gpu_device_ids": [0]}, {"gpu_device_ids": [3]}, {}, r"GPU ids \[0, 3\], but a pod sees its GPUs as 0..N-1"),
        ({"tp_size": 8, "pp_size": 2}, {}, {}, "needs 16 GPUs in one pod .* a node has 8"),
        ({"tp_size": 4}, {}, {"gpus_per_node": 2}, "needs 4 GPUs in one pod .* a node has 2"),
    ],
)
def test_gpu_counts_the_pod_cannot_satisfy_are_refused(tmp_path, target, draft, options, message):
    with pytest.raises(TrtspecError, match=message):
        plan(spec_file(tmp_path, target=target, draft=draft, trtllm={"runtime": "engine", "line": "1.2"}), **options)


# --- autoscaling, disruption budget, workload kinds ---------------------------------------------


@pytest.mark.parametrize("streaming, models", [(True, [BLS, BLS_STREAMING]), (False, [BLS])])
def test_hpa_scales_on_the_schedulers_queue_and_active_sequences_with_cpu_fallback(tmp_path, streaming, models):
    from trtspec.triton.backend import metrics

    p = plan(
        spec_file(tmp_path, "torch", build={"max_batch_size": 6}, serve={"streaming": streaming, "instance_count": 2}),
        max_replicas=7,
    )
    hpa = p.manifests["hpa.yaml"]["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "pair"}
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (1, 7)
    queue, active, cpu = hpa["metrics"]
    # the scheduler's gauges, by the names the backend registers them under
    assert (QUEUE_METRIC, ACTIVE_METRIC) == (metrics.PREFIX + "queue_depth", metrics.PREFIX + "active_sequences")
    assert queue["pods"]["metric"]["name"] == QUEUE_METRIC and active["pods"]["metric"]["name"] == ACTIVE_METRIC
    for m in (queue, active):
        assert m["pods"]["metric"]["selector"]["matchExpressions"][0]["values"] == models
    assert queue["pods"]["target"]["averageValue"] == "6"  # the spec's max_batch_size
    assert active["pods"]["target"]["averageValue"] == "9"  # 80% of 6 places x 2 instances
    assert plan(spec_file(tmp_path, "torch"), active_target=3).manifests["hpa.yaml"]["spec"]["metrics"][1]["pods"]["target"] == {
        "type": "AverageValue",
        "averageValue": "3",
    }
    assert cpu["resource"] == {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 80}}
    assert "replicas" not in p.manifests["deployment.yaml"]["spec"]  # the HPA owns it
    assert container(p)["resources"]["requests"]["cpu"]  # utilisation needs a request


def test_without_hpa_the_replica_count_is_fixed(tmp_path):
    p = plan(spec_file(tmp_path, "torch"), hpa=False, min_replicas=3)
    assert "hpa.yaml" not in p.manifests and p.manifests["deployment.yaml"]["spec"]["replicas"] == 3


def test_pdb_never_blocks_a_drain_and_selects_the_pods(tmp_path):
    p = plan(spec_file(tmp_path, "torch"))
    pdb = p.manifests["pdb.yaml"]["spec"]
    assert pdb["maxUnavailable"] == 1
    assert (
        pdb["selector"]["matchLabels"].items() <= p.manifests["deployment.yaml"]["spec"]["template"]["metadata"]["labels"].items()
    )


def test_build_mode_is_a_statefulset_with_a_claim_per_pod(tmp_path):
    p = plan(spec_file(tmp_path, "torch"), engines_from="build", storage_size="20Gi", storage_class="fast")
    sts = p.manifests["statefulset.yaml"]["spec"]
    assert sts["serviceName"] == "pair-headless" and p.manifests["service-headless.yaml"]["spec"]["clusterIP"] == "None"
    assert sts["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "20Gi"
    init = sts["template"]["spec"]["initContainers"][0]
    assert init["command"] == ["trtspec", "build", "/etc/trtspec/spec.yaml", "--output", ENGINES_DIR]
    server_mount = next(m for m in container(p)["volumeMounts"] if m["name"] == "engines")
    init_mount = next(m for m in init["volumeMounts"] if m["name"] == "engines")
    assert server_mount["mountPath"] == init_mount["mountPath"]  # the server sees what was built
    assert p.manifests["hpa.yaml"]["spec"]["scaleTargetRef"]["kind"] == "StatefulSet"


def test_build_mode_refuses_local_checkpoints(tmp_path):
    path = spec_file(tmp_path, "torch", target={"repo": None, "revision": None, "path": "ckpt"})
    with pytest.raises(TrtspecError, match="target come.s. from a local path"):
        plan(path, engines_from="build")


def test_image_mode_copies_engines_into_an_empty_dir(tmp_path):
    p = plan(spec_file(tmp_path, "torch"), engines_from="image", engines_image="reg/eng:1")
    pod = p.manifests["deployment.yaml"]["spec"]["template"]["spec"]
    assert pod["initContainers"][0]["image"] == "reg/eng:1"
    assert {"name": "engines", "emptyDir": {"sizeLimit": "50Gi"}} in pod["volumes"]


def test_pvc_mode_mounts_the_claim_read_only(tmp_path):
    p = plan(spec_file(tmp_path, "torch"), pvc="my-engines")
    pod = p.manifests["deployment.yaml"]["spec"]["template"]["spec"]
    assert {"name": "engines", "persistentVolumeClaim": {"claimName": "my-engines", "readOnly": True}} in pod["volumes"]


# --- the command: dry run, --force, atomic writes, one-line errors -------------------------------


def test_dry_run_prints_every_manifest_and_writes_nothing(tmp_path):
    out = tmp_path / "k8s"
    r = runner.invoke(app, ["deploy", "k8s", str(spec_file(tmp_path, "torch")), "-o", str(out), "--dry-run"])
    assert r.exit_code == 0, r.output
    docs = [d for d in yaml.safe_load_all(r.stdout) if d]
    assert [d["kind"] for d in docs] == [
        "ConfigMap",
        "Deployment",
        "Service",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
        "NetworkPolicy",
        "Kustomization",
    ]
    assert not out.exists()


def test_write_then_force(tmp_path):
    spec = spec_file(tmp_path, "torch")
    out = tmp_path / "k8s"
    r = runner.invoke(app, ["deploy", "k8s", str(spec), "-o", str(out)])
    assert r.exit_code == 0, r.output
    written = sorted(p.name for p in out.iterdir())
    kustomization = yaml.safe_load((out / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"] + ["kustomization.yaml"]) == written
    expected = plan_manifests(load_spec(spec), K8sOptions()).manifests
    assert {n: yaml.safe_load((out / n).read_text()) for n in written} == expected

    before = (out / "deployment.yaml").read_text()
    r = runner.invoke(app, ["deploy", "k8s", str(spec), "-o", str(out), "--max-replicas", "9"])
    assert r.exit_code == 2 and "pass --force" in r.output
    assert (out / "deployment.yaml").read_text() == before

    r = runner.invoke(app, ["deploy", "k8s", str(spec), "-o", str(out), "--max-replicas", "9", "--force", "--no-hpa"])
    assert r.exit_code == 0, r.output
    assert not (out / "hpa.yaml").exists()  # replaced whole: no stale manifest left behind
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_an_interrupted_write_leaves_nothing(tmp_path, monkeypatch):
    out = tmp_path / "k8s"
    calls = []
    real = Path.write_text

    def failing(self, *a, **k):
        calls.append(self.name)
        if len(calls) == 3:
            raise OSError("disk full")
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "write_text", failing)
    r = runner.invoke(app, ["deploy", "k8s", str(spec_file(tmp_path, "torch")), "-o", str(out)])
    assert r.exit_code != 0 and len(calls) == 3
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["pair.yaml"]


@pytest.mark.parametrize(
    "spec_sections, args, message",
    [
        ({"serve": {"http_port": 9000, "grpc_port": 9000}}, [], "http_port, grpc_port and metrics_port must differ"),
        ({"target": {"gpu_device_ids": [2]}}, [], "a pod sees its GPUs as 0..N-1"),
        ({"target": {"tp_size": 4}}, ["--gpus-per-node", "2"], "needs 4 GPUs in one pod"),
        ({}, ["--kube-version", "1.12"], "unknown Kubernetes version '1.12'"),
        ({}, ["--memory", "lots"], "--memory: 'lots' is not a Kubernetes quantity"),
        ({}, ["--min-replicas", "5", "--max-replicas", "2"], "min_replicas (5) exceeds max_replicas (2)"),
        ({}, ["--engines-from", "image"], "engines_from image needs engines_image"),
        ({}, ["--queue-target", "0"], "--queue-target: Input should be greater than or equal to 1"),
        ({}, ["--engines-from", "nfs"], "--engines-from: Input should be 'pvc', 'image' or 'build'"),
        ({}, ["--cpu", "4", "--cpu-limit", "2"], "cpu_limit (2) is below the cpu request (4)"),
        ({}, ["--cpu-limit", "2Gi"], "--cpu-limit: '2Gi' is not a CPU quantity"),
        ({}, ["--cpu", "0m"], "--cpu: '0m' is no CPU at all"),
    ],
)
def test_bad_input_one_message_exit_2_nothing_written(tmp_path, spec_sections, args, message):
    out = tmp_path / "k8s"
    spec = spec_file(tmp_path, **spec_sections)
    r = runner.invoke(app, ["deploy", "k8s", str(spec), "-o", str(out), *args])
    assert r.exit_code == 2, r.output
    assert r.output.startswith("Error: ") and message in r.output and "Traceback" not in r.output
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["pair.yaml"]


def test_each_deployment_option_is_a_k8s_options_field_with_its_default():
    # the command's flags are validated into K8sOptions: a flag per field, at the field's default
    import typer.main

    group = typer.main.get_command(app)
    command = group.commands["deploy"].commands["k8s"]
    options = {p.name: p for p in command.params}
    fields = {name: f for name, f in K8sOptions.model_fields.items() if name in options}
    assert len(fields) >= 25
    for name, field in fields.items():
        assert options[name].default == field.default, name
    assert options["hpa"].secondary_opts == ["--no-hpa"] and options["namespace"].opts == ["--namespace", "-n"]
    # the command's own options (where to write) are not options of the deployment
    assert {"output", "engines", "force", "dry_run", "spec"} == set(options) - set(fields)


def test_spec_name_that_cannot_be_an_object_name_needs_name(tmp_path):
    spec = spec_file(tmp_path, "torch", name="7b.pair")
    r = runner.invoke(app, ["deploy", "k8s", str(spec), "--dry-run"])
    assert r.exit_code == 2 and "pass one with --name" in r.output
    r = runner.invoke(app, ["deploy", "k8s", str(spec), "--dry-run", "--name", "pair-7b"])
    assert r.exit_code == 0 and "name: pair-7b\n" in r.stdout


# --- images ------------------------------------------------------------------------------------


def _dockerfile(name: str) -> list[str]:
    """Instructions of a Dockerfile, continuation lines joined."""
    text = (ROOT / "docker" / name).read_text().replace("\\\n", " ")
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_cpu_image_installs_as_make_install_and_runs_as_the_pod_user():
    from trtspec.deploy.images import CPU_BASE_IMAGE

    lines = _dockerfile("cpu.Dockerfile")
    assert f"FROM {CPU_BASE_IMAGE}" in lines
    assert any(line.startswith("RUN ") and "make install VENV=/opt/trtspec/.venv" in line for line in lines)
    assert "ENV PATH=/opt/trtspec/.venv/bin:$PATH" in " ".join(lines)  # `trtspec` on PATH for the pod command
    assert lines[[i for i, x in enumerate(lines) if x.startswith("USER ")][-1]] == f"USER {RUN_AS}:{RUN_AS}"


def test_trtllm_image_is_the_documented_triton_trtllm_tag():
    from trtspec.deploy.images import TRITON_RELEASE, TRTLLM_BASE_IMAGE, TRTLLM_IN_TRITON

    lines = _dockerfile("trtllm.Dockerfile")
    assert f"ARG TRITON_TRTLLM_IMAGE={TRTLLM_BASE_IMAGE}" in lines
    # converter scripts from the same TensorRT-LLM release as the image's runtime
    assert f"ARG TRTLLM_GIT_REF=v{TRTLLM_IN_TRITON[TRITON_RELEASE]}" in lines
    assert lines[-2:] == ["EXPOSE 8000 8001 8002", 'CMD ["trtspec", "--help"]']
    assert f"USER {RUN_AS}:{RUN_AS}" in lines


def test_images_default_to_the_backend_and_version(tmp_path):
    from trtspec import __version__

    assert container(plan(spec_file(tmp_path, "torch")))["image"] == f"trtspec-cpu:{__version__}"
    assert container(plan(spec_file(tmp_path, "trtllm")))["image"] == f"trtspec-trtllm:{__version__}"
    assert container(plan(spec_file(tmp_path, "trtllm"), image="reg/x:1"))["image"] == "reg/x:1"
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", "engines", "weights", ".git"} <= set(ignored)  # `COPY .` ships no local state


def test_a_file_that_does_not_parse_back_is_refused(tmp_path):
    p = plan(spec_file(tmp_path, "torch"))
    p.manifests["kustomization.yaml"]["resources"] = tuple(p.manifests["kustomization.yaml"]["resources"])  # renders as a list
    with pytest.raises(TrtspecError, match="kustomization.yaml does not parse back"):
        rendered_files(p, DEFAULT_KUBE_VERSION)


# --- bounded scratch, log on stdout, admin APIs closed -----------------------------------------


def test_every_empty_dir_has_a_size_limit(tmp_path):
    for options in ({}, {"engines_from": "image", "engines_image": "reg/eng:1"}, {"scratch_size": "8Gi", "tmp_size": "2Gi"}):
        pod = plan(spec_file(tmp_path, "torch"), **options).manifests["deployment.yaml"]["spec"]["template"]["spec"]
        dirs = {v["name"]: v["emptyDir"] for v in pod["volumes"] if "emptyDir" in v}
        assert dirs and all("sizeLimit" in d for d in dirs.values()), dirs
        assert dirs["scratch"]["sizeLimit"] == options.get("scratch_size", "4Gi")
        assert dirs["tmp"]["sizeLimit"] == options.get("tmp_size", "1Gi")


def test_triton_logs_to_the_container_log_and_its_admin_apis_need_a_key(tmp_path):
    p = plan(spec_file(tmp_path, "torch"))
    c = container(p)
    command = c["command"]
    assert command[command.index("--log-file") + 1] == "-"  # stdout: kubectl logs
    assert not any(a.endswith(".log") for a in command)
    # The key comes from the optional Secret as a file: never an environment value, never argv.
    env = {e["name"]: e for e in c["env"]}
    assert "TRTSPEC_ADMIN_KEY" not in env and env["TRTSPEC_ADMIN_KEY_FILE"] == {
        "name": "TRTSPEC_ADMIN_KEY_FILE",
        "value": "/etc/trtspec-admin/key",
    }
    assert not any("admin" in a for a in command)
    pod = p.manifests["deployment.yaml"]["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "admin-key"]
    assert volume["secret"] == {
        "secretName": "pair-triton-admin",
        "optional": True,
        "defaultMode": 0o440,  # the pod's group (fsGroup) only
        "items": [{"key": "TRTSPEC_ADMIN_KEY", "path": "key"}],
    }
    assert {"name": "admin-key", "mountPath": "/etc/trtspec-admin", "readOnly": True} in c["volumeMounts"]
    other = plan(spec_file(tmp_path, "torch"), admin_key_secret="ops-key").manifests["deployment.yaml"]
    assert {"name": "admin-key", "secret": {**volume["secret"], "secretName": "ops-key"}} in other["spec"]["template"]["spec"][
        "volumes"
    ]


def test_network_policy_admits_only_the_clients_to_the_api_and_prometheus_to_metrics(tmp_path):
    p = plan(spec_file(tmp_path, "torch"))
    policy = p.manifests["networkpolicy.yaml"]
    assert "networkpolicy.yaml" in p.manifests["kustomization.yaml"]["resources"]
    spec = policy["spec"]
    assert spec["podSelector"]["matchLabels"] == p.manifests["deployment.yaml"]["spec"]["selector"]["matchLabels"]
    assert spec["policyTypes"] == ["Ingress", "Egress"]
    assert spec["egress"] == [{"ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]}]  # DNS only
    ports = {p["name"]: p["containerPort"] for p in container(p)["ports"]}
    api, metrics = spec["ingress"]
    assert api == {
        "from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/component": "trtspec-front"}}}],  # same namespace
        "ports": [{"protocol": "TCP", "port": ports["http"]}, {"protocol": "TCP", "port": ports["grpc"]}],
    }
    assert metrics == {
        "from": [
            {
                "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
            }
        ],
        "ports": [{"protocol": "TCP", "port": ports["metrics"]}],
    }
    named = plan(spec_file(tmp_path, "torch"), clients_label="team=chat", clients_namespace="apps", metrics_namespace="obs")
    api, metrics = named.manifests["networkpolicy.yaml"]["spec"]["ingress"]
    assert api["from"] == [
        {
            "podSelector": {"matchLabels": {"team": "chat"}},
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "apps"}},
        }
    ]
    assert metrics["from"][0]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "obs"}
    assert "networkpolicy.yaml" not in plan(spec_file(tmp_path, "torch"), network_policy=False).manifests


def test_a_clients_label_that_is_no_label_is_one_clear_error(tmp_path):
    with pytest.raises(TrtspecError) as err:
        validated(K8sOptions, {"clients_label": "front"})
    assert str(err.value) == (
        "--clients-label: 'front' is not a pod label selector; write it as key=value, e.g. app.kubernetes.io/name=my-front"
    )


@pytest.mark.parametrize("backend", ["torch", "trtllm"])
def test_only_a_pod_that_builds_from_the_hub_may_leave_the_cluster_and_only_over_https(tmp_path, backend):
    dns = {"ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]}
    for mode in MODES[:2]:  # pvc, image: engines arrive ready, the pod downloads nothing
        policy = plan(spec_file(tmp_path, backend), **mode).manifests["networkpolicy.yaml"]
        assert policy["spec"]["egress"] == [dns]
    policy = plan(spec_file(tmp_path, backend), engines_from="build").manifests["networkpolicy.yaml"]
    dns_rule, hub = policy["spec"]["egress"]
    assert dns_rule == dns and hub["ports"] == [{"protocol": "TCP", "port": 443}]
    (block,) = hub["to"]
    assert block["ipBlock"]["cidr"] == "0.0.0.0/0"  # the Hub's addresses change; private ranges stay closed
    assert {"10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"} <= set(block["ipBlock"]["except"])


def _threads(c: dict) -> tuple[str, str]:
    env = {e["name"]: e.get("value") for e in c["env"]}
    return env["TRTSPEC_THREADS"], env["OMP_NUM_THREADS"]


@pytest.mark.parametrize(
    "backend, options, request_cpu, limit_cpu, threads",
    [
        ("torch", {}, "2", "2", "2"),  # the limit is the request by default
        ("trtllm", {}, "4", "4", "4"),
        ("torch", {"cpu": "1500m"}, "1500m", "1500m", "1"),  # whole cores
        ("torch", {"cpu": "250m"}, "250m", "250m", "1"),  # at least one
        ("torch", {"cpu": "2", "cpu_limit": "3.5"}, "2", "3.5", "3"),  # set apart
        ("torch", {"cpu_limit": "1"}, "1", "1", "1"),  # a limit alone lowers the default request
        ("torch", {"cpu_limit": "8"}, "2", "8", "8"),
    ],
)
def test_cpu_limit_and_thread_count_follow_the_request_or_the_limit(tmp_path, backend, options, request_cpu, limit_cpu, threads):
    p = plan(spec_file(tmp_path, backend), **options)
    r = container(p)["resources"]
    assert (r["requests"]["cpu"], r["limits"]["cpu"]) == (request_cpu, limit_cpu)
    assert _threads(container(p)) == (threads, threads)
    schemas.validate(p.manifests[f"{p.workload.lower()}.yaml"], DEFAULT_KUBE_VERSION)


def test_every_init_container_has_a_cpu_limit_and_the_build_step_the_pods_thread_count(tmp_path):
    build = plan(spec_file(tmp_path, "torch"), engines_from="build", cpu="3").manifests["statefulset.yaml"]
    (init,) = build["spec"]["template"]["spec"]["initContainers"]
    assert init["resources"]["limits"]["cpu"] == "3" and _threads(init) == ("3", "3")
    image = plan(spec_file(tmp_path, "torch"), engines_from="image", engines_image="reg/eng:1").manifests["deployment.yaml"]
    (copy_step,) = image["spec"]["template"]["spec"]["initContainers"]
    assert copy_step["resources"]["limits"]["cpu"] == copy_step["resources"]["requests"]["cpu"]


# --- serve.capture: the co-design loop's claim and refresh CronJob ----------------------------

CAPTURE = {
    "speculative": {"method": "eagle3", "max_draft_len": 4, "default_draft_tokens": 2},
    "serve": {"capture": {"dir": "captured", "max_gb": 1, "sample": 0.5}},
}
LOOP_FILES = {"pvc-loop.yaml", "cronjob-refresh.yaml", "networkpolicy-refresh.yaml"}
ONE_REPLICA = {"hpa": False}


def capture_plan(tmp_path: Path, **options):
    return plan(spec_file(tmp_path, "torch", **copy.deepcopy(CAPTURE)), **{**ONE_REPLICA, **options})


def job_pod(p) -> dict:
    return p.manifests["cronjob-refresh.yaml"]["spec"]["jobTemplate"]["spec"]["template"]


def env_of(c: dict) -> dict:
    return {e["name"]: e.get("value") for e in c["env"]}


def test_without_capture_there_is_no_loop(tmp_path):
    p = plan(spec_file(tmp_path, "torch"))
    assert not LOOP_FILES & set(p.manifests)
    assert "TRTSPEC_HEAD_CONTROL" not in env_of(container(p))
    assert "loop" not in {m["name"] for m in container(p)["volumeMounts"]}
    spec = yaml.safe_load(p.manifests["configmap.yaml"]["data"]["spec.yaml"])
    assert "capture" not in spec.get("serve", {})


@pytest.mark.parametrize("version", _versions())
@pytest.mark.parametrize("mode", MODES[:2], ids=["pvc", "image"])
def test_the_loop_manifests_pass_the_schemas_and_parse_back(tmp_path, mode, version):
    p = capture_plan(tmp_path, kube_version=version, **mode)
    assert LOOP_FILES <= set(p.manifests["kustomization.yaml"]["resources"])
    files = rendered_files(p, version)  # validates every object, parses every file back
    kinds = {f: yaml.safe_load(files[f])["kind"] for f in LOOP_FILES}
    assert kinds == {
        "pvc-loop.yaml": "PersistentVolumeClaim",
        "cronjob-refresh.yaml": "CronJob",
        "networkpolicy-refresh.yaml": "NetworkPolicy",
    }
    broken = copy.deepcopy(p.manifests["cronjob-refresh.yaml"])
    broken["spec"]["concurrency"] = "Forbid"
    with pytest.raises(schemas.ManifestInvalid, match="'concurrency' was unexpected"):
        schemas.validate(broken, version)


def test_capture_dir_and_control_file_lie_on_the_volume_the_server_and_the_job_share(tmp_path):
    p = capture_plan(tmp_path)
    claim = p.manifests["pvc-loop.yaml"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"] and claim["spec"]["resources"]["requests"]["storage"] == "20Gi"
    pods = [p.manifests["deployment.yaml"]["spec"]["template"]["spec"], job_pod(p)["spec"]]
    for pod in pods:
        (volume,) = [v for v in pod["volumes"] if v["name"] == "loop"]
        assert volume["persistentVolumeClaim"] == {"claimName": claim["metadata"]["name"]}
        (c,) = pod["containers"]
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == "loop"]
        assert mount == {"name": "loop", "mountPath": "/var/lib/trtspec-loop"}  # writable
        assert env_of(c)["TRTSPEC_HEAD_CONTROL"] == "/var/lib/trtspec-loop/eagle3_head.json"
    # the spec the pods read keeps its captured requests on that volume, not in the ConfigMap
    text = p.manifests["configmap.yaml"]["data"]["spec.yaml"]
    mounted = tmp_path / "etc-trtspec" / "spec.yaml"
    mounted.parent.mkdir()
    mounted.write_text(text)
    assert load_spec(mounted).capture_dir() == Path("/var/lib/trtspec-loop/capture")
    command = job_pod(p)["spec"]["containers"][0]["command"]
    assert command[command.index("--refresh-dir") + 1] == "/var/lib/trtspec-loop/refresh"  # heads the server loads


def test_the_cronjob_runs_one_refresh_round_at_low_priority_without_the_admin_key(tmp_path):
    p = capture_plan(tmp_path, refresh_schedule="15 3 * * *", refresh_cpu="2", refresh_memory="6Gi")
    cron = p.manifests["cronjob-refresh.yaml"]["spec"]
    assert cron["schedule"] == "15 3 * * *" and cron["concurrencyPolicy"] == "Forbid"
    assert cron["jobTemplate"]["spec"]["backoffLimit"] == 0
    pod = job_pod(p)["spec"]
    (c,) = pod["containers"]
    assert c["image"] == container(p)["image"]
    assert c["command"][:5] == ["nice", "-n", "19", "trtspec", "refresh"]
    args = c["command"][5:]
    assert args[args.index("--url") + 1] == f"{p.name}:{named_port(container(p), 'grpc')}"  # the Service
    assert args[args.index("--rounds") + 1] == "1" and args[args.index("--engines") + 1] == ENGINES_DIR
    assert c["resources"] == {"requests": {"cpu": "2", "memory": "6Gi"}, "limits": {"cpu": "2", "memory": "6Gi"}}
    assert env_of(c)["TRTSPEC_THREADS"] == "2"
    assert "admin-key" not in {v["name"] for v in pod["volumes"]} and "TRTSPEC_ADMIN_KEY_FILE" not in env_of(c)
    assert pod["restartPolicy"] == "Never" and pod["automountServiceAccountToken"] is False
    # distill writes its data beside the head it continues (the served head engine, at first):
    # the job works on its own copy of the engines, the claim stays read-only
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes["engines"] and volumes["engines-claim"]["persistentVolumeClaim"]["readOnly"] is True
    (copy_in,) = pod["initContainers"]
    assert copy_in["command"] == ["cp", "-R", "/models/engines-claim/.", f"{ENGINES_DIR}/"]
    image_mode = job_pod(capture_plan(tmp_path, engines_from="image", engines_image="registry/engines:1"))["spec"]
    assert image_mode["initContainers"][0]["image"] == "registry/engines:1" and "engines-claim" not in str(image_mode)
    # the Service and the server's policy select the server's labels; the job's pod has other ones
    labels = job_pod(p)["metadata"]["labels"]
    assert not p.manifests["service.yaml"]["spec"]["selector"].items() <= labels.items()
    default = capture_plan(tmp_path).manifests["cronjob-refresh.yaml"]["spec"]["schedule"]
    assert default == "0 */6 * * *"


def test_the_job_reaches_the_servers_grpc_and_metrics_and_nothing_else_inside(tmp_path):
    p = capture_plan(tmp_path)
    server = p.manifests["deployment.yaml"]["spec"]["selector"]["matchLabels"]
    job = job_pod(p)["metadata"]["labels"]
    ports = [{"protocol": "TCP", "port": named_port(container(p), n)} for n in ("grpc", "metrics")]
    ingress = p.manifests["networkpolicy.yaml"]["spec"]["ingress"]
    assert {"from": [{"podSelector": {"matchLabels": job}}], "ports": ports} in ingress
    policy = p.manifests["networkpolicy-refresh.yaml"]["spec"]
    assert policy["podSelector"]["matchLabels"] == job and policy["ingress"] == []
    dns, to_server, hub = policy["egress"]
    assert to_server == {"to": [{"podSelector": {"matchLabels": server}}], "ports": ports}
    assert hub["ports"] == [{"protocol": "TCP", "port": 443}] and "10.0.0.0/8" in hub["to"][0]["ipBlock"]["except"]
    assert "networkpolicy-refresh.yaml" not in capture_plan(tmp_path, network_policy=False).manifests


@pytest.mark.parametrize(
    "args, message",
    [
        (["--refresh-schedule", "61 * * * *"], "--refresh-schedule: '61 * * * *': minute '61' is not a cron field"),
        (["--refresh-schedule", "0 3 * *"], "has 4 fields, a cron schedule has 5"),
        (["--refresh-schedule", "@often"], "'@often' is not a cron macro"),
        (["--refresh-schedule", "CRON_TZ=UTC 0 3 * * *"], "a time zone in the schedule is refused by Kubernetes"),
        (["--refresh-cpu", "0m"], "--refresh-cpu: '0m' is no CPU at all"),
        ([], "swaps the head of one server"),  # the default HPA may scale to 4
        (["--no-hpa", "--min-replicas", "2"], "deploy one replica (--no-hpa --min-replicas 1)"),
        (["--no-hpa", "--engines-from", "build"], "use --engines-from pvc or image"),
    ],
)
def test_a_bad_loop_is_one_error_exit_2_nothing_written(tmp_path, args, message):
    out = tmp_path / "k8s"
    spec = spec_file(tmp_path, "torch", **copy.deepcopy(CAPTURE))
    r = runner.invoke(app, ["deploy", "k8s", str(spec), "-o", str(out), *args])
    assert r.exit_code == 2, r.output
    assert r.output.startswith("Error: ") and message in r.output and r.output.count("\n") == 1, r.output
    assert not out.exists()


def test_the_loop_needs_the_target_from_the_hub_and_a_schedule_needs_capture(tmp_path):
    local = spec_file(tmp_path, "torch", target={"repo": None, "revision": None, "path": "weights/t"}, **CAPTURE)
    with pytest.raises(TrtspecError, match="builds its own target engine from the checkpoint"):
        plan(local, **ONE_REPLICA)
    with pytest.raises(TrtspecError, match="the spec has no serve.capture"):
        plan(spec_file(tmp_path, "torch"), refresh_schedule="0 3 * * *")


@pytest.mark.parametrize("schedule", ["0 3 * * *", "*/15 * * * *", "0 0-23/2 1,15 JAN-MAR MON-FRI", "@hourly", "5 4 * * 7"])
def test_cron_schedules_kubernetes_runs_are_accepted(schedule):
    assert check_schedule(schedule) == schedule


@pytest.mark.parametrize(
    "schedule", ["*/0 * * * *", "5-1 * * * *", "0 0 0 * *", "0 24 * * *", "0 0 * 13 *", "x * * * *", "* * * * * *"]
)
def test_cron_schedules_kubernetes_refuses_are_refused(schedule):
    with pytest.raises(ValueError, match="write five fields"):
        check_schedule(schedule)

"""`trtspec refresh` on a real tritonserver (127.0.0.1, free ports, the repository's own model
control): a better head swapped in under 4 concurrent clients (none fails, none unanswered,
every answer identical to target-only, the old head answering until the new one serves), a
damaged head never deployed, --rollback, and a server serving another repository refused."""

from __future__ import annotations

import json
import shutil
import threading
import time

import numpy as np
import pytest

grpcclient = pytest.importorskip("tritonclient.grpc", reason="needs the serve extra: pip install 'trtspec[serve]'")
from conftest import require_tritonserver, serve_built, write_spec  # noqa: E402
from test_eagle3 import random_head  # noqa: E402
from test_eagle3_serve import _bls  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from trtspec.cli.app import app  # noqa: E402
from trtspec.layout import BLS_MODEL, CONTROL_MODEL  # noqa: E402
from trtspec.speculative.capture import read_capture  # noqa: E402
from trtspec.speculative.metrics import metrics_from_json  # noqa: E402
from trtspec.triton.backend.head_swap import CONTROL_FILE  # noqa: E402

PROMPTS = ["The quick brown fox", "def fibonacci(n):", "SELECT name FROM", "ls -la"]
runner = CliRunner()


@pytest.fixture(scope="module")
def live(tmp_path_factory, tiny_ckpts):
    """A deployment serving a random head, 4 captured requests, and an exact head that names
    them as its held-out requests (as `distill --from-capture` writes its manifest)."""
    from exact_head import make_bigram_target, make_exact_head

    from trtspec.spec import load_spec

    require_tritonserver()
    root = tmp_path_factory.mktemp("refresh")
    target = make_bigram_target(root / "target", tiny_ckpts["target"])
    random_head(target, root / "random")
    capture = {"dir": "captured", "max_gb": 1, "sample": 1.0}
    ck = {"target": target, "head": root / "random"}
    overrides = {"speculative.method": "eagle3", "serve.capture": capture, "serve.repo_dir": str(root / "repo")}
    spec = write_spec(root / "spec", ck, "head", **overrides)
    loaded = load_spec(spec)
    for server, _, repo in serve_built(loaded, root, root / "backend-cache"):
        client = grpcclient.InferenceServerClient(server.grpc_endpoint)
        for i, p in enumerate(PROMPTS):  # served, so captured: the held-out requests
            client.infer(BLS_MODEL, _inputs(p, capture=True), request_id=f"held-{i}")
        deadline = time.monotonic() + 60
        while len(read_capture(loaded.capture_dir())) < len(PROMPTS) and time.monotonic() < deadline:
            time.sleep(0.2)
        continued = {"held_requests": [f"held-{i}" for i in range(len(PROMPTS))], "capture": str(loaded.capture_dir())}
        new = make_exact_head(target, root / "new")
        (new / "trtspec-head.json").write_text(json.dumps({"continued": continued}))
        yield {"root": root, "spec": spec, "server": server, "client": client, "new": new, "repo": repo}


def _inputs(prompt: str, capture: bool = False):
    """A speculative request (k=3, 16 tokens, with its perf metrics); capture false keeps the
    load traffic out of the capture."""
    flag = grpcclient.InferInput("capture", [1, 1], "BOOL")
    flag.set_data_from_numpy(np.array([[capture]], dtype=np.bool_))
    return _bls(prompt, 3, 16) + [flag]


def _ids(result) -> list[int]:
    return result.as_numpy("output_ids")[0, : result.as_numpy("sequence_length")[0, 0]].tolist()


def _acceptance(result) -> tuple[int, int]:
    m = metrics_from_json(result.as_numpy("perf_metrics_json")[0, 0].decode())
    return m.accepted, m.drafted


def _refresh(live, *args: str):
    server = live["server"]
    port = str(server.command.metrics_port)
    return runner.invoke(app, ["refresh", str(live["spec"]), "--url", server.grpc_endpoint, "--metrics-port", port, *args])


def _history(live) -> list[dict]:
    return json.loads((live["repo"] / CONTROL_FILE).read_text())["history"]


def _load(server, answers: list, failures: list, stop: threading.Event, n: int) -> None:
    """One client: requests one after another until ``stop``; every answer or failure kept."""
    mine = grpcclient.InferenceServerClient(server.grpc_endpoint)
    i = n
    while not stop.is_set():
        prompt = PROMPTS[i % len(PROMPTS)]
        try:
            result = mine.infer(BLS_MODEL, _inputs(prompt), client_timeout=120)
            answers.append((prompt, _ids(result), _acceptance(result)))
        except Exception as err:  # failed or unanswered (timed out): counted
            failures.append(f"{type(err).__name__}: {err}")
        i += 1


@pytest.mark.server
def test_a_better_head_is_swapped_in_under_four_clients_without_a_failed_or_different_answer(live):
    client, server = live["client"], live["server"]
    expected = {p: _ids(client.infer(CONTROL_MODEL, _inputs(p))) for p in PROMPTS}
    before = _acceptance(client.infer(BLS_MODEL, _inputs(PROMPTS[0])))
    assert before[1] > 0 and before[0] < before[1]  # the random head misses
    answers, failures, stop = [], [], threading.Event()
    threads = [threading.Thread(target=_load, args=(server, answers, failures, stop, n)) for n in range(4)]
    for t in threads:
        t.start()
    r = _refresh(live, "--head", str(live["new"]))
    time.sleep(2.0)  # the clients keep going on the new head
    stop.set()
    for t in threads:
        t.join(timeout=180)
    assert r.exit_code == 0, r.output
    assert failures == [] and len(answers) > 8
    assert [a for a in answers if a[1] != expected[a[0]]] == []  # every answer is target-only's
    accepted, drafted = _acceptance(client.infer(BLS_MODEL, _inputs(PROMPTS[1])))
    assert drafted > 0 and accepted == drafted  # the exact head drafts now
    history = _history(live)
    assert [h["version"] for h in history] == [1, 2] and history[1]["new"] > history[1]["live"]
    metrics = server.metrics_url
    import urllib.request

    text = urllib.request.urlopen(metrics, timeout=10).read().decode()
    assert f'trtspec_eagle3_head_version{{instance="{BLS_MODEL}_0_0",mode="speculative",model="{BLS_MODEL}"}} 2' in text
    assert 'head="serving"' in text and 'head="replaced"' in text


@pytest.mark.server
def test_a_damaged_head_is_never_deployed_and_the_live_head_still_serves(live):
    from safetensors.torch import load_file, save_file

    damaged = live["root"] / "damaged"
    shutil.copytree(live["new"], damaged, dirs_exist_ok=True)
    state = load_file(str(damaged / "model.safetensors"))
    state["fc.weight"] = state["fc.weight"].flip(0)  # the features mapped to the wrong states
    save_file(state, str(damaged / "model.safetensors"), metadata={"format": "pt"})
    before = _history(live)
    r = _refresh(live, "--head", str(damaged))
    assert r.exit_code == 1, r.output
    assert r.output.count("Error: ") == 1 and "is not deployed" in r.output
    assert _history(live) == before
    accepted, drafted = _acceptance(live["client"].infer(BLS_MODEL, _inputs(PROMPTS[2])))
    assert drafted > 0 and accepted == drafted  # still the exact head


@pytest.mark.server
def test_rollback_serves_the_previous_head_again(live):
    first = _history(live)[0]["head"]
    r = _refresh(live, "--rollback")
    assert r.exit_code == 0, r.output
    assert _history(live)[-1]["head"] == first and _history(live)[-1]["version"] == 3
    client = live["client"]
    result = client.infer(BLS_MODEL, _inputs(PROMPTS[1]))
    assert _ids(result) == _ids(client.infer(CONTROL_MODEL, _inputs(PROMPTS[1])))
    accepted, drafted = _acceptance(result)
    assert drafted > 0 and accepted < drafted  # the random head drafts again


@pytest.mark.server
def test_no_server_at_the_url_a_server_of_another_spec_or_a_torn_record_is_refused(live, tmp_path, tiny_ckpts):
    r = runner.invoke(app, ["refresh", str(live["spec"]), "--url", "127.0.0.1:1", "--head", str(live["new"])])
    assert r.exit_code == 2 and r.output.count("Error: ") == 1 and "cannot reach" in r.output, r.output
    other = write_spec(
        tmp_path,
        {"target": tiny_ckpts["target"], "head": live["new"]},
        "head",
        **{"speculative.method": "eagle3", "serve.repo_dir": str(live["repo"])},
    )
    r = runner.invoke(app, ["refresh", str(other), "--url", live["server"].grpc_endpoint, "--head", str(live["new"])])
    assert r.exit_code == 2 and r.output.count("Error: ") == 1 and "not this spec's" in r.output, r.output
    control = live["repo"] / CONTROL_FILE
    kept = control.read_text()
    control.write_text("{torn")
    try:
        r = _refresh(live, "--rollback")
        assert r.exit_code == 2 and r.output.count("Error: ") == 1 and "is not a refresh record" in r.output, r.output
    finally:
        control.write_text(kept)


@pytest.mark.server
def test_the_loop_trains_on_the_capture_and_refreshes_by_itself(live):
    """One round of --every: distill --from-capture on what the server kept (a process of its
    own, at low priority), then refresh; the deployment answers as target-only throughout."""
    r = _refresh(live, "--every", "1s", "--rounds", "1", "--max-steps", "2", "--replay", "0")
    assert r.exit_code == 0, r.output
    assert "refresh round 1: " in r.output
    work = live["spec"].parent / "engines.refresh"
    (round_head,) = sorted((work / "rounds").glob("head-*"))
    assert json.loads((round_head / "trtspec-head.json").read_text())["continued"]["replay"] == 0
    deployed = "round 1: deployed" in r.output
    assert deployed or "round 1: nothing deployed" in r.output, r.output
    if deployed:  # the round's head, built beside the engines, serves now
        assert _history(live)[-1]["source"] == str(round_head.resolve())
    client = live["client"]
    assert _ids(client.infer(BLS_MODEL, _inputs(PROMPTS[3]))) == _ids(client.infer(CONTROL_MODEL, _inputs(PROMPTS[3])))

"""Fixes to the TensorRT-LLM engine path (trtllm.runtime engine) that a GPU would expose."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import write_spec
from typer.testing import CliRunner

from trtspec import files as files_mod
from trtspec.cli.app import app
from trtspec.files import swap_unit_into_place
from trtspec.spec import load_spec

DATA = Path(__file__).parent / "data"


# --------------------------------------------------- target and control swap as one unit


def _unit(tmp_path: Path, label: str) -> list[tuple[Path, Path]]:
    pairs = []
    for kind in ("target", "control"):
        tmp = tmp_path / f".{kind}.tmp-build"
        tmp.mkdir()
        (tmp / "which").write_text(label)
        pairs.append((tmp, tmp_path / kind))
    return pairs


@pytest.mark.parametrize("fail_at", [1, 2, 3, 4])
def test_an_interrupted_unit_swap_never_leaves_a_new_target_beside_an_old_control(tmp_path, monkeypatch, fail_at):
    for kind in ("target", "control"):
        (tmp_path / kind).mkdir()
        (tmp_path / kind / "which").write_text("old")
    pairs = _unit(tmp_path, "new")
    real, calls = os.replace, []

    def flaky(src, dst):
        calls.append(src)
        if len(calls) == fail_at:
            raise KeyboardInterrupt
        real(src, dst)

    monkeypatch.setattr(files_mod.os, "replace", flaky)
    with pytest.raises(KeyboardInterrupt):
        swap_unit_into_place(pairs)
    present = {k: (tmp_path / k / "which").read_text() for k in ("target", "control") if (tmp_path / k).is_dir()}
    assert len(set(present.values())) <= 1, f"mixed unit after interruption: {present}"


def test_a_completed_unit_swap_replaces_both(tmp_path):
    for kind in ("target", "control"):
        (tmp_path / kind).mkdir()
        (tmp_path / kind / "which").write_text("old")
    swap_unit_into_place(_unit(tmp_path, "new"))
    assert [(tmp_path / k / "which").read_text() for k in ("target", "control")] == ["new", "new"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


# --------------------------------------------------- custom code needs trust_remote_code


def _with_auto_map(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig"}
    (dst / "config.json").write_text(json.dumps(cfg))
    (dst / "configuration_evil.py").write_text("raise SystemExit('ran remote code')\n")
    return dst


def test_engine_dry_run_refuses_custom_code_the_spec_does_not_trust(tmp_path):
    target = _with_auto_map(DATA / "trtllm" / "hf_configs" / "llama-3.1-8b-instruct", tmp_path / "t")
    data = yaml.safe_load((DATA / "specs" / "trtllm-1gpu.yaml").read_text())
    data["target"]["path"] = str(target)
    data["draft"]["path"] = str(DATA / "trtllm" / "hf_configs" / "llama-3.2-1b-instruct")
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    r = CliRunner().invoke(app, ["build", str(path), "--dry-run"])
    assert r.exit_code == 2
    assert (
        f"target: {target} ships custom code (auto_map in config.json, configuration_evil.py) and the "
        "spec does not trust it; TensorRT-LLM would run it."
    ) in r.stderr
    assert "set target.trust_remote_code: true" in r.stderr


def test_llmapi_build_refuses_untrusted_custom_code_and_accepts_it_when_trusted(tmp_path, tiny_ckpts):
    target = _with_auto_map(tiny_ckpts["target"], tmp_path / "t")
    ckpts = {**tiny_ckpts, "target": target}
    common = {"backend": "trtllm", "speculative.default_draft_tokens": None}
    refused = load_spec(write_spec(tmp_path / "a", ckpts, **common))
    r = CliRunner().invoke(app, ["build", str(refused.path)])
    assert r.exit_code == 2 and "ships custom code" in r.stderr
    # trusted: the check passes (AutoConfig then runs the code, which the spec allowed)
    from trtspec.engines.trtllm.checks import refuse_untrusted_code

    refuse_untrusted_code("target", target, trusted=True)


# --------------------------------------------------- trtspec stop ends an mpirun-style tree


def test_stop_ends_a_launcher_and_a_rank_that_left_its_process_group(tmp_path):
    """mpirun is not named tritonserver and its ranks may leave the server's process group."""
    import sys
    import time

    from trtspec.triton.server.detached import read_pid_file, stop_detached
    from trtspec.triton.server.process import ServerCommand, TritonServer
    from trtspec.triton.server.procgroup import alive as _alive

    script = tmp_path / "fake_mpirun.py"
    script.write_text(
        "import subprocess, sys, time\n"
        "rank = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True)\n"
        f"open({str(tmp_path / 'rank.pid')!r}, 'w').write(str(rank.pid))\n"
        "time.sleep(600)\n"
    )
    cmd = ServerCommand(binary=Path("/bin/false"), model_repository=tmp_path)
    server = TritonServer(cmd, launcher=[sys.executable, str(script)])
    pid_file = tmp_path / "server.json"
    server.start(tmp_path / "log", detach=True, pid_file=pid_file)
    deadline = time.monotonic() + 20
    while not (tmp_path / "rank.pid").is_file() and time.monotonic() < deadline:
        time.sleep(0.05)
    rank = int((tmp_path / "rank.pid").read_text())
    assert read_pid_file(pid_file).argv[0] == sys.executable  # the launcher is recorded
    assert stop_detached(pid_file, timeout=5) is True
    assert not _alive(server.pid) and not _alive(rank)
    assert not pid_file.exists()


# --------------------------------------------------- orchestrator against TensorRT-LLM semantics


class FakeTensorrtllm:
    """The tiny torch engines behind TensorRT-LLM's non-decoupled `tensorrt_llm` semantics:
    a batch > 1 is refused, and after a rejected draft the target keeps decoding greedily
    until request_output_len tokens (or its end_id)."""

    def __init__(self, cores, target="tensorrt_llm"):
        import threading

        self.cores, self.target = cores, target
        self.log: list[tuple[str, int, int]] = []  # (model, request_output_len, drafts)
        self.lock = threading.Lock()
        self.in_flight = self.max_in_flight = 0

    def call(self, model, inputs, names):
        import time

        import numpy as np

        rows = np.asarray(inputs["input_ids"]).shape[0]
        if rows > 1:
            raise RuntimeError("batch size > 1 requires the decoupled transaction policy")
        with self.lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        time.sleep(0.01)  # let concurrent requests overlap
        try:
            want = int(np.asarray(inputs["request_output_len"]).reshape(-1)[0])
            drafts = np.asarray(inputs["draft_input_ids"]).shape[1] if "draft_input_ids" in inputs else 0
            self.log.append((model, want, drafts))
            out = self._one(model, inputs)
            ids = out["output_ids"].reshape(-1).tolist()[: int(out["sequence_length"].reshape(-1)[0])]
            end = int(np.asarray(inputs["end_id"]).reshape(-1)[0]) if "end_id" in inputs else None
            if model == self.target and drafts and len(ids) < want and (not ids or ids[-1] != end):
                more = dict(inputs)
                more.pop("draft_input_ids")
                seq = np.asarray(inputs["input_ids"]).reshape(-1).tolist() + ids
                more["input_ids"] = np.array([seq], dtype=np.int32)
                more["input_lengths"] = np.array([[len(seq)]], dtype=np.int32)
                more["request_output_len"] = np.array([[want - len(ids)]], dtype=np.int32)
                extra = self._one(model, more)
                ids += extra["output_ids"].reshape(-1).tolist()[: int(extra["sequence_length"].reshape(-1)[0])]
            return {"output_ids": np.array([[ids]], dtype=np.int32), "sequence_length": np.array([[len(ids)]], dtype=np.int32)}
        finally:
            with self.lock:
                self.in_flight -= 1

    def _one(self, model, inputs):
        (answer,) = self.cores[model].infer([inputs])
        if isinstance(answer, Exception):
            raise answer
        return answer

    def call_many(self, model, requests, names):
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=len(requests)) as pool:
            return list(pool.map(lambda r: self.call(model, r, names), requests))


def _trtllm_orchestrator(dep, mode, fake, per_row=True, continued=True):
    from test_triton_cores import settings_for

    from trtspec.triton.backend.bls import split_rows
    from trtspec.triton.backend.orchestrator_core import Orchestrator

    settings = settings_for(dep, mode, decoupled=False, margins_supported=False, target_continues=continued)
    call = split_rows(fake.call_many) if per_row else fake.call
    return Orchestrator(settings, call, dep.tokenizer, dep.end_ids)


PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Triton serves models over HTTP and gRPC."]


def _expected(dep, prompt, max_tokens):
    req = dep.request(dep.encode(prompt), max_tokens)
    (res,) = dep.generate([req], speculative=False)
    return res.output_ids


def _ids(answer):
    return answer["output_ids"][0][: int(answer["sequence_length"][0][0])].tolist()


def test_rows_of_one_batch_go_to_tensorrtllm_as_concurrent_single_requests(built):
    from test_triton_cores import _cores, _request

    dep = built()
    fake = FakeTensorrtllm(_cores(dep))
    batch = [_request(p, 16) for p in PROMPTS]
    refused = _trtllm_orchestrator(dep, "speculative", fake, per_row=False).run(batch)
    assert all("requires the decoupled transaction policy" in str(a) for a in refused)
    answers = _trtllm_orchestrator(dep, "speculative", fake).run(batch)
    assert [_ids(a) for a in answers] == [_expected(dep, p, 16) for p in PROMPTS]
    assert fake.max_in_flight > 1  # the rows were in flight together


def test_control_answers_each_prompt_in_one_target_request(built):
    from test_triton_cores import _cores, _request

    dep = built()
    fake = FakeTensorrtllm(_cores(dep))
    answers = _trtllm_orchestrator(dep, "target_only", fake).run([_request(p, 20) for p in PROMPTS])
    assert [_ids(a) for a in answers] == [_expected(dep, p, 20) for p in PROMPTS]
    assert sorted(fake.log) == sorted([("tensorrt_llm", 20, 0)] * len(PROMPTS))


def test_speculative_keeps_what_the_target_decoded_after_a_rejection(built):
    from test_triton_cores import _cores, _request

    dep = built()
    calls = {}
    for continued in (False, True):
        fake = FakeTensorrtllm(_cores(dep))
        answers = _trtllm_orchestrator(dep, "speculative", fake, continued=continued).run([_request(p, 32) for p in PROMPTS])
        assert [_ids(a) for a in answers] == [_expected(dep, p, 32) for p in PROMPTS]
        calls[continued] = sum(1 for m, _, _ in fake.log if m == "tensorrt_llm")
    # tokens the target produced are no longer thrown away and asked for again
    assert calls[True] < calls[False]

"""distill's checkpoints survive a crash or a power loss whole, a torn one is refused with one
line, and two runs never share a work folder: each refusal exits 2 before any work, writing nothing."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_distill import eagle_spec, prompts_file, small_opts
from typer.testing import CliRunner

from trtspec import files
from trtspec.cli.app import app
from trtspec.distill.run import distill
from trtspec.spec import load_spec

runner = CliRunner()


def _listing(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


def _record_syncs(monkeypatch) -> list[tuple[str, str]]:
    """(event, path) for every fsync and rename trtspec.files makes, in order."""
    events: list[tuple[str, str]] = []
    fsync, replace = os.fsync, os.replace

    def recorded_fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def recorded_replace(src, dst) -> None:
        events.append(("rename", str(dst)))
        replace(src, dst)

    monkeypatch.setattr(files.os, "fsync", recorded_fsync)
    monkeypatch.setattr(files.os, "replace", recorded_replace)
    return events


def test_a_durable_write_syncs_the_file_and_its_folder_before_and_after_the_rename(tmp_path, monkeypatch):
    events = _record_syncs(monkeypatch)
    path = tmp_path / "ckpt.pt"
    files.write_bytes_atomic(path, b"state", durable=True)
    assert path.read_bytes() == b"state"
    (synced_file, folder_before, rename, folder_after) = events
    assert synced_file[0] == "fsync" and Path(synced_file[1]).parent == tmp_path and synced_file[1] != str(path)  # the temp file
    assert folder_before == ("fsync", str(tmp_path)) and rename == ("rename", str(path)) and folder_after == folder_before


def test_every_training_checkpoint_is_written_durably(tmp_path, tiny_ckpts, monkeypatch):
    events = _record_syncs(monkeypatch)
    loaded = load_spec(eagle_spec(tmp_path, tiny_ckpts["target"]))
    distill(loaded, small_opts(tmp_path))
    ckpt = str(tmp_path / ".head.distill" / "checkpoint.pt")
    renames = [i for i, e in enumerate(events) if e == ("rename", ckpt)]
    assert len(renames) == 3  # steps 3 and 6 (eval_every 3), and the end of training
    for i in renames:
        assert events[i - 1] == events[i + 1] == ("fsync", str(tmp_path / ".head.distill"))
        assert events[i - 2][0] == "fsync" and Path(events[i - 2][1]).name.startswith(".checkpoint.pt.")


def _torn_checkpoint(work: Path) -> Path:
    buf = io.BytesIO()
    torch.save({"head": {"w": torch.zeros(64, 64)}, "step": 3}, buf)
    work.mkdir(parents=True)
    ckpt = work / "checkpoint.pt"
    ckpt.write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])  # a write cut off half way
    return ckpt


@pytest.mark.parametrize("damage", ["torn", "foreign"])
def test_a_torn_or_foreign_checkpoint_is_refused_on_resume_with_one_line_and_nothing_written(tmp_path, tiny_ckpts, damage):
    spec = eagle_spec(tmp_path, tiny_ckpts["target"])
    prompts = prompts_file(tmp_path)
    ckpt = _torn_checkpoint(tmp_path / ".head.distill")
    if damage == "foreign":
        buf = io.BytesIO()
        torch.save({"step": 3}, buf)  # loads, but is not a distill checkpoint
        ckpt.write_bytes(buf.getvalue())
    before = _listing(tmp_path)
    r = runner.invoke(app, ["distill", str(spec), "--prompts", str(prompts), "--resume"])
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: --resume: ") and "Traceback" not in r.output
    assert str(ckpt) in lines[0] and "delete it and run without --resume" in lines[0]
    assert _listing(tmp_path) == before  # no data generated, nothing trained, the lock gone


def test_a_second_run_into_the_same_output_is_refused_before_any_work(tmp_path, tiny_ckpts):
    spec = eagle_spec(tmp_path, tiny_ckpts["target"])
    prompts = prompts_file(tmp_path)
    work = tmp_path / ".head.distill"
    work.mkdir()
    lock = work / "lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); "
         "f.write(str(os.getpid())); f.flush(); print('held', flush=True); sys.stdin.read()", str(lock)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        before = _listing(tmp_path)
        r = runner.invoke(app, ["distill", str(spec), "--prompts", str(prompts)])
        after = _listing(tmp_path)
    finally:
        holder.stdin.close()
        holder.wait(10)
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "Traceback" not in r.output
    assert f"pid {holder.pid}, holding the lock {lock}" in lines[0]
    assert after == before and not (tmp_path / "head").exists()

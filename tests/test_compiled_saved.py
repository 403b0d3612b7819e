"""Compiled step programs saved to disk (engines/torch/saved.py): a second process loads them and
traces nothing, with logits bitwise those of torch.compile's own path; a torn or foreign file is
compiled again, said in one line; an eager engine saves nothing."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from trtspec.engines.torch import saved

# One process: load the tiny pair compiled (the other engine first), run, on the engine given, a
# prefill, a decode step and a two-row step; save the logits; print what it traced and loaded.
# argv: engine folder, output file, "plain" (torch.compile's path: no saved programs) or "saved".
_RUN = """
import json, sys, torch
from pathlib import Path
from trtspec.engines.torch import compiled, saved
from trtspec.engines.torch.engine import ForwardItem, TorchEngine
folder = Path(sys.argv[1])
other = folder.parent / ("target" if folder.name == "draft" else "draft")
other = TorchEngine.load(other, slots=1)  # its Linears named in the process too
engine = TorchEngine.load(Path(sys.argv[1]), slots=2)
if sys.argv[3] == "plain":
    engine.program.saved = None
seq = [5, 17, 9, 30, 2, 11, 40]
outs = engine.run([ForwardItem(seq, 3)]) + engine.run([ForwardItem(seq + [7], 1)])
outs += engine.run([ForwardItem(seq + [7, 3], 1), ForwardItem(seq[:5] + [4], 1)])
torch.save(outs, sys.argv[2])
from torch._dynamo.utils import counters
print(json.dumps({"traced": counters["stats"]["unique_graphs"], "loaded": saved.loads}))
"""


@pytest.fixture(scope="module")
def target(built):
    return built("same").target.folder


def _run(target, tmp_path, mode: str, out: str, **extra: str) -> tuple[dict, list[str], list[torch.Tensor]]:
    env = os.environ | {
        "TRTSPEC_CACHE": str(tmp_path / "cache"),  # programs saved here, by this test only
        "TORCHINDUCTOR_CACHE_DIR": os.environ["TORCHINDUCTOR_CACHE_DIR"],  # the session's C++
        "TRTSPEC_COMPILE": "1",
        "TRTSPEC_THREADS": "1",  # one count: every process runs the same programs
    }
    env |= extra
    r = subprocess.run(
        [sys.executable, "-c", _RUN, str(target), str(tmp_path / out), mode],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    notes = [line for line in r.stderr.splitlines() if line.startswith("trtspec: the") and " step " in line]  # programs' lines
    return json.loads(r.stdout.strip().splitlines()[-1]), notes, torch.load(tmp_path / out)


def _files(tmp_path):
    return sorted((tmp_path / "cache" / "programs").glob("*/*.bin"))


def test_a_second_process_loads_the_saved_programs_traces_nothing_and_answers_the_same(target, tmp_path):
    plain, _, expected = _run(target, tmp_path, "plain", "plain.pt")
    assert plain["traced"] > 0 and plain["loaded"] == 0 and not _files(tmp_path)
    first, notes, got = _run(target, tmp_path, "saved", "first.pt")
    assert first["traced"] > 0 and not notes, notes  # compiled, and saved without a word
    assert len(_files(tmp_path)) >= 4  # one row, one token and several; two rows; their heads
    second, notes, again = _run(target, tmp_path, "saved", "second.pt")
    variants = sum(len(pickle.loads(f.read_bytes())["variants"]) for f in _files(tmp_path))
    assert second == {"traced": 0, "loaded": variants} and not notes, (second, notes)
    for a, b, c in zip(expected, got, again, strict=True):
        assert torch.equal(a, b) and torch.equal(b, c)

    # a torn file: compiled again in one line, the same answer, and replaced by a sound one
    torn = _files(tmp_path)[0]
    torn.write_bytes(torn.read_bytes()[: torn.stat().st_size // 2])
    third, notes, after = _run(target, tmp_path, "saved", "third.pt")
    assert len(notes) == 1 and "does not load" in notes[0] and torn.name.removesuffix(".bin") in notes[0], notes
    assert third["traced"] == 1
    assert all(torch.equal(a, b) for a, b in zip(expected, after, strict=True))
    assert pickle.loads(torn.read_bytes())["format"] == saved.FORMAT


@pytest.mark.parametrize("layout", ["0", "panel"])  # PyTorch's int4/int8 kernels; the panel kernel
def test_a_bfloat16_quantized_engines_programs_are_saved_and_loaded(built, tmp_path, layout):
    """The demo's draft's kind (int4 layers, an int8 LM head, bfloat16): every program, its LM
    head's included, is saved and loaded. A quantized Linear kept its activation dtype as an
    attribute the program does not read, and torch's saved guards then read every bfloat16 tensor
    back as missing: the LM head programs were compiled in each process, said in one line."""
    folder = built("draft", **{"draft.quantization": "int4_wo", "draft.dtype": "bfloat16"}).draft.folder
    shared = Path(os.environ["TRTSPEC_CACHE"]) / "native"  # the panel kernel, built once a session
    shared.mkdir(parents=True, exist_ok=True)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "native").symlink_to(shared, target_is_directory=True)
    first, notes, got = _run(folder, tmp_path, "saved", "first.pt", TRTSPEC_ONEDNN=layout)
    assert first["traced"] > 0 and not notes, notes
    assert {f.name.split(".")[1].split("-t")[0] for f in _files(tmp_path)} >= {"head-0", "head-1"}
    second, notes, again = _run(folder, tmp_path, "saved", "second.pt", TRTSPEC_ONEDNN=layout)
    variants = sum(len(pickle.loads(f.read_bytes())["variants"]) for f in _files(tmp_path))
    assert second == {"traced": 0, "loaded": variants} and not notes, (second, notes)
    assert all(torch.equal(a, b) for a, b in zip(got, again, strict=True))


def test_a_foreign_file_is_ignored_in_one_line(tmp_path, capsys):
    (tmp_path / "x.bin").write_bytes(pickle.dumps({"format": "another-format", "variants": [b"junk"]}))
    store = saved.SavedPrograms(tmp_path, dict)
    assert store._load("x") == []
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "does not load" in lines[0] and "another-format" not in lines[0]
    assert store._load("absent") == [] and not capsys.readouterr().err


def test_marks_live_only_while_tracing():
    t, layers = torch.zeros(3, 4), [torch.zeros(2, 5)]
    torch._dynamo.maybe_mark_dynamic(t, 0)
    torch._dynamo.maybe_mark_dynamic(layers[0], 0)
    assert hasattr(t, "_has_dynamo_dim_marking")
    saved.unmark((t, layers))
    assert not any(hasattr(x, a) for x in (t, layers[0]) for a in saved._MARKS)


def test_an_eager_engine_saves_nothing(target, tmp_path, monkeypatch):
    from trtspec.engines.torch.engine import ForwardItem, TorchEngine

    monkeypatch.setenv("TRTSPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("TRTSPEC_COMPILE", "0")
    engine = TorchEngine.load(target, slots=1)
    engine.run([ForwardItem([1, 2, 3], 1)])
    assert engine.program is None and not (tmp_path / "programs").exists()


# -- old program folders ---------------------------------------------------------------------------

DAY = 86400


def _folder(root: Path, name: str, days_unused: float, marker: bool = True) -> Path:
    """A program folder last used ``days_unused`` ago (by its marker, or by its own time)."""
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "draft-0.head-0-t1.bin").write_bytes(b"x")
    when = time.time() - days_unused * DAY
    if marker:
        (folder / saved.USED).touch()
        os.utime(folder / saved.USED, (when, when))
    os.utime(folder, (when, when))
    return folder


def test_folders_unused_for_keep_days_are_removed_and_nothing_else(tmp_path):
    root, old = tmp_path / "programs", saved.KEEP_DAYS + 1
    stale, legacy = _folder(root, "a" * 24, old), _folder(root, "b" * 24, old, marker=False)
    recent = _folder(root, "c" * 24, old)
    (recent / saved.USED).touch()  # read now by another process
    kept, other = _folder(root, "d" * 24, old), _folder(root, "not-a-program-folder", old)
    outside = _folder(tmp_path / "elsewhere", "e" * 24, old)
    (root / ("f" * 24)).symlink_to(outside, target_is_directory=True)
    leftover = _folder(root, ".removing-" + "9" * 24 + "-1", old)  # a pruner killed midway
    assert sorted(saved.prune(root, keep=kept.name)) == [stale.name, legacy.name]
    assert sorted(p.name for p in root.iterdir()) == sorted([recent.name, kept.name, other.name, "f" * 24, saved.LOCK])
    assert (outside / "draft-0.head-0-t1.bin").exists() and not leftover.exists()
    assert saved.prune(root, keep=kept.name, now=time.time() + (saved.KEEP_DAYS - 1) * DAY) == []
    assert saved.prune(root, keep=kept.name, now=time.time() + (saved.KEEP_DAYS + 1) * DAY) == [recent.name]


def test_a_folder_being_read_is_never_removed(tmp_path):
    from trtspec.files import file_lock

    root = tmp_path / "programs"
    old = _folder(root, "a" * 24, saved.KEEP_DAYS + 1)
    with file_lock(root / saved.LOCK, shared=True) as held:  # as a loading process holds it
        assert held and saved.prune(root, keep="") == [] and old.exists()
    assert saved.prune(root, keep="") == [old.name] and not old.exists()


def test_a_folder_that_vanishes_while_pruned_is_passed_over(tmp_path, monkeypatch):
    root = tmp_path / "programs"
    gone, old = _folder(root, "a" * 24, saved.KEEP_DAYS + 1), _folder(root, "b" * 24, saved.KEEP_DAYS + 1)
    rename = os.rename

    def racing(src, dst):  # another pruner got there first
        if Path(src).name == gone.name:
            raise FileNotFoundError(src)
        rename(src, dst)

    monkeypatch.setattr(saved.os, "rename", racing)
    assert saved.prune(root, keep="") == [old.name]


class _Program:
    """What _save reads of a program: its serialized bytes."""

    @staticmethod
    def serialize(program, external):
        return type("Saved", (), {"serialized_data": b"program"})


def test_reading_marks_a_folder_used_and_writing_prunes_its_old_siblings(tmp_path, monkeypatch):
    root = tmp_path / "programs"
    old, mine = _folder(root, "a" * 24, saved.KEEP_DAYS + 1), _folder(root, "b" * 24, saved.KEEP_DAYS + 1)
    (mine / "x.bin").write_bytes(pickle.dumps({"format": saved.FORMAT, "variants": []}))
    store = saved.SavedPrograms(mine, dict)
    assert store._load("x") == [] and time.time() - saved.last_used(mine) < DAY  # read: used now
    monkeypatch.setattr(saved, "_pruned", set())
    store.variants["y"] = [_Program()]
    store._save("y")
    assert (mine / "y.bin").exists() and not old.exists() and mine.exists()

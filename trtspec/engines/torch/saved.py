"""Compiled step programs saved to disk, so that the next process loads them instead of tracing.

Why: torch.compile keeps the C++ it generates in inductor's cache, but a new process still
traces the whole step again (dynamo over every layer, then AOT autograd): 20-50 s a kind of
step on a 2-core CPU before its first token. torch's ahead-of-time precompile
(``torch.compile(...).aot_compile``) returns the traced program with its guards, which
``torch.compiler.load_compiled_function`` reads back in about a second.

What is saved: the program's bytecode, its guards and inductor's compiled graph; never a weight.
Every tensor the program reads (weights, packed kernel layouts, the KV cache) is an input read
from the live engine at each call, and the Linear modules it names are bound to this process's
modules by name on loading (``external``).

What the modules a program calls directly may hold: no ``torch.dtype`` (nor another object shared
process-wide) as an attribute the program does not read. torch saves a program's guards with the
modules it calls, and replaces each such unread attribute by a placeholder matched by identity:
a dtype left there (a quantized Linear's activation dtype) read back every tensor of that dtype in
the guards as missing, and the program could not be saved (quant.py's and native.py's Linears
keep their dtype by name).

Where: ``$TRTSPEC_CACHE/programs/<key>/<name>.bin``, ``key`` a digest of everything a program
depends on (the machine, torch, trtspec's traced code, the weights, the kernel choice); ``name``
the kind of step and the thread count. A file holds every variant met of that name (a variant per
set of guards: e.g. a one-slot KV cache and a many-slot one). Written atomically; a file that does
not load (torn, another torch, another version of this format) is compiled again and replaced,
said in one line on stderr.

Kept while used: a process that reads or writes a program touches its folder's ``used`` marker,
and a process that writes a program removes, once, the sibling folders no process has used for
KEEP_DAYS (``prune``): every change of machine, threads, torch, code or weights makes a new
folder, and the old ones would stay for ever. Readers and writers share ``programs/.lock``; the
pruner takes it alone or skips (never removing a folder being read), and moves each folder aside
under a hidden name before removing it, so that a removal cut short is never read as programs.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import pickle
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from trtspec.files import file_lock, write_bytes_atomic

FORMAT = "trtspec-programs-1"
# what torch's dim markings leave on a tensor: a program loaded from disk guards that its inputs
# carry none (their state when it was traced is not saved), so marks live only while tracing
_MARKS = (
    "_dynamo_dynamic_indices",
    "_dynamo_weak_dynamic_indices",
    "_dynamo_unbacked_indices",
    "_dynamo_strict_unbacked_indices",
    "_dynamo_static_indices",
    "_dynamo_hint_overrides",
    "_has_dynamo_dim_marking",
)
# the trtspec sources a program traces: an edit to any of them makes every saved program stale
_TRACED = ("compiled.py", "model.py", "native.py", "quant.py")

MAX_VERIFIED = 1024  # call signatures remembered per engine before the memory starts again
loads = 0  # programs loaded from disk in this process (compiled.compiles counts them too)

KEEP_DAYS = 14  # a program folder no process has read or written for this long is removed (prune)
USED = "used"  # the marker in a program folder, touched whenever a process reads or writes there
LOCK = ".lock"  # in programs/: shared by readers and writers, held alone by the pruner
_FOLDER = re.compile(r"[0-9a-f]{24}")  # a program folder's name (compiled.saved_folder's digest)
_REMOVING = ".removing-"  # a folder moved aside to be removed
_pruned: set[Path] = set()  # the programs/ folders this process has pruned (once each)


def code_digest() -> str:
    """A digest of the trtspec code a program is traced from."""
    here = Path(__file__).parent
    h = hashlib.sha256()
    for name in _TRACED:
        h.update((here / name).read_bytes())
    return h.hexdigest()[:16]


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _tensors(v)


def unmark(args: tuple) -> None:
    """Remove every dynamic-size marking from the tensors in ``args`` (lists included)."""
    for t in _tensors(args):
        for attr in _MARKS:
            if attr in t.__dict__:
                delattr(t, attr)


class SavedPrograms:
    """The saved programs of one StepProgram: ``find`` returns the program for a call's arguments,
    loaded from disk or compiled now (and saved), or None where this call cannot have one (then
    the caller runs its torch.compile'd function, as a process without saved programs does)."""

    def __init__(self, folder: Path, external: Callable[[], dict[str, Any]]):
        self.folder = folder
        self.external = external  # key -> object bound by name, not saved (modules, the program)
        self.variants: dict[str, list[Any]] = {}  # name -> AOTCompiledFunction, loaded or compiled
        self.refused: dict[str, str] = {}  # name -> why it cannot be saved: torch.compile's path
        self.unsaid: set[str] = set()  # refused names not yet said (said once compiled: said())
        # (name, call signature) -> the program whose guards accepted a call of that signature
        self.verified: dict[tuple[str, tuple], Callable] = {}

    def find(self, name: str, fn: Callable, args: tuple, mark: Callable[[], None]) -> Callable | None:
        """The program ``name`` whose guards accept ``args`` (``fn``'s arguments). ``mark`` marks
        the dynamic sizes of ``args`` for a trace. Guards are checked once per call signature
        (``signature``): a later call of the same signature runs the program they accepted."""
        if name in self.refused:
            return None
        key = (name, signature(args))
        if key in self.verified:
            return self.verified[key]
        if name not in self.variants:
            self.variants[name] = self._load(name)
        found = next((p for p in self.variants[name] if p.guard_check(*args)), None)
        if found is None:
            try:
                found = self._compile(fn, args, mark)
            except Exception as err:  # a program torch cannot save (an op, a guard): compiled as before
                self.refused[name] = _first_line(err)
                self.unsaid.add(name)
                return None
            self.variants[name].append(found)
            self._save(name)
        if len(self.verified) >= MAX_VERIFIED:  # many prompt lengths: start again rather than grow
            self.verified.clear()
        self.verified[key] = found.fn
        return found.fn

    def said(self, name: str) -> None:
        """Say once why ``name`` is compiled in this process only, once torch.compile's path
        compiled it (where that fails too, the engine's own line says why it runs eager)."""
        if name in self.unsaid:
            self.unsaid.discard(name)
            print(f"trtspec: the {name} step is compiled in this process only: {self.refused[name]}", file=sys.stderr)

    def _compile(self, fn: Callable, args: tuple, mark: Callable[[], None]) -> Any:
        mark()
        try:
            program = torch.compile(fn, fullgraph=True, dynamic=False).aot_compile((args, {}))
        finally:
            unmark(args)
        data = program.serialize(program, self.external()).serialized_data
        # the program run is the one read back, as the next process will read it
        program = self._read(data)
        if not program.guard_check(*args):
            raise RuntimeError("the program read back refuses the arguments it was traced with")
        return program

    def _read(self, data: bytes) -> Any:
        return torch.compiler.load_compiled_function(io.BytesIO(data), external_data=self.external())

    def _load(self, name: str) -> list[Any]:
        path = self.folder / f"{name}.bin"
        if not path.exists():
            return []
        with file_lock(self.folder.parent / LOCK, shared=True):  # never pruned while read
            if not path.exists():  # pruned before the lock was had
                return []
            _mark_used(self.folder)
            return self._read_file(name, path)

    def _read_file(self, name: str, path: Path) -> list[Any]:
        try:
            stored = pickle.loads(path.read_bytes())
            if not (isinstance(stored, dict) and stored.get("format") == FORMAT):
                raise ValueError(f"not a {FORMAT} file")
            programs = [self._read(data) for data in stored["variants"]]
        except Exception as err:  # torn, foreign or stale: compiled again and replaced
            print(
                f"trtspec: the saved {name} step at {path} does not load ({_first_line(err)}); compiling it again",
                file=sys.stderr,
            )
            return []
        global loads
        loads += len(programs)
        return programs

    def _save(self, name: str) -> None:
        data = [p.serialize(p, self.external()).serialized_data for p in self.variants[name]]
        blob = pickle.dumps({"format": FORMAT, "variants": data})
        try:
            with file_lock(self.folder.parent / LOCK, shared=True):  # never pruned while written
                write_bytes_atomic(self.folder / f"{name}.bin", blob)
                _mark_used(self.folder)
        except OSError as err:  # a read-only cache: the next process compiles it too
            print(f"trtspec: the {name} step could not be saved ({err}); the next process compiles it again", file=sys.stderr)
            return
        if self.folder.parent not in _pruned:
            _pruned.add(self.folder.parent)
            prune(self.folder.parent, self.folder.name)


def _mark_used(folder: Path) -> None:
    with contextlib.suppress(OSError):  # a read-only cache: nothing is pruned there either
        (folder / USED).touch()


def last_used(folder: Path) -> float:
    """When a process last read or wrote a program in ``folder``: its marker's time, or the
    folder's own where later (a program written into it); now where neither can be read."""
    times = []
    for path in (folder / USED, folder):
        with contextlib.suppress(OSError):
            times.append(path.stat().st_mtime)
    return max(times, default=time.time())


def prune(root: Path, keep: str, now: float | None = None) -> list[str]:
    """Remove the program folders in ``root`` (``$TRTSPEC_CACHE/programs``) that no process has
    used for KEEP_DAYS, ``keep`` aside; returns their names. Only while no process reads or writes
    a program there (else nothing now: the next writer prunes); nothing but program folders (no
    link, no other name) is touched, and one that vanishes meanwhile is passed over."""
    now = time.time() if now is None else now
    removed: list[str] = []
    with contextlib.suppress(OSError), file_lock(root / LOCK, wait=False) as held:
        for entry in os.scandir(root) if held else ():
            if entry.name == keep or not _FOLDER.fullmatch(entry.name) or not entry.is_dir(follow_symlinks=False):
                continue
            if now - last_used(Path(entry.path)) >= KEEP_DAYS * 86400:
                with contextlib.suppress(OSError):  # gone already, or a name taken: passed over
                    os.rename(entry.path, root / f"{_REMOVING}{entry.name}-{os.getpid()}")
                    removed.append(entry.name)
    with contextlib.suppress(OSError):  # these, and any a pruner killed midway left
        for entry in os.scandir(root):
            if entry.name.startswith(_REMOVING) and entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
    return removed


def signature(args: tuple) -> tuple:
    """What decides which variant may run a call, read in microseconds: each tensor's size,
    strides, dtype, device and autograd state, which arguments are the same tensor, every other
    argument's value (or, for an object such as the StepProgram, its identity), and the grad
    and inference modes. torch's guard check reads all of that and also every module and weight
    the program reaches (a median 0.85 ms a call for the demo draft on a 2-core EPYC); those belong to
    the loaded engine and do not change while it serves, so the guards need checking only once
    per signature."""
    seen: dict[int, int] = {}
    out: list[object] = [torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.get_default_dtype()]
    stack = list(reversed(args))
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            first = seen.setdefault(id(v), len(seen))
            out.append((first, v.shape, v.stride(), v.dtype, v.device, v.requires_grad, v.is_inference()))
        elif isinstance(v, list | tuple):
            out.append((type(v), len(v)))
            stack.extend(reversed(v))
        elif v is None or isinstance(v, bool | int | float | str):
            out.append((type(v), v))
        else:
            out.append(("object", id(v)))
    return tuple(out)


def _first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0][:200] if lines else ''}"

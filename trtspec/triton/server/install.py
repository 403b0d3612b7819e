"""Where tritonserver is and the environment its Python backend needs.

Three places provide a server, tried in this order: ``tritonserver`` on PATH, the NVIDIA
container layout ``/opt/tritonserver``, and the server bundled in the ``nvidia-pytriton`` wheel.
The wheel ships Python-backend stubs for several Python versions beside the backend; the one
matching the serving venv is copied into a private backend directory under trtspec's cache
(site-packages is never modified).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from trtspec.cache import cache_root
from trtspec.errors import ServerError
from trtspec.files import write_text_atomic

STUB_NAME = "triton_python_backend_stub"
_OPT_BINARY = Path("/opt/tritonserver/bin/tritonserver")

# Allocators that hand freed memory back to the system, preloaded into tritonserver (and so
# into its stubs), as Triton's documentation on memory growth recommends. Each name -> its
# shared library (Debian packages libjemalloc2 and libtcmalloc-minimal4). "auto" takes jemalloc
# when installed, else glibc's malloc ("glibc" preloads nothing): measured on the SmolLM2 demo
# (lab/refused_memory.py, two refused 256 MiB inputs then 32 ordinary requests, operations.md:
# memory), tritonserver kept +65 MiB with glibc, +11 MiB with jemalloc; tcmalloc kept more
# than glibc in the same run with Triton's gRPC object pool on (+1.1 GiB against +0.6 GiB).
ALLOCATORS: dict[str, str] = {"jemalloc": "libjemalloc.so.2", "tcmalloc": "libtcmalloc_minimal.so.4"}
AUTO_ALLOCATOR = "jemalloc"
# jemalloc returns freed pages only as later allocations in the same arena run its decay, so a
# process that goes quiet after a large request keeps them: its own thread purges them within
# about a second instead (a refused 2 x 64 MiB left tritonserver +106 MiB four requests later).
JEMALLOC_CONF = "background_thread:true,dirty_decay_ms:1000,muzzy_decay_ms:0"
# tritonserver runs about 250 threads and each thread that frees memory keeps a cache of its own
# (tcache) that fills as more of them handle requests, and over jemalloc's arenas (4 per core)
# its heap pages stayed partly used after a peak: with the caches off and one arena its soak growth
# fell within the goal (figures: lab/RECORDS.md and operations.md, memory). The engine stubs
# keep both: without their caches, served steps ran slower (lab/RECORDS.md: memory). The Python backend starts every stub as
# `bash -c "exec STUB ..."`, and bash first runs the file named by BASH_ENV, which gives the stubs
# JEMALLOC_CONF back (stub_env_file).
SERVER_JEMALLOC_CONF = JEMALLOC_CONF + ",tcache:false,narenas:1"
# oneDNN keeps a compiled primitive for every matmul shape the engines meet
# (ONEDNN_PRIMITIVE_CACHE_CAPACITY, 1024 by default) and PyTorch's ideep layer, which runs the
# engines' packed matmuls (_linear_pointwise), one computation per shape of its own
# (LRU_CACHE_CAPACITY, 1024 by default); oneDNN keys a primitive by the thread count that made
# it, too. Before the engines ran their matmuls in fixed row counts every new prefill length was a
# new entry (in process, the SmolLM2 target kept +1.2 MiB for every distinct prefill length
# with oneDNN's cache off; operations.md: memory). Now a packed weight meets at most 32 row
# counts (engines/torch/model.py row_blocks), a decoder has 5 packed weight shapes (q/k/v and
# gate/up fused, o, down, the LM head) and the thread governor compares at most 4 counts
# (engines/torch/threads.py candidates): 640 entries hold every shape an engine stub meets, so
# neither cache evicts and rebuilds (at 256, the bound before, a 2-core machine's 32 x 5 x 2 =
# 320 did not fit). An engine makes the whole set at load, at each of those counts
# (engines/torch/model.py warm_matmuls): met a few entries at a time through the governor's
# probes instead, the set at its other count kept a served stub growing (operations.md: memory).
SHAPE_CACHE_CAPACITY = 32 * 5 * 4
# What bounds the engines' caches in the server's environment; a user's own value wins.
CACHE_ENV = {
    "ONEDNN_PRIMITIVE_CACHE_CAPACITY": SHAPE_CACHE_CAPACITY,
    "LRU_CACHE_CAPACITY": SHAPE_CACHE_CAPACITY,
}
# glibc's malloc (no allocator preloaded) keeps what a freed buffer held unless the buffer was
# mmapped: a gRPC message is read in slices of 64 to 128 KiB, under glibc's 128 KiB threshold, so
# two refused 256 MiB inputs filled new 64 MiB arena heaps that a live object at their top kept
# (tritonserver +221 MiB); its threshold also rises to what was freed, up to 32 MiB. Fixed at 32
# KiB in tritonserver only, every larger buffer is mapped and unmapped on its own: +4.5 MiB
# (operations.md, memory). The stubs keep glibc's own thresholds, which keep their steps'
# buffers for reuse, as they keep jemalloc's thread caches (stub_env_file unsets them).
SERVER_GLIBC_ENV = {"MALLOC_MMAP_THRESHOLD_": "32768", "MALLOC_TRIM_THRESHOLD_": "131072"}
# Names or a shared library's path (one a user brought without root); "auto" otherwise.
ALLOCATOR_ENV = "TRTSPEC_ALLOCATOR"
Allocator = Literal["auto", "jemalloc", "tcmalloc", "glibc"]
_LIB_DIRS = (f"/usr/lib/{sysconfig.get_config_var('MULTIARCH') or 'x86_64-linux-gnu'}", "/usr/lib64", "/usr/lib", "/lib64")


@dataclass(frozen=True)
class TritonInstall:
    """Where a tritonserver and its companions live.

    ``stubs_dir`` and ``libs_dir`` are set only for the nvidia-pytriton wheel layout, whose
    backend directory lacks the stub and whose shared libraries sit in ``nvidia_pytriton.libs``.
    """

    binary: Path
    backend_dir: Path | None
    cache_dir: Path | None
    stubs_dir: Path | None = None
    libs_dir: Path | None = None


@dataclass(frozen=True)
class PythonEnv:
    """The interpreter the Python-backend stub must embed: a venv and its base interpreter."""

    prefix: Path  # the venv directory (sys.prefix)
    version: str  # "3.11": selects the stub build
    libdir: Path  # base interpreter's LIBDIR, holding the libpython the stub must load


def find_tritonserver() -> TritonInstall:
    """Return the first tritonserver found on PATH, in /opt/tritonserver, or in nvidia-pytriton."""
    on_path = shutil.which("tritonserver")
    if on_path:
        return _install_at(Path(on_path).resolve())
    if _OPT_BINARY.is_file():
        return _install_at(_OPT_BINARY)
    spec = importlib.util.find_spec("pytriton")  # locate only: importing pytriton is slow
    if spec is not None and spec.submodule_search_locations:
        binary = Path(spec.submodule_search_locations[0]) / "tritonserver" / "bin" / "tritonserver"
        if binary.is_file():
            return _install_at(binary)
    raise ServerError(
        "no tritonserver found: put one on PATH, run inside an NVIDIA Triton container "
        "(/opt/tritonserver), or install the bundled server with `pip install nvidia-pytriton`"
    )


def _install_at(binary: Path) -> TritonInstall:
    root = binary.parent.parent
    stubs = root / "python_backend_stubs"
    libs = root.parent.parent / "nvidia_pytriton.libs"  # site-packages/nvidia_pytriton.libs
    return TritonInstall(
        binary=binary,
        backend_dir=_dir_or_none(root / "backends"),
        cache_dir=_dir_or_none(root / "caches"),
        stubs_dir=_dir_or_none(stubs),
        libs_dir=_dir_or_none(libs) if stubs.is_dir() else None,
    )


def _dir_or_none(path: Path) -> Path | None:
    return path if path.is_dir() else None


def python_env(venv: str | os.PathLike[str] | None = None) -> PythonEnv:
    """Describe ``venv`` (default: the running interpreter's environment)."""
    if venv is None or Path(venv).resolve() == Path(sys.prefix).resolve():
        return PythonEnv(
            prefix=Path(sys.prefix),
            version=f"{sys.version_info[0]}.{sys.version_info[1]}",
            libdir=Path(str(sysconfig.get_config_var("LIBDIR"))),
        )
    python = Path(venv) / "bin" / "python"
    if not os.access(python, os.X_OK):
        raise ServerError(f"{venv} is not a Python environment (no executable bin/python)")
    # Inside a venv, sysconfig's LIBDIR already names the *base* interpreter's lib directory.
    probe = (
        "import sys, sysconfig; print(sys.prefix); print('%d.%d' % sys.version_info[:2]); "
        "print(sysconfig.get_config_var('LIBDIR'))"
    )
    try:
        out = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=60, check=True).stdout.split(
            "\n"
        )
    except (OSError, subprocess.SubprocessError) as err:
        raise ServerError(f"could not query the interpreter {python}: {err}") from err
    return PythonEnv(prefix=Path(out[0]), version=out[1], libdir=Path(out[2]))


def default_cache_dir() -> Path:
    """trtspec's cache (see trtspec.cache)."""
    return cache_root()


def prepare_backend_dir(install: TritonInstall, python_version: str, cache_root: Path | None = None) -> Path | None:
    """Return a ``--backend-directory`` whose python/ backend holds the stub for ``python_version``.

    Installs that already carry a stub (containers) are used as they are. For the pytriton
    wheel the python backend is copied, with the right stub, into the cache: the backend looks
    for the stub next to ``libtriton_python.so``, and site-packages is not ours to modify.
    """
    if install.stubs_dir is None or install.backend_dir is None:
        return install.backend_dir
    stub = install.stubs_dir / python_version / STUB_NAME
    if not stub.is_file():
        have = sorted(p.name for p in install.stubs_dir.iterdir() if (p / STUB_NAME).is_file())
        raise ServerError(
            f"the bundled tritonserver has no Python-backend stub for Python {python_version} "
            f"(it has {', '.join(have)}); serve from a venv of one of those versions"
        )
    source = install.backend_dir / "python"
    # Key by the source files' identity so a pytriton upgrade gets a fresh copy.
    fingerprint = "|".join(f"{p}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in (stub, source / "libtriton_python.so"))
    key = hashlib.sha256(fingerprint.encode()).hexdigest()[:12]
    parent = (cache_root or default_cache_dir()) / "tritonserver-backends"
    target = parent / f"py{python_version}-{key}"
    if (target / "python" / STUB_NAME).is_file():
        return target
    parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent callers never see a half-copied backend.
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=parent))
    try:
        shutil.copytree(source, staging / "python", ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy2(stub, staging / "python" / STUB_NAME)
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / "python" / STUB_NAME).is_file():  # not a lost race: a real error
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def find_allocator(name: Allocator | str, lib_dirs: Sequence[str] = _LIB_DIRS) -> Path | None:
    """The shared library of allocator ``name`` ("auto": AUTO_ALLOCATOR when installed; a path:
    that file); None for "glibc" and for "auto" without it. A named one that is missing is an
    error that says which package provides it."""
    if name == "glibc":
        return None
    if "/" in name:  # a library's path
        if not Path(name).is_file():
            raise ServerError(f"allocator {name} is not a file; give the path of an allocator's shared library, or auto or glibc")
        return Path(name)
    candidate = AUTO_ALLOCATOR if name == "auto" else name
    if candidate not in ALLOCATORS:
        raise ServerError(f"unknown allocator {candidate!r}; choose one of auto, glibc, {', '.join(ALLOCATORS)}")
    for folder in lib_dirs:
        path = Path(folder) / ALLOCATORS[candidate]
        if path.is_file():
            return path
    if name == "auto":
        return None
    package = {"jemalloc": "libjemalloc2", "tcmalloc": "libtcmalloc-minimal4"}[name]
    raise ServerError(
        f"allocator {name} is not installed (no {ALLOCATORS[name]} in {', '.join(lib_dirs)}); "
        f"install it (Debian/Ubuntu: apt-get install {package}) or choose allocator auto or glibc"
    )


def server_env(
    venv: str | os.PathLike[str] | PythonEnv | None = None,
    install: TritonInstall | None = None,
    base: Mapping[str, str] | None = None,
    allocator: Allocator = "auto",
) -> dict[str, str]:
    """The environment for tritonserver so that its Python-backend stub runs in ``venv``.

    The stub ignores PYTHONPATH; it finds the venv through the ``python`` first on PATH. It
    links ``libpython3.X.so`` dynamically, and must get the base interpreter's copy, not a
    system one of another patch level (undefined symbols), hence LIBDIR first on
    LD_LIBRARY_PATH. A relocated stub/backend also needs the wheel's bundled libraries.
    ``allocator`` (find_allocator; "auto": the environment's TRTSPEC_ALLOCATOR when set) goes first
    on LD_PRELOAD, with jemalloc's settings for the server (SERVER_JEMALLOC_CONF) and, through
    BASH_ENV, for its stubs (JEMALLOC_CONF) unless the environment sets MALLOC_CONF; with none,
    glibc's malloc gets SERVER_GLIBC_ENV in the server only, unless the environment sets glibc's
    malloc up; oneDNN's and ideep's caches are bounded (CACHE_ENV) unless the
    environment sets them.
    """
    py = venv if isinstance(venv, PythonEnv) else python_env(venv)
    install = install or find_tritonserver()
    env = dict(os.environ if base is None else base)
    env["PATH"] = _prepend([str(py.prefix / "bin")], env.get("PATH", ""))
    libs = [str(py.libdir)] + ([str(install.libs_dir)] if install.libs_dir else [])
    env["LD_LIBRARY_PATH"] = _prepend(libs, env.get("LD_LIBRARY_PATH", ""))
    malloc = find_allocator((env.get(ALLOCATOR_ENV) or "auto") if allocator == "auto" else allocator)
    if malloc is not None:
        env["LD_PRELOAD"] = " ".join([str(malloc), *(p for p in env.get("LD_PRELOAD", "").split() if p != str(malloc))])
        if malloc.name == ALLOCATORS["jemalloc"] and "MALLOC_CONF" not in env:  # a user's own setting wins
            env["MALLOC_CONF"] = SERVER_JEMALLOC_CONF
            env["BASH_ENV"] = str(stub_env_file(f"export MALLOC_CONF={shlex.quote(JEMALLOC_CONF)}", env.get("BASH_ENV")))
    elif not _sets_up_glibc_malloc(env):  # a user's own settings win
        env.update(SERVER_GLIBC_ENV)
        env["BASH_ENV"] = str(stub_env_file(f"unset {' '.join(SERVER_GLIBC_ENV)}", env.get("BASH_ENV")))
    for name, capacity in CACHE_ENV.items():
        env.setdefault(name, str(capacity))  # a user's own setting wins
    return env


def _sets_up_glibc_malloc(env: Mapping[str, str]) -> bool:
    """Whether ``env`` sets glibc's malloc up itself: a MALLOC_ variable (but jemalloc's
    MALLOC_CONF) or a glibc.malloc tunable."""
    return "glibc.malloc." in env.get("GLIBC_TUNABLES", "") or any(k.startswith("MALLOC_") and k != "MALLOC_CONF" for k in env)


def stub_env_file(setting: str, chained: str | None = None) -> Path:
    """The file bash runs (BASH_ENV) before it execs each Python-backend stub: it runs the shell
    line ``setting`` (the stub's allocator settings) and then ``chained`` (a BASH_ENV the user
    had). Named by its content under trtspec's cache, written once, never half-written."""
    text = f"{setting}\n"
    if chained:
        text += f". {shlex.quote(chained)}\n"
    path = cache_root() / "server-env" / f"stub-{hashlib.sha256(text.encode()).hexdigest()[:16]}.sh"
    if not path.is_file() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, text)
    return path


def _prepend(first: Sequence[str], existing: str) -> str:
    rest = [p for p in existing.split(os.pathsep) if p and p not in first]
    return os.pathsep.join([*first, *rest])

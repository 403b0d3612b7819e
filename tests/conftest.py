"""Shared fixtures: tiny seeded checkpoints, specs derived from the shipped tiny spec, and
isolation from the user's real cache (TRTSPEC_CACHE points into a temp dir)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
TINY_SPEC = ROOT / "engine_specs" / "tiny-llama.yaml"


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    """Never touch the user's cache or the network; set before any session fixture runs."""
    saved = {k: os.environ.get(k) for k in ("TRTSPEC_CACHE", "HF_HUB_OFFLINE", "TRTSPEC_COMPILE")}
    os.environ["TRTSPEC_CACHE"] = str(tmp_path_factory.getbasetemp() / "trtspec-cache")
    os.environ["HF_HUB_OFFLINE"] = "1"
    # Engines run eager unless a test asks for the compiled step (test_compiled.py): compiling
    # every engine a test loads would cost minutes; TRTSPEC_COMPILE=1 runs the suite compiled.
    os.environ.setdefault("TRTSPEC_COMPILE", "0")
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session", autouse=True)
def _quiet_machine():
    """Measured choices in this process see a quiet machine: the suite's own neighbours would
    otherwise make a measured kernel or program choice provisional and a later load measure it
    again (contention.py). Tests of that install their own sampler over this one."""
    from trtspec.engines.torch import contention

    saved = contention.snapshot
    contention.snapshot = lambda: None
    yield
    contention.snapshot = saved


@pytest.fixture(scope="session")
def tiny_ckpts(tmp_path_factory) -> dict[str, Path]:
    from trtspec.testing.tiny import make_tiny_pair

    return make_tiny_pair(tmp_path_factory.mktemp("tiny-ckpts"))


def require_trtllm_gpu():
    """Skip the calling test module unless tensorrt_llm is installed and torch sees a CUDA
    device; returns torch."""
    if importlib.util.find_spec("tensorrt_llm") is None:
        pytest.skip("tensorrt_llm is not installed (run inside a TensorRT-LLM container)", allow_module_level=True)
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device", allow_module_level=True)
    return torch


def write_spec(folder: Path, ckpts: dict[str, Path], draft: str | None = "draft", **overrides) -> Path:
    """The shipped tiny-llama spec with its paths pointed at ``ckpts`` and overrides merged
    (dotted keys: {"speculative.method": "ngram"})."""
    data = yaml.safe_load(TINY_SPEC.read_text())
    data["target"]["path"] = str(ckpts["target"])
    if draft is None:
        data.pop("draft")
    else:
        data["draft"]["path"] = str(ckpts[draft])
    data["output_dir"] = str(folder / "engines")
    for dotted, value in overrides.items():
        node = data
        *parents, last = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        if value is None:
            node.pop(last, None)
        else:
            node[last] = value
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "spec.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def built_spec(tmp_path_factory, ckpts: dict[str, Path], name: str, **overrides) -> Path:
    """A tiny spec (write_spec's overrides) in a fresh folder named ``name``, built with
    `trtspec build` as a user would; returns the spec's path."""
    from typer.testing import CliRunner

    from trtspec.cli.app import app

    path = write_spec(tmp_path_factory.mktemp(name), ckpts, **overrides)
    r = CliRunner().invoke(app, ["build", str(path)])
    assert r.exit_code == 0, r.output
    return path


@pytest.fixture(scope="session")
def built(tmp_path_factory, tiny_ckpts):
    """Build a tiny deployment once per (draft, method) and load it in process."""
    from trtspec.engines.build import build
    from trtspec.runtime import Deployment
    from trtspec.spec import load_spec

    cache: dict[tuple, object] = {}

    def get(draft: str | None = "draft", **overrides):
        key = (draft, tuple(sorted(overrides.items())))
        if key not in cache:
            folder = tmp_path_factory.mktemp(f"deploy-{draft}")
            loaded = load_spec(write_spec(folder, tiny_ckpts, draft, **overrides))
            build(loaded, loaded.output_dir())
            cache[key] = Deployment(loaded, loaded.output_dir())
        return cache[key]

    return get


def processes_mentioning(text: str) -> list[str]:
    """Live processes whose command line contains ``text`` (a test's own tmp path), so tests
    can check that servers and their stubs are gone."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if text in cmdline and state != "Z":
            found.append(f"{entry.name}: {cmdline[:200]}")
    return found


def serve_tiny(tmp_path_factory, tiny_ckpts, name: str, **overrides):
    """A real tritonserver on the tiny pair's repository (spec overrides as write_spec's), as a
    generator for fixtures: yields (server, in-process Deployment of the same engines), stops
    the server after. Skips where no tritonserver can be installed."""
    from trtspec.spec import load_spec

    require_tritonserver()
    folder = tmp_path_factory.mktemp(name)
    loaded = load_spec(write_spec(folder, tiny_ckpts, **overrides))
    for server, deployment, _ in serve_built(loaded, folder, tmp_path_factory.mktemp("backend-cache")):
        yield server, deployment


def require_tritonserver() -> None:
    """Skip the calling test where no tritonserver can be installed."""
    from trtspec.errors import ServerError
    from trtspec.triton.server.install import find_tritonserver

    try:
        find_tritonserver()
    except ServerError as err:
        pytest.skip(str(err))


def serve_built(loaded, folder: Path, backend_cache: Path):
    """Build ``loaded``'s engines and serve their repository (written in ``folder``) on a real
    tritonserver, as a generator for fixtures: yields (server, in-process Deployment of the same
    engines, the repository), stops the server after."""
    from trtspec.engines.build import build
    from trtspec.runtime import Deployment
    from trtspec.triton.repository.writer import write_repository
    from trtspec.triton.server.process import TritonServer

    build(loaded, loaded.output_dir())
    repo = write_repository(loaded, loaded.output_dir(), folder / "repo")
    server = TritonServer.for_repository(repo, cache_root=backend_cache)
    server.start(folder / "server.log")
    try:
        server.wait_ready(timeout=300)
        yield server, Deployment(loaded, loaded.output_dir()), repo
    finally:
        server.stop()


def serve_app(app, log_level: str = "warning", **options):
    """An ASGI app on uvicorn at 127.0.0.1 (a free port; ``options`` uvicorn.Config's), as a
    generator for fixtures: yields the port once the server has started, stops it after."""
    import threading
    import time

    import uvicorn

    from trtspec.triton.server.process import free_ports

    (port,) = free_ports(1)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level=log_level, **options))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the app did not start"
        time.sleep(0.05)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(30)


def unrolled_as(full: list):
    """A stand-in for trtspec.distill.ttt.unrolled_logits that gives the per-step logits
    ``full`` ([B, T, vocab] each), read at the positions a caller asks for (``at``) as the real
    one returns them."""
    return lambda *a, at=None, **kw: full if at is None else [x[m] for x, m in zip(full, at)]


def endpoint_params(**fields):
    """A speculative endpoint's EngineEndpointParams (what the repository hands the backend):
    small made-up shapes, ``fields`` in place of any of them, for tests of what the parameters
    carry and read back."""
    from trtspec.triton.backend.params import EngineEndpointParams

    basics = {
        "mode": "speculative",
        "method": "draft_target",
        "default_draft_tokens": 4,
        "max_input_len": 8,
        "max_seq_len": 16,
        "max_draft_len": 4,
        "vocab_size": 10,
        "tokenizer_dir": "/t",
    }
    return EngineEndpointParams(**{**basics, **fields})


def load_engine(folder: Path, role: str, mode: str, **kw):
    """The engine ``folder/role`` loaded with TRTSPEC_COMPILE=``mode`` (0 eager, 1 every step
    compiled), the variable restored afterwards."""
    from trtspec.engines.torch import compiled
    from trtspec.engines.torch.engine import TorchEngine

    saved = os.environ.get(compiled.COMPILE_ENV)
    os.environ[compiled.COMPILE_ENV] = mode
    try:
        return TorchEngine.load(folder / role, **kw)
    finally:
        if saved is None:
            os.environ.pop(compiled.COMPILE_ENV, None)
        else:
            os.environ[compiled.COMPILE_ENV] = saved

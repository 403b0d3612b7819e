"""Bounded inputs: every generated config.pbtxt has finite input shapes, so Triton refuses an
oversized input by its shape before any model process holds it; engine models' queues are
bounded; the server process runs with an allocator that returns freed memory."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import serve_tiny

from trtspec.errors import ServerError
from trtspec.layout import BLS_MODEL, CONTROL_MODEL, ENGINE_MODELS, TARGET_MODEL
from trtspec.testing.process_memory import tree_memory
from trtspec.triton.backend.contract import UNSERVED_INPUTS
from trtspec.triton.backend.params import EngineEndpointParams
from trtspec.triton.repository import pbtxt
from trtspec.triton.repository.writer import write_repository
from trtspec.triton.server.install import (
    ALLOCATOR_ENV,
    ALLOCATORS,
    JEMALLOC_CONF,
    SERVER_GLIBC_ENV,
    SERVER_JEMALLOC_CONF,
    STUB_NAME,
    find_allocator,
    server_env,
)
from trtspec.triton.server.procgroup import descendants

grpcclient = pytest.importorskip("tritonclient.grpc")


def test_inputs_trtspec_does_not_serve_get_the_smallest_shape_in_every_generated_config(built, tmp_path):
    dep = built()
    repo = write_repository(dep.loaded, dep.loaded.output_dir(), tmp_path / "repo")
    configs = {p.parent.name: pbtxt.parse(p.read_text()) for p in repo.glob("*/config.pbtxt")}
    declared = 0
    for name, cfg in configs.items():
        for tensor in cfg.input:
            if tensor.name in UNSERVED_INPUTS:
                declared += 1
                assert -1 not in tensor.dims, f"{name}.{tensor.name} has a variable dimension: {list(tensor.dims)}"
                assert max(tensor.dims) <= 3, f"{name}.{tensor.name}"  # 3: upstream's fixed channels / triples
    assert declared >= 2 * len(UNSERVED_INPUTS) - 8  # the text endpoints and the ensemble declare them
    bls = {t.name: list(t.dims) for t in configs[BLS_MODEL].input}
    ensemble = {t.name: list(t.dims) for t in configs["ensemble"].input}
    # upstream's rank, 1 in every variable dimension
    assert bls["image_bytes_input"] == [1, 1, 1, 1] and bls["image_input"] == [1, 3, 1, 1]
    assert bls["prompt_embedding_table"] == [1, 1] and bls["lora_weights"] == [1, 1] and bls["lora_config"] == [1, 3]
    assert ensemble["prompt_embedding_table"] == ensemble["lora_weights"] == [1, 1]
    # Served inputs stay variable: Triton's dims are exact or -1 (the models bound their sizes).
    assert bls["stop_words"] == bls["bad_words"] == [-1]
    assert [list(t.dims) for t in configs[TARGET_MODEL].input if t.name == "input_ids"] == [[-1]]


def test_engine_models_queue_one_request_per_calling_endpoint_instance(built, tmp_path):
    dep = built(**{"serve.instance_count": 2})
    repo = write_repository(dep.loaded, dep.loaded.output_dir(), tmp_path / "repo")
    queue = lambda name: pbtxt.parse((repo / name / "config.pbtxt").read_text()).dynamic_batching  # noqa: E731
    # target and draft: both instances of the unary and of the streaming endpoint call them
    assert queue(TARGET_MODEL).default_queue_policy.max_queue_size == 4
    assert queue(ENGINE_MODELS["draft"]).default_queue_policy.max_queue_size == 4
    assert queue(ENGINE_MODELS["control"]).default_queue_policy.max_queue_size == 2  # the control's instances


def test_an_allocator_is_found_by_name_auto_is_jemalloc_and_a_missing_one_says_what_to_install(tmp_path):
    (tmp_path / ALLOCATORS["tcmalloc"]).write_bytes(b"")
    assert find_allocator("auto", [str(tmp_path)]) is None  # auto: jemalloc or glibc's malloc
    assert find_allocator("tcmalloc", [str(tmp_path)]) == tmp_path / ALLOCATORS["tcmalloc"]
    assert find_allocator("glibc", [str(tmp_path)]) is None
    (tmp_path / ALLOCATORS["jemalloc"]).write_bytes(b"")
    assert find_allocator("auto", [str(tmp_path)]) == tmp_path / ALLOCATORS["jemalloc"]
    assert find_allocator("auto", [str(tmp_path / "none")]) is None
    with pytest.raises(ServerError, match="apt-get install libjemalloc2"):
        find_allocator("jemalloc", [str(tmp_path / "none")])


def _chosen_allocator() -> Path | None:
    """The library "auto" preloads here: TRTSPEC_ALLOCATOR's when set, else jemalloc's when installed."""
    return find_allocator(os.environ.get(ALLOCATOR_ENV) or "auto")


def _serve_with(tmp_path_factory, tiny_ckpts, allocator: str):
    served = serve_tiny(tmp_path_factory, tiny_ckpts, "bounds")
    with pytest.MonkeyPatch.context() as env:
        env.setenv(ALLOCATOR_ENV, allocator)  # how a user chooses it (install.server_env)
        started = next(served)  # only while it starts: the other fixture reads the user's choice
    yield started
    served.close()  # stops the server


@pytest.fixture(scope="module")
def glibc_server(tmp_path_factory, tiny_ckpts):
    yield from _serve_with(tmp_path_factory, tiny_ckpts, "glibc")


@pytest.fixture(scope="module")
def jemalloc_server(tmp_path_factory, tiny_ckpts):
    lib = _chosen_allocator()
    if lib is None or lib.name != ALLOCATORS["jemalloc"]:
        pytest.skip("jemalloc not installed (apt-get install libjemalloc2, or TRTSPEC_ALLOCATOR=its path)")
    yield from _serve_with(tmp_path_factory, tiny_ckpts, str(lib))


@pytest.fixture(scope="module")
def bounded_server(request):
    """The server as trtspec serve starts it here (allocator auto): one of the two above."""
    lib = _chosen_allocator()
    return request.getfixturevalue(
        "jemalloc_server" if lib is not None and lib.name == ALLOCATORS["jemalloc"] else "glibc_server"
    )


def _request(*extra):
    text = grpcclient.InferInput("text_input", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[b"hello"]], dtype=object))
    max_tokens = grpcclient.InferInput("max_tokens", [1, 1], "INT32")
    max_tokens.set_data_from_numpy(np.array([[4]], dtype=np.int32))
    return [text, max_tokens, *extra]


def _image(shape):
    image = grpcclient.InferInput("image_bytes_input", list(shape), "UINT8")
    image.set_data_from_numpy(np.ones(shape, np.uint8))
    return image


@pytest.mark.server
@pytest.mark.parametrize("allocator", ["glibc", "jemalloc"])
def test_an_oversized_unserved_input_is_refused_by_shape_and_no_model_process_keeps_it(allocator, request):
    server, _ = request.getfixturevalue(f"{allocator}_server")
    client = grpcclient.InferenceServerClient(server.grpc_endpoint)
    # At upstream's rank and the smallest size, the endpoint names the feature it lacks.
    with pytest.raises(Exception, match=r"multimodal inputs \(image_bytes_input\) is not supported"):
        client.infer(BLS_MODEL, _request(_image((1, 1, 1, 1, 1))))
    client.infer(BLS_MODEL, _request())
    before = tree_memory(server.pid)
    for _ in range(2):
        with pytest.raises(Exception, match="unexpected shape for input 'image_bytes_input'"):
            client.infer(BLS_MODEL, _request(_image((1, 1, 1, 256, 1 << 20))))  # 256 MiB
    for _ in range(4):
        assert client.infer(BLS_MODEL, _request()).as_numpy("output_ids").size  # still serving
    time.sleep(3.0)  # jemalloc's own thread purges freed pages within about a second
    after = tree_memory(server.pid)
    assert before.keys() == after.keys()
    assert sum(after[n]["held"] - before[n]["held"] for n in before) <= 128 << 10  # the tree: the goal
    for name in before:
        if name.startswith("stub"):  # no stub's shared-memory pool took the 256 MiB in
            assert after[name]["shm_maps"] == before[name]["shm_maps"], name
            assert after[name]["rss_shmem"] - before[name]["rss_shmem"] < 8 << 10, name
        else:  # and tritonserver kept no request object holding them (its gRPC pool is off)
            assert after[name]["held"] - before[name]["held"] < 32 << 10, (name, before[name], after[name])


@pytest.mark.server
def test_the_server_runs_with_jemalloc_when_installed(bounded_server):
    server, _ = bounded_server
    lib = find_allocator("auto")
    if lib is None:
        pytest.skip("no jemalloc or tcmalloc installed (apt-get install libjemalloc2)")
    assert server.env["LD_PRELOAD"].split()[0] == str(lib)
    assert str(lib) in open(f"/proc/{server.pid}/maps").read()


def test_server_env_preloads_the_allocator_once(tmp_path):
    lib = find_allocator("auto")
    if lib is None:
        pytest.skip("no jemalloc or tcmalloc installed")
    env = server_env(base={"PATH": "/usr/bin", "LD_PRELOAD": f"/x.so {lib}"})
    assert env["LD_PRELOAD"] == f"{lib} /x.so"
    if lib.name == ALLOCATORS["jemalloc"]:
        assert env["MALLOC_CONF"] == SERVER_JEMALLOC_CONF  # its own thread returns freed pages
    mine = server_env(base={"PATH": "/usr/bin", "MALLOC_CONF": "narenas:2"})
    assert mine["MALLOC_CONF"] == "narenas:2" and "BASH_ENV" not in mine
    glibc = server_env(base={"PATH": "/usr/bin"}, allocator="glibc")
    assert "LD_PRELOAD" not in glibc and "MALLOC_CONF" not in glibc
    assert glibc["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "640"  # bounded either way
    assert glibc["LRU_CACHE_CAPACITY"] == "640"  # ideep's own cache of packed matmuls
    assert server_env(base={"PATH": "/usr/bin", "LRU_CACHE_CAPACITY": "32"})["LRU_CACHE_CAPACITY"] == "32"
    assert (
        server_env(base={"PATH": "/usr/bin", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "16"})["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "16"
    )


def test_glibcs_malloc_maps_large_buffers_in_the_server_only_unless_the_user_set_it_up(tmp_path, monkeypatch):
    """Without a preloaded allocator tritonserver gets fixed glibc thresholds, so a refused
    input's buffers are unmapped when freed; the stubs start with glibc's own (BASH_ENV)."""
    monkeypatch.setenv("TRTSPEC_CACHE", str(tmp_path / "cache"))
    env = server_env(base={"PATH": "/usr/bin"}, allocator="glibc")
    assert {k: env[k] for k in SERVER_GLIBC_ENV} == SERVER_GLIBC_ENV and "LD_PRELOAD" not in env
    assert int(env["MALLOC_MMAP_THRESHOLD_"]) <= 64 << 10  # under the gRPC read slices
    stub = _as_a_stub_starts(env)
    assert not SERVER_GLIBC_ENV.keys() & stub.keys()
    (tmp_path / "mine.sh").write_text("export MINE=1\n")  # a user's own BASH_ENV still runs
    assert (
        _as_a_stub_starts(server_env(base={"PATH": "/usr/bin", "BASH_ENV": str(tmp_path / "mine.sh")}, allocator="glibc"))["MINE"]
        == "1"
    )
    for mine in ({"MALLOC_ARENA_MAX": "2"}, {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}):
        theirs = server_env(base={"PATH": "/usr/bin", **mine}, allocator="glibc")
        assert not SERVER_GLIBC_ENV.keys() & theirs.keys() and "BASH_ENV" not in theirs, mine


def test_trtspec_allocator_chooses_the_allocator_auto_preloads(tmp_path, monkeypatch):
    monkeypatch.setenv("TRTSPEC_CACHE", str(tmp_path / "cache"))
    lib = tmp_path / ALLOCATORS["jemalloc"]  # one a user brought without root
    lib.write_bytes(b"")
    env = server_env(base={"PATH": "/usr/bin", ALLOCATOR_ENV: str(lib)})
    assert env["LD_PRELOAD"] == str(lib) and env["MALLOC_CONF"] == SERVER_JEMALLOC_CONF
    assert not SERVER_GLIBC_ENV.keys() & env.keys()
    glibc = server_env(base={"PATH": "/usr/bin", ALLOCATOR_ENV: "glibc"})
    assert "LD_PRELOAD" not in glibc and glibc["MALLOC_MMAP_THRESHOLD_"] == SERVER_GLIBC_ENV["MALLOC_MMAP_THRESHOLD_"]
    assert "LD_PRELOAD" not in server_env(base={"PATH": "/usr/bin", ALLOCATOR_ENV: str(lib)}, allocator="glibc")  # named wins
    with pytest.raises(ServerError, match="is not a file"):
        server_env(base={"PATH": "/usr/bin", ALLOCATOR_ENV: str(tmp_path / "none.so")})
    with pytest.raises(ServerError, match="unknown allocator 'mimalloc'"):
        server_env(base={"PATH": "/usr/bin", ALLOCATOR_ENV: "mimalloc"})


@pytest.mark.server
def test_the_served_glibc_server_maps_large_buffers_and_its_stubs_keep_glibcs_thresholds(glibc_server):
    server, _ = glibc_server

    def environ(pid: int) -> dict[str, str]:
        items = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
        return dict(item.split("=", 1) for item in items if "=" in item)

    stubs = [pid for pid in descendants(server.pid) if STUB_NAME in Path(f"/proc/{pid}/cmdline").read_text(errors="replace")]
    assert stubs and "LD_PRELOAD" not in environ(server.pid)
    assert {k: environ(server.pid).get(k) for k in SERVER_GLIBC_ENV} == SERVER_GLIBC_ENV
    assert all(not SERVER_GLIBC_ENV.keys() & environ(pid).keys() for pid in stubs)


def _as_a_stub_starts(env: dict[str, str]) -> dict[str, str]:
    """The environment a stub gets: the Python backend runs `bash -c "exec STUB ..."`."""
    out = subprocess.run(["bash", "-c", " exec env -0"], env=env, capture_output=True, check=True).stdout
    return dict(item.split("=", 1) for item in out.decode().split("\0") if "=" in item)


def _jemalloc_installed() -> bool:
    """Whether the allocator "auto" preloads is jemalloc (find_allocator("jemalloc") raises
    when it is not installed: asking for it by name is an error to the user)."""
    lib = find_allocator("auto")
    return lib is not None and lib.name == ALLOCATORS["jemalloc"]


def test_the_server_runs_without_jemallocs_thread_caches_and_its_stubs_with_them(tmp_path, monkeypatch):
    """tritonserver's ~250 threads each keep a cache of freed memory: off in the server; the
    engine stubs, whose steps ran slower without theirs, get them back through BASH_ENV."""
    if not _jemalloc_installed():
        pytest.skip("jemalloc not installed (apt-get install libjemalloc2)")
    monkeypatch.setenv("TRTSPEC_CACHE", str(tmp_path / "cache"))
    env = server_env(base={"PATH": "/usr/bin"})
    assert env["MALLOC_CONF"] == SERVER_JEMALLOC_CONF and "tcache:false" in env["MALLOC_CONF"]
    assert _as_a_stub_starts(env)["MALLOC_CONF"] == JEMALLOC_CONF
    assert "tcache" not in JEMALLOC_CONF
    assert "narenas:1" in SERVER_JEMALLOC_CONF and "narenas" not in JEMALLOC_CONF  # one arena in tritonserver only
    # a user's own BASH_ENV still runs, after trtspec's
    (tmp_path / "mine.sh").write_text("export MINE=1\n")
    chained = _as_a_stub_starts(server_env(base={"PATH": "/usr/bin", "BASH_ENV": str(tmp_path / "mine.sh")}))
    assert chained["MALLOC_CONF"] == JEMALLOC_CONF and chained["MINE"] == "1"
    assert server_env(base={"PATH": "/usr/bin"})["BASH_ENV"] == env["BASH_ENV"]  # one file per content


@pytest.mark.server
def test_the_served_stubs_keep_their_thread_caches_and_tritonserver_does_not(bounded_server):
    server, _ = bounded_server
    if not _jemalloc_installed():
        pytest.skip("jemalloc not installed (apt-get install libjemalloc2)")

    def malloc_conf(pid: int) -> str | None:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        return next((v.split(b"=", 1)[1].decode() for v in environ if v.startswith(b"MALLOC_CONF=")), None)

    stubs = [pid for pid in descendants(server.pid) if STUB_NAME in Path(f"/proc/{pid}/cmdline").read_text(errors="replace")]
    assert stubs and malloc_conf(server.pid) == SERVER_JEMALLOC_CONF
    assert {malloc_conf(pid) for pid in stubs} == {JEMALLOC_CONF}
    assert all(str(find_allocator("jemalloc")) in Path(f"/proc/{pid}/maps").read_text() for pid in stubs)


def test_the_deployment_default_draft_length_is_a_parameter_named_apart_from_the_request_input(built, tmp_path):
    """The spec's default k is the parameter default_draft_tokens; num_draft_tokens stays what
    upstream's tensorrt_llm_bls names it, the input a request sends its own k in."""
    dep = built()
    s = dep.loaded.spec.speculative
    assert s.default_draft_tokens != s.max_draft_len  # the default, not the engines' bound
    repo = write_repository(dep.loaded, dep.loaded.output_dir(), tmp_path / "repo")
    for model in (BLS_MODEL, CONTROL_MODEL):
        cfg = pbtxt.parse((repo / model / "config.pbtxt").read_text())
        assert cfg.parameters["default_draft_tokens"].string_value == str(s.default_draft_tokens)
        assert "num_draft_tokens" not in cfg.parameters
        assert "num_draft_tokens" in {t.name for t in cfg.input}
    params = EngineEndpointParams.from_params(
        {k: v.string_value for k, v in pbtxt.parse((repo / BLS_MODEL / "config.pbtxt").read_text()).parameters.items()}
    )
    assert params.settings(False, 1).limits.default_draft_tokens == s.default_draft_tokens

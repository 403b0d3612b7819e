"""Contract tests for config.pbtxt rendering and for running a real tritonserver.

The server tests start the tritonserver bundled with nvidia-pytriton on free loopback ports,
with tiny Python-backend models written into tmp_path, and check that nothing of it survives.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tritonclient.grpc", reason="needs the serve extra: pip install 'trtspec[serve]'")

from conftest import processes_mentioning

from trtspec.errors import EXIT_RUNTIME, ServerError
from trtspec.triton.repository import pbtxt
from trtspec.triton.repository.pbtxt import DynamicBatching, ModelConfig, PbtxtError, TensorSpec
from trtspec.triton.server.detached import stop_detached
from trtspec.triton.server.install import find_tritonserver, prepare_backend_dir, python_env, server_env
from trtspec.triton.server.process import ServerCommand, TritonServer, failure_message

REPO_ROOT = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------------------------------------
# config.pbtxt
# ---------------------------------------------------------------------------------------------


def _echo_config(name: str = "echo", **overrides: object) -> ModelConfig:
    fields: dict[str, object] = {
        "name": name,
        "backend": "python",
        "inputs": [TensorSpec("INPUT0", "TYPE_INT32", [-1])],
        "outputs": [TensorSpec("OUTPUT0", "TYPE_INT32", [-1])],
    }
    return ModelConfig(**(fields | overrides))  # type: ignore[arg-type]


def test_render_parses_back_to_the_same_config() -> None:
    cfg = _echo_config(
        max_batch_size=8,
        parameters={"EXECUTION_ENV_PATH": "/venv", "k": "v"},
        instance_count=2,
        decoupled=True,
        dynamic_batching=DynamicBatching(max_queue_delay_microseconds=100, preferred_batch_sizes=[4, 8]),
        inputs=[
            TensorSpec("INPUT0", "TYPE_INT32", [-1]),
            TensorSpec("MASK", "TYPE_BOOL", [1], optional=True, reshape=[]),
        ],
    )
    text = pbtxt.render(cfg)
    msg = pbtxt.parse(text)

    assert msg == pbtxt.to_proto(cfg)
    assert msg.name == "echo" and msg.backend == "python" and msg.max_batch_size == 8
    assert [(t.name, t.optional) for t in msg.input] == [("INPUT0", False), ("MASK", True)]
    assert msg.input[1].HasField("reshape") and list(msg.input[1].reshape.shape) == []
    assert msg.parameters["EXECUTION_ENV_PATH"].string_value == "/venv"
    assert msg.model_transaction_policy.decoupled is True
    assert list(msg.dynamic_batching.preferred_batch_size) == [4, 8]
    assert (msg.instance_group[0].count, msg.instance_group[0].kind) == (2, 2)  # 2 == KIND_CPU
    # Triton's documented map syntax for parameters.
    flat = " ".join(text.split())
    assert 'parameters { key: "k" value { string_value: "v" } }' in flat


def test_extra_pbtxt_is_merged_and_schema_checked() -> None:
    cfg = _echo_config(extra_pbtxt="sequence_batching { max_sequence_idle_microseconds: 5000 }")
    assert pbtxt.parse(pbtxt.render(cfg)).sequence_batching.max_sequence_idle_microseconds == 5000

    with pytest.raises(PbtxtError, match="invalid config value"):
        pbtxt.render(_echo_config(extra_pbtxt="no_such_field: 1"))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"parameters": {"gpt_model_path": "${engine_dir}"}}, r"placeholders \$\{engine_dir\}"),
        ({"parameters": {"x": ""}}, "parameter 'x' has an empty value"),
        ({"backend": ""}, "neither backend nor platform is set"),
        ({"inputs": [TensorSpec("INPUT0", "TYPE_INT23", [-1])]}, "data_type is 'TYPE_INT23'; expected one of"),
        ({"inputs": [TensorSpec("INPUT0", "TYPE_INT32", [])]}, "input 'INPUT0' has no dims"),
        ({"inputs": [TensorSpec("INPUT0", "TYPE_INT32", [0])]}, r"dims \[0\]; each must be -1 or >= 1"),
        ({"instance_kind": "KIND_TPU"}, "instance_kind is 'KIND_TPU'"),
        ({"instance_count": 0}, "instance_count is 0"),
        ({"outputs": [TensorSpec("OUTPUT0", "TYPE_INT32", [-1], optional=True)]}, "only inputs can be optional"),
    ],
)
def test_render_rejects_invalid_configs(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(PbtxtError, match=message):
        pbtxt.render(_echo_config(**overrides))


def test_check_text_rejects_placeholders_from_templates() -> None:
    template = 'name: "tensorrt_llm"\nbackend: "${triton_backend}"\nmax_batch_size: ${triton_max_batch_size}\n'
    with pytest.raises(PbtxtError, match=r"\$\{triton_backend\}, \$\{triton_max_batch_size\}"):
        pbtxt.check_text(template)


def test_write_is_atomic_and_leaves_no_temp_files(tmp_path: Path) -> None:
    target = pbtxt.write(_echo_config(), tmp_path / "echo" / "config.pbtxt")
    assert pbtxt.parse(target.read_text()).name == "echo"
    assert [p.name for p in target.parent.iterdir()] == ["config.pbtxt"]

    with pytest.raises(PbtxtError):
        pbtxt.write(_echo_config(backend=""), target)
    assert pbtxt.parse(target.read_text()).backend == "python"  # old file untouched


# ---------------------------------------------------------------------------------------------
# Environment and command line (no server process)
# ---------------------------------------------------------------------------------------------


def test_load_models_requires_explicit_mode() -> None:
    with pytest.raises(ServerError, match="model_control_mode='explicit'"):
        ServerCommand(binary=Path("tritonserver"), model_repository=Path("r"), load_models=["a"])
    argv = ServerCommand(
        binary=Path("tritonserver"),
        model_repository=Path("r"),
        model_control_mode="explicit",
        load_models=["a"],
    ).argv()
    assert "--load-model=a" in argv and "--http-address=127.0.0.1" in argv


def test_an_upstream_lock_abort_is_named_with_what_to_do() -> None:
    """tritonserver 2.51 aborted this way while six stubs started beside other jobs on 2 cores."""
    log = (
        'I1202 17:52:57.161351 21701 python_be.cc:2249] "TRITONBACKEND_ModelInstanceInitialize: tensorrt_llm_bls_0_0"\n'
        "terminate called after throwing an instance of 'boost::interprocess::lock_exception'\n"
        "  what():  boost::interprocess::lock_exception\n"
    )
    message = failure_message("tritonserver exited with code -6 before it was ready", log, None)
    assert "lock_exception" in message and "server#8882" in message and "start the server again" in message
    assert "server#8882" not in failure_message("tritonserver exited with code 1", "E1202 failed to load 'x'\n", None)


def test_server_env_puts_the_venv_and_its_libpython_first() -> None:
    install = _install_or_skip()
    env = server_env(install=install, base={"PATH": "/usr/bin", "LD_LIBRARY_PATH": "/x"})
    py = python_env()
    assert env["PATH"].split(os.pathsep)[0] == str(py.prefix / "bin")
    assert env["LD_LIBRARY_PATH"].split(os.pathsep)[0] == str(py.libdir)
    assert env["LD_LIBRARY_PATH"].split(os.pathsep)[-1] == "/x"


def test_backend_dir_is_private_and_reused(tmp_path: Path) -> None:
    install = _install_or_skip()
    first = prepare_backend_dir(install, python_env().version, tmp_path)
    assert first is not None and first.is_relative_to(tmp_path)
    assert (first / "python" / "triton_python_backend_stub").is_file()
    assert prepare_backend_dir(install, python_env().version, tmp_path) == first
    with pytest.raises(ServerError, match="no Python-backend stub for Python 2.7"):
        prepare_backend_dir(install, "2.7", tmp_path)


def test_package_folder_named_triton_does_not_break_torch_dynamo() -> None:
    # A top-level folder named `triton` in the cwd shadows OpenAI Triton for torch._dynamo.
    subprocess.run(
        [sys.executable, "-c", "import trtspec.triton.server.process, torch._dynamo"],
        cwd=REPO_ROOT,
        check=True,
        timeout=300,
    )


# ---------------------------------------------------------------------------------------------
# A real server
# ---------------------------------------------------------------------------------------------

ECHO_MODEL = """
import platform
import sys

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        # Goes to the server log: which environment and which libpython the stub really runs.
        print("STUB_PYTHON", sys.prefix, platform.python_version(), flush=True)

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            out = pb_utils.Tensor("OUTPUT0", (x + 1).astype(np.int32))
            responses.append(pb_utils.InferenceResponse([out]))
        return responses
"""

STREAM_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            sender = request.get_response_sender()
            for step in range(3):
                out = pb_utils.Tensor("OUTPUT0", (x + step).astype(np.int32))
                sender.send(pb_utils.InferenceResponse([out]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

BROKEN_MODEL = """
class TritonPythonModel:
    def initialize(self, args):
        raise RuntimeError("broken on purpose in initialize")

    def execute(self, requests):
        return []
"""


def _install_or_skip():  # type: ignore[no-untyped-def]
    try:
        return find_tritonserver()
    except ServerError as err:
        pytest.skip(str(err))


def _add_model(repo: Path, cfg: ModelConfig, source: str) -> None:
    pbtxt.write(cfg, repo / cfg.name / "config.pbtxt")
    (repo / cfg.name / "1").mkdir(parents=True, exist_ok=True)
    (repo / cfg.name / "1" / "model.py").write_text(textwrap.dedent(source))


@pytest.fixture(scope="module")
def backend_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    _install_or_skip()
    return tmp_path_factory.mktemp("trtspec-cache")  # never the user's ~/.cache


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, backend_cache: Path):  # type: ignore[no-untyped-def]
    repo = tmp_path_factory.mktemp("repo")
    _add_model(repo, _echo_config(), ECHO_MODEL)
    _add_model(repo, _echo_config("stream", decoupled=True), STREAM_MODEL)
    server = TritonServer.for_repository(repo, cache_root=backend_cache)
    server.start(repo.parent / "server.log")
    server.wait_ready(timeout=120)
    yield server, repo
    server.stop()
    assert processes_mentioning(str(repo)) == []


@pytest.mark.server
def test_grpc_infer_returns_input_plus_one(served) -> None:  # type: ignore[no-untyped-def]
    import tritonclient.grpc as grpcclient

    server, _ = served
    client = grpcclient.InferenceServerClient(server.grpc_endpoint)
    tensor = grpcclient.InferInput("INPUT0", [4], "INT32")
    tensor.set_data_from_numpy(np.array([0, 1, 2, -5], dtype=np.int32))

    result = client.infer("echo", [tensor]).as_numpy("OUTPUT0")

    assert result.dtype == np.int32
    assert result.tolist() == [1, 2, 3, -4]


@pytest.mark.server
def test_decoupled_model_streams_three_responses(served) -> None:  # type: ignore[no-untyped-def]
    import tritonclient.grpc as grpcclient

    server, _ = served
    client = grpcclient.InferenceServerClient(server.grpc_endpoint)
    tensor = grpcclient.InferInput("INPUT0", [2], "INT32")
    tensor.set_data_from_numpy(np.array([10, 20], dtype=np.int32))
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        client.async_stream_infer("stream", [tensor], request_id="r1", enable_empty_final_response=True)
        outputs = []
        while True:
            result, error = responses.get(timeout=30)
            assert error is None, error
            params = result.get_response().parameters
            if params["triton_final_response"].bool_param:
                break
            outputs.append(result.as_numpy("OUTPUT0").tolist())
    finally:
        client.stop_stream()

    assert outputs == [[10, 20], [11, 21], [12, 22]]


@pytest.mark.server
def test_stub_processes_exist_while_serving(served) -> None:  # type: ignore[no-untyped-def]
    # Makes the "nothing remains" check meaningful: the stubs do carry the repository path.
    server, repo = served
    running = processes_mentioning(str(repo))
    assert sum("triton_python_backend_stub" in p for p in running) == 2, running
    assert any(p.startswith(f"{server.pid}:") for p in running)


@pytest.mark.server
def test_stub_runs_the_venv_with_its_own_libpython(served) -> None:  # type: ignore[no-untyped-def]
    # Without server_env the stub silently runs another Python: the first `python3` on PATH, or
    # the system libpython (3.11.2 beside a 3.11.7 venv on the dev machines) with the venv's
    # stdlib. Neither fails at load time, so check what actually ran.
    import platform

    server, _ = served
    lines = [line for line in server.log_path.read_text().splitlines() if line.startswith("STUB_PYTHON")]
    assert lines == [f"STUB_PYTHON {sys.prefix} {platform.python_version()}"]


@pytest.mark.server
def test_broken_model_fails_start_with_its_log_lines(tmp_path: Path, backend_cache: Path) -> None:
    repo = tmp_path / "repo"
    _add_model(repo, _echo_config(), ECHO_MODEL)
    _add_model(repo, _echo_config("broken"), BROKEN_MODEL)
    server = TritonServer.for_repository(repo, cache_root=backend_cache)
    server.start(tmp_path / "server.log")

    with pytest.raises(ServerError) as caught:
        server.wait_ready(timeout=120)

    message = str(caught.value)
    assert caught.value.exit_code == EXIT_RUNTIME
    assert "exited with code" in message
    assert "RuntimeError: broken on purpose in initialize" in message
    assert "failed to load 'broken'" in message
    assert "CudaDriverHelper" not in message  # CPU-only noise is filtered out
    assert f"full log: {tmp_path / 'server.log'}" in message
    assert not server.is_running()
    assert processes_mentioning(str(repo)) == []


@pytest.mark.server
def test_broken_model_is_reported_without_exit_on_error(tmp_path: Path, backend_cache: Path) -> None:
    repo = tmp_path / "repo"
    _add_model(repo, _echo_config("broken"), BROKEN_MODEL)
    server = TritonServer.for_repository(repo, cache_root=backend_cache, exit_on_error=False)
    server.start(tmp_path / "server.log")

    with pytest.raises(ServerError, match="model\\(s\\) broken failed to load"):
        server.wait_ready(timeout=120)
    assert processes_mentioning(str(repo)) == []


@pytest.mark.server
def test_detached_server_is_stopped_through_its_pid_file(tmp_path: Path, backend_cache: Path) -> None:
    repo = tmp_path / "repo"
    _add_model(repo, _echo_config(), ECHO_MODEL)
    pid_file = tmp_path / "run" / "server.json"
    server = TritonServer.for_repository(repo, cache_root=backend_cache)
    server.start(tmp_path / "server.log", detach=True, pid_file=pid_file)
    try:
        server.wait_ready(timeout=120)
        assert pid_file.is_file()

        assert stop_detached(pid_file) is True
        assert not pid_file.exists()
        assert processes_mentioning(str(repo)) == []
    finally:
        server.stop()  # no-op when already stopped; a safety net if an assertion failed

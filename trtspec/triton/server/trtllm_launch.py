"""How to launch tritonserver for a trtllm repository: mpirun, ranks, orchestrator mode.

The repository's tensorrtllm models (trtspec.triton.repository.trtllm_models) say which GPUs
each engine uses; this module turns that into the command line upstream's
launch_triton_server.py would run, with one difference: each rank's tritonserver is started
by trtspec.triton.server.rank, so the admin key is on no command line (mpirun exports it to
the ranks by name, -x TRTSPEC_ADMIN_KEY; rank.py says why).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from trtspec.layout import ENGINE_KINDS, ENGINE_MODELS
from trtspec.spec import EngineSpec
from trtspec.triton.repository.trtllm_models import gpu_ids
from trtspec.triton.server.process import ADMIN_KEY_ENV, ServerCommand
from trtspec.triton.server.rank import rank_argv


@dataclass(frozen=True)
class Launch:
    """The server command for a trtllm repository: argv plus the environment it needs.

    ``env`` holds only the variables to add to the serving environment. ``server`` is the
    rank-0 command, whose address and ports are where clients connect.
    """

    argv: list[str]
    env: dict[str, str]
    world_size: int
    orchestrator: bool
    server: ServerCommand


def launch_command(
    server: ServerCommand,
    engine_models: Sequence[tuple[str, int]],
    *,
    gpus: Sequence[int] = (),
    spawn_processes: bool = True,
    mpirun: str = "mpirun",
    python: str = sys.executable,
) -> Launch:
    """tritonserver under mpirun, one rank per GPU, as upstream's launch_triton_server.py.

    ``engine_models`` are ``(model name, tp x pp)`` of the tensorrtllm models; ``gpus`` are
    all device ids they use. Several tensorrtllm models need orchestrator mode
    (TRTLLM_ORCHESTRATOR=1): by default the backend spawns one worker per model on its
    gpu_device_ids and the server is a single rank; with ``spawn_processes=False`` every
    engine rank is an MPI rank (world = 1 + sum of tp x pp) and configs carry participant_ids.
    One model alone runs in leader mode: world = its tp x pp. Each rank is ``python -m
    trtspec.triton.server.rank`` around its tritonserver (the admin key in ``env`` only).
    """
    names = [name for name, _ in engine_models]
    orchestrator = len(engine_models) > 1
    env: dict[str, str] = {}
    rank0_extra: list[str] = []
    if orchestrator:
        env["TRTLLM_ORCHESTRATOR"] = "1"
        env["TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES"] = "1" if spawn_processes else "0"
        world = 1 if spawn_processes else 1 + sum(n for _, n in engine_models)
        if spawn_processes:
            # Workers own the GPUs; the orchestrator process must not reserve memory on them.
            rank0_extra = ["--pinned-memory-pool-byte-size=0", "--enable-peer-access=false"]
            rank0_extra += [f"--cuda-memory-pool-byte-size={g}:0" for g in sorted(set(gpus))]
    else:
        world = engine_models[0][1] if engine_models else 1
    argv = [mpirun, "--allow-run-as-root"]
    if server.restricted_apis:
        env[ADMIN_KEY_ENV] = server.admin_key
        argv += ["-x", ADMIN_KEY_ENV]  # by name: the value stays in the environment
    for rank in range(world):
        extra = [f"--backend-config=python,shm-region-prefix-name=prefix{rank}_"]
        if rank == 0:
            cmd = dataclasses.replace(server, extra_args=(*server.extra_args, *rank0_extra, *extra))
        else:  # worker ranks load only the engine models; they never serve requests
            cmd = dataclasses.replace(
                server, model_control_mode="explicit", load_models=tuple(names), extra_args=(*server.extra_args, *extra)
            )
        argv += ["-n", "1", *rank_argv(python, cmd.argv(), server.admin_key), ":"]
    return Launch(argv=argv[:-1], env=env, world_size=world, orchestrator=orchestrator, server=server)


def launch_for_spec(
    spec: EngineSpec,
    server: ServerCommand,
    repo_names: Mapping[str, str] = ENGINE_MODELS,
    *,
    spawn_processes: bool = True,
    python: str = sys.executable,
) -> Launch:
    """:func:`launch_command` for the three engine models of a trtllm spec."""
    models = [(repo_names[k], len(gpu_ids(spec, k))) for k in ENGINE_KINDS]
    gpus = sorted({g for k in ENGINE_KINDS for g in gpu_ids(spec, k)})
    return launch_command(server, models, gpus=gpus, spawn_processes=spawn_processes, python=python)

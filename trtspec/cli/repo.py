"""`trtspec repo SPEC`: write the Triton model repository for the built engines."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from trtspec import console
from trtspec.cli.common import EnginesOpt, LlmapiOpt, SpecArg, handle_errors
from trtspec.spec import load_spec
from trtspec.speculative.llmapi import TENSORRT_LLM
from trtspec.triton.repository.writer import write_repository

OutputOpt = Annotated[
    Path | None, typer.Option("--output", "-o", help="Repository folder (default: serve.repo_dir, else model_repo/<name>).")
]


@handle_errors
def repo(
    spec: SpecArg,
    output: OutputOpt = None,
    engines: EnginesOpt = None,
    llmapi_impl: LlmapiOpt = TENSORRT_LLM,
) -> None:
    """Write a Triton model repository for the engines of SPEC.

    Models: tensorrt_llm (target), tensorrt_llm_draft, tensorrt_llm_bls (speculative),
    tensorrt_llm_bls_streaming (decoupled) and target_only (control), all with NVIDIA's
    tensorrtllm_backend contracts. Written atomically; configs are checked by parsing them back.
    trtllm.runtime llmapi: tensorrt_llm_bls and target_only run the LLM API (1/model.yaml).

    Examples:
      trtspec repo engine_specs/smollm2-135m-cpu.yaml
      trtspec repo my-spec.yaml -o /srv/repo --engines /data/engines/my-spec
    """
    loaded = load_spec(spec)
    path = write_repository(loaded, loaded.output_dir(engines), loaded.repo_dir(output), llmapi_impl)
    console.out.print(f"wrote model repository {path}")

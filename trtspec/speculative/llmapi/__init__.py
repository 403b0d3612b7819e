"""The LLM API as a runtime: load an llmapi build's argument files into the real one or the double.

The same code path serves in-process verify and the Triton llmapi models: read the YAML with
yaml.safe_load, drop Triton's reserved `triton_config` block, merge through
`update_llm_args_with_extra_dict({}, cfg)` and call `LLM(**args)` -- what upstream's Triton
llmapi model.py does (triton_backend/all_models/llmapi/tensorrt_llm/1/model.py@044a90d2).

``impl`` picks the implementation: TENSORRT_LLM (the library; GPU; every signature's default)
or DOUBLE (trtspec's CPU conformance double, speculative/llmapi/double.py), which is only ever
chosen by asking for it.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import yaml

from trtspec.errors import RuntimeFailure, TrtspecError

TENSORRT_LLM = "tensorrt_llm"  # the library
DOUBLE = "double"  # trtspec's CPU conformance double
IMPLS = (TENSORRT_LLM, DOUBLE)
TRITON_CONFIG = "triton_config"  # reserved key of upstream's model.yaml


def load_api(impl: str, line: str) -> SimpleNamespace:
    """LLM, SamplingParams and update_llm_args_with_extra_dict of ``impl`` for ``line``."""
    if impl == DOUBLE:
        from trtspec.speculative.llmapi.double import api

        return api(line)
    if impl != TENSORRT_LLM:
        raise TrtspecError(f"unknown LLM API implementation {impl!r}; use one of {', '.join(IMPLS)}")
    try:
        import tensorrt_llm
        from tensorrt_llm import LLM, SamplingParams
    except ImportError as e:
        raise RuntimeFailure(
            f"tensorrt_llm cannot be imported ({e}); run inside a TensorRT-LLM container, or "
            "pass --llmapi double to exercise the files with trtspec's CPU conformance double "
            "(that is not a TensorRT-LLM result)"
        ) from e
    check_installed_version(line, tensorrt_llm.__version__)
    try:  # where upstream's Triton model imports it from; llm_args holds it too
        from tensorrt_llm.llmapi.llm_utils import update_llm_args_with_extra_dict
    except ImportError:
        from tensorrt_llm.llmapi.llm_args import update_llm_args_with_extra_dict
    return SimpleNamespace(
        __version__=tensorrt_llm.__version__,
        LLM=LLM,
        SamplingParams=SamplingParams,
        update_llm_args_with_extra_dict=update_llm_args_with_extra_dict,
        is_double=False,
    )


def read_config(path: Path) -> dict:
    data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise TrtspecError(f"{path}: the LLM API configuration must be a YAML mapping")
    return data


def make_llm(api: SimpleNamespace, path: Path):
    """An LLM from a YAML argument file (model.yaml or speculative/control.yaml)."""
    cfg = {k: v for k, v in read_config(path).items() if k != TRITON_CONFIG}
    args = api.update_llm_args_with_extra_dict({}, cfg, str(path))
    try:
        return api.LLM(**args)
    except (ValueError, TypeError) as e:
        raise TrtspecError(f"{path}: the LLM API refused these arguments: {e}") from e


def greedy_params(
    api: SimpleNamespace,
    max_tokens: int,
    perf: bool,
    end_id: int | None = None,
    stop: list[str] | None = None,
    ignore_eos: bool = False,
):
    """``ignore_eos``: generate exactly max_tokens (SamplingParams.ignore_eos: no end id ends it)."""
    kwargs = {"max_tokens": max_tokens, "top_k": 1, "return_perf_metrics": perf}
    if end_id is not None:
        kwargs["end_id"] = end_id
    if ignore_eos:
        kwargs["ignore_eos"] = True
    if stop:
        # kept in the output, as every other trtspec endpoint emits the stop sequence
        kwargs |= {"stop": list(stop), "include_stop_str_in_output": True}
    return api.SamplingParams(**kwargs)


def acceptance(output) -> tuple[int, int] | None:
    """(accepted, drafted) of one CompletionOutput, when it carries perf metrics."""
    perf = getattr(output, "request_perf_metrics", None)
    spec = getattr(perf, "speculative_decoding", None) if perf is not None else None
    if spec is None:
        return None
    return int(spec.total_accepted_draft_tokens), int(spec.total_draft_tokens)


def check_installed_version(line: str, version: str) -> None:
    """RuntimeFailure when the installed tensorrt_llm is not of the spec's line."""
    parts = version.split(".")
    try:
        major, minor = int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        raise RuntimeFailure(f"cannot read the tensorrt_llm version {version!r}") from None
    is_12 = (major, minor) == (1, 2)
    is_13_plus = (major, minor) >= (1, 3)
    if (line == "1.2" and not is_12) or (line == "1.3+" and not is_13_plus):
        want = "1.2.x" if line == "1.2" else "1.3 or later"
        other = "1.3+" if is_13_plus else "1.2"
        raise RuntimeFailure(
            f"the spec targets TensorRT-LLM {want} (trtllm.line: '{line}') but tensorrt_llm "
            f"{version} is installed; set trtllm.line: '{other}' and rebuild, or install {want}",
            exit_code=2,
        )

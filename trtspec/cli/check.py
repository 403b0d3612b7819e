"""`trtspec check SPEC`: resolve checkpoints and report whether they make a valid pair."""

from __future__ import annotations

from trtspec.cli.common import AllowPickleOpt, JsonFileOpt, JsonOpt, SpecArg, handle_errors
from trtspec.cli.output import emit
from trtspec.engines.check import check as check_pair
from trtspec.spec import load_spec


@handle_errors
def check(
    spec: SpecArg,
    allow_pickle: AllowPickleOpt = False,
    as_json: JsonOpt = False,
    json_file: JsonFileOpt = None,
) -> None:
    """Validate SPEC and its checkpoints: architecture, parameters, vocab, dtypes, memory.

    Exits 0 when the pair can be built, 2 with the reasons when it cannot.

    Examples:
      trtspec check engine_specs/smollm2-135m-cpu.yaml
      trtspec check my-spec.yaml --json
    """
    report = check_pair(load_spec(spec), allow_pickle)
    emit(report, report.render, as_json=as_json, json_file=json_file)

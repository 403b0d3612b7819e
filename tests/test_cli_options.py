"""One way to declare an option: a typed ``Annotated`` alias named in the command's signature,
validated into the library's options model from the flags given (trtspec/cli/options.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import pytest
import typer
import typer.main
from pydantic import BaseModel, Field
from typer.testing import CliRunner

from trtspec.bench.run import BenchOptions
from trtspec.cli.app import app
from trtspec.cli.common import engines_dir, with_device
from trtspec.cli.options import from_flags
from trtspec.deploy.options import K8sOptions
from trtspec.distill.options import DistillOptions
from trtspec.errors import RequestError
from trtspec.spec import EngineSpec, LoadedSpec
from trtspec.verify.run import VerifyOptions

runner = CliRunner()
COMMAND = typer.main.get_command(app)
MODELS = {
    ("verify",): VerifyOptions,
    ("bench",): BenchOptions,
    ("distill",): DistillOptions,
    ("deploy", "k8s"): K8sOptions,
}


def _command(path: tuple[str, ...]):
    command = COMMAND
    for name in path:
        command = command.commands[name]
    return command


@pytest.mark.parametrize("path", sorted(MODELS), ids=" ".join)
def test_an_option_that_names_a_model_field_has_the_fields_default(path):
    """A flag left at its default is left out of the model (its own default applies): the
    default --help shows must be that one."""
    model = MODELS[path]
    options = {p.name: p for p in _command(path).params}
    fields = [name for name in model.model_fields if name in options]
    assert len(fields) >= 10
    for name in fields:
        assert options[name].default == model.model_fields[name].default, name


def test_no_command_is_built_by_rewriting_a_signature():
    """Typer reads each command's own signature: nothing in trtspec rewrites one."""
    root = Path(__file__).resolve().parents[1] / "trtspec"
    assert [str(p) for p in root.rglob("*.py") if "__signature__" in p.read_text()] == []


class _Options(BaseModel):
    count: Annotated[int, Field(ge=1)] = 2
    samples: int | None = None


def _probe() -> typer.Typer:
    probe = typer.Typer()
    seen: list[_Options] = []

    @probe.command()
    def run(
        ctx: typer.Context,
        count: Annotated[int, typer.Option("--count")] = 2,
        samples: Annotated[int | None, typer.Option("--sampling")] = None,
        other: Annotated[int, typer.Option("--other")] = 0,
    ) -> None:
        try:
            seen.append(from_flags(_Options, ctx))
        except RequestError as e:
            typer.echo(f"Error: {e}")
            raise typer.Exit(2) from None

    probe.seen = seen
    return probe


def test_from_flags_takes_only_the_flags_given_and_names_a_refusal_by_its_flag():
    probe = _probe()
    assert runner.invoke(probe, ["--other", "3"]).exit_code == 0
    assert probe.seen[-1].model_fields_set == set() and probe.seen[-1].count == 2
    assert runner.invoke(probe, ["--count", "2"]).exit_code == 0
    assert probe.seen[-1].model_fields_set == {"count"}  # given at its default value is still given
    r = runner.invoke(probe, ["--count", "0"])
    assert r.exit_code == 2 and r.output == "Error: --count: Input should be greater than or equal to 1\n"
    r = runner.invoke(probe, ["--sampling", "x"])
    assert r.exit_code == 2 and "Invalid value for '--sampling'" in r.output  # click's own type check first


def test_a_verify_option_refused_by_the_model_names_the_flag_as_typed(tmp_path):
    r = runner.invoke(app, ["verify", str(tmp_path / "none.yaml"), "--sampling", "0"])
    assert r.exit_code == 2 and "Error: --sampling: Input should be greater than or equal to 1" in r.stderr
    r = runner.invoke(app, ["verify", str(tmp_path / "none.yaml"), "--fail-on", "some"])
    assert r.exit_code == 2 and "Error: --fail-on: Input should be 'any' or 'algorithmic'" in r.stderr


def test_the_engine_folder_is_engines_and_its_old_name_still_reads(tmp_path, capsys):
    loaded = LoadedSpec(
        spec=EngineSpec.model_validate({"name": "p", "target": {"path": "t"}, "draft": {"path": "d"}}), path=tmp_path / "p.yaml"
    )
    assert engines_dir(loaded, tmp_path / "e", None) == (tmp_path / "e").resolve()
    assert engines_dir(loaded, None, tmp_path / "old") == (tmp_path / "old").resolve()
    with pytest.raises(RequestError, match="give the engine folder once: --engines DIR"):
        engines_dir(loaded, tmp_path / "e", tmp_path / "old")
    for path in (("verify",), ("bench",)):
        options = {p.name: p for p in _command(path).params}
        assert options["engines"].opts == ["--engines"] and not options["engines"].hidden
        assert options["output"].hidden and sorted(options["output"].opts) == ["--output", "-o"]


def test_device_is_validated_with_the_spec_it_joins():
    """--device goes through the spec's own rules (a copy patched in unvalidated skipped them)."""
    spec = EngineSpec.model_validate({"name": "q", "target": {"path": "t", "quantization": "int4_wo"}, "draft": {"path": "d"}})
    loaded = LoadedSpec(spec=spec, path=Path("q.yaml"))
    assert with_device(loaded, "cpu").spec.device == "cpu"
    with pytest.raises(RequestError) as err:
        with_device(loaded, "cuda")
    assert str(err.value) == (
        "--device cuda: target.quantization: int4_wo runs PyTorch's CPU weight-only kernels; "
        "set device: cpu (not cuda) or quantization: none"
    )


@pytest.mark.parametrize("command", ["verify", "bench"])
def test_verify_and_bench_load_the_engine_folder_of_either_name(tmp_path, tiny_ckpts, command):
    """Through the command: -o/--output is the folder the engines are looked for in (a note on
    stderr says it is --engines now); both names at once are refused before anything runs."""
    from conftest import write_spec

    spec, old = str(write_spec(tmp_path, tiny_ckpts)), tmp_path / "old-name"
    r = runner.invoke(app, [command, spec, "-o", str(old)])
    stderr = r.stderr.replace("\n", "")
    assert r.exit_code == 2 and "under its old name; use --engines" in stderr and str(old / "target") in stderr, r.stderr
    r = runner.invoke(app, [command, spec, "--engines", str(tmp_path / "e"), "-o", str(old)])
    assert r.exit_code == 2 and "give the engine folder once: --engines DIR" in r.stderr


def _callbacks(typer_app: typer.Typer):
    """Every function Typer builds a command line from: the commands, the sub-apps' and the
    root callback."""
    if typer_app.registered_callback is not None:
        yield typer_app.registered_callback.callback
    for info in typer_app.registered_commands:
        yield info.callback
    for group in typer_app.registered_groups:
        yield from _callbacks(group.typer_instance)


def test_every_option_is_an_annotated_alias_not_an_inline_default():
    """No parameter declares its option inline (``x: bool = typer.Option(...)``): each names a
    typed alias, its default a plain value."""
    import inspect

    from typer.models import ParameterInfo

    inline = [
        f"{fn.__module__}.{fn.__name__}({name})"
        for fn in _callbacks(app)
        for name, p in inspect.signature(fn).parameters.items()
        if isinstance(p.default, ParameterInfo)
    ]
    assert inline == []

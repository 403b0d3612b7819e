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
from trtspec.cli.common import with_device
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


def test_output_is_what_a_command_writes_and_engines_what_it_reads():
    """One name per meaning: -o/--output is the folder a command writes, in every command that
    writes one; --engines is the engine folder a command reads. bench's and deploy k8s's old
    --out is gone: click refuses it (exit 2) and names --output."""
    writers = {("build",), ("repo",), ("distill",), ("bench",), ("deploy", "k8s")}
    for path in writers:
        options = {p.name: p for p in _command(path).params}
        assert sorted(options["output"].opts) == ["--output", "-o"] and not options["output"].hidden, path
    for path in (("verify",), ("bench",), ("repo",), ("serve",), ("refresh",), ("openai",), ("deploy", "k8s")):
        assert {p.name: p for p in _command(path).params}["engines"].opts == ["--engines"], path
    flags = {o for p in _command(("verify",)).params for o in p.opts}
    assert not flags & {"-o", "--output", "--out"}  # verify writes no folder: its files are --json-file, --html, --junit
    for command in (["bench", "spec.yaml"], ["deploy", "k8s", "spec.yaml"]):
        r = runner.invoke(app, [*command, "--out", "x"])
        assert r.exit_code == 2 and "No such option: --out" in r.output and "--output" in r.output


def test_bench_refuses_an_output_folder_holding_engines_before_anything_runs(tmp_path, tiny_ckpts):
    """bench once read its engine folder from -o: a folder of built engines given there is
    refused, not filled with a report."""
    from conftest import write_spec

    spec = str(write_spec(tmp_path, tiny_ckpts))
    (tmp_path / "built" / "target").mkdir(parents=True)
    r = runner.invoke(app, ["bench", spec, "-o", str(tmp_path / "built")])
    said = " ".join(r.stderr.split())
    assert r.exit_code == 2 and "holds built engines: name the engines with --engines" in said, r.stderr


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

"""The `trtspec` command: one small module per command, registered here."""

from __future__ import annotations

import inspect
from typing import Annotated

import typer

from trtspec import __version__
from trtspec.cli import bench, build, check, choices, deploy, distill, openai_front, refresh, repo, serve, stop, verify

app = typer.Typer(
    name="trtspec",
    help="Ship speculative decoding safely: build paired draft/target engines, serve them on "
    "Triton, and prove greedy outputs are token-identical to the target alone.\n\n"
    "Exit codes: 0 ok, 1 verify found a divergence, 2 bad input (spec, checkpoint, flag, "
    "request), 3 runtime failure (server, engine load), 130 interrupted.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command("check")(check.check)
app.command("build")(build.build)
app.command("verify", help=verify.HELP)(verify.verify)
app.command("repo")(repo.repo)
app.command("serve")(serve.serve)
app.command("stop")(stop.stop)
app.command("bench", help=bench.HELP)(bench.bench)
app.command("distill", help=distill.HELP)(distill.distill)
app.command("openai")(openai_front.openai)
app.command("refresh")(refresh.refresh)
app.command("choices")(choices.choices)
app.add_typer(deploy.app, name="deploy")


def reflowed(text: str | None) -> str | None:
    """Help text whose prose paragraphs are one line each, so the terminal wraps them at its
    own width (Typer keeps a docstring's line breaks, and a paragraph hard-wrapped at 90
    columns reads broken mid-sentence at 80); a paragraph with indented lines (examples) keeps
    its lines as written."""
    if not text:
        return text
    out = []
    for paragraph in inspect.cleandoc(text).split("\n\n"):
        lines = paragraph.splitlines()
        block = any(line[:1].isspace() for line in lines[1:])
        out.append(paragraph if block else " ".join(line.strip() for line in lines))
    return "\n\n".join(out)


def _reflow_commands(typer_app: typer.Typer) -> None:
    """Every registered command's help, reflowed (sub-apps' too), in one place."""
    for info in typer_app.registered_commands:
        info.help = reflowed(info.help or (info.callback.__doc__ if info.callback else None))
    for group in typer_app.registered_groups:
        _reflow_commands(group.typer_instance)


_reflow_commands(app)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"trtspec {__version__}")
        raise typer.Exit()


VersionOpt = Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")]


@app.callback()
def _root(version: VersionOpt = False) -> None:
    pass


def main() -> None:
    app()

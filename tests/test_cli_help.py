"""Every command's --help reads at 80 columns: a prose paragraph is filled line by line (no
line ends early, as a docstring hard-wrapped at another width re-wrapped by the terminal
would), and an example line is shown whole, never cut."""

from __future__ import annotations

import re

import pytest
import typer.main
from typer.testing import CliRunner

from trtspec.cli.app import app, reflowed

COLUMNS = 80
TEXT_WIDTH = COLUMNS - 2  # Typer pads the help text one column on each side


def _commands(command=None, path=()):
    command = command or typer.main.get_command(app)
    yield path, command
    for name, sub in (getattr(command, "commands", None) or {}).items():
        yield from _commands(sub, (*path, name))


COMMANDS = {" ".join(("trtspec", *path)): (path, cmd) for path, cmd in _commands()}


def _help_paragraphs(rendered: str) -> list[list[str]]:
    """The help text under the Usage line, before the first panel: paragraphs of lines, each
    line without Typer's padding."""
    lines = rendered.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("Usage:")) + 1
    paragraphs: list[list[str]] = [[]]
    for line in lines[start:]:
        if line.lstrip().startswith("╭"):
            break
        text = line[1:].rstrip()  # one column of padding on the left
        if text:
            paragraphs[-1].append(text)
        elif paragraphs[-1]:
            paragraphs.append([])
    return [p for p in paragraphs if p]


def _early_breaks(lines: list[str]) -> list[str]:
    """Lines of a prose paragraph that end although the next line's first word would fit."""
    return [a for a, b in zip(lines, lines[1:]) if len(a) + 1 + len(b.split()[0]) <= TEXT_WIDTH]


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_help_reads_at_80_columns(name, monkeypatch):
    path, command = COMMANDS[name]
    monkeypatch.setenv("COLUMNS", str(COLUMNS))
    result = CliRunner().invoke(app, [*path, "--help"], terminal_width=COLUMNS)
    assert result.exit_code == 0, result.output
    assert max(len(line) for line in result.output.splitlines()) <= COLUMNS
    source = reflowed(command.help).split("\n\n")
    shown = _help_paragraphs(result.output)
    assert len(shown) == len(source), (source, shown)
    for written, lines in zip(source, shown):
        if "\n" in written:  # a block (examples): every line shown whole
            # whole lines (Typer dedents a last block, so indentation may differ)
            assert [x.strip() for x in lines] == [x.strip() for x in written.splitlines()], f"{name}: an example is cut"
        else:
            assert _early_breaks(lines) == [], f"{name}: a sentence breaks early at 80 columns"


def test_a_hard_wrapped_paragraph_is_reflowed_and_examples_keep_their_lines():
    doc = """First line.

    A paragraph wrapped
    by hand.

    Examples:
      trtspec check a.yaml
      trtspec check b.yaml
    """
    assert (
        reflowed(doc)
        == "First line.\n\nA paragraph wrapped by hand.\n\nExamples:\n  trtspec check a.yaml\n  trtspec check b.yaml"
    )


def test_the_check_catches_an_early_break():
    """The fill rule fails on what Typer made of a docstring hard-wrapped at 90 columns."""
    assert _early_breaks(["replayed in both forward shapes and", "classed numerical or algorithmic."]) == [
        "replayed in both forward shapes and"
    ]


def test_each_command_is_listed_by_one_sentence():
    """`trtspec --help` lists each command by its help's first paragraph: one sentence, the
    rest of the help below it (a first paragraph of several sentences fills the list)."""
    for name, (_, command) in COMMANDS.items():
        first = reflowed(command.help or "").split("\n\n")[0]
        assert not re.search(r"[.;:] [A-Z$]", first.rstrip(".")), f"{name}: {first}"


def _cut_words(output: str) -> list[str]:
    """The words an 80-column help shows cut (rich ends a word too wide for its column with …)."""
    return [m[1] for m in re.finditer(r"([^\s│]*)…", output)]


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_no_option_help_word_is_cut_at_80_columns(name, monkeypatch):
    """An option's help reads whole at 80 columns: no word of it is cut. Only a default value
    wider than the help column may be (a Kubernetes label: Typer shows defaults as they are)."""
    path, command = COMMANDS[name]
    monkeypatch.setenv("COLUMNS", str(COLUMNS))
    output = CliRunner().invoke(app, [*path, "--help"], terminal_width=COLUMNS).output
    defaults = [str(p.default) for p in command.params if isinstance(p.default, str)]
    cut = [w for w in _cut_words(output) if not any(d.startswith(w) and len(d) > len(w) for d in defaults)]
    assert cut == [], f"{name}: option help cut at 80 columns: {cut}"

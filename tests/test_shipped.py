"""What the package ships names no development machine: no home folder, checkout or
reference folder outside the repository (a user's machine has none of them)."""

from __future__ import annotations

import re
from pathlib import Path

import trtspec

PACKAGE = Path(trtspec.__file__).parent
# A checkout, a home folder (~/.pyenv/... is one), or a reference folder outside the repository.
DEVELOPMENT_PATHS = re.compile(r"/work/|/root/|/home/|~/\.pyenv|shared/reference")


def test_no_development_machine_path_in_shipped_files():
    found = []
    for path in sorted(PACKAGE.rglob("*")):
        if not path.is_file() or "__pycache__" in path.parts:
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if DEVELOPMENT_PATHS.search(line):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{n}: {line.strip()}")
    assert found == []


def _commands(command, path=()):
    yield path, command
    for name, sub in (getattr(command, "commands", None) or {}).items():
        yield from _commands(sub, (*path, name))


def test_no_command_help_names_a_lab_path_and_every_prompt_set_it_names_ships():
    """A pip install has no lab/ (the repository's benchmark scripts and results): no command's
    help names a path in it (as default output folder or example prompts), and each file under
    trtspec/ that help offers (the chat and repeat prompt sets) is inside the package."""
    import typer.main
    from typer.testing import CliRunner

    from trtspec.cli.app import app

    root = typer.main.get_command(app)
    lab_paths, named = [], set()
    for path, _ in _commands(root):
        out = CliRunner().invoke(app, [*path, "--help"], terminal_width=400, env={"COLUMNS": "400"}).output
        lab_paths += [f"trtspec {' '.join(path)}: {m[0]}" for m in re.finditer(r"(?<![\w/.-])(?:bench|lab)/[\w./<>-]+", out)]
        named |= set(re.findall(r"(?<![\w/.-])trtspec/[\w/.-]+\.jsonl", out))
    assert lab_paths == []
    assert named and all((PACKAGE.parent / p).is_file() for p in named), named

"""What the package ships names no development machine: no home folder, checkout or
reference folder outside the repository (a user's machine has none of them)."""

from __future__ import annotations

import re
from pathlib import Path

import trtspec

PACKAGE = Path(trtspec.__file__).parent
DEVELOPMENT_PATHS = re.compile(r"/work/|/root/|/home/|shared/reference")


def test_no_development_machine_path_in_shipped_files():
    found = []
    for path in sorted(PACKAGE.rglob("*")):
        if not path.is_file() or "__pycache__" in path.parts:
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if DEVELOPMENT_PATHS.search(line):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{n}: {line.strip()}")
    assert found == []

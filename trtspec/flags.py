"""How an option appears on the command line, declared on the typed options it fills.

A field of an options model carries ``Flag`` in its ``Annotated`` metadata; the command's
signature is built from the model (trtspec/cli/options.py), so each option's type, default,
bounds and help are written once, where the library reads them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Flag:
    """``help`` for --help; ``short`` an optional one-letter alias ("-o"); ``name`` the long
    flag when it is not the field's name with dashes; ``negatable`` gives a bool field a
    --no-<name> form (for options on by default); ``text`` reads the value as text for the
    model to parse (a value written "5%" for a float field)."""

    help: str
    short: str | None = None
    name: str | None = None
    negatable: bool = False
    text: bool = False

    def long(self, field: str) -> str:
        return self.name or "--" + field.replace("_", "-")

"""A command's typed options, built from the flags the command line gave.

Every option is declared once as a typed ``Annotated[...]`` alias (those several commands share
in cli/common.py, a command's own at the top of its module) and named in the command's
signature, where Typer reads it. A command that hands a library call an options model builds it
with ``from_flags``: the model validated from the flags given, so the model's bounds, choices
and cross-checks refuse a bad value with one ``--flag: reason`` line per problem (exit 2).
"""

from __future__ import annotations

from typing import Any, TypeVar

import typer
from pydantic import BaseModel, ValidationError

from trtspec.errors import RequestError

M = TypeVar("M", bound=BaseModel)


def given(ctx: typer.Context) -> dict[str, Any]:
    """The values the command line gave, by parameter name: a flag left at its default is left
    out, so the model's own default applies and ``model_fields_set`` names exactly the flags
    given (distill lets those, and only those, override the spec's recipe)."""
    return {k: v for k, v in ctx.params.items() if getattr(ctx.get_parameter_source(k), "name", None) != "DEFAULT"}


def flag_names(ctx: typer.Context) -> dict[str, str]:
    """Each parameter's long flag as the user types it (``samples`` -> ``--sampling``)."""
    return {p.name: next((o for o in p.opts if o.startswith("--")), p.opts[0]) for p in ctx.command.params if p.opts}


def from_flags(model: type[M], ctx: typer.Context, **values: Any) -> M:
    """``model`` validated from the flags given that name its fields, plus ``values`` the
    command decides itself."""
    flags = {k: v for k, v in given(ctx).items() if k in model.model_fields}
    return validated(model, {**flags, **values}, flag_names(ctx))


def validated(model: type[M], values: dict[str, Any], names: dict[str, str] | None = None) -> M:
    """``model`` from command-line values; each problem one line naming its flag (``names``:
    field -> flag; a field not in it is ``--field-name``)."""
    try:
        return model.model_validate(values)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            name = str(err["loc"][0]) if err["loc"] else ""
            where = (names or {}).get(name) or (f"--{name.replace('_', '-')}" if name else "options")
            reason = str(err["msg"]).removeprefix("Value error, ")
            lines.append(f"{where} {reason}" if reason.startswith("takes ") else f"{where}: {reason}")
        raise RequestError("\n".join(lines)) from e

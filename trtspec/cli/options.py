"""A command's typed options, built from the flags the command line gave.

Every option is declared once as a typed ``Annotated[...]`` alias (those several commands share
in cli/common.py, a command's own at the top of its module) and named in the command's
signature, where Typer reads it. A command that hands a library call an options model builds it
with ``from_flags``: the model validated from the flags given, so the model's bounds, choices
and cross-checks refuse a bad value with one ``--flag: reason`` line per problem (exit 2).
"""

from __future__ import annotations

import functools
import inspect
import types
import typing
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import typer
from pydantic import BaseModel, ValidationError

from trtspec.errors import RequestError
from trtspec.flags import Flag

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


# --- legacy: bench and distill, until they name their flags


def flag_of(field) -> Flag | None:
    return next((m for m in field.metadata if isinstance(m, Flag)), None)


def _plain(annotation: Any) -> Any:
    """The field's type as click can parse it: Annotated bounds stripped and Literal choices
    read as text (the model checks both, so every refusal is one ``--flag: reason`` line),
    ``X | None`` kept."""
    if typing.get_origin(annotation) is typing.Literal:
        return str
    if typing.get_origin(annotation) is Annotated:
        return _plain(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [_plain(a) for a in typing.get_args(annotation)]
        return functools.reduce(lambda a, b: a | b, args)
    return annotation


def _choices(annotation: Any) -> list[str]:
    """A Literal field's values (inside Annotated or ``| None`` too), for --help."""
    if typing.get_origin(annotation) is typing.Literal:
        return [str(v) for v in typing.get_args(annotation)]
    if typing.get_origin(annotation) in (Annotated, typing.Union, types.UnionType):
        return next((c for c in map(_choices, typing.get_args(annotation)) if c), [])
    return []


def parameters(model: type[BaseModel]) -> list[inspect.Parameter]:
    """One keyword parameter per flagged field, in the model's order."""
    params = []
    for name, field in model.model_fields.items():
        flag = flag_of(field)
        if flag is None:
            continue
        long = flag.long(name)
        decls = [f"{long}/--no-{long.removeprefix('--')}" if flag.negatable else long]
        if flag.short:
            decls.append(flag.short)
        choices = _choices(field.annotation)
        text = f"{flag.help} One of: {', '.join(choices)}." if choices else flag.help
        option = typer.Option(*decls, help=text, show_default=field.default is not None)
        kind = (str | None if field.default is None else str) if flag.text else _plain(field.annotation)
        annotation = Annotated[kind, option]
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation, default=field.default))
    return params


def _given_values(values: dict[str, Any], ctx: typer.Context | None) -> dict[str, Any]:
    """The values the command line gave: a flag left at its default is left out, so the model's
    ``model_fields_set`` names exactly the flags given (distill lets those, and only those,
    override the spec's recipe)."""
    if ctx is None:
        return values
    return {k: v for k, v in values.items() if getattr(ctx.get_parameter_source(k), "name", None) != "DEFAULT"}


_CTX = "_command_context"  # the parameter typer fills with the command's context


def declared(model: type[M]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a command whose parameter annotated ``model`` receives the validated options."""

    def wrap(command: Callable[..., Any]) -> Callable[..., Any]:
        own = inspect.signature(command)
        hints = typing.get_type_hints(command, include_extras=True)
        slot = next(name for name in own.parameters if hints.get(name) is model)
        flags = parameters(model)
        names = {p.name for p in flags}

        @functools.wraps(command)
        def run(**kwargs):
            ctx = kwargs.pop(_CTX, None)
            values = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
            return command(**kwargs, **{slot: validated(model, _given_values(values, ctx))})

        kept = [p.replace(annotation=hints.get(p.name, p.annotation)) for p in own.parameters.values() if p.name != slot]
        positional = [p for p in kept if p.default is inspect.Parameter.empty]
        keyword = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in kept if p.default is not inspect.Parameter.empty]
        ctx = inspect.Parameter(_CTX, inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context, default=None)
        run.__signature__ = own.replace(parameters=positional + flags + keyword + [ctx], return_annotation=None)
        # typer reads the signature above and resolves annotations itself: give it objects,
        # not the command module's strings (which it would look up in this module)
        run.__annotations__ = {p.name: p.annotation for p in run.__signature__.parameters.values()}
        del run.__wrapped__
        return run

    return wrap

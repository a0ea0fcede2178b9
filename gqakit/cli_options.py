"""The options vocabulary: a verb's options declared once, as the fields of its dataclass (:func:`opt`),
made into click options (:func:`click_options`) and ``--set`` pairs (:func:`parse_set`), with the
fields several verbs share (``--device``, ``--progress``) and comma-separated lists. The problem
collector that names each flag the way the running command spells it is :mod:`gqakit.problems`.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import click

from gqakit.errors import GqakitError, did_you_mean
from gqakit.problems import Problems, check_options

F = TypeVar("F", bound=Callable[..., Any])

_EXAMPLES = {int: "1,8,32", float: "0,0.05,0.1"}


def parse_list(value: str | Any, kind: type = str, flag: str = "the list") -> tuple:
    """``"1, 8,32"`` -> ``(1, 8, 32)``: a comma-separated string (or a sequence) as a tuple of ``kind``;
    empty names are dropped (``"a,b,"``).

    Raises:
        GqakitError: naming ``flag`` and the value when an item is not a ``kind``, or is not finite
            (``inf``, ``nan``).
    """
    items = [
        v.strip() if isinstance(v, str) else v
        for v in (value.split(",") if isinstance(value, str) else value)
    ]
    if kind is str:
        return tuple(v for v in items if v)  # "a,,b" and "a," name two
    fix = f"comma-separated numbers, e.g. {_EXAMPLES.get(kind, 'a,b')}."
    try:
        out = tuple(kind(v) for v in items)  # an empty item is no number: "1,,8" is an error
    except (TypeError, ValueError):
        what = f"a comma-separated list of {kind.__name__} values"
        raise GqakitError(f"{flag} {value!r} is not {what}: give {fix}") from None
    # float() reads "inf" and "nan", which no list option means: they would fail later, mid-run
    bad = [v for v, x in zip(items, out, strict=True) if isinstance(x, float) and not math.isfinite(x)]
    if bad:
        raise GqakitError(
            f"{flag} {value!r}: {', '.join(map(str, bad))} is not a finite number: give finite {fix}"
        )
    return out


class CommaList(click.ParamType):
    """A click type for ``1,2,4``-style values: a tuple of ``kind``."""

    def __init__(self, kind: type = str) -> None:
        self.kind = kind
        self.name = f"{kind.__name__}[,{kind.__name__}...]"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple:
        if isinstance(value, tuple):
            return value
        flag = param.opts[0] if param is not None and param.opts else "value"
        try:
            return parse_list(value, self.kind, flag)
        except GqakitError as e:
            self.fail(e.message, param, ctx)


def device_field() -> Any:
    """The ``device`` field of a verb's options: ``--device``, the same words in every command."""
    return opt("auto", "Where to run: auto (CUDA when present), cpu, cuda:N.")


def progress_field() -> Any:
    """The ``progress`` field of a verb's options: ``--progress/--no-progress``."""
    return opt(True, "Show progress bars of the long steps.")


def opt(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    short: str | None = None,
    choices: Sequence[str] | Callable[[], Sequence[str]] | None = None,
    kind: type | None = None,
    cli: bool | str = True,
    factory: Callable[[], Any] | None = None,
) -> Any:
    """A field of a verb's options dataclass, with what its command-line option needs.

    The dataclass is then the one place the option is declared: :func:`click_options` makes its click
    option (``--calib-tokens`` from ``calib_tokens``), a recipe builds the same dataclass from YAML, and a
    pipeline passes the instance through.

    Args:
        default: the default (omit for a required field; ``factory`` for a mutable one).
        help: what the option does, for ``--help`` (figures belong in the docs, not here).
        short: a one-letter alias (``-g``).
        choices: the allowed names (or a function returning them, read when the command is built).
        kind: the item type of a comma-separated list field (``tuple[int, ...]``: ``int``).
        cli: ``True``: an option of its own; ``"set"``: a less used knob, given as ``--set name=value``
            (:func:`parse_set`); ``False``: no option (set by a pipeline or a recipe only).
        factory: default factory, for list or dict defaults.
    """
    meta = {"help": help, "short": short, "choices": choices, "kind": kind, "cli": cli}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata={"gqakit": meta})
    return dataclasses.field(default=default, metadata={"gqakit": meta})


def _plain_type(tp: Any) -> tuple[Any, bool]:
    """``int | None`` -> ``(int, True)``; ``int`` -> ``(int, False)``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return (args[0] if len(args) == 1 else str), True
    return tp, False


def click_options(cls: type, *, skip: Sequence[str] = ()):
    """A decorator adding one click option per field of the dataclass ``cls`` that has :func:`opt`
    metadata (and ``cli`` true), in the fields' order; ``skip`` names fields the command declares itself
    (arguments).

    Booleans that default to False are flags; those that default to True get ``--x/--no-x``. When
    ``cls`` has ``cli="set"`` fields, a repeatable ``--set NAME=VALUE`` comes last, listing them.
    """
    hints = typing.get_type_hints(cls)

    def decorate(fn: F) -> F:
        if settable(cls):
            knobs = "; ".join(
                name
                + ("" if f.default in (None, dataclasses.MISSING) else f"={str(f.default).lower()}")
                + f": {f.metadata['gqakit']['help'].rstrip('.')}"
                for name, f in settable(cls).items()
            )
            text = f"A less used setting, NAME=VALUE (repeatable): {knobs}."
            fn = click.option("--set", "settings", multiple=True, metavar="NAME=VALUE", help=text)(fn)
            # so that a problem names such a field "--set name" (command_flags)
            fn.__click_params__[-1].settable = tuple(settable(cls))  # type: ignore[attr-defined]
        for f in reversed(dataclasses.fields(cls)):
            meta = f.metadata.get("gqakit")
            if meta is None or meta["cli"] is not True or f.name in skip:
                continue
            tp = _plain_type(hints[f.name])[0]
            default = f.default
            if default is dataclasses.MISSING and f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            flag = "--" + f.name.rstrip("_").replace("_", "-")  # compile_: --compile
            decls = [flag] + ([meta["short"]] if meta["short"] else [])
            kw: dict[str, Any] = {"help": meta["help"]}
            if default is dataclasses.MISSING:
                kw["required"] = True
            else:
                kw["default"] = default
                kw["show_default"] = default is not None and default != () and not isinstance(default, bool)
            choices = meta["choices"]
            if tp is bool:
                kw["is_flag"] = True
                if default is True:
                    decls = [f"{decls[0]}/--no-{decls[0][2:]}"]
            elif choices is not None:
                kw["type"] = click.Choice(list(choices() if callable(choices) else choices))
            elif meta["kind"] is not None or typing.get_origin(tp) is tuple:
                kw["type"] = CommaList(meta["kind"] or str)
                if isinstance(default, tuple):
                    kw["default"] = ",".join(map(str, default)) if default else None
                    kw["show_default"] = bool(default)
            elif tp in (Path, int, float):
                kw["type"] = click.Path(path_type=Path) if tp is Path else tp
            fn = click.option(*decls, f.name, **kw)(fn)
        return fn

    return decorate


def options_from(cls: type, kwargs: dict[str, Any], **fixed: Any) -> Any:
    """Build ``cls`` from a click command's keyword arguments (the fields it has, the ``--set`` pairs of
    :func:`parse_set`, plus ``fixed``) and check it: the ``--set`` problems and every problem its
    ``check`` finds (:func:`~gqakit.problems.check_options`) are raised together, before the command
    writes anything. The keyword arguments it took are removed from ``kwargs`` (the rest are the
    command's own)."""
    names = {f.name for f in dataclasses.fields(cls)}
    values = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
    p = Problems("")
    values.update(parse_set(cls, kwargs.pop("settings", ()), p))
    return check_options(cls(**values, **fixed), problems=p)


def settable(cls: type) -> dict[str, dataclasses.Field]:
    """The fields of ``cls`` given as ``--set name=value`` (``opt(..., cli="set")``), by name."""
    return {f.name: f for f in dataclasses.fields(cls) if f.metadata.get("gqakit", {}).get("cli") == "set"}


_KINDS = {int: "a whole number", float: "a number", bool: "true or false"}


def parse_set(cls: type, pairs: Iterable[str], problems: Problems | None = None) -> dict[str, Any]:
    """``["stride=256", "static_cache=true"]`` -> ``{"stride": 256, "static_cache": True}``: each value read
    as its field's type (``none`` gives an optional field None).

    Every pair that is not ``NAME=VALUE`` of a settable field of ``cls``, or whose value is not of the
    field's type, is a problem naming the known names and the closest one: added to ``problems`` when
    given (reported with the options' other problems), else raised.

    Raises:
        GqakitError: those problems, when no ``problems`` collects them.
    """
    known = settable(cls)
    hints = typing.get_type_hints(cls)
    out: dict[str, Any] = {}
    p = problems if problems is not None else Problems("")
    for pair in pairs:
        name, eq, text = pair.partition("=")
        name, text = name.strip().replace("-", "_"), text.strip()
        if not eq:
            p.add(f"--set {pair!r} is not NAME=VALUE; e.g. --set {next(iter(known), 'name')}=...")
        elif name not in known:
            if p.flag(name) != name:  # the running command has a flag for it
                p.add(f"--set {pair!r}: {name} has an option of its own, {p.flag(name)}.")
            else:
                close = did_you_mean(name, list(known))
                p.add(f"--set {pair!r}: {name!r} is no setting.{close} Known: {', '.join(known)}.")
        else:
            tp, optional = _plain_type(hints[name])
            # click's own reading of a number or a boolean (true/false, yes/no, 1/0, on/off)
            read = click.types.convert_type(tp if tp in _KINDS else str)
            try:
                none = optional and text.lower() in ("none", "null")
                out[name] = None if none else read.convert(text, None, None)
            except click.BadParameter:
                p.add(f"--set {pair!r}: {name} takes {_KINDS.get(tp, 'a value')}, got {text!r}.")
    if problems is None:
        p.raise_if_any()
    return out

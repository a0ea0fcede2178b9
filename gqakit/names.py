"""Tables of names: the one place a kind of name (a conversion method, a preset, an eval engine) is
defined, with what each name means. Everything else reads the table: click's choices, the help text,
recipe validation, the docs' tests, the dispatch to an implementation, and the one message for an
unknown name, with the choices and the closest one.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

from gqakit.errors import did_you_mean

T = TypeVar("T")


class NameTable(dict[str, T], Generic[T]):
    """Names of one kind, in the order they are shown, each with its entry (a dict of them).

    Args:
        kind: what a name is, for messages (``conversion method``).
        entries: name -> entry, in display order.
        summary: how to describe an entry in one line; default ``str(entry)`` (entries that are
            descriptions) or the entry's ``summary`` attribute.
    """

    def __init__(
        self, kind: str, entries: Mapping[str, T], summary: Callable[[T], str] | None = None
    ) -> None:
        super().__init__(entries)
        self.kind = kind
        self._summary = summary or (lambda e: e if isinstance(e, str) else str(getattr(e, "summary", e)))

    @property
    def names(self) -> tuple[str, ...]:
        """Every name, in display order (click's ``Choice``, docs)."""
        return tuple(self)

    def where(self, test: Callable[[T], bool]) -> tuple[str, ...]:
        """The names whose entry passes ``test``, in display order."""
        return tuple(n for n, e in self.items() if test(e))

    def unknown(self, name: str, flag: str) -> str | None:
        """The message for ``name`` given as ``flag`` when it is not in the table, with the choices and the
        closest one; None when it is known."""
        if name in self:
            return None
        close = did_you_mean(str(name), self.names)
        return f"{flag} {name!r} is unknown; choose one of {', '.join(self)}.{close}"

    def unknown_in(self, names: tuple[str, ...] | list[str], flag: str) -> str | None:
        """The message for a comma-separated list ``names`` given as ``flag``: the unknown ones, the
        choices and the closest name to the first unknown; None when every name is known."""
        bad = [n for n in names if n not in self]
        if not bad:
            return None
        plural = "s" if len(bad) > 1 else ""
        return (
            f"{flag} {','.join(map(str, bad))}: unknown {self.kind}{plural}; choose from {', '.join(self)}."
            f"{did_you_mean(str(bad[0]), self.names)}"
        )

    def describe(self) -> str:
        """``name: summary`` for every name, for help texts."""
        return "; ".join(f"{n}: {self._summary(e)}" for n, e in self.items())


def resolve(ref: str) -> Any:
    """The object a table names as ``"module:attr"``, its module imported now (so that listing a table
    imports no command and no backend)."""
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)

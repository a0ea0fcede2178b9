"""Tables of names: the one place a kind of name (a conversion method, a grouping, an eval engine) is
defined, with what each name means.

A :class:`NameTable` maps each name to its entry (a description, or a dataclass that says what the name
does). Everything else reads the table: click's choices, the help text, recipe validation, the docs'
tests, and the dispatch to an implementation. An unknown name gets one message with the choices and the
closest name (lm-eval's registries work the same way)::

    GROUPINGS = NameTable("grouping", {"contiguous": "...", "similarity": "..."})
    GROUPINGS.unknown("simlarity", "--grouping")
    # --grouping 'simlarity' is unknown; choose one of contiguous, similarity. Did you mean "similarity"?
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar

from gqakit.errors import did_you_mean

T = TypeVar("T")


class NameTable(Mapping[str, T], Generic[T]):
    """Names of one kind, in the order they are shown, each with its entry.

    Args:
        kind: what a name is, for messages (``conversion method``).
        entries: name -> entry, in display order.
        summary: how to describe an entry in one line; default ``str(entry)`` (entries that are
            descriptions) or the entry's ``summary`` attribute.
    """

    def __init__(
        self, kind: str, entries: Mapping[str, T], summary: Callable[[T], str] | None = None
    ) -> None:
        self.kind = kind
        self._entries = dict(entries)
        self._summary = summary or (lambda e: e if isinstance(e, str) else str(getattr(e, "summary", e)))

    def __getitem__(self, name: str) -> T:
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def names(self) -> tuple[str, ...]:
        """Every name, in display order (click's ``Choice``, docs)."""
        return tuple(self._entries)

    def where(self, test: Callable[[T], bool]) -> tuple[str, ...]:
        """The names whose entry passes ``test``, in display order."""
        return tuple(n for n, e in self._entries.items() if test(e))

    def unknown(self, name: str, flag: str, among: tuple[str, ...] | None = None) -> str | None:
        """The message for ``name`` given as ``flag`` when it is not one of ``among`` (default: every
        name), with the choices and the closest one; None when it is known."""
        among = self.names if among is None else among
        if name in among:
            return None
        return (
            f"{flag} {name!r} is unknown; choose one of {', '.join(among)}.{did_you_mean(str(name), among)}"
        )

    def unknown_in(
        self, names: tuple[str, ...] | list[str], flag: str, among: tuple[str, ...] | None = None
    ) -> str | None:
        """The message for a comma-separated list ``names`` given as ``flag``: the unknown ones, the
        choices and the closest name to the first unknown; None when every name is known."""
        among = self.names if among is None else among
        bad = [n for n in names if n not in among]
        if not bad:
            return None
        plural = "s" if len(bad) > 1 else ""
        return (
            f"{flag} {','.join(map(str, bad))}: unknown {self.kind}{plural}; choose from {', '.join(among)}."
            f"{did_you_mean(str(bad[0]), among)}"
        )

    def describe(self, names: tuple[str, ...] | None = None, sep: str = "; ") -> str:
        """``name: summary`` for each of ``names`` (default: all), for help texts."""
        return sep.join(f"{n}: {self._summary(self._entries[n])}" for n in (names or self.names))


def resolve(ref: str) -> Any:
    """The object a table names as ``"module:attr"``, its module imported now (so that listing a table
    imports no command and no backend)."""
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)

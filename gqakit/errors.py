"""The one exception type users see.

Every error that a person can fix (a bad path, a bad number of groups, a corrupt shard) is raised as
:class:`GqakitError` with a message that names the bad value and the fix. It subclasses
``click.ClickException`` so the CLI prints ``Error: <message>`` and exits non-zero without a traceback,
while Python callers can catch it like any exception.
"""

from __future__ import annotations

import difflib

import click


class GqakitError(click.ClickException):
    """A problem with the user's input, reported as one clear message."""

    exit_code = 2

    def __init__(self, message: str) -> None:
        super().__init__(message)


def did_you_mean(value: str, choices: list[str] | tuple[str, ...]) -> str:
    """Return ' Did you mean "x"?' for the closest choice, or '' when nothing is close."""
    close = difflib.get_close_matches(value, list(choices), n=1, cutoff=0.5)
    return f' Did you mean "{close[0]}"?' if close else ""

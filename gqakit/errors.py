"""The one exception type users see, :class:`GqakitError`: a ``click.ClickException``, so the CLI prints
``Error: <message>`` and exits non-zero without a traceback, while Python callers catch it like any
exception."""

from __future__ import annotations

import difflib

import click


class GqakitError(click.ClickException):
    """A problem a person can fix (a bad path, a bad number of groups, a corrupt shard), reported as one
    message that names the bad value and the fix."""

    exit_code = 2


def did_you_mean(value: str, choices: list[str] | tuple[str, ...]) -> str:
    """Return ' Did you mean "x"?' for the closest choice, or '' when nothing is close."""
    close = difflib.get_close_matches(value, list(choices), n=1, cutoff=0.5)
    return f' Did you mean "{close[0]}"?' if close else ""

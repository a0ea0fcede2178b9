"""The options of ``gqakit probe``: which conversions to measure, on what text."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gqakit.cli_options import Problems, device_problem
from gqakit.convert.methods import GROUPINGS, MERGE_METHODS, METHODS


@dataclass(frozen=True)
class ProbeOptions:
    """Options of ``gqakit probe``.

    Attributes:
        groups: the G values to try.
        methods: conversion methods to try (:data:`~gqakit.convert.methods.METHODS`).
        groupings: head groupings to try (:data:`~gqakit.convert.methods.GROUPINGS`).
        eval_data: held-out text for perplexity and attention errors.
        calib_data: calibration text (needed for ``calibrated`` and ``similarity``).
        calib_tokens: calibration tokens.
        eval_tokens: held-out tokens scored for perplexity.
        error_tokens: held-out tokens for the attention-output errors.
        seq_len: perplexity window (tokens); also the length of error sequences.
        batch_size: windows per forward pass.
        text_field: column of ``.jsonl`` / ``.parquet`` data.
        device: ``auto``, ``cpu``, ``cuda``...
    """

    groups: tuple[int, ...]
    eval_data: str
    methods: tuple[str, ...] = ("mean", "first", "calibrated")
    groupings: tuple[str, ...] = ("contiguous",)
    calib_data: str | None = None
    calib_tokens: int = 4096
    eval_tokens: int = 16384
    error_tokens: int = 2048
    seq_len: int = 256
    batch_size: int = 8
    text_field: str = "text"
    device: str = "auto"

    def validate(self) -> None:
        p = Problems("probe")
        f = p.flag
        p.add(device_problem(self.device, f("device")))
        if not self.groups:
            p.add(f"{f('groups')} needs at least one value, e.g. {f('groups')} 1,2.")
        if not self.methods:
            p.add(f"{f('methods')} needs at least one of {', '.join(METHODS)}.")
        p.add(METHODS.unknown_in(self.methods, f("methods")))
        if not self.groupings:
            p.add(f"{f('groupings')} needs at least one of {', '.join(GROUPINGS)}.")
        p.add(GROUPINGS.unknown_in(self.groupings, f("groupings")))
        needs = [f"{f('methods')} {m}" for m in self.methods if m in METHODS and METHODS[m].needs_calibration]
        needs += [
            f"{f('groupings')} {g}"
            for g in self.groupings
            if g in GROUPINGS and GROUPINGS[g].needs_calibration
        ]
        if needs and not self.calib_data:
            p.add(f"{' and '.join(needs)} need {f('calib_data')} FILE.")
        if self.calib_data and not Path(self.calib_data).expanduser().is_file():
            p.add(f"{f('calib_data')} {self.calib_data} does not exist or is not a file.")
        if not Path(self.eval_data).expanduser().is_file():
            p.add(f"{f('eval_data')} {self.eval_data} does not exist or is not a file.")
        for name in ("calib_tokens", "eval_tokens", "error_tokens", "seq_len", "batch_size"):
            if getattr(self, name) <= 0:
                p.add(f"{f(name)} must be positive, got {getattr(self, name)}.")
        p.raise_if_any()

    def combinations(self) -> list[tuple[int, str, str]]:
        """(G, method, grouping) in table order; similarity is skipped for methods it cannot combine with."""
        return [
            (g, m, grp)
            for g in self.groups
            for grp in self.groupings
            for m in self.methods
            if not GROUPINGS[grp].needs_calibration or m in MERGE_METHODS
        ]


__all__ = ["ProbeOptions"]

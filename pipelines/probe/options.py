"""The options of ``gqakit probe``: which conversions to measure, on what text."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gqakit.cli_options import device_field, opt
from gqakit.convert.methods import GROUPINGS, MERGE_METHODS, METHODS
from gqakit.pipelines.steps import at_least
from gqakit.problems import Problems, device_problem


@dataclass(frozen=True)
class ProbeOptions:
    """Options of ``gqakit probe``. The fields without a flag are for Python callers and tests: the
    calibration tokens, the held-out tokens of the attention-output errors, the perplexity window (also
    the length of the error sequences), windows per forward pass, and the column of ``.jsonl`` /
    ``.parquet`` data."""

    groups: tuple[int, ...] = opt(help="Comma-separated G values to try, e.g. 1,3.", short="-g", kind=int)
    eval_data: str = opt(help="Held-out text, for perplexity and the attention-output errors.")
    methods: tuple[str, ...] = opt(
        ("mean", "first", "calibrated"), f"Comma-separated conversion methods ({', '.join(METHODS)})."
    )
    groupings: tuple[str, ...] = opt(
        ("contiguous",), f"Comma-separated head groupings ({', '.join(GROUPINGS)}).", flag="--grouping"
    )
    calib_data: str | None = opt(None, "Calibration text, for calibrated and similarity.")
    eval_tokens: int = opt(16384, "Held-out tokens scored for perplexity.")
    device: str = device_field()
    calib_tokens: int = opt(4096, cli=False)
    error_tokens: int = opt(2048, cli=False)
    seq_len: int = opt(256, cli=False)
    batch_size: int = opt(8, cli=False)
    text_field: str = opt("text", cli=False)

    def check(self, p: Problems) -> None:
        """Add every problem with these options to ``p`` (:func:`gqakit.problems.check_options`)."""
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
        for name in ("calib_data", "eval_data"):  # text, .jsonl or .parquet: load_texts reads each kind
            path = getattr(self, name)
            if path and not Path(path).expanduser().is_file():
                p.add(f"{f(name)} {path} does not exist or is not a file.")
        at_least(p, self, 1, "calib_tokens", "eval_tokens", "error_tokens", "seq_len", "batch_size")

    def combinations(self) -> list[tuple[int, str, str]]:
        """(G, method, grouping) in table order; similarity is skipped for methods it cannot combine with."""
        return [
            (g, m, grp)
            for g in self.groups
            for grp in self.groupings
            for m in self.methods
            if not GROUPINGS[grp].needs_calibration or m in MERGE_METHODS
        ]

"""The options of ``gqakit probe``: which conversions to measure, on what text."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gqakit.cli_options import device_field, opt
from gqakit.convert.methods import METHODS
from gqakit.pipelines.steps import at_least
from gqakit.problems import Problems, device_problem


@dataclass(frozen=True)
class ProbeOptions:
    """Options of ``gqakit probe``. The fields without a flag are for Python callers and tests: the
    calibration tokens, the held-out tokens of the attention-output errors, the perplexity window (also
    the length of the error sequences)."""

    groups: tuple[int, ...] = opt(help="Comma-separated G values to try, e.g. 1,3.", short="-g", kind=int)
    eval_data: str = opt(help="Held-out text, for perplexity and the attention-output errors.")
    methods: tuple[str, ...] = opt(
        ("mean", "first", "calibrated"), f"Comma-separated conversion methods ({', '.join(METHODS)})."
    )
    calib_data: str | None = opt(None, "Calibration text, for the calibrated method.")
    eval_tokens: int = opt(16384, "Held-out tokens scored for perplexity.")
    device: str = device_field()
    out: Path = opt(Path("probe"), "Directory for probe.json, probe.md and probe.png.")
    calib_tokens: int = opt(4096, cli=False)
    error_tokens: int = opt(2048, cli=False)
    seq_len: int = opt(256, cli=False)

    def check(self, p: Problems) -> None:
        """Add every problem with these options to ``p`` (:func:`gqakit.problems.check_options`)."""
        f = p.flag
        p.add(device_problem(self.device, f("device")))
        if not self.groups:
            p.add(f"{f('groups')} needs at least one value, e.g. {f('groups')} 1,2.")
        if not self.methods:
            p.add(f"{f('methods')} needs at least one of {', '.join(METHODS)}.")
        p.add(METHODS.unknown_in(self.methods, f("methods")))
        needs = [f"{f('methods')} {m}" for m in self.methods if m in METHODS and METHODS[m].needs_calibration]
        if needs and not self.calib_data:
            p.add(f"{' and '.join(needs)} need {f('calib_data')} FILE.")
        for name in ("calib_data", "eval_data"):  # text, .jsonl or .parquet: load_texts reads each kind
            path = getattr(self, name)
            if path and not Path(path).expanduser().is_file():
                p.add(f"{f(name)} {path} does not exist or is not a file.")
        at_least(p, self, 1, "calib_tokens", "eval_tokens", "error_tokens", "seq_len")

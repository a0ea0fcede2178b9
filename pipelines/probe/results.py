"""What ``gqakit probe`` measured: one row per combination, and the table and JSON they make."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class ProbeRow:
    """One measured combination (G = None: the original)."""

    groups: int | None
    method: str
    grouping: str
    ppl: float
    ppl_ratio: float
    attn_error: list[float] = field(default_factory=list)
    key_error: float | None = None
    value_error: float | None = None
    seconds: float = 0.0

    @property
    def mean_attn_error(self) -> float | None:
        return sum(self.attn_error) / len(self.attn_error) if self.attn_error else None


@dataclass
class ProbeResult:
    source: str
    num_heads: int
    num_kv_heads: int
    rows: list[ProbeRow]
    settings: dict[str, Any]
    out_dir: Path | None = None

    def to_table(self) -> str:
        head = (
            "| G | method | grouping | perplexity | x original | attn-out error (mean) | key err "
            "| value err |"
        )
        lines = [head, "|---|---|---|---:|---:|---:|---:|---:|"]

        def f(x: float | None) -> str:
            return "" if x is None else f"{x:.4f}"

        for r in self.rows:
            g = "orig" if r.groups is None else str(r.groups)
            lines.append(
                f"| {g} | {r.method} | {r.grouping} | {r.ppl:,.2f} | {r.ppl_ratio:,.2f} | "
                f"{f(r.mean_attn_error)} | {f(r.key_error)} | {f(r.value_error)} |"
            )
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "settings": self.settings,
            "rows": [{**asdict(r), "mean_attn_error": r.mean_attn_error} for r in self.rows],
        }


__all__ = ["ProbeResult", "ProbeRow"]

"""The one table of dtype names (:data:`TABLE`): how torch and ``config.json`` (``bfloat16``),
safetensors (``BF16``) and a recipe or a report (``bf16``) spell each dtype. Every lookup takes any of
the spellings, a torch dtype too."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gqakit.errors import GqakitError


@dataclass(frozen=True)
class DType:
    """A dtype in each spelling; ``float``: one that ``--dtype`` casts (float8 weights are kept as is)."""

    name: str
    torch: torch.dtype
    safetensors: str
    short: str = ""
    float: bool = False


TABLE: tuple[DType, ...] = (
    DType("float32", torch.float32, "F32", "fp32", float=True),
    DType("bfloat16", torch.bfloat16, "BF16", "bf16", float=True),
    DType("float16", torch.float16, "F16", "fp16", float=True),
    DType("float64", torch.float64, "F64", "fp64", float=True),
    DType("int64", torch.int64, "I64"),
    DType("int32", torch.int32, "I32"),
    DType("int16", torch.int16, "I16"),
    DType("int8", torch.int8, "I8"),
    DType("uint8", torch.uint8, "U8"),
    DType("bool", torch.bool, "BOOL"),
    DType("float8_e4m3fn", torch.float8_e4m3fn, "F8_E4M3"),
    DType("float8_e5m2", torch.float8_e5m2, "F8_E5M2"),
)
# every spelling -> its row: "bfloat16", "torch.bfloat16", "BF16", "bf16", torch.bfloat16
_ROWS: dict[Any, DType] = {
    key: r for r in TABLE for key in (r.name, f"torch.{r.name}", r.safetensors, r.short, r.torch) if key != ""
}

# The dtypes a model is loaded in (eval, demo): auto is the checkpoint's own.
LOAD_DTYPES = ("auto", "float32", "bfloat16", "float16")
SAFETENSORS_DTYPES = frozenset(row.safetensors for row in TABLE)


def row(dtype: str | torch.dtype) -> DType:
    """The row of ``dtype``; a :class:`GqakitError` naming the floating ones when there is none."""
    try:
        return _ROWS[dtype]
    except (KeyError, TypeError):
        names = ", ".join(r.name for r in TABLE if r.float)
        raise GqakitError(f"dtype {dtype!r} is unknown; choose one of {names}.") from None


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"``, ``"BF16"``, ``"bf16"`` or ``"torch.bfloat16"`` -> ``torch.bfloat16``."""
    return row(dtype).torch


def dtype_name(dtype: str | torch.dtype) -> str:
    """Any spelling -> torch's and ``config.json``'s name (``bfloat16``)."""
    return row(dtype).name


def safetensors_name(dtype: str | torch.dtype) -> str:
    """Any spelling -> the safetensors header's name (``BF16``)."""
    return row(dtype).safetensors


def short_name(dtype: str | torch.dtype) -> str:
    """Any spelling -> the short name (``bf16``) where the table has one, else the name."""
    r = row(dtype)
    return r.short or r.name


def config_dtype(config: Any, default: torch.dtype = torch.float32) -> torch.dtype:
    """The dtype a config (a dict or a transformers config) states in ``dtype`` (or the older
    ``torch_dtype``) when it is float32, bfloat16 or float16; else ``default``."""
    get = config.get if isinstance(config, dict) else lambda k: getattr(config, k, None)
    stated = get("dtype") or get("torch_dtype")
    found = _ROWS.get(str(stated)) if stated is not None else None
    return found.torch if found is not None and found.name in LOAD_DTYPES else default

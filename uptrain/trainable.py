"""Which parameters train: ``all`` (the paper), ``attention``, or ``kv`` (only the K/V projections).

The attention and K/V module paths come from the converter's architecture adapters
(:data:`gqakit.convert.registry.ADAPTERS`), so a family that converts also freezes correctly.
"""

from __future__ import annotations

import re

import torch

from gqakit.convert.registry import ArchAdapter, get_adapter
from gqakit.errors import GqakitError


def _pattern(template: str) -> str:
    """``model.layers.{layer}.self_attn.k_proj`` -> a regex matching its parameters."""
    escaped = re.escape(template).replace(r"\{layer\}", r"\d+").replace(r"\{head\}", r"\d+")
    return escaped + r"\."


def trainable_patterns(adapter: ArchAdapter, mode: str) -> list[str]:
    """Regexes of the parameter names that train under ``mode`` (``attention`` or ``kv``)."""
    if mode == "attention":
        return [_pattern(adapter.o.rsplit(".", 1)[0])]  # the whole attention module
    if mode == "kv":
        # A fused qkv projection (phi3) trains as a whole: its K/V rows cannot be split from Q's.
        templates = [adapter.k, adapter.v, adapter.qkv, adapter.k_norm_flat, adapter.k_norm_per_head]
        return [_pattern(t) for t in templates if t]
    raise ValueError(f"unknown trainable mode {mode!r}")


def apply_trainable(model: torch.nn.Module, mode: str) -> tuple[int, int]:
    """Freeze every parameter that ``mode`` does not train; return (trainable, total) parameter counts.

    Raises:
        GqakitError: the family has no adapter (for ``attention`` / ``kv``), or nothing matched.
    """
    params = dict(model.named_parameters())
    total = sum(p.numel() for p in params.values())
    if mode == "all":
        for p in params.values():
            p.requires_grad_(True)
        return total, total
    model_type = getattr(model.config, "model_type", "")
    regex = re.compile("|".join(trainable_patterns(get_adapter(model_type), mode)))
    chosen = 0
    for name, p in params.items():
        train = bool(regex.match(name))
        p.requires_grad_(train)
        chosen += p.numel() if train else 0
    if chosen == 0:
        raise GqakitError(
            f"train.trainable={mode} matched no parameter of this {model_type} model (first names: "
            f"{', '.join(list(params)[:3])}). Use train.trainable=all."
        )
    return chosen, total


__all__ = ["apply_trainable", "trainable_patterns"]

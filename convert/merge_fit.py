"""Calibrated conversions: one key and one value merge per group of contiguous K/V heads, fitted per
decoder layer (:func:`fit_one_layer`), and the plan that applies them (:func:`merged_layer`); the method
and its key fallback for keys normalized per head are docs/convert.md's "Calibrated conversion".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from gqakit.convert.merge import (
    Merge,
    augment,
    compensate_o_cols,
    compensate_q_rows,
    downstream_scales,
    energy,
    fit_key_merge,
    fit_value_merge,
    in_metric,
    mean_merge,
    merge_error,
    merge_rows,
)
from gqakit.convert.plan import (
    Infos,
    OutputTensor,
    RegroupSpec,
    cast_output,
    plan_layer,
    split_qkv,
)
from gqakit.family_parts import ArchAdapter
from gqakit.geometry import AttentionGeometry

# What a calibrated merge minimizes, for the provenance record (see merge.downstream_scales).
MERGE_OBJECTIVE = (
    "output error on the calibration data, keys weighted per rotary pair by the energy of the queries "
    "they serve, values through the o_proj columns that read them"
)
KEY_FALLBACK = "mean (keys are normalized per head after projection, so a linear key merge is not exact)"


@dataclass
class LayerMerge:
    """How one layer's contiguous groups of K/V heads are merged.

    Attributes:
        keys, values: one merge per group.
        key_error, value_error: the merges' relative reconstruction error on the calibration data,
            ``sum ||X (W_i - D_i W_s)^T||^2 / sum ||X W_i^T||^2`` over the layer's heads.
    """

    keys: list[Merge]
    values: list[Merge]
    key_error: float = 0.0
    value_error: float = 0.0


def keys_normalized(infos: Infos, adapter: ArchAdapter, layer: int) -> bool:
    """Whether this layer normalizes keys after projection: the checkpoint holds one of the key-norm
    modules its adapter names."""
    return any(f"{m}.weight" in infos for m in adapter.key_norm_modules(layer))


def layer_attention_weights(
    read: Callable[[str], torch.Tensor],
    infos: Infos,
    adapter: ArchAdapter,
    geom: AttentionGeometry,
    layer: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This layer's query, key and value heads with their affine column: ``[heads, d, hidden + 1]``
    tensors. A fused ``qkv`` projection is read once."""
    kv, d, h = geom.num_kv_heads, geom.head_dim, geom.num_heads

    def rows(module: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        bias = f"{module}.bias"
        return read(f"{module}.weight"), (read(bias) if bias in infos else None)

    if adapter.qkv is not None:
        w, b = rows(adapter.tensor("qkv", layer).rsplit(".", 1)[0])
        ws = split_qkv(w, h, kv, d, adapter.qkv_per_head)
        bs = split_qkv(b, h, kv, d, adapter.qkv_per_head) if b is not None else (None, None, None)
        pairs = list(zip(ws, bs, strict=True))
    else:
        pairs = [rows(adapter.module(role, layer)) for role in ("q", "k", "v")]  # type: ignore[arg-type]
    q, k, v = (augment(w, b).reshape(-1, d, w.shape[1] + 1) for w, b in pairs)
    return q, k, v


def fit_one_layer(
    read: Callable[[str], torch.Tensor],
    infos: Infos,
    adapter: ArchAdapter,
    geom: AttentionGeometry,
    layer: int,
    gram: torch.Tensor,
    groups: int,
    rdim: int = 0,
) -> tuple[LayerMerge, str]:
    """Fit the calibrated key/value merges of one layer's contiguous groups of K/V heads.

    Args:
        read: reads a source tensor by name (only this layer's attention tensors are read).
        infos: the source's tensor index.
        layer: the decoder layer.
        gram: ``[X, 1]^T [X, 1]`` of this layer's K/V projection input.
        groups: K/V heads in the output.
        rdim: rotary channels per head (none in a family with learned positions).

    Returns:
        The layer's merge, and how its keys were merged (``calibrated``, or the per-head-norm fallback).
    """
    wq, wk, wv = layer_attention_weights(read, infos, adapter, geom, layer)
    # Merges count errors where they matter downstream (see downstream_scales).
    ks, vs = downstream_scales(wq, read(adapter.tensor("o", layer)), gram, geom.num_kv_heads, rdim)
    r, d = geom.num_kv_heads // groups, geom.head_dim
    chosen = [slice(g * r, (g + 1) * r) for g in range(groups)]
    mean_keys = keys_normalized(infos, adapter, layer)
    fit_keys = partial(fit_key_merge, gram=gram, rotary_dim=rdim)
    keys = [mean_merge(r, d) if mean_keys else in_metric(fit_keys, wk[g], ks[g]) for g in chosen]
    values = [in_metric(partial(fit_value_merge, gram=gram), wv[g], vs[g]) for g in chosen]
    # reported plainly: output energy lost, relative to the layer's
    ek = sum(merge_error(wk[g], gram, m) for g, m in zip(chosen, keys, strict=True))
    ev = sum(merge_error(wv[g], gram, m) for g, m in zip(chosen, values, strict=True))
    merge = LayerMerge(keys, values, ek / max(energy(wk, gram), 1e-300), ev / max(energy(wv, gram), 1e-300))
    return merge, KEY_FALLBACK if mean_keys else "calibrated"


def merged_layer(
    infos: Infos, adapter: ArchAdapter, geom: AttentionGeometry, spec: RegroupSpec, layer: int, lm: LayerMerge
) -> dict[str, OutputTensor]:
    """The planned tensors of one layer's attention, merged by ``lm``, by output name: q rows (and bias)
    absorb the key compensation; k/v rows (and biases, and key norms) are merged; o_proj columns absorb
    the value compensation."""
    d, n_rep = geom.head_dim, geom.queries_per_kv
    outs = plan_layer(
        infos,
        adapter,
        geom,
        spec,
        layer,
        k=lambda t, **_random: merge_rows(t, lm.keys, d),  # a merge draws nothing: no random init
        v=lambda t, **_random: merge_rows(t, lm.values, d),
        q=partial(compensate_q_rows, key_merges=lm.keys, d=d, n_rep=n_rep),
        o=partial(compensate_o_cols, value_merges=lm.values, d=d, n_rep=n_rep),
    )
    return {out.name: cast_output(out, spec.out_dtype) for out in outs}

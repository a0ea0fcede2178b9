"""Fitting merges: which K/V heads share a group, and one key and one value merge per group.

:func:`fit_one_layer` fits one decoder layer from that layer's attention weights (read one tensor at a
time) and the second moment of its K/V projection input (:mod:`gqakit.convert.calibrate`); the
whole-model :func:`fit_layer_merges` and the layer-by-layer path (:mod:`gqakit.convert.layerwise`) both
call it. Each merge minimizes its error where it matters downstream
(:func:`~gqakit.convert.merge.downstream_scales`): a key error through the queries that read it, a value
error through the o_proj columns. On SmolLM2-135M -> MQA this takes zero-shot test perplexity from 116
(plain output error) to 92.

Families that normalize keys per head after projection (qwen3, gemma3, olmo2, stablelm with
``qk_layernorm``, phi with ``qk_layernorm``) make the key merge non-linear: their keys fall back to mean
pooling (the norm weights pool the same way), while values are still merged with calibration. The
provenance record says ``"key_merge": "mean (keys are normalized per head)"`` for them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from gqakit.checkpoint import Checkpoint
from gqakit.convert.grouping import contiguous_groups, similarity_groups
from gqakit.convert.merge import Merge, augment, downstream_scales, energy, in_metric, merge_error
from gqakit.convert.methods import fit_merge
from gqakit.convert.plan import Infos
from gqakit.families import rotary_dims
from gqakit.family_parts import ArchAdapter, Role
from gqakit.geometry import AttentionGeometry

if TYPE_CHECKING:
    from gqakit.convert.calibrate import CalibrationStats

# What a calibrated merge minimizes, for the provenance record (see merge.downstream_scales).
MERGE_OBJECTIVE = (
    "output error on the calibration data, keys weighted per rotary pair by the energy of the queries "
    "they serve, values through the o_proj columns that read them"
)
KEY_FALLBACK = "mean (keys are normalized per head after projection, so a linear key merge is not exact)"


@dataclass
class LayerMerge:
    """How one layer's K/V heads are grouped and merged.

    Attributes:
        groups: old K/V heads of each new head, in order (their concatenation is the head permutation).
        keys, values: one merge per group.
        key_error, value_error: the merges' relative reconstruction error on the calibration data,
            ``sum ||X (W_i - D_i W_s)^T||^2 / sum ||X W_i^T||^2`` over the layer's heads.
    """

    groups: list[list[int]]
    keys: list[Merge]
    values: list[Merge]
    key_error: float = 0.0
    value_error: float = 0.0

    @property
    def kv_order(self) -> list[int]:
        return [h for g in self.groups for h in g]

    def report_entry(self, layer: int, grouping: str) -> dict[str, Any]:
        """This layer's line of the provenance record: its reconstruction errors (and groups)."""
        entry: dict[str, Any] = {
            "layer": layer,
            "key": round(self.key_error, 6),
            "value": round(self.value_error, 6),
        }
        if grouping == "similarity":
            entry["groups"] = self.groups
        return entry


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
    queries: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """This layer's query (only when ``queries``), key and value heads with their affine column:
    ``[heads, d, hidden + 1]`` tensors. A fused ``qkv`` projection is read once."""
    kv, d, h = geom.num_kv_heads, geom.head_dim, geom.num_heads

    def rows(module: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        bias = f"{module}.bias"
        return read(f"{module}.weight"), (read(bias) if bias in infos else None)

    if adapter.qkv is not None:
        w, b = rows(adapter.tensor("qkv", layer).rsplit(".", 1)[0])
        sizes = [h * d, kv * d, kv * d]
        bs = b.split(sizes) if b is not None else (None, None, None)
        triples: list[tuple[Any, Any]] = list(zip(w.split(sizes), bs, strict=True))
        if not queries:
            triples[0] = (None, None)
    else:
        roles: tuple[Role, ...] = ("q", "k", "v") if queries else ("k", "v")
        modules = [None] * (3 - len(roles)) + [adapter.module(role, layer) for role in roles]
        triples = [rows(m) if m else (None, None) for m in modules]
    q, k, v = (None if w is None else augment(w, b).reshape(-1, d, w.shape[1] + 1) for w, b in triples)
    return q, k, v  # type: ignore[return-value]


def fit_one_layer(
    read: Callable[[str], torch.Tensor],
    infos: Infos,
    adapter: ArchAdapter,
    geom: AttentionGeometry,
    layer: int,
    gram: torch.Tensor | None,
    groups: int,
    method: str,
    grouping: str = "contiguous",
    rdim: int = 0,
) -> tuple[LayerMerge, str]:
    """Choose the groups of one layer and fit their key/value merges.

    Args:
        read: reads a source tensor by name (only this layer's attention tensors are read).
        infos: the source's tensor index.
        layer: the decoder layer.
        gram: ``[X, 1]^T [X, 1]`` of this layer's K/V projection input; None for ``mean``/``first``
            with contiguous groups (nothing is fitted then).
        groups: K/V heads in the output.
        method: ``mean``, ``first`` or ``calibrated``.
        grouping: ``contiguous`` or ``similarity``.
        rdim: rotary channels per head (:func:`gqakit.families.rotary_dims`).

    Returns:
        The layer's merge, and how its keys were merged (``method``, or the per-head-norm fallback).
    """
    wq, wk, wv = layer_attention_weights(read, infos, adapter, geom, layer, queries=method == "calibrated")
    gram = gram if gram is not None else torch.eye(wk.shape[-1], dtype=torch.float64)
    key_method = key_treatment = method
    if method == "calibrated" and keys_normalized(infos, adapter, layer):
        key_method, key_treatment = "mean", KEY_FALLBACK
    # Calibrated merges count errors where they matter downstream (see downstream_scales); mean and
    # first have nothing to fit, and a key that falls back to mean gets no key metric.
    ks = vs = None
    if wq is not None:
        wo = read(adapter.tensor("o", layer))
        ks, vs = downstream_scales(wq, wo, gram, geom.num_kv_heads, rdim)
        ks = ks if key_method == "calibrated" else None

    def fit(heads: Sequence[int]) -> tuple[Merge, Merge]:
        idx = list(heads)
        mk = _fit(partial(fit_merge, "key", key_method, gram=gram, rotary_dim=rdim), wk[idx], ks, idx)
        mv = _fit(partial(fit_merge, "value", method, gram=gram), wv[idx], vs, idx)
        return mk, mv

    if grouping == "similarity":
        # the error each merge minimizes (in its metric), relative to the layer's energy in it
        tk, tv = energy(wk, gram, ks), energy(wv, gram, vs)

        def cost(heads: Sequence[int]) -> float:
            idx = list(heads)
            mk, mv = fit(heads)
            ek = merge_error(wk[idx], gram, mk, _rows(ks, idx))
            ev = merge_error(wv[idx], gram, mv, _rows(vs, idx))
            return ek / max(tk, 1e-300) + ev / max(tv, 1e-300)

        chosen = similarity_groups(cost, geom.num_kv_heads, groups)
    else:
        chosen = contiguous_groups(geom.num_kv_heads, groups)
    fitted = [fit(g) for g in chosen]
    # reported plainly (as for mean and first): output energy lost, relative to the layer's
    tk, tv = energy(wk, gram), energy(wv, gram)
    ek = sum(merge_error(wk[g], gram, f[0]) for g, f in zip(chosen, fitted, strict=True))
    ev = sum(merge_error(wv[g], gram, f[1]) for g, f in zip(chosen, fitted, strict=True))
    merge = LayerMerge(
        groups=chosen,
        keys=[f[0] for f in fitted],
        values=[f[1] for f in fitted],
        key_error=ek / max(tk, 1e-300),
        value_error=ev / max(tv, 1e-300),
    )
    return merge, key_treatment


def fit_layer_merges(
    ckpt: Checkpoint,
    adapter: ArchAdapter,
    geom: AttentionGeometry,
    stats: CalibrationStats | None,
    groups: int,
    method: str,
    grouping: str = "contiguous",
) -> tuple[list[LayerMerge], str]:
    """Choose groups and fit key/value merges for every layer (:func:`fit_one_layer` in turn).

    Args:
        ckpt: the source checkpoint (weights are read one tensor at a time).
        stats: calibration statistics; needed for ``calibrated`` and for ``similarity`` grouping.
        groups: K/V heads in the output.
        method: ``mean``, ``first`` or ``calibrated``.
        grouping: ``contiguous`` or ``similarity``.

    Returns:
        The per-layer merges, and how keys were merged (``method``, or the per-head-norm fallback).
    """
    infos = ckpt.tensor_infos()
    rdim = rotary_dims(ckpt.config, geom.head_dim)
    key_treatment = method
    merges = []
    with ckpt.reader() as reader:
        for layer in range(geom.num_layers):
            gram = stats.grams[layer] if stats is not None else None
            merge, keys = fit_one_layer(
                reader.read, infos, adapter, geom, layer, gram, groups, method, grouping, rdim
            )
            merges.append(merge)
            key_treatment = keys if keys != method else key_treatment
    return merges, key_treatment


def _rows(t: torch.Tensor | None, idx: list[int]) -> torch.Tensor | None:
    return None if t is None else t[idx]


def _fit(fn: Callable[[torch.Tensor], Merge], w: torch.Tensor, scales: torch.Tensor | None, idx) -> Merge:
    """``fn(w)``, or fitted in the metric of the members' ``scales`` when there are some."""
    return fn(w) if scales is None else in_metric(fn, w, scales[idx])


@dataclass
class MergeReport:
    """What a merged conversion records in gqakit.json."""

    method: str
    grouping: str
    key_merge: str
    calibration: dict[str, Any] | None
    layers: list[dict[str, Any]] = field(default_factory=list)

    def to_record(self) -> dict[str, Any]:
        rec: dict[str, Any] = {"grouping": self.grouping, "key_merge": self.key_merge}
        if self.method == "calibrated":
            rec["merge_objective"] = MERGE_OBJECTIVE
        if self.calibration is not None:
            rec["calibration"] = self.calibration
        rec["reconstruction_error"] = self.layers
        return rec


def merge_report(
    method: str, grouping: str, key_merge: str, stats: CalibrationStats | None, merges: list[LayerMerge]
) -> MergeReport:
    calib = None if stats is None else {**stats.record, "elapsed_s": round(stats.elapsed_s, 3)}
    layers = [lm.report_entry(i, grouping) for i, lm in enumerate(merges)]
    return MergeReport(method, grouping, key_merge, calib, layers)

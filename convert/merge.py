"""Activation-aware merging of K/V heads, as pure tensor math. No I/O, no model objects.

Everything here works on one group of ``r`` K or V heads of ``d`` channels in *head space*: their weight
rows stacked as ``w`` of shape ``[r, d, m]``, where ``m = hidden + 1`` and the last column holds the bias
(zeros when the projection has none): the *affine column*, so ``x W^T + b = [x, 1] [W | b]^T``. The
calibration statistic is ``gram = [X, 1]^T [X, 1]`` (``[m, m]``), the second moment of the projection's
input over the calibration tokens; every output energy is a quadratic form in it, so no activation is
ever kept.

A merge of a group is a :class:`Merge`: one *compress* matrix ``A`` (``[d, r*d]``) that makes the shared
head's rows from the group's rows, ``W_s = A [W_1; ...; W_r]``, and per member a *decompress* matrix
``D_i`` (``[d, d]``) with ``W_i ~ D_i W_s``. Each query head ``j`` served by member ``i`` then absorbs
``D_i``:

* keys: ``q_j . k_i = q_j^T D_i k_s = (D_i^T q_j) . k_s``, so q_proj rows (and bias) of head ``j`` become
  ``D_i^T W_q_j``;
* values: ``(A v_i) W_o_j^T = (A v_s) (W_o_j D_i)^T``, so o_proj columns of head ``j`` become ``W_o_j D_i``.

Mean pooling is the merge ``A = [I ... I] / r``, ``D_i = I`` (the keys of families that normalize them
per head merge so).

Rotary keys merge per complex channel, so the compensation commutes with rotation at every position
(:func:`fit_key_merge`; docs/convert.md, "Calibrated conversion").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Merge:
    """How ``r`` heads of ``d`` channels become one.

    Attributes:
        compress: ``[d, r*d]``; the shared head's rows are ``compress @ [W_1; ...; W_r]``.
        decompress: ``[r, d, d]``; member ``i`` is reconstructed as ``decompress[i] @ W_shared``.
    """

    compress: torch.Tensor
    decompress: torch.Tensor


def augment(weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``[rows, hidden]`` weight (+ ``[rows]`` bias) -> ``[rows, hidden + 1]``, the bias as last column."""
    w = weight.double()
    b = bias.double() if bias is not None else torch.zeros(w.shape[0], dtype=torch.float64)
    return torch.cat([w, b[:, None]], dim=1)


def mean_merge(r: int, d: int) -> Merge:
    """The paper's mean pooling as a merge."""
    eye = torch.eye(d, dtype=torch.float64)
    return Merge(torch.cat([eye] * r, dim=1) / r, eye.expand(r, d, d).clone())


def _through(w: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """Member rows ``[r, d, m]`` mapped by per-member ``[r, d, d]`` scales (unchanged without)."""
    return w if scales is None else torch.einsum("ide,iem->idm", scales.double(), w.double())


def energy(w: torch.Tensor, gram: torch.Tensor, scales: torch.Tensor | None = None) -> float:
    """Total output energy ``sum_n ||[x_n, 1] W^T||^2`` of the rows ``w`` (``[..., m]``); with ``scales``
    (``[r, d, d]``, ``w`` then ``[r, d, m]``), of each member's outputs mapped by its scale."""
    rows = _through(w, scales).reshape(-1, w.shape[-1]).double()
    return float(torch.einsum("im,mn,in->", rows, gram.double(), rows))


def merge_error(
    w: torch.Tensor, gram: torch.Tensor, merge: Merge, scales: torch.Tensor | None = None
) -> float:
    """Energy the merge loses, ``sum_i ||X (W_i - D_i A W)^T S_i^T||^2``, for ``w`` of shape ``[r, d, m]``
    (``S_i = I`` without ``scales``)."""
    r, d, m = w.shape
    w = w.double()
    shared = merge.compress @ w.reshape(r * d, m)
    recon = torch.einsum("ide,em->idm", merge.decompress, shared)
    return max(energy(w - recon, gram, scales), 0.0)


def fit_value_merge(w: torch.Tensor, gram: torch.Tensor) -> Merge:
    """Calibrated merge of value heads ``w`` (``[r, d, m]``); the decompression folds into o_proj.

    Takes the top ``d`` right singular vectors ``P`` of the side-by-side outputs ``X [W_1; ...; W_r]^T``
    (the top eigenvectors of their ``rd x rd`` Gram matrix): ``W_s = s P^T W``, ``D_i = P_i / s``, exact
    whenever the outputs span at most ``d`` dimensions. ``s`` scales the shared head to the members'
    average energy (identical heads merge into that head itself), which keeps weights at their usual size.
    """
    r, k, m = w.shape
    flat = w.reshape(r * k, m).double()
    cov = flat @ gram.double() @ flat.T
    evals, evecs = torch.linalg.eigh((cov + cov.T) / 2)
    p = evecs[:, -k:]
    kept = float(evals[-k:].clamp(min=0).sum())
    total = float(cov.trace())
    s = math.sqrt(total / (r * kept)) if kept > 0 else 1.0
    return Merge(s * p.T, p.reshape(r, k, k) / s)


def fit_key_merge(w: torch.Tensor, gram: torch.Tensor, rotary_dim: int) -> Merge:
    """Calibrated merge of key heads ``w`` (``[r, d, m]``) whose first ``rotary_dim`` channels get RoPE.

    Rotary channels: per frequency ``f``, the group's complex key outputs ``k_i = X z_i^T`` with
    ``z_i = W_i[f] + i W_i[f + R/2]`` are stacked (``N x r``); their top right singular vector ``v``
    gives the shared channel ``sum_i v_i z_i`` and member ``i`` is ``conj(v_i)`` times it. The remaining
    channels (partial rotary, or all of them without rotary) merge like values.
    """
    r, d, m = w.shape
    w = w.double()
    gram = gram.double()
    if rotary_dim % 2 or not 0 <= rotary_dim <= d:
        raise ValueError(f"rotary_dim must be even and within head_dim {d}, got {rotary_dim}")
    compress = torch.zeros(d, r * d, dtype=torch.float64)
    decompress = torch.zeros(r, d, d, dtype=torch.float64)
    half = rotary_dim // 2
    if half:
        z = torch.complex(w[:, :half], w[:, half:rotary_dim])  # [r, half, m]
        zg = torch.einsum("rfm,mn->rfn", z, gram.to(z.dtype))
        cov = torch.einsum("rfn,sfn->frs", z.conj(), zg)  # K_f^H K_f, Hermitian [half, r, r]
        evals, evecs = torch.linalg.eigh((cov + cov.mH) / 2)
        v = evecs[..., -1]  # [half, r], unit norm
        top = evals[..., -1].clamp(min=0)
        total = cov.diagonal(dim1=-2, dim2=-1).real.sum(-1)
        s = torch.where(top > 0, (total / (r * top.clamp(min=1e-300))).sqrt(), torch.ones_like(top))
        for i in range(r):
            re, im = v[:, i].real, v[:, i].imag  # [half]
            # shared z_f = s * sum_i v_i z_i; member i = (conj(v_i) / s) * shared
            compress[:rotary_dim, i * d : i * d + rotary_dim] = _complex_scale(s * re, s * im)
            decompress[i, :rotary_dim, :rotary_dim] = _complex_scale(re / s, -im / s)
    if rotary_dim < d:
        rest = fit_value_merge(w[:, rotary_dim:], gram)
        p = d - rotary_dim
        for i in range(r):
            compress[rotary_dim:, i * d + rotary_dim : (i + 1) * d] = rest.compress[:, i * p : (i + 1) * p]
        decompress[:, rotary_dim:, rotary_dim:] = rest.decompress
    return Merge(compress, decompress)


def _complex_scale(re: torch.Tensor, im: torch.Tensor) -> torch.Tensor:
    """Multiplication of each complex channel ``x_f + i x_{f + half}`` by ``re_f + i im_f``, as a real
    ``[2 half, 2 half]`` matrix."""
    return torch.cat([torch.cat([re.diag(), -im.diag()], 1), torch.cat([im.diag(), re.diag()], 1)])


def in_metric(fit: Callable[[torch.Tensor], Merge], w: torch.Tensor, scales: torch.Tensor) -> Merge:
    """Fit a merge that minimizes the members' error measured through ``scales`` instead of plainly.

    ``scales[i]`` (``[d, d]``, invertible) maps member ``i``'s outputs to where their errors matter: the
    merge is fitted to ``S_i W_i`` and mapped back, ``A = A' blockdiag(S_i)``, ``D_i = S_i^{-1} D'_i``, so
    it minimizes ``sum_i ||X (W_i - D_i W_s)^T S_i^T||^2``. An exact merge (outputs of rank at most
    ``d``, or per-frequency complex multiples with diagonal ``S_i`` constant on each rotary pair) stays
    exact.
    """
    s = scales.double()
    inner = fit(_through(w, s))
    return Merge(inner.compress @ torch.block_diag(*s), torch.linalg.solve(s, inner.decompress))


def downstream_scales(
    wq: torch.Tensor, wo: torch.Tensor, gram: torch.Tensor, kv_heads: int, rotary_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each K/V head's merge error matters, as ``[kv, d, d]`` key and value scales for
    :func:`in_metric`.

    Keys: an error ``e`` in key channel pair ``f`` moves the score of query ``q`` by about
    ``|q_f| |e_f|``, so each pair is weighted by the root of the calibration energy of the queries the
    head serves in that pair (rotation keeps the pair's magnitude, so the weight is position-free).
    Values: an error ``e`` reaches the residual stream as ``e W_o_j^T``, so the scale is the root of
    ``sum_j W_o_j^T W_o_j`` over the query heads ``j`` it serves. Both are normalized over the layer, so
    only the heads' relative weights count.

    Args:
        wq: query heads with their affine column, ``[H, d, m]``.
        wo: o_proj weight, ``[hidden, H * d]``.
        gram: ``[X, 1]^T [X, 1]`` of the projections' input, ``[m, m]``.
        kv_heads: K/V heads of the source; query head ``j`` reads K/V head ``j // (H / kv_heads)``.
        rotary_dim: channels of a head that get RoPE.
    """
    h, d, m = wq.shape
    n_rep = h // kv_heads
    wq = wq.double().reshape(kv_heads, n_rep * d, m)  # the query heads of each K/V head, side by side
    per_channel = torch.einsum("icm,mn,icn->ic", wq, gram.double(), wq).reshape(kv_heads, n_rep, d).sum(1)
    half = rotary_dim // 2
    pairs = per_channel[:, :half] + per_channel[:, half:rotary_dim]
    key_energy = torch.cat([pairs, pairs, per_channel[:, rotary_dim:]], dim=1)  # [kv, d]
    key_energy = key_energy / key_energy.mean().clamp(min=1e-300)
    key_scales = torch.diag_embed(key_energy.clamp(min=1e-6).sqrt())

    cols = wo.double().reshape(wo.shape[0], kv_heads, n_rep, d)
    gram_o = torch.einsum("oird,oire->ide", cols, cols)  # [kv, d, d]
    gram_o = gram_o / gram_o.diagonal(dim1=-2, dim2=-1).mean().clamp(min=1e-300)
    evals, evecs = torch.linalg.eigh(gram_o + 1e-6 * torch.eye(d, dtype=gram_o.dtype))
    value_scales = evecs @ torch.diag_embed(evals.clamp(min=1e-6).sqrt()) @ evecs.mT
    return key_scales, value_scales


# ----------------------------------------------------------------------------------------------------
# Applying merges to checkpoint tensors: group g is K/V heads g*r .. g*r + r - 1 (what repeat_kv implies).


def merge_rows(t: torch.Tensor, merges: list[Merge], d: int) -> torch.Tensor:
    """K or V rows ``[kv * d, ...]`` (weight, bias, or a flat per-channel norm) -> ``[G * d, ...]``."""
    rest = tuple(t.shape[1:])
    groups = t.double().split([len(mg.decompress) * d for mg in merges])  # refused unless they cover t
    out = [mg.compress @ g.reshape(g.shape[0], -1) for mg, g in zip(merges, groups, strict=True)]
    return torch.cat(out).reshape(-1, *rest).to(t.dtype)


def _per_query(merges: list[Merge], n_rep: int) -> list[torch.Tensor]:
    """The decompress matrix of each query head, in (contiguous) query-head order."""
    return [mg.decompress[i] for mg in merges for i in range(len(mg.decompress)) for _ in range(n_rep)]


def compensate_q_rows(t: torch.Tensor, key_merges: list[Merge], d: int, n_rep: int) -> torch.Tensor:
    """q_proj rows ``[H * d, ...]`` (weight or bias): query head ``j`` of member ``i`` -> ``D_i^T q_j``."""
    rest = tuple(t.shape[1:])
    mats = _per_query(key_merges, n_rep)
    heads = t.double().reshape(len(mats), d, -1)
    out = torch.stack([m.T @ h for m, h in zip(mats, heads, strict=True)])
    return out.reshape(len(mats) * d, *rest).to(t.dtype)


def compensate_o_cols(w: torch.Tensor, value_merges: list[Merge], d: int, n_rep: int) -> torch.Tensor:
    """o_proj weight ``[hidden, H * d]``: columns of query head ``j`` of member ``i`` -> ``W_o_j D_i``."""
    mats = _per_query(value_merges, n_rep)
    cols = w.double().reshape(w.shape[0], len(mats), d)
    out = torch.stack([cols[:, j] @ m for j, m in enumerate(mats)], dim=1)
    return out.reshape(w.shape[0], -1).to(w.dtype)

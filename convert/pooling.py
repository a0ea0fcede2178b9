"""Pure tensor functions that regroup K/V heads. No I/O, no model objects.

Everything is done in *head space*: a K or V projection weight ``[kv_heads * head_dim, hidden]`` is
viewed as ``[kv_heads, head_dim, hidden]`` and the first axis is reduced (pooling) or repeated
(expansion). HF's ``repeat_kv`` serves query head ``j`` from KV head ``j // (H / G)``, so the KV heads
that end up sharing one new head are consecutive: new head ``g`` pools old heads
``g*r .. g*r + r - 1`` with ``r = kv_heads / G``.

Rotary embeddings rotate channel pairs *inside* a head by an angle that depends only on the channel
index and the position, identically for every head. Averaging weight rows of several heads channel by
channel therefore commutes with the rotation: ``R(mean_i W_i x) = mean_i R(W_i x)``. Pooling needs no
knowledge of the rotary layout (tests/convert/test_pooling.py checks this numerically).
"""

from __future__ import annotations

import zlib

import torch

from gqakit.convert.methods import METHODS, POOLING_METHODS


def regroup(
    x: torch.Tensor,
    target: int,
    method: str = "mean",
    *,
    init: str = "normal",
    std: float = 0.02,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Regroup ``x`` of shape ``[kv_heads, ...]`` (one slice per KV head) to ``[target, ...]``.

    Args:
        x: per-head slices, heads on axis 0.
        target: number of KV heads wanted. Fewer than ``x.shape[0]`` pools (must divide it); more
            expands by repeating each head (must be a multiple of it); equal keeps ``x``.
        method: one of :data:`~gqakit.convert.methods.POOLING_METHODS`: ``mean`` (average each group,
            the paper's choice), ``first`` (keep each group's first head) or ``random`` (fresh
            initialisation, ignoring ``x``). Expansion always repeats.
        init: what ``random`` draws for this tensor: ``normal(0, std)`` for weights, ``zeros`` for
            biases, ``ones`` for norm weights (transformers' own initialisation).
        std: standard deviation for ``normal`` (the checkpoint's ``initializer_range``).
        generator: RNG for ``random``.

    Returns:
        A tensor of ``x``'s dtype; pooling is computed in float32 and cast back.
    """
    k = x.shape[0]
    rest = tuple(x.shape[1:])
    if target <= 0:
        raise ValueError(f"target must be positive, got {target}")
    if method not in POOLING_METHODS:
        raise ValueError(f"unknown pooling method {method!r}; choose one of {', '.join(POOLING_METHODS)}")
    entry = METHODS[method]
    if entry.fresh:
        shape = (target, *rest)
        if init == "zeros":
            return torch.zeros(shape, dtype=x.dtype)
        if init == "ones":
            return torch.ones(shape, dtype=x.dtype)
        return (torch.randn(shape, generator=generator, dtype=torch.float32) * std).to(x.dtype)
    if target == k:
        return x.clone()
    if target > k:
        if target % k:
            raise ValueError(f"cannot expand {k} heads to {target}: {target} is not a multiple of {k}")
        return x.repeat_interleave(target // k, dim=0)
    if k % target:
        raise ValueError(f"cannot pool {k} heads into {target} groups: {target} does not divide {k}")
    return entry.pool(x.reshape(target, k // target, *rest)).to(x.dtype)  # type: ignore[misc]


def regroup_head_axis(
    t: torch.Tensor, num_kv_heads: int, target: int, head_dim: int, method: str = "mean", **kw: object
) -> torch.Tensor:
    """Regroup a tensor whose first axis is ``num_kv_heads * head_dim`` (K/V weights and biases)."""
    if t.shape[0] != num_kv_heads * head_dim:
        raise ValueError(f"expected {num_kv_heads} x {head_dim} rows, got {t.shape[0]}")
    rest = tuple(t.shape[1:])
    heads = t.reshape(num_kv_heads, head_dim, *rest)
    return regroup(heads, target, method, **kw).reshape(target * head_dim, *rest)  # type: ignore[arg-type]


def regroup_fused_qkv(
    t: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    target: int,
    head_dim: int,
    method: str = "mean",
    **kw: object,
) -> torch.Tensor:
    """Regroup the K and V row blocks of a fused ``q | k | v`` projection (phi3); Q passes through."""
    q, k, v = t.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim])
    k = regroup_head_axis(k, num_kv_heads, target, head_dim, method, **kw)
    v = regroup_head_axis(v, num_kv_heads, target, head_dim, method, **kw)
    return torch.cat([q, k, v])


def tensor_generator(seed: int, name: str) -> torch.Generator:
    """A generator seeded from the run's seed and the tensor's name, so ``random`` does not depend on
    the order in which shards are streamed."""
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))

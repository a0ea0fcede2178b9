"""Turn a checkpoint's tensor index into a conversion plan: one entry per output tensor.

A plan says, for every output tensor, its name, dtype and shape, which input tensors it is computed
from, and the pure function that computes it (None: copy the single source unchanged). Planning needs
only the tensor headers, so a whole checkpoint is planned, and every problem found, before one byte is
written; executing a plan streams it (``convert.stream``) or applies it to an in-memory state dict
(:func:`convert_state_dict`).

Pooling is pure tensor math in *head space*: a K or V projection weight ``[kv_heads * head_dim,
hidden]`` is viewed as ``[kv_heads, head_dim, hidden]`` and the first axis is reduced (pooling) or
repeated (expansion). HF's ``repeat_kv`` serves query head ``j`` from KV head ``j // (H / G)``, so the
KV heads that end up sharing one new head are consecutive: new head ``g`` pools old heads
``g*r .. g*r + r - 1`` with ``r = kv_heads / G``.

Rotary embeddings rotate channel pairs *inside* a head by an angle that depends only on the channel
index and the position, identically for every head. Averaging weight rows of several heads channel by
channel therefore commutes with the rotation: ``R(mean_i W_i x) = mean_i R(W_i x)``. Pooling needs no
knowledge of the rotary layout (tests/convert/test_pooling.py checks this numerically).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from gqakit.convert.methods import METHODS, POOLING_METHODS
from gqakit.dtypes import is_float, safetensors_name, torch_dtype
from gqakit.errors import GqakitError
from gqakit.family_parts import ArchAdapter
from gqakit.geometry import AttentionGeometry

TensorFn = Callable[[list[torch.Tensor]], torch.Tensor]
Infos = dict[str, tuple[str, tuple[int, ...]]]


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


def split_qkv(
    t: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, per_head: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The q, k and v rows of a fused projection's weight or bias: ``q | k | v`` (phi3), or with
    ``per_head`` one head's ``q_h | k_h | v_h`` after another (gpt_bigcode's MHA ``c_attn``)."""
    if not per_head:
        return t.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim])
    rest = tuple(t.shape[1:])
    q, k, v = t.reshape(num_heads, 3, head_dim, *rest).unbind(1)
    return tuple(x.reshape(num_heads * head_dim, *rest) for x in (q, k, v))  # type: ignore[return-value]


def join_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int, per_head: bool = False):
    """The fused rows of q, k and v (:func:`split_qkv`'s layout); ``per_head`` holds only while every
    query head keeps its own K/V head (gpt_bigcode stores one shared K/V head as ``q | k | v``)."""
    if not per_head or k.shape[0] != q.shape[0]:
        return torch.cat([q, k, v])
    rest = tuple(q.shape[1:])
    heads = q.shape[0] // head_dim
    return torch.stack([x.reshape(heads, head_dim, *rest) for x in (q, k, v)], dim=1).reshape(-1, *rest)


def regroup_fused_qkv(
    t: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    target: int,
    head_dim: int,
    method: str = "mean",
    per_head: bool = False,
    **kw: object,
) -> torch.Tensor:
    """Regroup the K and V rows of a fused projection (:func:`split_qkv`); Q passes through."""
    q, k, v = split_qkv(t, num_heads, num_kv_heads, head_dim, per_head)
    k = regroup_head_axis(k, num_kv_heads, target, head_dim, method, **kw)
    v = regroup_head_axis(v, num_kv_heads, target, head_dim, method, **kw)
    return join_qkv(q, k, v, head_dim, per_head)


def tensor_generator(seed: int, name: str) -> torch.Generator:
    """A generator seeded from the run's seed and the tensor's name, so ``random`` does not depend on
    the order in which shards are streamed."""
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


@dataclass(frozen=True)
class OutputTensor:
    """One tensor of the converted checkpoint.

    Attributes:
        name: output tensor name.
        dtype: safetensors dtype name of the output.
        shape: output shape.
        sources: input tensor names that ``fn`` receives, in order; the first decides the shard.
        fn: computes the output from the sources; None means "the single source, unchanged".
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    sources: tuple[str, ...]
    fn: TensorFn | None = None


@dataclass(frozen=True)
class RegroupSpec:
    """How to regroup K/V heads.

    Attributes:
        target: K/V heads in the output (G).
        method: ``mean``, ``first`` or ``random``; expansion (target above the current K/V heads)
            always repeats heads.
        seed: seed for ``random``.
        std: init std for ``random`` weights (``config.initializer_range``).
        out_dtype: safetensors dtype name for every floating tensor, or None to keep each one's own.
    """

    target: int
    method: str = "mean"
    seed: int = 0
    std: float = 0.02
    out_dtype: str | None = None


def module_tensors(infos: Infos, module: str | None) -> list[str]:
    """The names of a module's ``weight`` and ``bias`` that exist in the checkpoint (none for None)."""
    return [] if module is None else [f"{module}.{s}" for s in ("weight", "bias") if f"{module}.{s}" in infos]


def _init_for(name: str, is_norm: bool) -> str:
    """What ``random`` draws for the tensor ``name``: zeros for a bias, ones for a norm, else normal."""
    if name.endswith(".bias"):
        return "zeros"
    return "ones" if is_norm else "normal"


def _require(infos: Infos, name: str | None, adapter: ArchAdapter, what: str) -> None:
    if name is not None and name not in infos:
        raise GqakitError(
            f"Expected tensor {name!r} ({what}) is not in the checkpoint, although its config says "
            f"model_type {adapter.model_type!r}. Is the checkpoint complete and of that family?"
        )


def plan_regroup(
    infos: Infos, adapter: ArchAdapter, geom: AttentionGeometry, spec: RegroupSpec
) -> list[OutputTensor]:
    """Plan a K/V regrouping (pooling or expansion) of a whole checkpoint.

    Args:
        infos: input tensor name -> (dtype name, shape), in file order.
        adapter: where this family keeps its attention tensors.
        geom: the input's attention geometry.
        spec: the regrouping wanted.

    Returns:
        Output tensors in input order.
    """
    kv, d, g = geom.num_kv_heads, geom.head_dim, spec.target
    special: dict[str, list[OutputTensor]] = {}  # input name -> outputs anchored on it
    consumed: set[str] = set()

    def add(anchor: str, out: OutputTensor) -> None:
        special.setdefault(anchor, []).append(out)
        consumed.update(out.sources)

    for layer in range(geom.num_layers):
        k, v, qkv = (adapter.module(role, layer) for role in ("k", "v", "qkv"))
        if qkv is not None:
            _require(infos, f"{qkv}.weight", adapter, "fused q|k|v projection")
            rows = infos[f"{qkv}.weight"][1][0]
            want = (geom.num_heads + 2 * kv) * d
            if rows != want:
                raise GqakitError(
                    f"{qkv}.weight has {rows} rows but the config implies {want} "
                    f"({geom.num_heads} query + 2 x {kv} K/V heads of {d}). "
                    "The config does not match the weights."
                )
            for name in module_tensors(infos, qkv):
                dtype, shape = infos[name]
                init = _init_for(name, False)
                fn = partial(
                    _fused,
                    heads=geom.num_heads,
                    kv=kv,
                    target=g,
                    d=d,
                    spec=spec,
                    init=init,
                    name=name,
                    per_head=adapter.qkv_per_head,
                )
                add(name, OutputTensor(name, dtype, ((geom.num_heads + 2 * g) * d, *shape[1:]), (name,), fn))
            continue
        for module, what in ((k, "key projection"), (v, "value projection")):
            _require(infos, f"{module}.weight", adapter, what)
            rows = infos[f"{module}.weight"][1][0]
            if rows != kv * d:
                raise GqakitError(
                    f"{module}.weight has {rows} rows but the config implies {kv} K/V heads x head_dim {d} "
                    f"= {kv * d}. The config does not match the weights."
                )
        flat_norm = adapter.module("k_norm_flat", layer)
        for module, is_norm in ((k, False), (v, False), (flat_norm, True)):
            for name in module_tensors(infos, module):
                dtype, shape = infos[name]
                init = _init_for(name, is_norm)
                fn = partial(_head_axis, kv=kv, target=g, d=d, spec=spec, init=init, name=name)
                add(name, OutputTensor(name, dtype, (g * d, *shape[1:]), (name,), fn))
        if adapter.k_norm_per_head is not None:
            _plan_per_head(infos, adapter.k_norm_per_head, layer, kv, g, spec, add)

    plan: list[OutputTensor] = []
    for name, (dtype, shape) in infos.items():
        if name in special:
            plan.extend(special[name])
        elif name not in consumed:
            plan.append(OutputTensor(name, dtype, shape, (name,)))
    return [_cast(o, spec.out_dtype) for o in plan]


def _plan_per_head(infos: Infos, template: str, layer: int, kv: int, g: int, spec: RegroupSpec, add) -> None:
    """Per-head modules (one norm per K/V head): group r inputs into one output, or copy one to many."""
    for suffix in ("weight", "bias"):
        names = [f"{template.format(layer=layer, head=h)}.{suffix}" for h in range(kv)]
        if not all(n in infos for n in names):
            continue
        dtype, shape = infos[names[0]]
        for new in range(g):
            out_name = f"{template.format(layer=layer, head=new)}.{suffix}"
            srcs = (
                tuple(names[new * (kv // g) : (new + 1) * (kv // g)])
                if g <= kv
                else (names[new // (g // kv)],)
            )
            fn = partial(_per_head, spec=spec, init=_init_for(out_name, True), name=out_name)
            add(srcs[0], OutputTensor(out_name, dtype, shape, srcs, fn))


def _head_axis(ts: list[torch.Tensor], *, kv, target, d, spec: RegroupSpec, init, name) -> torch.Tensor:
    gen = tensor_generator(spec.seed, name)
    return regroup_head_axis(ts[0], kv, target, d, spec.method, init=init, std=spec.std, generator=gen)


def _fused(
    ts: list[torch.Tensor], *, heads, kv, target, d, spec: RegroupSpec, init, name, per_head
) -> torch.Tensor:
    gen = tensor_generator(spec.seed, name)
    kw = dict(init=init, std=spec.std, generator=gen)
    return regroup_fused_qkv(ts[0], heads, kv, target, d, spec.method, per_head, **kw)


def _per_head(ts: list[torch.Tensor], *, spec: RegroupSpec, init, name) -> torch.Tensor:
    if len(ts) == 1 and not METHODS[spec.method].fresh:
        return ts[0].clone()  # a group of one, or expansion: a copy of the one source head
    gen = tensor_generator(spec.seed, name)
    return regroup(torch.stack(ts), 1, spec.method, init=init, std=spec.std, generator=gen)[0]


def _cast(out: OutputTensor, dtype: str | None) -> OutputTensor:
    if dtype is None or out.dtype == dtype or not is_float(out.dtype):
        return out
    inner = out.fn
    cast = torch_dtype(dtype)

    def fn(ts: list[torch.Tensor]) -> torch.Tensor:
        return (inner(ts) if inner else ts[0]).to(cast)

    return OutputTensor(out.name, dtype, out.shape, out.sources, fn)


def execute(out: OutputTensor, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """Compute one planned tensor, reading its sources with ``read``."""
    ts = [read(s) for s in out.sources]
    t = out.fn(ts) if out.fn is not None else ts[0]
    if safetensors_name(t.dtype) != out.dtype or tuple(t.shape) != out.shape:
        raise RuntimeError(
            f"{out.name}: computed {tuple(t.shape)} {t.dtype}, planned {out.shape} {out.dtype}"
        )
    return t


def convert_state_dict(
    state_dict: dict[str, torch.Tensor], adapter: ArchAdapter, geom: AttentionGeometry, spec: RegroupSpec
) -> dict[str, torch.Tensor]:
    """Regroup the K/V heads of an in-memory state dict (state dict in, state dict out)."""
    infos = {k: (safetensors_name(v.dtype), tuple(v.shape)) for k, v in state_dict.items()}
    return {o.name: execute(o, state_dict.__getitem__) for o in plan_regroup(infos, adapter, geom, spec)}

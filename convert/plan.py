"""Turn a checkpoint's tensor index into a conversion plan: one entry per output tensor.

A plan says, for every output tensor, its name, dtype and shape, its input tensors, and the pure
function that computes it (None: copy the single source unchanged). Planning needs only the tensor
headers, so a whole checkpoint is planned, and every problem found, before one byte is written.

Pooling works in *head space*: a K or V projection ``[kv_heads * head_dim, hidden]`` is viewed as
``[kv_heads, head_dim, hidden]`` and new head ``g`` pools the consecutive old heads ``g*r .. g*r + r - 1``
(what ``repeat_kv`` implies). Rotary embeddings rotate channel pairs inside a head identically for every
head, so averaging heads channel by channel commutes with them (tests/convert/test_pooling.py).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from gqakit.convert.methods import METHODS
from gqakit.dtypes import row, safetensors_name, torch_dtype
from gqakit.errors import GqakitError
from gqakit.family_parts import ArchAdapter, Role
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


def _check_rows(infos: Infos, module: str, adapter: ArchAdapter, what: str, want: int, implied: str) -> None:
    name = f"{module}.weight"
    if name not in infos:
        raise GqakitError(
            f"Expected tensor {name!r} ({what}) is not in the checkpoint, although its config says "
            f"model_type {adapter.model_type!r}. Is the checkpoint complete and of that family?"
        )
    if infos[name][1][0] != want:
        raise GqakitError(
            f"{name} has {infos[name][1][0]} rows but the config implies {implied} = {want}. The config "
            "does not match the weights."
        )


def plan_layer(
    infos: Infos,
    adapter: ArchAdapter,
    geom: AttentionGeometry,
    spec: RegroupSpec,
    layer: int,
    k: Callable[..., torch.Tensor],
    v: Callable[..., torch.Tensor],
    q: Callable[[torch.Tensor], torch.Tensor] | None = None,
    o: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> list[OutputTensor]:
    """The planned tensors of one layer's attention, in the source's dtypes (the shapes checked against
    the config first): ``k``/``v`` map K or V rows ``[kv * d, ...]`` (a weight, a bias, a key norm) to
    ``[G * d, ...]``, called with ``init`` and ``generator`` for ``random`` (:func:`regroup`); ``q`` maps
    q_proj rows ``[H * d, ...]`` and ``o`` the o_proj weight ``[hidden, H * d]`` (None: unchanged)."""
    kv, d, h, g = geom.num_kv_heads, geom.head_dim, geom.num_heads, spec.target
    outs: list[OutputTensor] = []

    def put(name: str, shape, fn, init: str | None, sources: tuple[str, ...] | None = None) -> None:
        sources = sources or (name,)
        fn = partial(_computed, fn=fn, name=name, seed=spec.seed, init=init)
        outs.append(OutputTensor(name, infos[sources[0]][0], tuple(shape), sources, fn))

    def tensors(role: Role) -> list[str]:  # the module's weight and bias that the checkpoint holds
        module = adapter.module(role, layer)
        return [n for n in (f"{module}.weight", f"{module}.bias") if module is not None and n in infos]

    qkv = adapter.module("qkv", layer)
    if qkv is not None:
        heads = f"{h} query + 2 x {kv} K/V heads of {d}"
        _check_rows(infos, qkv, adapter, "fused q|k|v projection", (h + 2 * kv) * d, heads)
        fused = partial(_fused, q=q, k=k, v=v, h=h, kv=kv, d=d, per_head=adapter.qkv_per_head)
        for name in tensors("qkv"):
            put(name, ((h + 2 * g) * d, *infos[name][1][1:]), fused, _init_for(name, False))
    else:
        for role, what in (("k", "key projection"), ("v", "value projection")):
            module: str = adapter.module(role, layer)  # type: ignore[arg-type, assignment]
            _check_rows(infos, module, adapter, what, kv * d, f"{kv} K/V heads x head_dim {d}")
    kv_rows = [(n, k, False) for n in tensors("k")] + [(n, v, False) for n in tensors("v")]
    for name, fn, is_norm in kv_rows + [(n, k, True) for n in tensors("k_norm_flat")]:
        put(name, (g * d, *infos[name][1][1:]), fn, _init_for(name, is_norm))
    for name in tensors("q") if q is not None else []:
        put(name, infos[name][1], q, None)
    if o is not None:
        o_proj = adapter.tensor("o", layer)
        put(o_proj, infos[o_proj][1], o, None)
    template = adapter.k_norm_per_head
    for suffix in ("weight", "bias") if template is not None else ():
        names = tuple(f"{template.format(layer=layer, head=i)}.{suffix}" for i in range(kv))  # type: ignore[union-attr]
        if all(n in infos for n in names):  # one norm per head: each output head from all of them
            for new in range(g):
                out = f"{template.format(layer=layer, head=new)}.{suffix}"  # type: ignore[union-attr]
                fn = partial(_one_head, fn=k, head=new, d=d)
                put(out, infos[names[0]][1], fn, _init_for(out, True), names)
    return outs


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
    pool = partial(
        regroup_head_axis,
        num_kv_heads=geom.num_kv_heads,
        target=spec.target,
        head_dim=geom.head_dim,
        method=spec.method,
        std=spec.std,
    )
    changed: dict[str, list[OutputTensor]] = {}  # input name -> outputs anchored on it
    for layer in range(geom.num_layers):
        for out in plan_layer(infos, adapter, geom, spec, layer, pool, pool):
            changed.setdefault(out.sources[0], []).append(out)
    consumed = {s for outs in changed.values() for out in outs for s in out.sources}
    plan: list[OutputTensor] = []
    for name, (dtype, shape) in infos.items():
        if name in changed:
            plan.extend(changed[name])
        elif name not in consumed:
            plan.append(OutputTensor(name, dtype, shape, (name,)))
    return [cast_output(o, spec.out_dtype) for o in plan]


def _init_for(name: str, is_norm: bool) -> str:
    """What ``random`` draws for the tensor ``name``: zeros for a bias, ones for a norm, else normal."""
    if name.endswith(".bias"):
        return "zeros"
    return "ones" if is_norm else "normal"


def _computed(ts: list[torch.Tensor], *, fn, name: str, seed: int, init: str | None) -> torch.Tensor:
    """``fn`` on the source (several are joined: one per head), with ``random``'s draw for ``name`` (seeded
    by the run's seed and the tensor's name, so it does not depend on the order shards are streamed in)."""
    t = ts[0] if len(ts) == 1 else torch.cat(ts)
    if init is None:
        return fn(t)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return fn(t, init=init, generator=generator)


def _one_head(t: torch.Tensor, *, fn, head: int, d: int, **kw) -> torch.Tensor:
    """Output head ``head`` (``d`` rows) of ``fn`` on all the per-head norms ``t``, joined."""
    return fn(t, **kw)[head * d : (head + 1) * d]


def _fused(t: torch.Tensor, *, q, k, v, h, kv, d, per_head, **kw) -> torch.Tensor:
    qs, ks, vs = split_qkv(t, h, kv, d, per_head)
    return join_qkv(q(qs) if q else qs, k(ks, **kw), v(vs, **kw), d, per_head)


def cast_output(out: OutputTensor, dtype: str | None) -> OutputTensor:
    """``out`` cast to ``dtype`` (a safetensors name; None: as it is) when it is floating."""
    if dtype is None or out.dtype == dtype or not row(out.dtype).float:
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

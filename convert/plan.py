"""Turn a checkpoint's tensor index into a conversion plan: one entry per output tensor.

A plan says, for every output tensor, its name, dtype and shape, which input tensors it is computed
from, and the pure function that computes it (None: copy the single source unchanged). Planning needs
only the tensor headers, so a whole checkpoint is planned, and every problem found, before one byte is
written; executing a plan streams it (``convert.stream``) or applies it to an in-memory state dict
(:func:`convert_state_dict`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from gqakit.convert.methods import METHODS
from gqakit.convert.pooling import regroup, regroup_fused_qkv, regroup_head_axis, tensor_generator
from gqakit.dtypes import is_float, safetensors_name, torch_dtype
from gqakit.errors import GqakitError
from gqakit.family_parts import ArchAdapter
from gqakit.geometry import AttentionGeometry

TensorFn = Callable[[list[torch.Tensor]], torch.Tensor]
Infos = dict[str, tuple[str, tuple[int, ...]]]


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
                    _fused, heads=geom.num_heads, kv=kv, target=g, d=d, spec=spec, init=init, name=name
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


def _fused(ts: list[torch.Tensor], *, heads, kv, target, d, spec: RegroupSpec, init, name) -> torch.Tensor:
    gen = tensor_generator(spec.seed, name)
    return regroup_fused_qkv(ts[0], heads, kv, target, d, spec.method, init=init, std=spec.std, generator=gen)


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

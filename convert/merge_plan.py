"""The plan of a merged conversion: each layer's attention tensors as functions that permute and merge
the streamed source tensors, so the output is written through the same atomic, shard-by-shard path as
every other conversion."""

from __future__ import annotations

from functools import partial

import torch

from gqakit.convert.grouping import permute_cols, permute_rows, query_order
from gqakit.convert.merge import Merge, compensate_o_cols, compensate_q_rows, merge_rows
from gqakit.convert.merge_fit import LayerMerge
from gqakit.convert.plan import Infos, OutputTensor, RegroupSpec, module_tensors, plan_regroup
from gqakit.dtypes import torch_dtype
from gqakit.family_parts import ArchAdapter, Role
from gqakit.geometry import AttentionGeometry


def merged_layer(
    infos: Infos, adapter: ArchAdapter, geom: AttentionGeometry, spec: RegroupSpec, layer: int, lm: LayerMerge
) -> dict[str, OutputTensor]:
    """The planned tensors of one layer's attention, permuted and merged by ``lm``, by output name.

    q rows (and bias) move with their K/V head and absorb the key compensation; k/v rows (and biases,
    and flat key norms) are permuted and merged; o_proj columns move and absorb the value compensation;
    per-head norms move (query) or are merged (key).
    """
    d, n_rep, kv, h = geom.head_dim, geom.queries_per_kv, geom.num_kv_heads, geom.num_heads
    override: dict[str, OutputTensor] = {}

    def put(name: str, shape: tuple[int, ...], sources: tuple[str, ...], fn) -> None:
        dtype = spec.out_dtype or infos[sources[0]][0]
        override[name] = OutputTensor(name, dtype, shape, sources, partial(_cast_to, fn=fn, dtype=dtype))

    def tensors(role: Role) -> list[str]:
        return module_tensors(infos, adapter.module(role, layer))

    kv_order, q_order = lm.kv_order, query_order(lm.kv_order, n_rep)
    q_fn = partial(_q_rows, q_order=q_order, keys=lm.keys, d=d, n_rep=n_rep)
    k_fn = partial(_kv_rows, kv_order=kv_order, merges=lm.keys, d=d)
    v_fn = partial(_kv_rows, kv_order=kv_order, merges=lm.values, d=d)
    for name in tensors("q"):
        put(name, infos[name][1], (name,), q_fn)
    for name in tensors("k") + tensors("k_norm_flat"):
        put(name, (spec.target * d, *infos[name][1][1:]), (name,), k_fn)
    for name in tensors("v"):
        put(name, (spec.target * d, *infos[name][1][1:]), (name,), v_fn)
    for name in tensors("q_norm_flat"):
        put(name, infos[name][1], (name,), partial(_permuted_rows, order=q_order, d=d))
    for name in tensors("qkv"):
        fn = partial(_fused, q_fn=q_fn, k_fn=k_fn, v_fn=v_fn, sizes=[h * d, kv * d, kv * d])
        put(name, ((h + 2 * spec.target) * d, *infos[name][1][1:]), (name,), fn)
    o = adapter.tensor("o", layer)
    put(o, infos[o][1], (o,), partial(_o_cols, q_order=q_order, values=lm.values, d=d, n_rep=n_rep))
    for suffix in ("weight", "bias"):
        if adapter.q_norm_per_head is not None:
            names = [f"{adapter.q_norm_per_head.format(layer=layer, head=j)}.{suffix}" for j in range(h)]
            if all(n in infos for n in names):
                for j, old in enumerate(q_order):
                    put(names[j], infos[names[old]][1], (names[old],), _copy)
        if adapter.k_norm_per_head is not None:
            names = [f"{adapter.k_norm_per_head.format(layer=layer, head=i)}.{suffix}" for i in range(kv)]
            if all(n in infos for n in names):
                for g, (members, mg) in enumerate(zip(lm.groups, lm.keys, strict=True)):
                    new = f"{adapter.k_norm_per_head.format(layer=layer, head=g)}.{suffix}"
                    srcs = tuple(names[i] for i in members)
                    put(new, infos[srcs[0]][1], srcs, partial(_per_head_norm, merge=mg))
    return override


def base_plan(
    infos: Infos, adapter: ArchAdapter, geom: AttentionGeometry, spec: RegroupSpec
) -> list[OutputTensor]:
    """The plan that merged layers override: mean pooling, whose output names, shapes and dtypes are
    those of every merge."""
    return plan_regroup(infos, adapter, geom, RegroupSpec(spec.target, "mean", out_dtype=spec.out_dtype))


def apply_overrides(plan: list[OutputTensor], override: dict[str, OutputTensor]) -> list[OutputTensor]:
    """``plan`` with the entries named in ``override`` replaced; every override must replace one."""
    out = [override.get(o.name, o) for o in plan]
    missing = set(override) - {o.name for o in plan}
    if missing:
        raise RuntimeError(f"planned overrides without a base entry: {sorted(missing)[:5]}")
    return out


def plan_merged(
    infos: Infos, adapter: ArchAdapter, geom: AttentionGeometry, spec: RegroupSpec, merges: list[LayerMerge]
) -> list[OutputTensor]:
    """:func:`plan_regroup`, with each layer's attention tensors permuted and merged by ``merges``
    (:func:`merged_layer`). Everything else is as planned."""
    override: dict[str, OutputTensor] = {}
    for layer, lm in enumerate(merges):
        override.update(merged_layer(infos, adapter, geom, spec, layer, lm))
    return apply_overrides(base_plan(infos, adapter, geom, spec), override)


def _cast_to(ts: list[torch.Tensor], *, fn, dtype: str) -> torch.Tensor:
    return fn(ts).to(torch_dtype(dtype)).contiguous()


def _copy(ts: list[torch.Tensor]) -> torch.Tensor:
    return ts[0].clone()


def _permuted_rows(ts: list[torch.Tensor], *, order, d) -> torch.Tensor:
    return permute_rows(ts[0], order, d)


def _q_rows(ts: list[torch.Tensor], *, q_order, keys, d, n_rep) -> torch.Tensor:
    return compensate_q_rows(permute_rows(ts[0], q_order, d), keys, d, n_rep)


def _kv_rows(ts: list[torch.Tensor], *, kv_order, merges, d) -> torch.Tensor:
    return merge_rows(permute_rows(ts[0], kv_order, d), merges, d)


def _o_cols(ts: list[torch.Tensor], *, q_order, values, d, n_rep) -> torch.Tensor:
    return compensate_o_cols(permute_cols(ts[0], q_order, d), values, d, n_rep)


def _fused(ts: list[torch.Tensor], *, q_fn, k_fn, v_fn, sizes) -> torch.Tensor:
    q, k, v = ts[0].split(sizes)
    return torch.cat([q_fn([q]), k_fn([k]), v_fn([v])])


def _per_head_norm(ts: list[torch.Tensor], *, merge: Merge) -> torch.Tensor:
    d = ts[0].shape[0]
    return merge_rows(torch.cat(ts), [merge], d)

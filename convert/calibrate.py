"""Calibrated conversion: capture what each layer's K/V projections see, fit merges, plan the output.

Three steps, each a function a Python user can call:

1. :func:`calibrate` runs the source model once over ``--calib-tokens`` tokens of calibration text.
   A forward hook on each layer's key projection adds ``[X, 1]^T [X, 1]`` of that batch to the layer's
   statistic and drops the activations, so memory holds one ``(hidden + 1)^2`` matrix per layer,
   independent of the number of tokens, and never a whole model's activations.
2. :func:`fit_layer_merges` chooses the groups (``contiguous`` or ``similarity``) and fits one key and
   one value :class:`~gqakit.convert.merge.Merge` per group, layer by layer, from the weights read off
   the checkpoint. Each merge minimizes its error where it matters downstream
   (:func:`~gqakit.convert.merge.downstream_scales`): a key error through the queries that read it, a
   value error through the o_proj columns. On SmolLM2-135M -> MQA this takes zero-shot test perplexity
   from 116 (plain output error) to 92.
3. :func:`plan_merged` builds on :func:`~gqakit.convert.plan.plan_regroup` and replaces each layer's
   attention tensors by functions that permute and merge the streamed source tensors, so the output is
   written through the same atomic, shard-by-shard path as every other conversion.

Families that normalize keys per head after projection (qwen3, gemma3, olmo2, stablelm with
``qk_layernorm``, phi with ``qk_layernorm``) make the key merge non-linear: their keys fall back to mean
pooling (the norm weights pool the same way), while values are still merged with calibration. The
provenance record says ``"key_merge": "mean (keys are normalized per head)"`` for them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from gqakit.checkpoint import Checkpoint, sha256_file
from gqakit.convert.grouping import (
    contiguous_groups,
    permute_cols,
    permute_rows,
    query_order,
    similarity_groups,
)
from gqakit.convert.merge import (
    Merge,
    augment,
    compensate_o_cols,
    compensate_q_rows,
    downstream_scales,
    energy,
    fit_merge,
    in_metric,
    merge_error,
    merge_rows,
)
from gqakit.convert.plan import Infos, OutputTensor, RegroupSpec, plan_regroup
from gqakit.convert.registry import ArchAdapter
from gqakit.errors import GqakitError
from gqakit.geometry import AttentionGeometry
from gqakit.safetensors_io import DTYPES

log = logging.getLogger(__name__)

CALIB_SEQ_LEN = 512  # tokens per calibration sequence (capped by the model's max positions)
# Module names, inside a layer's attention, of norms applied to keys after projection.
KEY_NORM_MODULES: tuple[str, ...] = ("k_norm", "k_layernorm")
# What a calibrated merge minimizes, for the provenance record (see merge.downstream_scales).
MERGE_OBJECTIVE = (
    "output error on the calibration data, keys weighted per rotary pair by the energy of the queries "
    "they serve, values through the o_proj columns that read them"
)
KEY_FALLBACK = "mean (keys are normalized per head after projection, so a linear key merge is not exact)"


@dataclass
class CalibrationStats:
    """Second moments of each layer's K/V projection input.

    Attributes:
        grams: per layer, ``[X, 1]^T [X, 1]`` summed over the calibration tokens (float64).
        record: what was measured on, for provenance: path, sha256, tokens, seq_len, device.
        elapsed_s: seconds spent loading the model and running it.
    """

    grams: list[torch.Tensor]
    record: dict[str, Any]
    elapsed_s: float = 0.0


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


# ----------------------------------------------------------------------------------------------------
# 1. Calibration data and statistics


def load_calibration_texts(path: str | Path, text_field: str = "text") -> list[str]:
    """Read calibration documents (``.txt``: one document; ``.jsonl``/``.json``/``.parquet``: one per row)."""
    from gqakit.eval.data import load_texts

    p = Path(str(path)).expanduser()
    if not p.is_file():
        raise GqakitError(
            f"--calib-data {path} does not exist. Give a .txt, .jsonl or .parquet file of text in the "
            "model's domain, e.g. the train split of `gqakit assets fetch wiki-en`."
        )
    return load_texts(p, text_field, option="--calib-data")


def calibration_ids(
    tokenizer, texts: Sequence[str], tokens: int, seq_len: int = CALIB_SEQ_LEN, source: str = "--calib-data"
) -> list[torch.Tensor]:
    """The first ``tokens`` tokens of the joined documents, cut into sequences of at most ``seq_len``."""
    from gqakit.eval.data import DOC_SEPARATOR

    text = DOC_SEPARATOR.join(texts)
    chars = max(tokens * 8, 4096)
    while True:  # tokenize only as much text as needed (a train split can be megabytes)
        ids = tokenizer(text[:chars], add_special_tokens=False, verbose=False)["input_ids"]
        if len(ids) > tokens or chars >= len(text):
            break
        chars *= 4
    if len(ids) < tokens:
        raise GqakitError(
            f"{source} holds {len(ids):,} tokens but --calib-tokens asks for {tokens:,}. Give more text, or "
            f"pass --calib-tokens {len(ids)} or less (the merge needs at least a few times the head_dim)."
        )
    ids = torch.tensor(ids[:tokens])
    return list(ids.split(seq_len))


def _key_module(adapter: ArchAdapter, layer: int) -> str:
    return adapter.layer(adapter.k or adapter.qkv, layer)  # type: ignore[return-value]


@torch.no_grad()
def capture_grams(
    model, adapter: ArchAdapter, num_layers: int, sequences: Sequence[torch.Tensor], batch_size: int = 4
) -> list[torch.Tensor]:
    """Run ``model`` over ``sequences``; return each layer's ``[X, 1]^T [X, 1]`` at its K projection input.

    A forward pre-hook folds each batch into a float64 accumulator and keeps nothing else.
    """
    device = next(model.parameters()).device
    grams: list[torch.Tensor | None] = [None] * num_layers

    def hook(layer: int, module, args) -> None:
        x = args[0].reshape(-1, args[0].shape[-1]).float()
        x = torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device)], dim=1)
        g = (x.T @ x).double().cpu()
        grams[layer] = g if grams[layer] is None else grams[layer] + g

    handles = [
        model.get_submodule(_key_module(adapter, layer)).register_forward_pre_hook(partial(hook, layer))
        for layer in range(num_layers)
    ]
    try:
        base = model.base_model  # skip the LM head: only the layers' inputs are needed
        for batch in batches(sequences, batch_size):
            base(input_ids=batch.to(device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    if any(g is None for g in grams):
        raise RuntimeError("calibration hooks did not fire for every layer")
    return grams  # type: ignore[return-value]


def batches(sequences: Sequence[torch.Tensor], batch_size: int):
    """Stack runs of equal-length sequences into batches of at most ``batch_size``."""
    i = 0
    while i < len(sequences):
        j = i
        while j < len(sequences) and j - i < batch_size and len(sequences[j]) == len(sequences[i]):
            j += 1
        yield torch.stack(list(sequences[i:j]))
        i = j


def load_model_for_calibration(path: Path, device: str = "auto"):
    """The source model for calibration: its own dtype on a GPU, float32 on the CPU."""
    from gqakit.models import load_causal_lm, resolve_device

    dev = resolve_device(device)
    return load_causal_lm(path, dtype="auto" if dev.type == "cuda" else "float32", device=str(dev))


def calibration_sequences(ckpt: Checkpoint, data: str | Path, tokens: int) -> list[torch.Tensor]:
    """The first ``tokens`` tokens of ``data`` under ``ckpt``'s tokenizer, in sequences of
    ``CALIB_SEQ_LEN`` (or the model's maximum positions, when shorter)."""
    from gqakit.eval.perplexity import max_positions
    from gqakit.models import load_tokenizer

    tokenizer = load_tokenizer(ckpt.path)
    seq_len = min(CALIB_SEQ_LEN, max_positions(_config_obj(ckpt.config)) or CALIB_SEQ_LEN)
    return calibration_ids(tokenizer, load_calibration_texts(data), tokens, seq_len)


def calibrate(
    ckpt: Checkpoint,
    adapter: ArchAdapter,
    geom: AttentionGeometry,
    data: str | Path,
    tokens: int = 4096,
    device: str = "auto",
    model=None,
    sequences: list[torch.Tensor] | None = None,
) -> CalibrationStats:
    """Measure every layer's K/V projection input on ``tokens`` tokens of ``data``.

    Args:
        ckpt: the resolved source checkpoint (its tokenizer and weights are loaded from ``ckpt.path``).
        adapter, geom: the family and geometry.
        data: calibration text file.
        tokens: how many tokens to run.
        device: where to run the model.
        model: an already loaded source model to reuse (the probe has one).
        sequences: the calibration token sequences, when the caller has them already
            (:func:`calibration_sequences` of the same data and tokens).
    """
    start = time.perf_counter()
    if sequences is None:
        sequences = calibration_sequences(ckpt, data, tokens)
    own = model is None
    if own:
        model = load_model_for_calibration(ckpt.path, device)
    run_on = str(next(model.parameters()).device)
    try:
        grams = capture_grams(model, adapter, geom.num_layers, sequences)
    finally:
        if own:
            del model
    record = {
        "path": str(Path(str(data)).expanduser().resolve()),
        "sha256": sha256_file(Path(str(data)).expanduser()),
        "tokens": tokens,
        "seq_len": len(sequences[0]),
        "device": run_on,
    }
    return CalibrationStats(grams, record, time.perf_counter() - start)


def _config_obj(config: dict[str, Any]):
    from types import SimpleNamespace

    return SimpleNamespace(**config)


# ----------------------------------------------------------------------------------------------------
# 2. Fitting merges


def rotary_dim(config: dict[str, Any], adapter: ArchAdapter, head_dim: int) -> int:
    """Channels of each head that get rotary embeddings: HF rotates the first
    ``head_dim * partial_rotary_factor``."""
    if not adapter.rotary:
        return 0
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    factor = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    dim = int(head_dim * float(factor))
    return dim - dim % 2


def keys_normalized(infos: Infos, adapter: ArchAdapter, layer: int) -> bool:
    """Whether this layer normalizes keys after projection (a ``k_norm`` / ``k_layernorm`` tensor exists)."""
    attn = adapter.layer(adapter.o, layer).rsplit(".", 1)[0]  # type: ignore[union-attr]
    prefixes = tuple(f"{attn}.{m}." for m in KEY_NORM_MODULES)
    return any(name.startswith(prefixes) for name in infos)


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
        w, b = rows(adapter.layer(adapter.qkv, layer))  # type: ignore[arg-type]
        sizes = [h * d, kv * d, kv * d]
        bs = b.split(sizes) if b is not None else (None, None, None)
        triples: list[tuple[Any, Any]] = list(zip(w.split(sizes), bs, strict=True))
        if not queries:
            triples[0] = (None, None)
    else:
        wanted = (adapter.q if queries else None, adapter.k, adapter.v)
        triples = [rows(adapter.layer(m, layer)) if m else (None, None) for m in wanted]  # type: ignore[arg-type]
    q, k, v = (None if w is None else augment(w, b).reshape(-1, d, w.shape[1] + 1) for w, b in triples)
    return q, k, v  # type: ignore[return-value]


def fit_layer_merges(
    ckpt: Checkpoint,
    adapter: ArchAdapter,
    geom: AttentionGeometry,
    stats: CalibrationStats | None,
    groups: int,
    method: str,
    grouping: str = "contiguous",
) -> tuple[list[LayerMerge], str]:
    """Choose groups and fit key/value merges for every layer.

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
    rdim = rotary_dim(ckpt.config, adapter, geom.head_dim)
    key_treatment = method
    merges = []
    with ckpt.reader() as reader:
        for layer in range(geom.num_layers):
            wq, wk, wv = layer_attention_weights(
                reader.read, infos, adapter, geom, layer, queries=method == "calibrated"
            )
            gram = stats.grams[layer] if stats is not None else torch.eye(wk.shape[-1], dtype=torch.float64)
            key_method = method
            if method == "calibrated" and keys_normalized(infos, adapter, layer):
                key_method, key_treatment = "mean", KEY_FALLBACK
            # Calibrated merges count errors where they matter downstream (see downstream_scales); mean
            # and first have nothing to fit, and a key that falls back to mean gets no key metric.
            ks = vs = None
            if wq is not None:
                wo = reader.read(f"{adapter.layer(adapter.o, layer)}.weight")
                ks, vs = downstream_scales(wq, wo, gram, geom.num_kv_heads, rdim)
                ks = ks if key_method == "calibrated" else None

            def fit(heads: Sequence[int], wk=wk, wv=wv, gram=gram, key_method=key_method, ks=ks, vs=vs):
                idx = list(heads)
                mk = _fit(partial(fit_merge, "key", key_method, gram=gram, rotary_dim=rdim), wk[idx], ks, idx)
                mv = _fit(partial(fit_merge, "value", method, gram=gram), wv[idx], vs, idx)
                return mk, mv

            if grouping == "similarity":
                # the error each merge minimizes (in its metric), relative to the layer's energy in it
                tk, tv = energy(wk, gram, ks), energy(wv, gram, vs)

                def cost(heads: Sequence[int], fit=fit, wk=wk, wv=wv, gram=gram, ks=ks, vs=vs, tk=tk, tv=tv):
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
            merges.append(
                LayerMerge(
                    groups=chosen,
                    keys=[f[0] for f in fitted],
                    values=[f[1] for f in fitted],
                    key_error=ek / max(tk, 1e-300),
                    value_error=ev / max(tv, 1e-300),
                )
            )
    return merges, key_treatment


def _rows(t: torch.Tensor | None, idx: list[int]) -> torch.Tensor | None:
    return None if t is None else t[idx]


def _fit(fn: Callable[[torch.Tensor], Merge], w: torch.Tensor, scales: torch.Tensor | None, idx) -> Merge:
    """``fn(w)``, or fitted in the metric of the members' ``scales`` when there are some."""
    return fn(w) if scales is None else in_metric(fn, w, scales[idx])


# ----------------------------------------------------------------------------------------------------
# 3. The plan


def plan_merged(
    infos: Infos, adapter: ArchAdapter, geom: AttentionGeometry, spec: RegroupSpec, merges: list[LayerMerge]
) -> list[OutputTensor]:
    """:func:`plan_regroup`, with each layer's attention tensors permuted and merged by ``merges``.

    Per layer: q rows (and bias) move with their K/V head and absorb the key compensation; k/v rows
    (and biases, and flat key norms) are permuted and merged; o_proj columns move and absorb the value
    compensation; per-head norms move (query) or are merged (key). Everything else is as planned.
    """
    base = plan_regroup(infos, adapter, geom, RegroupSpec(spec.target, "mean", out_dtype=spec.out_dtype))
    d, n_rep, kv, h = geom.head_dim, geom.queries_per_kv, geom.num_kv_heads, geom.num_heads
    override: dict[str, OutputTensor] = {}

    def put(name: str, shape: tuple[int, ...], sources: tuple[str, ...], fn) -> None:
        dtype = spec.out_dtype or infos[sources[0]][0]
        override[name] = OutputTensor(name, dtype, shape, sources, partial(_cast_to, fn=fn, dtype=dtype))

    def present(module: str | None) -> list[str]:
        return (
            []
            if module is None
            else [f"{module}.{s}" for s in ("weight", "bias") if f"{module}.{s}" in infos]
        )

    for layer, lm in enumerate(merges):
        kv_order, q_order = lm.kv_order, query_order(lm.kv_order, n_rep)
        q_fn = partial(_q_rows, q_order=q_order, keys=lm.keys, d=d, n_rep=n_rep)
        k_fn = partial(_kv_rows, kv_order=kv_order, merges=lm.keys, d=d)
        v_fn = partial(_kv_rows, kv_order=kv_order, merges=lm.values, d=d)
        for name in present(adapter.layer(adapter.q, layer)):
            put(name, infos[name][1], (name,), q_fn)
        for name in present(adapter.layer(adapter.k, layer)) + present(
            adapter.layer(adapter.k_norm_flat, layer)
        ):
            put(name, (spec.target * d, *infos[name][1][1:]), (name,), k_fn)
        for name in present(adapter.layer(adapter.v, layer)):
            put(name, (spec.target * d, *infos[name][1][1:]), (name,), v_fn)
        for name in present(adapter.layer(adapter.q_norm_flat, layer)):
            put(name, infos[name][1], (name,), partial(_permuted_rows, order=q_order, d=d))
        for name in present(adapter.layer(adapter.qkv, layer)):
            fn = partial(_fused, q_fn=q_fn, k_fn=k_fn, v_fn=v_fn, sizes=[h * d, kv * d, kv * d])
            put(name, ((h + 2 * spec.target) * d, *infos[name][1][1:]), (name,), fn)
        o = f"{adapter.layer(adapter.o, layer)}.weight"
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

    plan, seen = [], set()
    for out in base:
        if out.name in override:
            plan.append(override[out.name])
            seen.add(out.name)
        else:
            plan.append(out)
    missing = set(override) - seen
    if missing:
        raise RuntimeError(f"planned overrides without a base entry: {sorted(missing)[:5]}")
    return plan


def _cast_to(ts: list[torch.Tensor], *, fn, dtype: str) -> torch.Tensor:
    return fn(ts).to(DTYPES[dtype]).contiguous()


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
    layers = []
    for i, lm in enumerate(merges):
        entry: dict[str, Any] = {"layer": i, "key": round(lm.key_error, 6), "value": round(lm.value_error, 6)}
        if grouping == "similarity":
            entry["groups"] = lm.groups
        layers.append(entry)
    calib = None
    if stats is not None:
        calib = {**stats.record, "elapsed_s": round(stats.elapsed_s, 3)}
    return MergeReport(method, grouping, key_merge, calib, layers)

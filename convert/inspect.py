"""``gqakit inspect``: a checkpoint's attention geometry, what each valid G costs in KV cache, and what
its G costs each GPU under tensor parallelism."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gqakit.checkpoint import resolve_checkpoint
from gqakit.convert.plan import RegroupSpec, plan_regroup
from gqakit.convert.retarget import refusals
from gqakit.dtypes import SAFETENSORS_DTYPES, dtype_name
from gqakit.families import family_of
from gqakit.geometry import AttentionGeometry, TensorParallelKV
from gqakit.gguf.dequantize import is_gguf
from gqakit.gguf.header import read_gguf_header


@dataclass
class Inspection:
    """What ``gqakit inspect`` reports."""

    source: str
    model_type: str
    supported: bool
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    parameters: int
    dtypes: dict[str, int]
    format: str
    shards: list[str]
    kv_bytes_per_token: dict[int, int]
    output_class: str = ""
    # KV cache per GPU per token, bf16, under tensor parallelism of degree 1, 2, 4, 8 (its G as it is)
    tensor_parallel: list[TensorParallelKV] = field(default_factory=list)

    def to_text(self) -> str:
        kind = "MHA" if self.num_kv_heads == self.num_heads else ("MQA" if self.num_kv_heads == 1 else "GQA")
        dt = ", ".join(f"{k} ({v:,} params)" for k, v in self.dtypes.items())
        lines = [
            f"source            {self.source}",
            f"model_type        {self.model_type}"
            + ("" if self.supported else "  (not supported by convert)"),
            f"layers            {self.num_layers}",
            f"hidden size       {self.hidden_size}",
            f"query heads       {self.num_heads}",
            f"K/V heads         {self.num_kv_heads}  ({kind})",
            f"head_dim          {self.head_dim}",
            f"parameters        {self.parameters:,}",
            f"dtype             {dt}",
            f"weights           {self.format}, {len(self.shards)} shard(s)",
            "KV cache per token, bf16 (valid --groups):",
        ]
        if self.output_class:
            lines.insert(2, f"converts into     {self.output_class}")
        for g, b in self.kv_bytes_per_token.items():
            lines.append(f"  G={g:<4} {b:>10,} bytes   {b * 4096 / 2**20:>9.1f} MiB per 4096-token sequence")
        if self.tensor_parallel:
            lines.append("KV cache per GPU per token, bf16, under tensor parallelism (TP GPUs):")
        for t in self.tensor_parallel:
            notes = [f"K/V heads replicated (G={self.num_kv_heads} < TP)"] if t.replicated else []
            notes += [f"transformers' TP refuses: {t.transformers_refuses}"] if t.transformers_refuses else []
            lines.append(
                f"  TP={t.tp:<3} {t.kv_heads_per_gpu:>3} K/V head(s)/GPU {t.kv_bytes_per_gpu:>10,} bytes"
                + ("   " + "; ".join(notes) if notes else "")
            )
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def inspect_checkpoint(src: str | Path) -> Inspection:
    """Describe a checkpoint's attention and what each valid G would cost in KV cache.

    A ``.gguf`` file is described from its header alone (seconds, not a dequantization of the whole
    model). For a checkpoint of a supported family, the weights' shapes are checked against the config
    the way ``convert`` checks them, so the valid G listed are the ones ``convert`` accepts.
    """
    if is_gguf(src):  # geometry and dtypes from the header
        header = read_gguf_header(path := Path(src).expanduser())
        supported = family_of(header.geometry.model_type).attention is not None
        return _inspection(str(path), header.geometry, supported, header.dtypes, "gguf", [path.name])
    with resolve_checkpoint(src) as ckpt:
        family = family_of(ckpt.model_type)
        retarget = family.retarget
        geom = AttentionGeometry.from_config(ckpt.config)  # a retargeted source: its heads now (MHA)
        infos = ckpt.tensor_infos()
        if family.attention is not None:  # the checks convert runs on the headers: a config that lies fails
            plan_regroup(infos, family.attention, geom, RegroupSpec(geom.num_kv_heads))
        # a family converted into another class: every reason convert would refuse it (its config and
        # its weights), else the class, why, and the G it holds
        problems = refusals(ckpt)
        dtypes: dict[str, int] = {}
        for dtype, shape in infos.values():
            dtypes[dtype] = dtypes.get(dtype, 0) + math.prod(shape)
        supported = family.attention is not None or (retarget is not None and not problems)
        groups = retarget.valid_groups(geom.num_heads) if retarget else None
        inspection = _inspection(
            ckpt.origin, geom, supported, dtypes, ckpt.format, [s.file for s in ckpt.shards], groups
        )
        if retarget is not None:
            why = f"{retarget.target}: {retarget.why}"
            inspection.output_class = f"nothing: {' '.join(problems)}" if problems else why
        return inspection


def _inspection(
    source: str,
    geom: AttentionGeometry,
    supported: bool,
    dtypes: dict[str, int],
    fmt: str,
    shards: list[str],
    groups: list[int] | None = None,
) -> Inspection:
    return Inspection(
        source=source,
        supported=supported,
        **asdict(geom),  # model_type, num_layers, hidden_size, num_heads, num_kv_heads, head_dim
        parameters=sum(dtypes.values()),
        # safetensors' names as config.json spells them (bfloat16); a GGUF's types (Q8_0) as they are
        dtypes={dtype_name(k) if k in SAFETENSORS_DTYPES else k: v for k, v in dtypes.items()},
        format=fmt,
        shards=shards,
        kv_bytes_per_token={g: geom.kv_bytes_per_token(g) for g in groups or geom.valid_groups()},
        tensor_parallel=geom.tensor_parallel_kv(),
    )

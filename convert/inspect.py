"""``gqakit inspect``: a checkpoint's attention geometry and what each valid G costs in KV cache."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from gqakit.checkpoint import Checkpoint, resolve_checkpoint
from gqakit.convert.plan import RegroupSpec, plan_regroup
from gqakit.convert.registry import get_adapter
from gqakit.convert.retarget import RETARGETS
from gqakit.convert.write import _CONFIG_DTYPE
from gqakit.errors import GqakitError
from gqakit.geometry import AttentionGeometry
from gqakit.gguf import read_gguf_header


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
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def inspect_checkpoint(src: str | Path) -> Inspection:
    """Describe a checkpoint's attention and what each valid G would cost in KV cache.

    A ``.gguf`` file is described from its header alone (seconds, not a dequantization of the whole
    model). For a checkpoint of a supported family, the weights' shapes are checked against the config
    the way ``convert`` checks them, so the valid G listed are the ones ``convert`` accepts.
    """
    if Path(str(src)).expanduser().suffix.lower() == ".gguf" and Path(str(src)).expanduser().is_file():
        return _inspect_gguf(Path(str(src)).expanduser())
    with resolve_checkpoint(src) as ckpt:
        if ckpt.model_type in RETARGETS:
            return _inspect_retargeted(ckpt)
        geom = AttentionGeometry.from_config(ckpt.config)
        infos = ckpt.tensor_infos()
        supported = _supported(ckpt.model_type)
        if supported:  # the checks convert runs on the headers: a config that lies about its heads fails here
            plan_regroup(infos, get_adapter(ckpt.model_type), geom, RegroupSpec(geom.num_kv_heads))
        dtypes: dict[str, int] = {}
        for dtype, shape in infos.values():
            dtypes[dtype] = dtypes.get(dtype, 0) + math.prod(shape)
        return _inspection(ckpt.origin, geom, supported, dtypes, ckpt.format, [s.file for s in ckpt.shards])


def _inspect_retargeted(ckpt: Checkpoint) -> Inspection:
    """A family that converts into another class: the target's geometry, the G it holds, and why."""
    retarget = RETARGETS[ckpt.model_type]
    target = retarget.geometry(ckpt.config)
    # reported as the source family, with its heads as they are now (MHA)
    geom = AttentionGeometry(
        ckpt.model_type, target.num_layers, target.hidden_size, target.num_heads, target.num_heads,
        target.head_dim,
    )  # fmt: skip
    problems = retarget.problems(ckpt.config)
    output = f"{retarget.target}: {retarget.why}"
    if problems:
        output = f"nothing: {'; '.join(problems)}"
    dtypes: dict[str, int] = {}
    for dtype, shape in ckpt.tensor_infos().values():
        dtypes[dtype] = dtypes.get(dtype, 0) + math.prod(shape)
    groups = retarget.valid_groups(target.num_heads)
    inspection = _inspection(
        ckpt.origin, geom, not problems, dtypes, ckpt.format, [s.file for s in ckpt.shards], groups
    )
    inspection.output_class = output
    return inspection


def _supported(model_type: str) -> bool:
    try:
        get_adapter(model_type)
        return True
    except GqakitError:
        return False


def _inspect_gguf(path: Path) -> Inspection:

    header = read_gguf_header(path)
    return _inspection(
        str(path), header.geometry(), _supported(header.model_type), header.dtypes, "gguf", [path.name]
    )


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
        model_type=geom.model_type,
        supported=supported,
        num_layers=geom.num_layers,
        hidden_size=geom.hidden_size,
        num_heads=geom.num_heads,
        num_kv_heads=geom.num_kv_heads,
        head_dim=geom.head_dim,
        parameters=sum(dtypes.values()),
        dtypes={_CONFIG_DTYPE.get(k, k): v for k, v in dtypes.items()},
        format=fmt,
        shards=shards,
        kv_bytes_per_token={g: geom.kv_bytes_per_token(g) for g in groups or geom.valid_groups()},
    )

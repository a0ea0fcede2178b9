"""Writing a converted checkpoint atomically: shards, config, tokenizer files, provenance, model card.

The one writer of every conversion's output directory (``convert`` of every family, ``expand``, probe's
candidates): what each method computes reaches DST through :func:`write_converted`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gqakit import __version__
from gqakit.checkpoint import Checkpoint, copy_non_weight_files
from gqakit.convert.plan import OutputTensor
from gqakit.convert.stream import write_plan
from gqakit.dtypes import dtype_name
from gqakit.geometry import AttentionGeometry
from gqakit.storage import atomic_output_dir, sha256_file, write_json, write_text

# Writes a conversion's weight shards into a directory and returns their file names.
WeightWriter = Callable[[Path], list[str]]


@dataclass
class ConvertResult:
    """What a conversion wrote."""

    dst: Path
    source: str
    model_type: str
    num_heads: int
    from_kv_heads: int
    to_kv_heads: int
    files: list[str]
    elapsed_s: float
    provenance: dict[str, Any] = field(default_factory=dict)


def source_path(ckpt: Checkpoint) -> Path:
    """What the user converts, for the output checks: a ``.gguf`` file as named (its checkpoint is a
    dequantized copy in the cache), else the user's checkpoint directory (not a retargeted family's
    temporary rewrite)."""
    origin = Path(ckpt.origin).expanduser() if ckpt.origin else None
    return origin if origin is not None and origin.is_file() else (ckpt.derived_from or ckpt).path


def source_hashes(ckpt: Checkpoint) -> dict[str, str | None]:
    """The provenance hashes of the user's source: the ``.gguf`` file itself when that is what was named
    (the config we read was derived from it), and the config and shard index of the user's checkpoint."""
    user = ckpt.derived_from or ckpt
    return {
        "source_file_sha256": sha256_file(Path(ckpt.origin)) if Path(ckpt.origin).is_file() else None,
        "source_config_sha256": sha256_file(user.path / "config.json"),
        "source_index_sha256": sha256_file(user.index_file) if user.index_file else None,
    }


def write_converted(
    ckpt: Checkpoint,
    dst: str | Path,
    weights: list[OutputTensor] | WeightWriter,
    geom: AttentionGeometry,
    groups: int,
    out_dtype: str | None,
    force: bool,
    record: dict[str, Any],
    start: float,
    config: dict[str, Any],
    progress: bool = True,
) -> ConvertResult:
    """Write a conversion atomically: shards, config, tokenizer files, provenance, model card.

    Shared by every conversion method and family, so each writes the same complete, loadable directory.
    ``weights`` is either a plan (streamed tensor by tensor) or a function that writes the weight shards
    into the temporary directory itself and returns their names (the layer-by-layer calibrated path);
    such a function may add to ``record`` what it measured, which then goes into the provenance.
    ``config``: the output's config (G as its class states it), a new dict this may change. ``progress``
    False: no progress bar for a streamed plan. The output directory is claimed (and DST checked) before
    any weight is computed.
    """
    if out_dtype is not None:
        config["dtype"] = dtype_name(out_dtype)
        if "torch_dtype" in config:  # a carried-over legacy key must not contradict it
            config["torch_dtype"] = config["dtype"]
    with atomic_output_dir(Path(dst), force, src=source_path(ckpt)) as tmp:
        if callable(weights):
            files = weights(tmp)
        else:
            files = write_plan(ckpt, weights, tmp, f"{record['command']} -> G={groups}", progress)
        copy_non_weight_files(ckpt.path, tmp)
        write_json(tmp / "config.json", config)
        provenance = {
            "tool": "gqakit",
            "version": __version__,
            **record,
            "source": ckpt.origin,
            **source_hashes(ckpt),
            "model_type": ckpt.model_type,
            "num_heads": geom.num_heads,
            "from_kv_heads": geom.num_kv_heads,
            "to_kv_heads": groups,
            "shards": files,
            "elapsed_s": round(time.perf_counter() - start, 3),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        write_json(tmp / "gqakit.json", provenance)
        write_text(tmp / "README.md", _model_card(Path(dst).name, geom, groups, provenance))
    return ConvertResult(
        Path(dst).resolve(),
        ckpt.origin,
        ckpt.model_type,
        geom.num_heads,
        geom.num_kv_heads,
        groups,
        files,
        provenance["elapsed_s"],
        provenance,
    )


def _model_card(name: str, geom: AttentionGeometry, groups: int, prov: dict[str, Any]) -> str:
    """A short model card: the command, the source and G; gqakit.json holds every setting and figure."""
    kind = "MQA" if groups == 1 else ("MHA" if groups == geom.num_heads else f"GQA-{groups}")
    return (
        f"# {name}\n\n`{prov['source']}` after `gqakit {prov['command']}` (gqakit {prov['version']}, method "
        f"`{prov['method']}`): {geom.num_heads} query heads share {groups} K/V heads ({kind}), down from "
        f"{geom.num_kv_heads}. A plain Hugging Face checkpoint; the conversion's settings and measurements "
        "are in [gqakit.json](gqakit.json).\n"
    )

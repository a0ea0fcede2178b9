"""The typed entry points behind ``gqakit convert``, ``gqakit expand`` and ``gqakit inspect``."""

from __future__ import annotations

import copy
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gqakit import __version__
from gqakit.checkpoint import (
    Checkpoint,
    atomic_output_dir,
    copy_non_weight_files,
    resolve_checkpoint,
    sha256_file,
    write_json,
)
from gqakit.convert.grouping import GROUPINGS
from gqakit.convert.plan import OutputTensor, RegroupSpec, plan_regroup
from gqakit.convert.pooling import METHODS
from gqakit.convert.refine import REFINE_LR
from gqakit.convert.registry import get_adapter
from gqakit.convert.stream import write_plan
from gqakit.errors import GqakitError
from gqakit.geometry import AttentionGeometry
from gqakit.safetensors_io import DTYPES

# Every --method of convert: the pooling methods, and the activation-aware merge (gqakit.convert.merge).
CONVERT_METHODS: tuple[str, ...] = (*METHODS, "calibrated")
# Methods that --grouping similarity can combine with (random ignores the weights, so grouping is moot).
SIMILARITY_METHODS: tuple[str, ...] = ("mean", "first", "calibrated")

# CLI dtype names -> safetensors dtype names (None: keep each tensor's own).
DTYPE_CHOICES: dict[str, str | None] = {"keep": None, "bfloat16": "BF16", "float16": "F16", "float32": "F32"}
_CONFIG_DTYPE = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


@dataclass(frozen=True)
class ConvertOptions:
    """Options of ``gqakit convert``.

    Attributes:
        groups: K/V heads in the output (G). 1 is MQA.
        method: ``mean`` (the paper's), ``first``, ``random``, or ``calibrated`` (activation-aware
            merge with q/o compensation; needs ``calib_data``).
        dtype: ``keep``, ``bfloat16``, ``float16`` or ``float32`` for every floating tensor.
        seed: seed for ``random``.
        force: replace a non-empty output directory.
        calib_data: calibration text (``.txt``/``.jsonl``/``.parquet``) for ``calibrated`` and
            ``similarity``.
        calib_tokens: calibration tokens to run through the model.
        grouping: ``contiguous`` (what ``repeat_kv`` implies) or ``similarity`` (groups chosen by the
            merge's reconstruction error on the calibration data, heads reordered to match).
        device: where calibration runs: ``auto``, ``cpu``, ``cuda``...
        refine_steps: Adam steps per layer fitting each converted attention block to the original's
            output on the calibration data (``gqakit.convert.refine``); 0 skips it. Needs ``calib_data``.
        refine_lr: the learning rate of those steps.
    """

    groups: int
    method: str = "mean"
    dtype: str = "keep"
    seed: int = 0
    force: bool = False
    calib_data: str | None = None
    calib_tokens: int = 4096
    grouping: str = "contiguous"
    device: str = "auto"
    refine_steps: int = 0
    refine_lr: float = REFINE_LR

    @property
    def merged(self) -> bool:
        """True when this conversion goes through the merge path (calibration and/or head grouping)."""
        return self.method == "calibrated" or self.grouping == "similarity"

    def validate(self) -> None:
        problems = []
        if self.groups <= 0:
            problems.append(f"--groups must be a positive number of K/V heads, got {self.groups}.")
        if self.method not in CONVERT_METHODS:
            problems.append(
                f"--method {self.method!r} is unknown; choose one of {', '.join(CONVERT_METHODS)}."
            )
        if self.dtype not in DTYPE_CHOICES:
            problems.append(f"--dtype {self.dtype!r} is unknown; choose one of {', '.join(DTYPE_CHOICES)}.")
        if self.grouping not in GROUPINGS:
            problems.append(f"--grouping {self.grouping!r} is unknown; choose one of {', '.join(GROUPINGS)}.")
        if self.calib_tokens <= 0:
            problems.append(f"--calib-tokens must be a positive number of tokens, got {self.calib_tokens}.")
        if self.refine_steps < 0:
            problems.append(
                f"--refine-steps must be 0 (off) or a positive step count, got {self.refine_steps}."
            )
        if not self.refine_lr > 0:
            problems.append(f"--refine-lr must be a positive learning rate, got {self.refine_lr}.")
        needs = [
            w
            for w, on in (
                ("--method calibrated", self.method == "calibrated"),
                ("--grouping similarity", self.grouping == "similarity"),
                ("--refine-steps", self.refine_steps > 0),
            )
            if on
        ]
        if needs and not self.calib_data:
            problems.append(
                f"{' and '.join(needs)} need calibration text: pass --calib-data FILE (.txt, .jsonl or "
                ".parquet), e.g. the train split of `gqakit assets fetch wiki-en`."
            )
        if self.calib_data and not needs:
            problems.append(
                f"--calib-data is only used by --method calibrated, --grouping similarity or --refine-steps; "
                f"add one of them, or drop --calib-data for --method {self.method}."
            )
        if self.calib_data and not Path(self.calib_data).expanduser().is_file():
            problems.append(f"--calib-data {self.calib_data} does not exist or is not a file.")
        if self.refine_steps > 0 and self.method == "random":
            problems.append(
                "--refine-steps cannot start from --method random (the blocks would be trained from scratch "
                "on a few thousand tokens); use --method calibrated or mean."
            )
        if self.grouping == "similarity" and self.method not in SIMILARITY_METHODS and self.method in METHODS:
            problems.append(
                f"--grouping similarity cannot be combined with --method {self.method}; use one of "
                f"{', '.join(SIMILARITY_METHODS)}."
            )
        if problems:
            raise GqakitError(" ".join(problems))


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


def check_groups(geom: AttentionGeometry, groups: int) -> None:
    """Raise a clear error unless pooling ``geom``'s K/V heads into ``groups`` heads is possible."""
    if groups <= 0:
        raise GqakitError(f"--groups must be a positive number of K/V heads, got {groups}.")
    valid = ", ".join(map(str, geom.valid_groups()))
    if groups > geom.num_kv_heads:
        raise GqakitError(
            f"--groups {groups} is more than the {geom.num_kv_heads} K/V heads this checkpoint has; pooling "
            f"cannot add heads. Valid --groups: {valid}. To get more K/V heads, run `gqakit expand SRC DST` "
            f"first (it gives {geom.num_heads}, exactly equivalent) and convert that."
        )
    if geom.num_kv_heads % groups:
        raise GqakitError(
            f"--groups {groups} does not divide the {geom.num_kv_heads} K/V heads of this checkpoint. "
            f"Valid --groups: {valid}."
        )


def convert_checkpoint(src: str | Path, dst: str | Path, options: ConvertOptions) -> ConvertResult:
    """Convert a checkpoint to ``options.groups`` K/V heads, streaming, into a new directory.

    Args:
        src: a checkpoint directory, a ``.gguf`` file or a hub id.
        dst: the output directory; written atomically.
        options: what to do.

    Returns:
        A :class:`ConvertResult` describing the output.

    Raises:
        GqakitError: for any input a user can fix; nothing is left at ``dst`` then.
    """
    options.validate()
    start = time.perf_counter()
    with resolve_checkpoint(src) as ckpt:
        adapter = get_adapter(ckpt.model_type)
        geom = AttentionGeometry.from_config(ckpt.config)
        check_groups(geom, options.groups)
        spec = RegroupSpec(
            target=options.groups,
            method=options.method,
            seed=options.seed,
            std=float(ckpt.config.get("initializer_range", 0.02)),
            out_dtype=DTYPE_CHOICES[options.dtype],
        )
        record: dict[str, Any] = {
            "command": "convert",
            "groups": options.groups,
            "method": options.method,
            "dtype": options.dtype,
        }
        if options.method == "random":
            record["seed"] = options.seed
        model = sequences = None
        if options.refine_steps:  # tokenize and load the original once: calibration and refinement share them
            from gqakit.convert.calibrate import calibration_sequences, load_model_for_calibration
            from gqakit.convert.refine import check_sequences

            sequences = calibration_sequences(ckpt, options.calib_data, options.calib_tokens)  # type: ignore[arg-type]
            check_sequences(sequences)  # before the model is loaded
            model = load_model_for_calibration(ckpt.path, options.device)
        try:
            if options.merged:
                plan, merge_record = plan_with_merges(
                    ckpt, adapter, geom, spec, options, model=model, sequences=sequences
                )
                record.update(merge_record)
            else:
                plan = plan_regroup(ckpt.tensor_infos(), adapter, geom, spec)
            if options.refine_steps:
                plan, refine_record = refine_with(ckpt, adapter, geom, plan, options, model, sequences)
                record["refine"] = refine_record
        finally:
            del model
        return write_converted(
            ckpt, dst, plan, geom, options.groups, spec.out_dtype, options.force, record, start
        )


def plan_with_merges(
    ckpt: Checkpoint,
    adapter,
    geom: AttentionGeometry,
    spec: RegroupSpec,
    options: ConvertOptions,
    stats=None,
    model=None,
    sequences=None,
) -> tuple[list[OutputTensor], dict[str, Any]]:
    """Calibrate (unless ``stats`` is given; on ``model`` and ``sequences`` when they are at hand already),
    fit the merges, and plan; return the plan and its record."""
    from gqakit.convert.calibrate import calibrate, fit_layer_merges, merge_report, plan_merged

    if stats is None and options.calib_data:
        stats = calibrate(
            ckpt,
            adapter,
            geom,
            options.calib_data,
            options.calib_tokens,
            options.device,
            model=model,
            sequences=sequences,
        )
    merges, key_merge = fit_layer_merges(
        ckpt, adapter, geom, stats, options.groups, options.method, options.grouping
    )
    plan = plan_merged(ckpt.tensor_infos(), adapter, geom, spec, merges)
    return plan, merge_report(options.method, options.grouping, key_merge, stats, merges).to_record()


def refine_with(
    ckpt: Checkpoint,
    adapter,
    geom: AttentionGeometry,
    plan: list[OutputTensor],
    options: ConvertOptions,
    model,
    sequences: list,
) -> tuple[list[OutputTensor], dict[str, Any]]:
    """Refine ``plan``'s attention tensors against ``model`` (the loaded original) on the calibration
    ``sequences``."""
    from gqakit.convert.refine import RefineSettings, refine_plan

    settings = RefineSettings(options.refine_steps, options.refine_lr, options.seed)
    with ckpt.reader() as reader:
        plan, report = refine_plan(
            plan, reader.read, model, adapter, geom.num_layers, options.groups, sequences, settings
        )
    return plan, report.to_record()


def expand_checkpoint(
    src: str | Path, dst: str | Path, dtype: str = "keep", force: bool = False
) -> ConvertResult:
    """GQA/MQA -> MHA: repeat each K/V head over its group. The output computes exactly the same logits."""
    if dtype not in DTYPE_CHOICES:
        raise GqakitError(f"--dtype {dtype!r} is unknown; choose one of {', '.join(DTYPE_CHOICES)}.")
    start = time.perf_counter()
    with resolve_checkpoint(src) as ckpt:
        adapter = get_adapter(ckpt.model_type)
        geom = AttentionGeometry.from_config(ckpt.config)
        spec = RegroupSpec(target=geom.num_heads, method="mean", out_dtype=DTYPE_CHOICES[dtype])
        plan = plan_regroup(ckpt.tensor_infos(), adapter, geom, spec)
        record = {"command": "expand", "groups": geom.num_heads, "method": "repeat", "dtype": dtype}
        return write_converted(ckpt, dst, plan, geom, geom.num_heads, spec.out_dtype, force, record, start)


def write_converted(
    ckpt: Checkpoint,
    dst: str | Path,
    plan: list[OutputTensor],
    geom: AttentionGeometry,
    groups: int,
    out_dtype: str | None,
    force: bool,
    record: dict[str, Any],
    start: float,
    config_updates: dict[str, Any] | None = None,
) -> ConvertResult:
    """Write a planned conversion atomically: shards, config, tokenizer files, provenance, model card.

    Shared by every conversion method, so each writes the same complete, loadable directory.
    """
    config = copy.deepcopy(ckpt.config)
    config["num_key_value_heads"] = groups
    if out_dtype is not None:
        config["dtype"] = _CONFIG_DTYPE[out_dtype]
        if "torch_dtype" in config:
            config["torch_dtype"] = config["dtype"]
    config.update(config_updates or {})
    with atomic_output_dir(Path(dst), force, src=ckpt.path) as tmp:
        files = write_plan(ckpt, plan, tmp, desc=f"{record['command']} -> G={groups}")
        copy_non_weight_files(ckpt.path, tmp)
        write_json(tmp / "config.json", config)
        provenance = {
            "tool": "gqakit",
            "version": __version__,
            **record,
            "source": ckpt.origin,
            # a .gguf source is hashed itself: the config we read was derived from it
            "source_file_sha256": sha256_file(Path(ckpt.origin)) if Path(ckpt.origin).is_file() else None,
            "source_config_sha256": sha256_file(ckpt.path / "config.json"),
            "source_index_sha256": sha256_file(ckpt.index_file) if ckpt.index_file else None,
            "model_type": ckpt.model_type,
            "num_heads": geom.num_heads,
            "from_kv_heads": geom.num_kv_heads,
            "to_kv_heads": groups,
            "shards": files,
            "elapsed_s": round(time.perf_counter() - start, 3),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        write_json(tmp / "gqakit.json", provenance)
        (tmp / "README.md").write_text(_model_card(Path(dst).name, geom, groups, provenance))
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
    before = geom.kv_bytes_per_token(geom.num_kv_heads)
    after = geom.kv_bytes_per_token(groups)
    kind = "MQA" if groups == 1 else ("MHA" if groups == geom.num_heads else f"GQA-{groups}")
    return f"""---
library_name: transformers
base_model: {prov["source"]}
tags:
- gqakit
- grouped-query-attention
---

# {name}

`{prov["source"]}` with its attention regrouped by gqakit {prov["version"]} (`gqakit {prov["command"]}`):
{geom.num_heads} query heads now share **{groups} K/V heads** ({kind}), down from {geom.num_kv_heads};
method `{prov["method"]}`, dtype `{prov["dtype"]}`.

KV cache per token (bf16, all {geom.num_layers} layers): {before:,} bytes before, {after:,} bytes after.

This is a plain Hugging Face checkpoint:

```python
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained("{name}")
```

Pooling K/V heads without training costs quality; uptrain it (`gqakit uptrain`) and measure it
(`gqakit eval`) before use. Provenance: `gqakit.json`. Licence: that of the source model.
"""


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
        for g, b in self.kv_bytes_per_token.items():
            lines.append(f"  G={g:<4} {b:>10,} bytes   {b * 4096 / 2**20:>9.1f} MiB per 4096-token sequence")
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def inspect_checkpoint(src: str | Path) -> Inspection:
    """Describe a checkpoint's attention and what each valid G would cost in KV cache."""
    with resolve_checkpoint(src) as ckpt:
        geom = AttentionGeometry.from_config(ckpt.config)
        try:
            get_adapter(ckpt.model_type)
            supported = True
        except GqakitError:
            supported = False
        dtypes: dict[str, int] = {}
        for dtype, shape in ckpt.tensor_infos().values():
            n = 1
            for s in shape:
                n *= s
            dtypes[dtype] = dtypes.get(dtype, 0) + n
        return Inspection(
            source=ckpt.origin,
            model_type=ckpt.model_type,
            supported=supported,
            num_layers=geom.num_layers,
            hidden_size=geom.hidden_size,
            num_heads=geom.num_heads,
            num_kv_heads=geom.num_kv_heads,
            head_dim=geom.head_dim,
            parameters=sum(dtypes.values()),
            dtypes={_CONFIG_DTYPE.get(k, k): v for k, v in dtypes.items()},
            format=ckpt.format,
            shards=[s.file for s in ckpt.shards],
            kv_bytes_per_token={g: geom.kv_bytes_per_token(g) for g in geom.valid_groups()},
        )


__all__ = [
    "CONVERT_METHODS",
    "DTYPE_CHOICES",
    "DTYPES",
    "ConvertOptions",
    "ConvertResult",
    "Inspection",
    "check_groups",
    "convert_checkpoint",
    "expand_checkpoint",
    "inspect_checkpoint",
    "plan_with_merges",
    "write_converted",
]

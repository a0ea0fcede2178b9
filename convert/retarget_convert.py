"""Converting a retargeted family (GPT-2, OPT, GPT-NeoX): checks, the exact MHA rewrite, then G heads.

The rewrite into the target family's MHA checkpoint goes to a temporary directory; a ``phi`` target then
converts through the ordinary path (every method, grouping and refinement), a ``gpt_bigcode`` target is
pooled here (it holds G = 1 or G = H only). DST is written atomically in both cases.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gqakit import __version__
from gqakit.checkpoint import Checkpoint, resolve_checkpoint
from gqakit.cli_options import Problems
from gqakit.convert.calibrate import calibration_sequences
from gqakit.convert.methods import POOLING_METHODS
from gqakit.convert.options import DTYPE_CHOICES, ConvertOptions
from gqakit.convert.refine import RefineSettings, check_sequences
from gqakit.convert.retarget import (
    RETARGETS,
    Retarget,
    read_state,
    write_target,
)
from gqakit.convert.retarget_bigcode import bigcode_to_mqa
from gqakit.convert.retarget_bigcode_merge import calibrated_mqa
from gqakit.convert.write import ConvertResult, source_hashes, source_path
from gqakit.errors import GqakitError
from gqakit.files import write_json
from gqakit.models import resolve_device
from gqakit.outputs import atomic_output_dir, check_output_dir
from gqakit.safetensors_io import DTYPES

ConvertFn = Callable[..., ConvertResult]


def retarget_problems(ckpt: Checkpoint, retarget: Retarget, options: ConvertOptions) -> list[str]:
    """Everything about this source and these options that the target class cannot hold, together."""
    p = Problems("convert")
    for reason in retarget.problems(ckpt.config):
        p.add(f"{reason}.")
    heads = retarget.geometry(ckpt.config).num_heads
    groups = retarget.valid_groups(heads)
    if options.groups not in groups:
        holds = "any G dividing" if retarget.any_groups else "only G = 1 (multi_query) or G ="
        p.add(
            f"{p.flag('groups')} {options.groups}: {retarget.target} holds {holds} {heads} heads; "
            f"choose one of {', '.join(map(str, groups))}."
        )
    pooled = options.method in POOLING_METHODS and not options.merged and not options.refine_steps
    if not retarget.any_groups and not pooled:
        if options.groups != 1:
            p.add(
                f"{p.flag('method')} {options.method} (or {p.flag('refine_steps')} "
                f"{options.refine_steps}) at {p.flag('groups')} {options.groups}: G = H is "
                f"{retarget.target}'s exact rewrite, nothing to merge; the calibrated merge and "
                f"refinement go to {p.flag('groups')} 1."
            )
        if options.grouping != "contiguous":
            p.add(
                f"{p.flag('grouping')} {options.grouping}: a {retarget.target} target holds one K/V head, "
                "so every head is in the one group and there is nothing to choose."
            )
        if options.refine_steps and options.refine_target != "attention":
            p.add(
                f"{p.flag('refine_target')} {options.refine_target}: a {retarget.target} target is refined "
                "against the attention output only."
            )
        if options.refine_steps and options.refine_loss not in (None, "relative"):  # (a target's own: above)
            p.add(
                f"{p.flag('refine_loss')} {options.refine_loss}: a {retarget.target} target is refined with "
                "the relative loss only (its blocks are fitted without the residual states)."
            )
    return p.messages


def convert_retargeted(
    ckpt: Checkpoint, dst: str | Path, options: ConvertOptions, start: float, convert: ConvertFn
) -> ConvertResult:
    """Convert ``ckpt`` of a retargeted family to ``options.groups`` K/V heads of its target class.

    Args:
        ckpt: an open checkpoint whose ``model_type`` is in :data:`RETARGETS`.
        dst: the output directory; written atomically.
        options: validated convert options.
        start: when the command started (for the provenance's elapsed time).
        convert: the ordinary conversion of an open checkpoint (``gqakit.convert.api``), for ``phi``.

    Raises:
        GqakitError: every reason the source or the options cannot be held, in one message; nothing is
            written then.
    """
    retarget = RETARGETS[ckpt.model_type]
    what = f"{ckpt.origin} ({ckpt.model_type}) cannot be converted exactly into {retarget.target}:"
    problems = retarget_problems(ckpt, retarget, options)
    if problems:
        raise GqakitError(" ".join([what, *problems]))
    check_output_dir(Path(dst), options.force, ckpt.path)  # before the whole model is read and rewritten
    state = read_state(ckpt)
    problems = retarget.weight_problems(state, ckpt.config)
    if problems:
        raise GqakitError(" ".join([what, *problems]) + ".")
    config = retarget.config(ckpt.config)
    mha_state = retarget.state(state, ckpt.config)
    extra: dict[str, Any] = {"retargeted": {"from": ckpt.model_type, "to": retarget.target}}
    if not retarget.any_groups:  # gpt_bigcode: pooled here, written once
        return _write_bigcode(ckpt, dst, options, config, mha_state, start, extra)
    with tempfile.TemporaryDirectory(prefix="gqakit-retarget-") as tmp:
        mha = write_target(Path(tmp) / "mha", config, mha_state, ckpt.path)
        with resolve_checkpoint(mha) as target:
            target.origin = ckpt.origin  # the provenance names what the user gave
            target.derived_from = ckpt  # ... and hashes its files, not the rewrite's
            return convert(target, dst, options, start, extra)


def _fitted_mqa(
    ckpt: Checkpoint, options: ConvertOptions, config: dict[str, Any], mha: dict
) -> tuple[dict, dict[str, Any]]:
    """The gpt_bigcode MQA state by the calibrated merge or from a pooled start, refined when asked
    (:mod:`gqakit.convert.retarget_bigcode_merge`), with its record for gqakit.json."""
    sequences = calibration_sequences(ckpt, options.calib_data, options.calib_tokens)  # type: ignore[arg-type]
    refine = None
    if options.refine_steps:
        check_sequences(sequences)
        refine = RefineSettings(
            options.refine_steps, options.refine_lr, options.seed, schedule=options.refine_schedule
        )
    start = (
        None if options.method == "calibrated" else bigcode_to_mqa(mha, config, options.method, options.seed)
    )
    device = resolve_device(options.device)
    state, record = calibrated_mqa(mha, config, sequences, start=start, refine=refine, device=device)
    record["calibration"] = {
        "data": str(options.calib_data),
        "tokens": sum(s.numel() for s in sequences),
        "device": str(device),
    }
    return state, record


def _write_bigcode(
    ckpt: Checkpoint,
    dst: str | Path,
    options: ConvertOptions,
    config: dict[str, Any],
    state: dict,
    start: float,
    extra: dict[str, Any],
) -> ConvertResult:
    heads = config["n_head"]
    mqa = options.groups == 1 and heads > 1
    if mqa and (options.method == "calibrated" or options.refine_steps):
        state, measured = _fitted_mqa(ckpt, options, config, state)
        extra = {**extra, **measured}
    elif mqa:
        state = bigcode_to_mqa(state, config, options.method, options.seed)
    config = {**config, "multi_query": mqa}
    out_dtype = DTYPE_CHOICES[options.dtype]
    if out_dtype is not None:  # --dtype: floating tensors cast, the config says so
        torch_dtype = DTYPES[out_dtype]
        state = {k: v.to(torch_dtype) if v.is_floating_point() else v for k, v in state.items()}
        config["dtype"] = options.dtype
        if "torch_dtype" in config:  # a carried-over legacy key must not contradict it (as in write.py)
            config["torch_dtype"] = options.dtype
    with atomic_output_dir(Path(dst), options.force, src=source_path(ckpt)) as tmp:
        write_target(tmp, config, state, ckpt.path)
        provenance = {
            "tool": "gqakit",
            "version": __version__,
            "command": "convert",
            "groups": options.groups,
            "method": options.method,
            "dtype": options.dtype,
            **extra,
            "source": ckpt.origin,
            **source_hashes(ckpt),
            "model_type": ckpt.model_type,
            "num_heads": heads,
            "from_kv_heads": heads,
            "to_kv_heads": options.groups,
            "shards": ["model.safetensors"],
            "elapsed_s": round(time.perf_counter() - start, 3),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        write_json(tmp / "gqakit.json", provenance)
    return ConvertResult(
        Path(dst).resolve(), ckpt.origin, ckpt.model_type, heads, heads, options.groups,
        ["model.safetensors"], provenance["elapsed_s"], provenance,
    )  # fmt: skip

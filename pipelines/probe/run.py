"""The probe: :func:`probe_checkpoint` measures every combination (see :mod:`gqakit.pipelines.probe`)."""

from __future__ import annotations

import logging
import tempfile
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

import torch

from gqakit.checkpoint import resolve_checkpoint
from gqakit.convert.api import ConvertOptions, check_groups, plan_with_merges, write_converted
from gqakit.convert.calibrate import calibrate, calibration_ids, load_model_for_calibration
from gqakit.convert.merge_fit import fit_layer_merges
from gqakit.convert.methods import MERGE_METHODS, METHODS
from gqakit.convert.plan import RegroupSpec, plan_regroup
from gqakit.errors import GqakitError
from gqakit.eval import load_texts, perplexity
from gqakit.families import family_of, get_adapter
from gqakit.family_parts import ArchAdapter, Retarget
from gqakit.geometry import AttentionGeometry
from gqakit.models import load_tokenizer
from gqakit.pipelines.probe.options import ProbeOptions
from gqakit.pipelines.probe.report import ProbeResult, ProbeRow, write_probe

log = logging.getLogger(__name__)


@torch.no_grad()
def attention_errors(original, converted, adapter: ArchAdapter, num_layers: int, sequences) -> list[float]:
    """Per layer, ``sum ||attn'(x) - attn(x)||^2 / sum ||attn(x)||^2`` with ``x`` the original's layer inputs.

    One layer's outputs at a time: each hook compares and keeps two running sums.
    """
    num = [0.0] * num_layers
    den = [0.0] * num_layers

    def hook(layer: int, module, args, kwargs, output) -> None:
        other = converted.get_submodule(adapter.attention_module(layer))
        ref = output[0] if isinstance(output, tuple) else output
        got = other(*args, **kwargs)
        got = got[0] if isinstance(got, tuple) else got
        num[layer] += float((got.float() - ref.float()).pow(2).sum())
        den[layer] += float(ref.float().pow(2).sum())

    handles = [
        original.get_submodule(adapter.attention_module(layer)).register_forward_hook(
            partial(hook, layer), with_kwargs=True
        )
        for layer in range(num_layers)
    ]
    device = next(original.parameters()).device
    try:
        for ids in sequences:
            original.base_model(input_ids=ids[None].to(device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return [n / d if d > 0 else 0.0 for n, d in zip(num, den, strict=True)]


def _retargeted_hint(model_type: str, retarget: Retarget, config: dict) -> str:
    """What to do instead of probing a family that converts by an exact rewrite into another class."""
    heads = AttentionGeometry.from_config(config).num_heads
    head = (
        f"gqakit probe measures the families it converts directly; {model_type} converts by an exact "
        f"rewrite into {retarget.target}."
    )
    if retarget.any_groups:
        return (
            f"{head} Rewrite it first (`gqakit convert SRC SRC-{retarget.target} --groups {heads}`: the same "
            f"logits) and probe that."
        )
    return (
        f"{head} {retarget.target} holds only G = 1 or {heads}: compare `gqakit convert SRC OUT --groups 1 "
        "--method mean` and `--method calibrated` with `gqakit eval OUT --baseline SRC`."
    )


def probe_checkpoint(src: str | Path, out_dir: str | Path | None, options: ProbeOptions) -> ProbeResult:
    """Measure every combination of ``options`` on ``src``; write the table, JSON and plot to ``out_dir``."""
    options.validate()
    with resolve_checkpoint(src) as ckpt:
        retarget = family_of(ckpt.model_type).retarget
        if retarget is not None:
            raise GqakitError(_retargeted_hint(ckpt.model_type, retarget, ckpt.config))
        adapter = get_adapter(ckpt.model_type)
        geom = AttentionGeometry.from_config(ckpt.config)
        for g in options.groups:
            check_groups(geom, g)
        tokenizer = load_tokenizer(ckpt.path)
        eval_texts = load_texts(
            Path(options.eval_data).expanduser(), options.text_field, option="--eval-data"
        )
        error_ids = calibration_ids(
            tokenizer, eval_texts, options.error_tokens, options.seq_len, source="--eval-data"
        )
        original = load_model_for_calibration(ckpt.path, options.device)

        def ppl(model) -> float:
            res = perplexity(
                model,
                tokenizer,
                eval_texts,
                seq_len=options.seq_len,
                batch_size=options.batch_size,
                max_tokens=options.eval_tokens,
                progress=False,
            )
            return float(res.ppl)

        t0 = time.perf_counter()
        base_ppl = ppl(original)
        rows = [ProbeRow(None, "original", "", base_ppl, 1.0, seconds=time.perf_counter() - t0)]
        log.info("original: perplexity %.2f", base_ppl)
        stats = None
        if options.calib_data:
            stats = calibrate(ckpt, adapter, geom, options.calib_data, options.calib_tokens, model=original)
        for g, method, grouping in options.combinations():
            t0 = time.perf_counter()
            conv_opts = ConvertOptions(
                groups=g,
                method=method,
                grouping=grouping,
                calib_data=options.calib_data,
                calib_tokens=options.calib_tokens,
                device=options.device,
            )
            spec = RegroupSpec(
                target=g,
                method=method if METHODS[method].pool or METHODS[method].fresh else "mean",
                std=float(ckpt.config.get("initializer_range", 0.02)),
            )
            record: dict[str, Any] = {"command": "probe", "groups": g, "method": method, "dtype": "keep"}
            if conv_opts.merged:
                plan, merge_record = plan_with_merges(ckpt, adapter, geom, spec, conv_opts, stats=stats)
                record.update(merge_record)
            else:
                plan = plan_regroup(ckpt.tensor_infos(), adapter, geom, spec)
                if stats is not None and method in MERGE_METHODS:  # the same error measure, for the table
                    merges, _ = fit_layer_merges(ckpt, adapter, geom, stats, g, method, grouping)
                    record["reconstruction_error"] = [
                        {"key": m.key_error, "value": m.value_error} for m in merges
                    ]
            with tempfile.TemporaryDirectory(prefix="gqakit-probe-") as tmp:
                write_converted(ckpt, Path(tmp) / "m", plan, geom, g, None, False, record, t0)
                converted = load_model_for_calibration(Path(tmp) / "m", options.device)
            errs = attention_errors(original, converted, adapter, geom.num_layers, error_ids)
            p = ppl(converted)
            del converted
            recon = record.get("reconstruction_error") or []
            key_err = sum(e["key"] for e in recon) / len(recon) if recon else None
            val_err = sum(e["value"] for e in recon) / len(recon) if recon else None
            rows.append(
                ProbeRow(
                    g, method, grouping, p, p / base_ppl, errs, key_err, val_err, time.perf_counter() - t0
                )
            )
            log.info("G=%d %s %s: perplexity %.2f", g, method, grouping, p)
        settings = {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(options).items()}
        result = ProbeResult(ckpt.origin, geom.num_heads, geom.num_kv_heads, rows, settings)
    if out_dir is not None:
        write_probe(result, Path(out_dir))
    return result


__all__ = ["attention_errors", "probe_checkpoint"]

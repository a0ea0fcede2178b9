"""Calibrated conversion one decoder layer at a time, the path of ``--method calibrated`` and
``--refine-steps``: calibrate, fit, refine and write each layer in turn, carrying only the hidden states
(docs/convert.md, "Scale: one decoder layer in memory"). Each layer sees the original model's hidden
states (the converted model's measured worse); the ``layer-corrective`` target carries those beside the
original's, to aim each block at the original's result.
"""

from __future__ import annotations

import copy
import re
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from gqakit.checkpoint import Checkpoint
from gqakit.console import progress as progress_bar
from gqakit.convert.calibrate import CALIB_BATCH, batch_gram, batches, calibration_record
from gqakit.convert.decoder_stream import DecoderStream
from gqakit.convert.layerwise_resume import LayerwiseResume
from gqakit.convert.merge_fit import KEY_FALLBACK, MERGE_OBJECTIVE, fit_one_layer, merged_layer
from gqakit.convert.options import ConvertOptions
from gqakit.convert.plan import OutputTensor, RegroupSpec, execute, plan_regroup
from gqakit.convert.refine import (
    REFINE_TARGETS,
    fit_block,
    layer_output,
    refine_record,
    split_batches,
    to_float,
    token_weights,
)
from gqakit.convert.stream import PlanWriter
from gqakit.dtypes import torch_dtype
from gqakit.families import rotary_dims
from gqakit.family_parts import ArchAdapter, Role
from gqakit.geometry import AttentionGeometry
from gqakit.models import release_memory, resolve_device


def write_layerwise(
    ckpt: Checkpoint,
    adapter: ArchAdapter,
    geom: AttentionGeometry,
    spec: RegroupSpec,
    options: ConvertOptions,
    sequences: list[torch.Tensor],
    record: dict[str, Any],
    kv_config: dict[str, Any],
    out_dir: Path,
    resume: LayerwiseResume,
    progress: bool = True,
) -> list[str]:
    """Convert layer by layer into ``out_dir`` (see the module docstring); add what was measured to
    ``record`` and return the shard names.

    Each finished layer is saved in ``resume``, and the layers a killed run of the same conversion
    finished are written from there instead of being converted again. Progress is one bar
    in layers, its ETA the mean time per layer of this run (the first layer includes loading); none
    when ``progress`` is False.
    """
    start = time.perf_counter()
    first = resume.done
    desc = f"convert -> G={options.groups}"
    with ckpt.reader() as reader:
        job = _LayerwiseJob(ckpt, reader, adapter, geom, spec, options, sequences, kv_config)
        writer = PlanWriter(ckpt, job.plan, out_dir, reader, desc, progress=False)
        bar = progress_bar(
            desc=desc, total=geom.num_layers, enabled=progress, unit="layer", leave=True, initial=first,
            smoothing=0,
        )  # fmt: skip
        try:
            if first:
                bar.write(f"resuming at layer {first}: layers 0-{first - 1} were finished by an earlier run")
                job.resume_from(resume.hidden())
            for i in range(geom.num_layers):
                if i < first:  # finished by an earlier run: its computed tensors and measurements
                    values, info = resume.layer(i)
                    job.stream.release(i)
                else:
                    values, info = job.convert_layer(i)
                job.measured.append(info)
                for out in job.per_layer[i]:
                    writer.write(out, values.get(out.name))
                if i >= first:
                    resume.save(i, values, info, job.carried)
                    bar.update(1)
            for out in job.rest:
                writer.write(out)
            files = writer.close()
        except BaseException:
            writer.abort()
            raise
        finally:
            bar.close()
    record.update(job.record(time.perf_counter() - start))
    return files


class _LayerwiseJob:
    """The state carried from one decoder layer to the next, and the conversion of one layer."""

    def __init__(
        self, ckpt, reader, adapter, geom, spec, options: ConvertOptions, sequences, kv_config
    ) -> None:
        self.reader, self.adapter, self.geom, self.spec, self.options = reader, adapter, geom, spec, options
        self.infos = ckpt.tensor_infos()
        self.sequences = sequences
        self.device = resolve_device(options.device)
        self.refine = bool(options.refine_steps)
        self.fit_runs, self.check_runs = list(batches(sequences, CALIB_BATCH)), []
        if self.refine:
            self.fit_runs, self.check_runs = split_batches(sequences)
        # what the blocks are fitted to (None without refinement); a corrective target fits each block in
        # its decoder layer, on the converted model's hidden states (see RefineTarget)
        self.target = REFINE_TARGETS[options.refine_target] if self.refine else None
        self.corrective = self.target is not None and self.target.corrective
        # a merged layer overrides the mean-pooling plan, whose names, shapes and dtypes every merge keeps
        base = replace(spec, method="mean") if options.merged else spec
        self.plan = plan_regroup(self.infos, adapter, geom, base)
        self.stream = DecoderStream(ckpt, reader, adapter, self.fit_runs + self.check_runs, self.device)
        self.conv_config = copy.deepcopy(self.stream.model.config)
        for key, value in kv_config.items():  # the converted blocks' G, as the output config states it
            setattr(self.conv_config, key, value)
        # rotary channels per head (none with learned positions)
        self.rdim = rotary_dims(ckpt.config, geom.head_dim) if adapter.rotary else 0
        self.per_layer: list[list[OutputTensor]] = [[] for _ in range(geom.num_layers)]
        self.rest: list[OutputTensor] = []
        in_layer = re.compile(rf"{re.escape(self.stream.layers_path)}\.(\d+)\.")  # model.layers.7.mlp...
        for out in self.plan:
            found = in_layer.match(out.name)
            (self.per_layer[int(found.group(1))] if found else self.rest).append(out)
        # the hidden states the next layer reads: the original's, then (corrective) the converted model's
        self.carried = list(self.stream.hidden) * (2 if self.corrective else 1)
        # per finished layer, what was measured on it (merge, refinement, seconds), as a resumed run reads it
        self.measured: list[dict[str, Any]] = []

    def resume_from(self, states: list[torch.Tensor]) -> None:
        """Carry on from the hidden states a resumed run saved (on the CPU; the layers run on the device)."""
        self.carried = [s.to(self.device) for s in states]

    def _capture(self, module: torch.nn.Module, i: int, gram: bool, hidden: list[torch.Tensor]):
        """Run the loaded layer ``i`` on ``hidden``; return the second moment of its K/V projection input
        (when ``gram``), its block's float32 ``(args, kwargs, output)`` per batch (when refining; the block
        is the attention, or for a corrective target the whole layer), and the layer's outputs."""
        grams: list[torch.Tensor] = []  # the running sum: one (hidden + 1)^2 matrix, whatever the tokens
        io: list[tuple] = []

        def add_gram(_module, args) -> None:
            grams[:] = [batch_gram(args[0]) + (grams[0] if grams else 0)]

        def add_io(_module, args, kwargs, output) -> None:
            kwargs = {k: v for k, v in kwargs.items() if k != "past_key_values"}
            io.append((to_float(args), to_float(kwargs), layer_output(output).float()))

        key = self.adapter.key_input(i)[len(self.stream.layer_prefix(i)) :]
        handles = [module.get_submodule(key).register_forward_pre_hook(add_gram)] if gram else []
        if self.refine:
            block = module.get_submodule("" if self.corrective else self.stream.attention_name)
            handles.append(block.register_forward_hook(add_io, with_kwargs=True))
        try:
            outputs = self.stream.run(i, module, hidden)
            return (grams[0] if grams else None), io, outputs
        finally:
            for h in handles:
                h.remove()

    def convert_layer(self, i: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Calibrate, fit and refine decoder layer ``i``: its computed tensors by name (the others are as
        planned), and what was measured on it.

        The layer's weights are held only while it runs: merge fitting and refinement, which need memory
        of their own, run after it is freed (its unchanged tensors are copied from the shards).
        """
        t0, o = time.perf_counter(), self.options
        hidden, conv_hidden = self.carried[: len(self.stream.hidden)], self.carried[len(self.stream.hidden) :]
        layer_copy = conv_io = None
        with self.stream.layer(i) as module:
            gram, io, next_hidden = self._capture(module, i, o.merged, hidden)
            if self.corrective:  # the same block's inputs in the converted model
                conv_io = self._capture(module, i, False, conv_hidden)[1]
                layer_copy = copy.deepcopy(module).float().requires_grad_(False)
        release_memory(self.device)
        info: dict[str, Any] = {"merge": None, "key_merge": o.method, "refine": None}
        planned = {out.name: out for out in self.per_layer[i]}
        values: dict[str, torch.Tensor] = {}
        if o.merged:
            lm, info["key_merge"] = fit_one_layer(
                self.reader.read, self.infos, self.adapter, self.geom, i, gram, o.groups, self.rdim
            )
            info["merge"] = {"layer": i, "key": round(lm.key_error, 6), "value": round(lm.value_error, 6)}
            merged = merged_layer(self.infos, self.adapter, self.geom, self.spec, i, lm)
            planned.update(merged)
            # the merged tensors, computed once: written, and kept for a resumed run
            values = {name: execute(out, self.reader.read) for name, out in merged.items()}
        if self.refine:
            path = f"{self.stream.layer_prefix(i)}{self.stream.attention_name}"
            block = self._planned_block(i, path, planned)
            pairs, n = io, len(self.fit_runs)
            if conv_io is not None:  # the converted model's inputs, aimed at the original layer's output
                pairs = [(a, k, t) for (a, k, _), (_, _, t) in zip(conv_io, pairs, strict=True)]
            del io, conv_io
            run = block
            if layer_copy is not None:  # the converted block inside a copy of the original layer
                layer_copy.set_submodule(self.stream.attention_name, block)
                run = layer_copy
            # the per-token loss weighs each token by the residual state it lands in: a whole layer's
            # output is that state (the per-token target is the corrective, whole-layer one)
            per_token = self.target.loss == "per-token"  # type: ignore[union-attr]
            weights = [token_weights(t) for _, _, t in pairs] if per_token else None
            qk = qk_parameters(self.adapter, i, path, block)
            rates = {"steps": o.refine_steps, "lr": o.refine_lr, "qk_lr": o.refine_qk_lr, "seed": o.seed}
            fitted = fit_block(
                run, pairs[:n], pairs[n:], **rates, trained=block, qk_params=qk, weights=weights
            )
            info["refine"] = {"layer": i, **fitted}
            del pairs
            for name, p in block.named_parameters():
                dtype = torch_dtype(planned[f"{path}.{name}"].dtype)  # _planned_block checked every name
                values[f"{path}.{name}"] = p.detach().to("cpu", dtype).contiguous()
            if self.corrective:  # the converted layer's outputs: the next layer's inputs
                outs_conv = self.stream.run(i, layer_copy, [h.float() for h in conv_hidden], to_float)
                conv_hidden = [h.to(self.stream.dtype) for h in outs_conv]
            del block, run, layer_copy
        self.carried = next_hidden + conv_hidden
        self.stream.release(i)
        release_memory(self.device)
        return values, {**info, "seconds": round(time.perf_counter() - t0, 3)}

    def _planned_block(self, i: int, path: str, planned: dict[str, OutputTensor]) -> torch.nn.Module:
        """The converted attention block of layer ``i`` (at ``path``) in float32, with the planned (merged)
        weights: a fresh module of the original's class, built for the converted config."""
        original = type(self.stream.layers[i].get_submodule(self.stream.attention_name))
        block = original(self.conv_config, layer_idx=i).to(device=self.device, dtype=torch.float32).eval()
        with torch.no_grad():
            for n, p in block.named_parameters():
                if f"{path}.{n}" not in planned:
                    raise RuntimeError(f"layer-wise conversion: no planned tensor for {path}.{n}")
                p.copy_(execute(planned[f"{path}.{n}"], self.reader.read).to(p.dtype))
        return block

    def record(self, elapsed_s: float) -> dict[str, Any]:
        """What the conversion measured, for gqakit.json."""
        o, rec = self.options, {}
        if o.merged:
            calib = calibration_record(o.calib_data, o.calib_tokens, self.sequences, str(self.device))  # type: ignore[arg-type]
            calib["elapsed_s"] = round(elapsed_s, 3)
            # the keys' treatment: the method's, unless some layer normalized its keys per head
            keys = next((m["key_merge"] for m in self.measured if m["key_merge"] == KEY_FALLBACK), o.method)
            rec = {"key_merge": keys, "merge_objective": MERGE_OBJECTIVE, "calibration": calib}
            rec["reconstruction_error"] = [m["merge"] for m in self.measured]
        if self.refine:
            tokens = sum(b.numel() for b in self.fit_runs), sum(b.numel() for b in self.check_runs)
            rec["refine"] = refine_record(o, *tokens, [m["refine"] for m in self.measured], elapsed_s)
        rec["layerwise"] = {
            "device": str(self.device),
            "seconds_per_layer": [m["seconds"] for m in self.measured],
        }
        if self.device.type == "cuda":
            rec["layerwise"]["peak_device_bytes"] = torch.cuda.max_memory_allocated(self.device)
        return rec


# The query/key side that refine_qk_lr covers: the q and k projections and every norm on them.
_QK_ROLES: tuple[Role, ...] = ("q", "k", "q_norm", "k_norm", "q_norm_flat", "k_norm_flat")
_QK_ROLES += ("q_norm_per_head", "k_norm_per_head")  # one module per head: named by their container


def qk_parameters(adapter: ArchAdapter, layer: int, path: str, block: torch.nn.Module) -> list[str]:
    """The names, in ``block`` (the attention module at ``path``), of the query/key-side parameters:
    the q and k projections and their norms (none for a fused qkv projection)."""
    templates = [t for t in (getattr(adapter, role) for role in _QK_ROLES) if t is not None]
    # a per-head norm's "...k_layernorm.norms.{head}" (stablelm) -> the container "...k_layernorm.norms"
    found = [t.split(".{head}", 1)[0].format(layer=layer) for t in templates]
    mods = [m[len(path) + 1 :] for m in found if m.startswith(path + ".")]
    return [n for n, _ in block.named_parameters() if any(n.startswith(m + ".") for m in mods)]


__all__ = ["qk_parameters", "write_layerwise"]

"""Calibrated conversion one decoder layer at a time: the path of ``--method calibrated``,
``--grouping similarity`` and ``--refine-steps``.

For each decoder layer, in order: load its weights from the shards (:class:`DecoderStream`), run the
calibration tokens' hidden states through it, capturing the second moment of its K/V projection input
and, when refining, its attention block's inputs and outputs; fit the layer's merge
(:func:`~gqakit.convert.merge_fit.fit_one_layer`), plan its converted tensors, refine them
(:func:`~gqakit.convert.refine.fit_block`), write the whole layer into the output shards, free it. Only
the calibration tokens' hidden states are carried from one layer to the next, so peak memory is about
one decoder layer (plus the embedding and those hidden states) whatever the depth, on the CPU or with
each layer on the GPU in turn.

Each layer sees the original model's hidden states, so it is fitted to the inputs it had before
conversion; over the calibrated merge this gave exactly the statistics, merges and tensors of calibrating
the whole model at once (gqakit 0.2.0, bit for bit: docs/convert.md). Feeding each layer the hidden
states of the model converted so far instead, with the original layer's result on them as the target, as
GPTQ-style quantizers do, was measured worse on SmolLM2-135M -> MQA (zero-shot test perplexity 110.7
calibrated and 36.0 refined, against 91.9 and 30.9; CHANGELOG). The ``layer-corrective`` refinement
target (:data:`~gqakit.convert.refine.REFINE_TARGETS`) carries the converted model's hidden states beside
the original's, and fits each block on them to the original's result on the original's states.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gqakit.checkpoint import Checkpoint
from gqakit.console import progress as progress_bar
from gqakit.convert.calibrate import CALIB_BATCH, batch_gram, batches, calibration_record
from gqakit.convert.decoder_stream import DecoderStream
from gqakit.convert.layerwise_resume import LayerwiseResume
from gqakit.convert.merge_fit import (
    KEY_FALLBACK,
    base_plan,
    fit_one_layer,
    merge_record,
    merged_layer,
    rotary_channels,
)
from gqakit.convert.options import ConvertOptions
from gqakit.convert.plan import OutputTensor, RegroupSpec, execute, plan_regroup
from gqakit.convert.refine import (
    REFINE_TARGETS,
    RefineSettings,
    fit_block,
    layer_output,
    refine_record,
    split_batches,
    to_float,
    token_weights,
)
from gqakit.convert.stream import PlanWriter
from gqakit.dtypes import torch_dtype
from gqakit.family_parts import ArchAdapter, Role
from gqakit.geometry import AttentionGeometry
from gqakit.models import release_memory, resolve_device


class LayerCapture:
    """Forward hooks on one layer for one pass: the K/V projection input's second moment, and the
    attention block's float32 ``(args, kwargs, output)`` per batch."""

    def __init__(self, module: torch.nn.Module, key: str, attention: str, gram: bool, io: bool) -> None:
        self.gram: torch.Tensor | None = None
        self.io: list[tuple] = []
        self._handles = []
        if gram:
            self._handles.append(module.get_submodule(key).register_forward_pre_hook(self._gram))
        if io:
            hook = module.get_submodule(attention).register_forward_hook(self._io, with_kwargs=True)
            self._handles.append(hook)

    def _gram(self, _module, args) -> None:
        g = batch_gram(args[0])
        self.gram = g if self.gram is None else self.gram + g

    def _io(self, _module, args, kwargs, output) -> None:
        kwargs = {k: v for k, v in kwargs.items() if k != "past_key_values"}
        self.io.append((to_float(args), to_float(kwargs), layer_output(output).float()))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def layer_of(name: str, prefix: str) -> int | None:
    """The decoder layer a tensor belongs to (``model.layers.7.mlp...`` -> 7), or None."""
    if not name.startswith(prefix):
        return None
    head = name[len(prefix) :].split(".", 1)[0]
    return int(head) if head.isdigit() else None


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
    resume: LayerwiseResume | None = None,
    progress: bool = True,
) -> list[str]:
    """Convert layer by layer into ``out_dir`` (see the module docstring); add what was measured to
    ``record`` and return the shard names.

    With ``resume``, each finished layer is saved there, and the layers a killed run of the same
    conversion finished are written from there instead of being converted again. Progress is one bar
    in layers, its ETA the mean time per layer of this run (the first layer includes loading); none
    when ``progress`` is False.
    """
    start = time.perf_counter()
    with ckpt.reader() as reader:
        job = _LayerwiseJob(ckpt, reader, adapter, geom, spec, options, sequences, kv_config)
        writer = PlanWriter(ckpt, job.plan, out_dir, reader, f"convert -> G={options.groups}", progress=False)
        first = resume.done if resume is not None else 0
        bar = progress_bar(
            desc=f"convert -> G={options.groups}", total=geom.num_layers, enabled=progress, unit="layer",
            leave=True, initial=first, smoothing=0,
        )  # fmt: skip
        if first:
            bar.write(f"resuming at layer {first}: layers 0-{first - 1} were finished by an earlier run")
        try:
            for i in range(first):
                for out, value in job.finished_layer(i, resume):  # type: ignore[arg-type]
                    writer.write(out, value)
            if first:
                job.resume_from(resume.hidden())  # type: ignore[union-attr]
            for i in range(first, geom.num_layers):
                outs = job.convert_layer(i)
                for out, value in outs:
                    writer.write(out, value)
                if resume is not None:
                    computed = {out.name: v for out, v in outs if v is not None}
                    resume.save(i, computed, job.measured[-1], job.carried)
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
        self.refine = None
        if options.refine_steps:
            self.refine = RefineSettings(
                options.refine_steps,
                options.refine_lr,
                options.seed,
                options.refine_target,
                options.refine_qk_lr,
            )
            self.fit_runs, self.check_runs = split_batches(sequences)
        else:
            self.fit_runs, self.check_runs = list(batches(sequences, CALIB_BATCH)), []
        # what the blocks are fitted to (None without refinement); a corrective target fits each block in
        # its decoder layer, on the converted model's hidden states (see RefineTarget)
        self.target = None if self.refine is None else REFINE_TARGETS[self.refine.target]
        self.corrective = self.target is not None and self.target.corrective
        planner = base_plan if options.merged else plan_regroup
        self.plan = planner(self.infos, adapter, geom, spec)
        self.stream = DecoderStream(ckpt, reader, adapter, self.fit_runs + self.check_runs, self.device)
        self.conv_config = copy.deepcopy(self.stream.model.config)
        for key, value in kv_config.items():  # the converted blocks' G, as the output config states it
            setattr(self.conv_config, key, value)
        self.rdim = rotary_channels(ckpt.config, adapter, geom.head_dim)
        self.per_layer: list[list[OutputTensor]] = [[] for _ in range(geom.num_layers)]
        self.rest: list[OutputTensor] = []
        for out in self.plan:
            i = layer_of(out.name, self.stream.layers_path + ".")
            (self.rest if i is None else self.per_layer[i]).append(out)
        # the hidden states the next layer reads: the original's, then (corrective) the converted model's
        self.carried = list(self.stream.hidden) * (2 if self.corrective else 1)
        # per finished layer, what was measured on it (merge, refinement, seconds), as a resumed run reads it
        self.measured: list[dict[str, Any]] = []

    def resume_from(self, states: list[torch.Tensor]) -> None:
        """Carry on from the hidden states a resumed run saved (on the CPU; the layers run on the device)."""
        self.carried = [s.to(self.device) for s in states]

    def _capture(self, module: torch.nn.Module, i: int, gram: bool, hidden: list[torch.Tensor]):
        """Run the loaded layer ``i`` on ``hidden`` with capture hooks; return (capture, outputs)."""
        key = self.adapter.key_input(i)[len(self.stream.layer_prefix(i)) :]
        # the block is fitted to the attention output, or to the whole layer's (its own inputs and output)
        target = "" if self.corrective else self.stream.attention_name
        cap = LayerCapture(module, key, target, gram, self.refine is not None)
        try:
            return cap, self.stream.run(i, module, hidden)
        finally:
            cap.remove()

    def convert_layer(self, i: int) -> list[tuple[OutputTensor, torch.Tensor | None]]:
        """Calibrate, fit and refine decoder layer ``i``; return its output tensors with their computed
        values (None: from the plan).

        The layer's weights are held only while it runs: merge fitting and refinement, which need memory
        of their own, run after it is freed (its unchanged tensors are copied from the shards).
        """
        t0 = time.perf_counter()
        n = len(self.carried) // 2 if self.corrective else len(self.carried)
        hidden, conv_hidden = self.carried[:n], self.carried[n:]
        layer_copy = None
        conv_io = None
        with self.stream.layer(i) as module:
            capture, next_hidden = self._capture(module, i, self.options.merged, hidden)
            if self.corrective:  # the same block's inputs in the converted model
                conv_io = self._capture(module, i, False, conv_hidden)[0].io
                layer_copy = copy.deepcopy(module).float().requires_grad_(False)
        release_memory(self.device)
        info: dict[str, Any] = {"merge": None, "key_merge": self.options.method, "refine": None}
        outs = self._merged_outputs(i, capture.gram, info)
        base = {id(o) for o in self.per_layer[i]}
        # the merged tensors, computed once: written, and kept for a resumed run
        values = {o.name: execute(o, self.reader.read) for o in outs if id(o) not in base}
        if self.refine is not None:
            path = f"{self.stream.layer_prefix(i)}{self.stream.attention_name}"
            attn = self.stream.layers[i].get_submodule(self.stream.attention_name)
            block = planned_block(attn, self.conv_config, i, self.device, path, outs, self.reader.read)
            pairs, n = capture.io, len(self.fit_runs)
            if conv_io is not None:  # the converted model's inputs, aimed at the original layer's output
                pairs = [(a, k, t) for (a, k, _), (_, _, t) in zip(conv_io, pairs, strict=True)]
            del capture, conv_io
            run = block
            if layer_copy is not None:  # the converted block inside a copy of the original layer
                layer_copy.set_submodule(self.stream.attention_name, block)
                run = layer_copy
            # the per-token loss weighs each token by the residual state it lands in: a whole layer's
            # output is that state (the per-token target is the corrective, whole-layer one)
            per_token = self.target.loss == "per-token"  # type: ignore[union-attr]
            weights = [token_weights(t) for _, _, t in pairs] if per_token else None
            qk = qk_parameters(self.adapter, i, path, block)
            fitted = fit_block(run, pairs[:n], pairs[n:], self.refine, block, qk, weights)
            info["refine"] = {"layer": i, **fitted}
            del pairs
            by_name = {o.name: o for o in outs}
            for name, p in block.named_parameters():
                out = by_name.get(f"{path}.{name}")
                if out is None:
                    raise RuntimeError(f"layer-wise refinement: no output tensor for {path}.{name}")
                values[out.name] = p.detach().to("cpu", torch_dtype(out.dtype)).contiguous()
            if self.corrective:  # the converted layer's outputs: the next layer's inputs
                outs_conv = self.stream.run(i, layer_copy, [h.float() for h in conv_hidden], to_float)
                conv_hidden = [h.to(self.stream.dtype) for h in outs_conv]
            del block, run, layer_copy
        self.carried = next_hidden + conv_hidden
        self.stream.release(i)
        release_memory(self.device)
        self.measured.append({**info, "seconds": round(time.perf_counter() - t0, 3)})
        return [(out, values.get(out.name)) for out in outs]

    def finished_layer(
        self, i: int, resume: LayerwiseResume
    ) -> list[tuple[OutputTensor, torch.Tensor | None]]:
        """Layer ``i`` as an earlier run converted it: its computed tensors from ``resume``, the rest as
        planned; its measurements join this run's records."""
        values, info = resume.layer(i)
        self.measured.append(info)
        self.stream.release(i)
        return [(out, values.get(out.name)) for out in self.per_layer[i]]

    def _merged_outputs(self, i: int, gram: torch.Tensor | None, info: dict[str, Any]) -> list[OutputTensor]:
        """Layer ``i``'s planned output tensors, its attention merged when the conversion merges (what
        was measured goes into ``info``)."""
        overrides: dict[str, OutputTensor] = {}
        if self.options.merged:
            lm, info["key_merge"] = fit_one_layer(
                self.reader.read, self.infos, self.adapter, self.geom, i, gram,
                self.options.groups, self.options.method, self.options.grouping, self.rdim,
            )  # fmt: skip
            overrides = merged_layer(self.infos, self.adapter, self.geom, self.spec, i, lm)
            info["merge"] = lm.report_entry(i, self.options.grouping)
        return [overrides.get(o.name, o) for o in self.per_layer[i]]

    def record(self, elapsed_s: float) -> dict[str, Any]:
        """What the conversion measured, for gqakit.json."""
        o, rec = self.options, {}
        if o.merged:
            calib = calibration_record(o.calib_data, o.calib_tokens, self.sequences, str(self.device))  # type: ignore[arg-type]
            calib["elapsed_s"] = round(elapsed_s, 3)
            # the keys' treatment: the method's, unless some layer normalized its keys per head
            keys = next((m["key_merge"] for m in self.measured if m["key_merge"] == KEY_FALLBACK), o.method)
            rec = merge_record(o.method, o.grouping, keys, calib, [m["merge"] for m in self.measured])  # type: ignore[arg-type]
        if self.refine is not None:
            tokens = sum(b.numel() for b in self.fit_runs), sum(b.numel() for b in self.check_runs)
            rec["refine"] = refine_record(
                self.refine, *tokens, [m["refine"] for m in self.measured], elapsed_s
            )
        rec["layerwise"] = {
            "device": str(self.device),
            "seconds_per_layer": [m["seconds"] for m in self.measured],
        }
        if self.device.type == "cuda":
            rec["layerwise"]["peak_device_bytes"] = torch.cuda.max_memory_allocated(self.device)
        return rec


# The query/key side that refine_qk_lr covers: the q and k projections and every norm on them.
_QK_ROLES: tuple[Role, ...] = ("q", "k", "q_norm", "k_norm", "q_norm_flat", "k_norm_flat")
# Per-head norms (stablelm): one module per head, named by the container that holds them all.
_QK_PER_HEAD_ROLES: tuple[Role, ...] = ("q_norm_per_head", "k_norm_per_head")


def qk_parameters(adapter: ArchAdapter, layer: int, path: str, block: torch.nn.Module) -> list[str]:
    """The names, in ``block`` (the attention module at ``path``), of the query/key-side parameters:
    the q and k projections and their norms (none for a fused qkv projection)."""
    found = [adapter.module(r, layer) for r in _QK_ROLES]
    for role in _QK_PER_HEAD_ROLES:
        template: str | None = getattr(adapter, role)
        if template is not None:  # "...k_layernorm.norms.{head}" -> the container "...k_layernorm.norms"
            found.append(template.split(".{head}", 1)[0].format(layer=layer))
    mods = [m[len(path) + 1 :] for m in found if m and m.startswith(path + ".")]
    return [n for n, _ in block.named_parameters() if any(n.startswith(m + ".") for m in mods)]


def planned_block(
    original: torch.nn.Module,
    config,
    layer: int,
    device: torch.device,
    path: str,
    outs: list[OutputTensor],
    read: Callable[[str], torch.Tensor],
) -> torch.nn.Module:
    """The converted attention block of ``layer`` in float32, with the planned (merged) weights: a fresh
    module of ``original``'s class, built for the converted ``config``."""
    block = type(original)(config, layer_idx=layer).to(device=device, dtype=torch.float32).eval()
    by_name = {o.name: o for o in outs}
    with torch.no_grad():
        for n, p in block.named_parameters():
            full = f"{path}.{n}"
            if full not in by_name:
                raise RuntimeError(f"layer-wise conversion: no planned tensor for {full}")
            p.copy_(execute(by_name[full], read).to(p.dtype))
    return block


__all__ = ["LayerCapture", "layer_of", "planned_block", "qk_parameters", "write_layerwise"]

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
conversion; over the calibrated merge this gives exactly the statistics, merges and tensors of
calibrating the whole model at once (tested). Feeding each layer the hidden states of the model
converted so far instead, with the original layer's result on them as the target, as GPTQ-style
quantizers do, was measured worse on SmolLM2-135M -> MQA (zero-shot test perplexity 110.7 calibrated and
36.0 refined, against 91.9 and 30.9; CHANGELOG). The corrective refinement targets
(:data:`~gqakit.convert.refine_names.REFINE_TARGETS`) carry the converted model's hidden states beside the
original's, and fit each block on them to the original's result on the original's states. The window
targets also load the next decoder layer (a second layer's weights, read twice from the shards) and fit
each block through it.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from gqakit.checkpoint import Checkpoint
from gqakit.convert.calibrate import CALIB_BATCH, batch_gram, batches, calibration_record, key_module
from gqakit.convert.decoder_stream import DecoderStream
from gqakit.convert.layerwise_blocks import Window, planned_block, qk_parameters
from gqakit.convert.layerwise_resume import LayerwiseResume
from gqakit.convert.merge_fit import KEY_FALLBACK, MergeReport, fit_one_layer, rotary_dim
from gqakit.convert.merge_plan import base_plan, merged_layer
from gqakit.convert.options import ConvertOptions
from gqakit.convert.plan import OutputTensor, RegroupSpec, execute, plan_regroup
from gqakit.convert.refine import (
    RefineReport,
    RefineSettings,
    fit_block,
    layer_output,
    split_batches,
    to_float,
    token_weights,
)
from gqakit.convert.refine_names import REFINE_LOSSES, REFINE_TARGETS
from gqakit.convert.registry import ArchAdapter
from gqakit.convert.stream import PlanWriter
from gqakit.geometry import AttentionGeometry
from gqakit.memory import release_memory
from gqakit.models import resolve_device
from gqakit.safetensors_io import DTYPES


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
        job = _LayerwiseJob(ckpt, reader, adapter, geom, spec, options, sequences)
        writer = PlanWriter(ckpt, job.plan, out_dir, reader, f"convert -> G={options.groups}", progress=False)
        first = resume.done if resume is not None else 0
        bar = tqdm(
            total=geom.num_layers, initial=first, desc=f"convert -> G={options.groups}", unit="layer",
            smoothing=0, dynamic_ncols=True, disable=not progress,
        )  # fmt: skip
        if first:
            bar.write(f"resuming at layer {first}: layers 0-{first - 1} were finished by an earlier run")
        try:
            for i in range(first):
                for out, value in job.finished_layer(i, resume):  # type: ignore[arg-type]
                    writer.write(out, value)
            if first:
                job.carried = resume.hidden()  # type: ignore[union-attr]
            for i in range(first, geom.num_layers):
                outs = job.convert_layer(i)
                for out, value in outs:
                    writer.write(out, value)
                if resume is not None:
                    computed = {out.name: v for out, v in outs if v is not None}
                    resume.save(i, computed, job.layer_info(i), job.carried)
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

    def __init__(self, ckpt, reader, adapter, geom, spec, options: ConvertOptions, sequences) -> None:
        self.reader, self.adapter, self.geom, self.spec, self.options = reader, adapter, geom, spec, options
        self.infos = ckpt.tensor_infos()
        self.sequences = sequences
        self.device = resolve_device(options.device)
        self.needs_gram = options.merged
        self.refine = None
        if options.refine_steps:
            self.refine = RefineSettings(
                options.refine_steps,
                options.refine_lr,
                options.seed,
                options.refine_target,
                options.refine_qk_lr,
                options.refine_schedule,
                options.refine_loss_used,
            )
            self.fit_runs, check_runs = split_batches(sequences)
        else:
            self.fit_runs, check_runs = list(batches(sequences, CALIB_BATCH)), []
        planner = base_plan if options.merged else plan_regroup
        self.plan = planner(self.infos, adapter, geom, spec)
        self.stream = DecoderStream(ckpt, reader, adapter, self.fit_runs + check_runs, self.device)
        self.conv_config = copy.deepcopy(self.stream.model.config)
        self.conv_config.num_key_value_heads = options.groups
        self.rdim = rotary_dim(ckpt.config, adapter, geom.head_dim)
        self.per_layer: list[list[OutputTensor]] = [[] for _ in range(geom.num_layers)]
        self.rest: list[OutputTensor] = []
        for out in self.plan:
            i = layer_of(out.name, self.stream.layers_path + ".")
            (self.rest if i is None else self.per_layer[i]).append(out)
        self.hidden = self.stream.hidden
        # the hidden states of the model converted so far, when the blocks read them (see RefineTarget)
        self.conv_hidden: list[torch.Tensor] | None = list(self.hidden) if self._converted_inputs else None
        self.merges = MergeReport(options.method, options.grouping, options.method, None)
        self.refined = None
        if self.refine is not None:
            tokens = sum(b.numel() for b in self.fit_runs), sum(b.numel() for b in check_runs)
            self.refined = RefineReport(self.refine, *tokens)
        self.seconds: list[float] = []

    @property
    def _whole_layer(self) -> bool:
        """Whether refinement fits the whole decoder layer's output (not the attention block's)."""
        return self.refine is not None and REFINE_TARGETS[self.refine.target].whole_layer

    @property
    def _converted_inputs(self) -> bool:
        """Whether the blocks read the converted model's hidden states (not the original's)."""
        return self.refine is not None and REFINE_TARGETS[self.refine.target].converted_inputs

    @property
    def _window(self) -> bool:
        """Whether each block is fitted through the next decoder layer too (see RefineTarget.window)."""
        return self.refine is not None and REFINE_TARGETS[self.refine.target].window

    def _window_next(self, i: int, hidden: list[torch.Tensor]) -> tuple[torch.nn.Module, list, list] | None:
        """For fitting layer ``i`` through layer ``i + 1``: a float32 copy of the original layer ``i + 1``,
        its call arguments per batch, and its outputs on ``hidden`` (the original's states after layer
        ``i``): the window's targets. None for the last layer."""
        if i + 1 >= self.geom.num_layers:
            return None
        with self.stream.layer(i + 1) as module:
            targets = [h.float() for h in self.stream.run(i + 1, module, hidden)]
            nxt = copy.deepcopy(module).float().requires_grad_(False)
        return nxt, [to_float(c) for c in self.stream.calls[i + 1]], targets

    @property
    def carried(self) -> list[torch.Tensor]:
        """The hidden states the next layer reads: the original's, then the converted model's if kept."""
        return self.hidden + (self.conv_hidden or [])

    @carried.setter
    def carried(self, states: list[torch.Tensor]) -> None:
        # a resumed run's states come back from LayerwiseResume on the CPU; the layers run on self.device
        states = [s.to(self.device) for s in states]
        n = len(states) // 2 if self._converted_inputs else len(states)
        self.hidden = states[:n]
        if self._converted_inputs:
            self.conv_hidden = states[n:]

    def _capture(self, module: torch.nn.Module, i: int, gram: bool, hidden: list[torch.Tensor]):
        """Run the loaded layer ``i`` on ``hidden`` with capture hooks; return (capture, outputs)."""
        key = key_module(self.adapter, i)[len(self.stream.layer_prefix(i)) :]
        # the block is fitted to the attention output, or to the whole layer's (its own inputs and output)
        target = "" if self._whole_layer else self.stream.attention_name
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
        layer_copy = None
        conv_io = None
        with self.stream.layer(i) as module:
            capture, next_hidden = self._capture(module, i, self.needs_gram, self.hidden)
            if self.conv_hidden is not None:  # the same block's inputs in the converted model
                conv_io = self._capture(module, i, False, self.conv_hidden)[0].io
            if self._whole_layer or self.conv_hidden is not None:
                layer_copy = copy.deepcopy(module).float().requires_grad_(False)
        window = self._window_next(i, next_hidden) if self._window else None
        release_memory(self.device)
        outs = self._merged_outputs(i, capture.gram)
        base = {id(o) for o in self.per_layer[i]}
        # the merged tensors, computed once: written, and kept for a resumed run
        values = {o.name: execute(o, self.reader.read) for o in outs if id(o) not in base}
        if self.refine is not None:
            path = f"{self.stream.layer_prefix(i)}{self.stream.attention_name}"
            attn = self.stream.layers[i].get_submodule(self.stream.attention_name)
            block = planned_block(attn, self.conv_config, i, self.device, path, outs, self.reader.read)
            pairs, n = capture.io, len(self.fit_runs)
            if conv_io is not None:
                pairs = self._corrective_pairs(conv_io, pairs)
            del capture, conv_io
            run, trained, prefix = block, block, f"{path}."
            qk = qk_parameters(self.adapter, i, path, block)
            if layer_copy is not None:  # the converted block inside a copy of the original layer
                layer_copy.set_submodule(self.stream.attention_name, block)
            if window is not None:  # through the next layer too, to the original's output after it
                run = Window(layer_copy, window[0], self.stream.positional)
                pairs = [
                    ((a, k, *call), {}, t) for (a, k, _), call, t in zip(pairs, *window[1:], strict=True)
                ]
            elif self._whole_layer:
                run = layer_copy
                if REFINE_TARGETS[self.refine.target].moves_layer:
                    trained, prefix = layer_copy, self.stream.layer_prefix(i)
                    qk = [f"{self.stream.attention_name}.{q}" for q in qk]
            weights = self._token_weights(pairs)
            fitted = fit_block(run, pairs[:n], pairs[n:], self.refine, trained, qk, weights)
            self.refined.layers.append({"layer": i, **fitted})  # type: ignore[union-attr]
            del pairs
            by_name = {o.name: o for o in outs}
            for name, p in trained.named_parameters():
                out = by_name.get(f"{prefix}{name}")
                if out is None:
                    raise RuntimeError(f"layer-wise refinement: no output tensor for {prefix}{name}")
                values[out.name] = p.detach().to("cpu", DTYPES[out.dtype]).contiguous()
            if self.conv_hidden is not None:  # the converted layer's outputs: the next layer's inputs
                outs_conv = self.stream.run(i, layer_copy, [h.float() for h in self.conv_hidden], to_float)
                self.conv_hidden = [h.to(self.stream.dtype) for h in outs_conv]
            del block, run, layer_copy, window
        self.hidden = next_hidden
        self.stream.release(i)
        release_memory(self.device)
        self.seconds.append(round(time.perf_counter() - t0, 3))
        return [(out, values.get(out.name)) for out in outs]

    def _token_weights(self, pairs: list[tuple]) -> list[torch.Tensor] | None:
        """Per batch, the ``per-token`` loss's weights (see REFINE_LOSSES): from the residual state each
        target token lands in: a whole layer's output is that state; an attention output lands in the
        block's input state plus itself. None under the ``relative`` loss."""
        if not REFINE_LOSSES[self.refine.loss].per_token:  # type: ignore[union-attr]
            return None
        if self._whole_layer:
            return [token_weights(t) for _, _, t in pairs]
        states = self.conv_hidden if self.conv_hidden is not None else self.hidden
        return [token_weights(s.float() + t) for s, (_, _, t) in zip(states, pairs, strict=True)]

    def _corrective_pairs(self, conv_io: list[tuple], orig_io: list[tuple]) -> list[tuple]:
        """Refinement batches that read the converted model's inputs and aim at the original's result.

        A whole layer is aimed at the original layer's output. An attention block is aimed at the
        original's state after its residual add, less the converted layer's input: the original block's
        output plus the drift ``h - h'`` between the two models' inputs, so that ``h' + block(h')`` lands
        where ``h + attention(h)`` did.
        """
        pairs = []
        for b, ((args, kwargs, _), (_, _, target)) in enumerate(zip(conv_io, orig_io, strict=True)):
            if not self._whole_layer:
                target = target + (self.hidden[b].float() - self.conv_hidden[b].float())  # type: ignore[index]
            pairs.append((args, kwargs, target))
        return pairs

    def layer_info(self, i: int) -> dict[str, Any]:
        """What was measured on layer ``i`` (just converted), as a resumed run needs it back."""
        return {
            "merge": self.merges.layers[-1] if self.options.merged else None,
            "key_merge": self.merges.key_merge,
            "refine": self.refined.layers[-1] if self.refined is not None else None,
            "seconds": self.seconds[-1],
        }

    def finished_layer(
        self, i: int, resume: LayerwiseResume
    ) -> list[tuple[OutputTensor, torch.Tensor | None]]:
        """Layer ``i`` as an earlier run converted it: its computed tensors from ``resume``, the rest as
        planned; its measurements join this run's records."""
        values, info = resume.layer(i)
        if info["merge"] is not None:
            self.merges.layers.append(info["merge"])
            self.merges.key_merge = info["key_merge"]
        if info["refine"] is not None and self.refined is not None:
            self.refined.layers.append(info["refine"])
        self.seconds.append(info["seconds"])
        self.stream.release(i)
        return [(out, values.get(out.name)) for out in self.per_layer[i]]

    def _merged_outputs(self, i: int, gram: torch.Tensor | None) -> list[OutputTensor]:
        """Layer ``i``'s planned output tensors, its attention merged when the conversion merges."""
        overrides: dict[str, OutputTensor] = {}
        if self.options.merged:
            lm, keys = fit_one_layer(
                self.reader.read, self.infos, self.adapter, self.geom, i, gram,
                self.options.groups, self.options.method, self.options.grouping, self.rdim,
            )  # fmt: skip
            overrides = merged_layer(self.infos, self.adapter, self.geom, self.spec, i, lm)
            self.merges.layers.append(lm.report_entry(i, self.options.grouping))
            if keys == KEY_FALLBACK:
                self.merges.key_merge = keys
        return [overrides.get(o.name, o) for o in self.per_layer[i]]

    def record(self, elapsed_s: float) -> dict[str, Any]:
        """What the conversion measured, for gqakit.json."""
        rec: dict[str, Any] = {}
        if self.options.merged:
            calib = calibration_record(
                self.options.calib_data, self.options.calib_tokens, self.sequences, str(self.device)
            )  # type: ignore[arg-type]
            self.merges.calibration = {**calib, "elapsed_s": round(elapsed_s, 3)}
            rec.update(self.merges.to_record())
        if self.refined is not None:
            self.refined.elapsed_s = elapsed_s
            rec["refine"] = self.refined.to_record()
        rec["layerwise"] = {"device": str(self.device), "seconds_per_layer": self.seconds}
        if self.device.type == "cuda":
            rec["layerwise"]["peak_device_bytes"] = torch.cuda.max_memory_allocated(self.device)
        return rec


__all__ = ["LayerCapture", "layer_of", "write_layerwise"]

"""The source model run one decoder layer at a time, with one layer's weights in memory: built on the
meta device, its layers' call arguments (masks, rotary tables) recorded in one pass, then each layer
loaded and called exactly as the model would (docs/convert.md, "Scale: one decoder layer in memory").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch

from gqakit.checkpoint import Checkpoint, TensorReader
from gqakit.dtypes import config_dtype
from gqakit.errors import GqakitError
from gqakit.family_parts import ArchAdapter


class DecoderStream:
    """The source model over fixed calibration batches, one decoder layer at a time.

    Args:
        ckpt: the source checkpoint.
        reader: an open reader of it.
        adapter: the family (where its decoder layers are).
        batches: token id batches ``[batch, seq]``; every run covers all of them, in order.
        device: where layers run.
    """

    def __init__(
        self,
        ckpt: Checkpoint,
        reader: TensorReader,
        adapter: ArchAdapter,
        batches: Sequence[torch.Tensor],
        device: torch.device,
    ) -> None:
        # deferred: transformers takes seconds to import
        from accelerate import init_empty_weights
        from transformers import AutoConfig, AutoModelForCausalLM

        self.reader, self.device = reader, device
        self.infos = ckpt.tensor_infos()
        # float32 on the CPU (fast there, and exact); the checkpoint's own dtype on a GPU
        self.dtype = config_dtype(ckpt.config) if device.type == "cuda" else torch.float32
        # every parameter on the meta device and real buffers: nothing is read but the config
        with init_empty_weights(include_buffers=False):
            self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(ckpt.path))).eval()
        # "model.layers.{i}.self_attn" -> decoder layers at "model.layers", attention at "self_attn"
        layer_path, self.attention_name = adapter.attention_module(0).rsplit(".", 1)
        self.layers_path = layer_path.rsplit(".", 1)[0]
        try:
            self.layers = list(self.model.get_submodule(self.layers_path))
        except AttributeError:
            raise GqakitError(
                f"{ckpt.model_type!r}: the model has no decoder layers at {self.layers_path!r}, where "
                "gqakit's adapter for this family expects them; this transformers version builds it "
                "differently."
            ) from None
        # every parameter outside the decoder layers that the base model runs (not the LM head), and the
        # buffers (rotary tables, embedding scales) on the device
        base, layers = self.model.base_model_prefix + ".", self.layers_path + "."
        names = [
            n for n, _ in self.model.named_parameters() if n.startswith(base) and not n.startswith(layers)
        ]
        self._load(self.model, "", names, ": is the checkpoint complete?")
        for name, b in list(self.model.named_buffers()):
            if not name.startswith(layers) and b.device.type != "meta":
                owner, _, attr = name.rpartition(".")
                self.model.get_submodule(owner)._buffers[attr] = b.to(self.device)
        self.hidden: list[torch.Tensor] = []
        self.calls: list[list[tuple[tuple, dict]]] = [[] for _ in self.layers]
        self.positional = True
        self._record(batches)

    def _load(self, module: torch.nn.Module, prefix: str, names: list[str], missing: str) -> None:
        """Set ``module``'s parameters ``names`` from the shards (tensor ``prefix + name``) on the device."""
        for name in names:
            if prefix + name not in self.infos:
                raise GqakitError(f"{prefix + name} is missing from the checkpoint's shards{missing}")
            owner, _, attr = name.rpartition(".")  # get_submodule("") is the module itself
            value = self.reader.read(prefix + name).to(self.device, self.dtype)
            module.get_submodule(owner)._parameters[attr] = torch.nn.Parameter(value, requires_grad=False)

    def _recorder(self, index: int, *args: Any, **kwargs: Any) -> torch.Tensor:
        hidden = args[0] if args else kwargs["hidden_states"]
        if index == 0:
            self.positional = bool(args)
            self.hidden.append(hidden)
        rest = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        self.calls[index].append((tuple(args[1:]), rest))
        return hidden  # the next layer records the same states: only layer 0's input is kept

    @torch.no_grad()
    def _record(self, batches: Sequence[torch.Tensor]) -> None:
        for i, layer in enumerate(self.layers):
            layer.forward = partial(self._recorder, i)
        try:
            for batch in batches:
                self.model.base_model(input_ids=batch.to(self.device), use_cache=False)
        finally:
            for layer in self.layers:
                del layer.forward
        if any(len(c) != len(batches) for c in self.calls):
            raise RuntimeError("the decoder layers were not called once per calibration batch")

    def layer_prefix(self, index: int) -> str:
        """``model.layers.{index}.``: the tensor names of decoder layer ``index`` start with this."""
        return f"{self.layers_path}.{index}."

    @contextmanager
    def layer(self, index: int) -> Iterator[torch.nn.Module]:
        """Decoder layer ``index`` with its weights loaded from the shards, freed again on exit."""
        module = self.layers[index]
        names = [n for n, _ in module.named_parameters()]
        missing = (
            f" (decoder layer {index}): the checkpoint is incomplete or its index is wrong. Re-download it."
        )
        self._load(module, self.layer_prefix(index), names, missing)
        module.to(self.device)  # the layer's own buffers, if any
        try:
            yield module
        finally:
            module.to("meta")  # frees the weights

    @torch.no_grad()
    def run(
        self,
        index: int,
        module: torch.nn.Module,
        hidden: Sequence[torch.Tensor],
        cast: Callable[[Any], Any] | None = None,
    ) -> list[torch.Tensor]:
        """Call decoder layer ``index`` (``module``, loaded) on ``hidden`` (one tensor per batch) with the
        arguments the model passes it; return its outputs. ``cast`` is applied to those arguments first
        (e.g. to run a float32 copy of a layer that the stream runs in bfloat16)."""
        outs = []
        for h, (rest, kwargs) in zip(hidden, self.calls[index], strict=True):
            if cast is not None:
                rest, kwargs = cast(rest), cast(kwargs)
            out = module(h, *rest, **kwargs) if self.positional else module(*rest, hidden_states=h, **kwargs)
            outs.append(out[0] if isinstance(out, tuple) else out)
        return outs

    def release(self, index: int) -> None:
        """Drop the call arguments of a finished layer."""
        self.calls[index] = []

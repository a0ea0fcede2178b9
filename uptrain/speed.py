"""The uptraining loop's speed levers, resolved once for the device the run is on.

Four levers, each a recipe option under ``speed:`` whose ``auto`` picks what was measured fastest and
correct on that kind of device (docs/gpu.md, ``benchmarks/bench_uptrain.py``), and each falling back with
one log line where the device cannot run it:

- ``fused_loss``: the output projection and the loss in one chunked pass that never holds the
  ``[tokens, vocab]`` logits (:mod:`gqakit.uptrain.fused_loss`), for the student and, under distillation,
  the teacher's logits too;
- ``compile``: ``torch.compile`` of each decoder layer in place (one compiled graph serves every layer;
  parameter names and checkpoints are unchanged), student and teacher;
- ``kernels``: ``liger``'s fused RMSNorm, RoPE and SwiGLU Triton kernels (``pip install liger-kernel``;
  CUDA only), patched into this model instance;
- ``attention``: the scaled-dot-product attention backend (``flash``, ``efficient``, ``cudnn``,
  ``math``); ``auto`` lets PyTorch choose per call.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from gqakit.uptrain.fused_loss import LossSpec, fused_linear_loss

log = logging.getLogger("gqakit.uptrain")

ATTENTION_BACKENDS = ("auto", "flash", "efficient", "cudnn", "math")
KERNELS = ("auto", "liger", "none")
# Config fields that transform the logits after the output projection; the fused loss would skip them.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


@dataclass
class Speed:
    """The levers a run uses, after ``auto`` and the device's limits are resolved.

    Attributes:
        fused_loss: compute the objective with :func:`~gqakit.uptrain.fused_loss.fused_linear_loss`.
        compile: ``torch.compile`` each decoder layer.
        kernels: ``liger`` or ``none``.
        attention: the sdpa backend, or ``auto``.
        off: why each lever that was asked for (or would be on by default) is off here.
    """

    fused_loss: bool = False
    compile: bool = False
    kernels: str = "none"
    attention: str = "auto"
    off: list[str] = field(default_factory=list)

    def describe(self) -> str:
        on = [n for n, v in (("fused loss", self.fused_loss), ("compile", self.compile)) if v]
        on += [f"kernels {self.kernels}"] if self.kernels != "none" else []
        on += [f"attention {self.attention}"] if self.attention != "auto" else []
        text = "speed: " + (", ".join(on) if on else "plain eager loop")
        return text + ("; off: " + "; ".join(self.off) if self.off else "")


def resolve_speed(cfg: Any, device_type: str, distributed_type: str, model: torch.nn.Module) -> Speed:
    """Turn the recipe's ``speed`` section into the levers this run uses.

    What ``auto`` picks was measured with ``benchmarks/bench_uptrain.py`` (docs/gpu.md): on an H100, a
    1.1B llama at 4 x 2048 tokens took 210.8 ms a step plain, 148.9 ms with ``compile`` and the fused loss
    together, 223.7 ms with the fused loss alone (eager, its chunk loop costs more than it saves), 166.2 ms
    with liger's kernels and the fused loss, and 167.1 ms with all three (liger's kernels stop compile's
    own fusions). So on a CUDA GPU in one process or DDP ``auto`` turns on ``compile`` and, with it, the
    fused loss; liger stays off. On a CPU ``auto`` keeps the fused loss (SmolLM2-135M's shape: 1.03x the
    speed and 341 MiB less memory; a 7M model: 0.95x) and leaves compile off (compiling costs more than
    the short CPU runs gain). Under FSDP and DeepSpeed ``auto`` turns nothing on (not measured there).
    Explicit ``true``/``liger`` the device cannot run are turned off with the reason.
    """
    cuda = device_type == "cuda"
    simple = distributed_type in ("NO", "MULTI_GPU", "MULTI_CPU")
    s = Speed(attention=cfg.attention)
    reason = fused_loss_unsupported(model)
    if cfg.compile is True or (cfg.compile == "auto" and cuda and simple):
        s.compile = True
    elif cfg.compile == "auto":
        s.off.append("compile (auto: on for CUDA in one process or DDP only)")
    # auto: with compile on a GPU (eager it is slower there), and on a CPU (it saves the logits' memory)
    wanted = cfg.fused_loss is True or (cfg.fused_loss == "auto" and simple and (s.compile or not cuda))
    if wanted and reason:
        s.off.append(f"fused loss ({reason})")
    elif wanted:
        s.fused_loss = True
    elif cfg.fused_loss == "auto" and not simple:
        s.off.append(f"fused loss (auto: not measured under {distributed_type}; set speed.fused_loss=true)")
    if cfg.kernels == "liger":
        if not cuda:
            s.off.append("kernels liger (needs a CUDA GPU)")
        elif importlib.util.find_spec("liger_kernel") is None:
            s.off.append("kernels liger (not installed: pip install liger-kernel)")
        else:
            s.kernels = "liger"
    if cfg.attention != "auto" and not cuda and cfg.attention in ("flash", "cudnn"):
        s.off.append(f"attention {cfg.attention} (needs a CUDA GPU)")
        s.attention = "auto"
    return s


def fused_loss_unsupported(model: torch.nn.Module) -> str | None:
    """Why the fused loss cannot stand in for this model's own logits, or None when it can."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear):
        return "the model has no linear output projection"
    for name in _LOGIT_TRANSFORMS:
        value = getattr(model.config, name, None)
        if value not in (None, 1, 1.0):
            return f"{model.config.model_type} transforms its logits ({name}={value})"
    return None


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated decoder blocks: modules of the classes transformers will not split."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


def compile_layers(model: torch.nn.Module) -> int:
    """``torch.compile`` each decoder layer in place; return how many."""
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile()
    return len(layers)


def apply_kernels(model: torch.nn.Module, kernels: str) -> None:
    """Patch liger's fused RMSNorm/RoPE/SwiGLU into ``model`` (its loss is gqakit's fused loss)."""
    if kernels != "liger":
        return
    # deferred: liger-kernel is optional (CUDA only)
    from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance

    _apply_liger_kernel_to_instance(
        model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False
    )


@contextlib.contextmanager
def attention_backend(name: str) -> Iterator[None]:
    """Run the enclosed forward passes with one sdpa backend (``auto``: PyTorch's choice)."""
    if name == "auto":
        yield
        return
    # deferred: torch.nn.attention.sdpa_kernel needs torch >= 2.3, and only a chosen backend uses it
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "math": SDPBackend.MATH,
    }[name]
    with sdpa_kernel([backend]):
        yield


def install_fused_loss(model: torch.nn.Module) -> None:
    """Give ``model`` a forward that, when called with ``loss_spec=``, returns the fused objective.

    Called without it, the forward is the model's own (logits, for evaluation). The loss is computed
    inside the model's forward so that DDP and FSDP wrappers, which act around ``forward``, see it.
    """
    own = model.forward

    def forward(self, input_ids=None, *args, loss_spec: LossSpec | None = None, teacher=None, **kwargs):
        if loss_spec is None:
            return own(input_ids, *args, **kwargs)
        hidden = self.base_model(input_ids=input_ids, use_cache=False).last_hidden_state
        head = self.get_output_embeddings()
        th, tw, tb = teacher if teacher is not None else (None, None, None)
        return fused_linear_loss(hidden, head.weight, head.bias, input_ids, loss_spec, th, tw, tb)

    model.forward = types.MethodType(forward, model)


def teacher_outputs(teacher: torch.nn.Module, input_ids: torch.Tensor) -> tuple:
    """The teacher's last hidden states and output projection, for the fused distillation loss."""
    head = teacher.get_output_embeddings()
    hidden = teacher.base_model(input_ids=input_ids, use_cache=False).last_hidden_state
    return hidden, head.weight, head.bias


__all__ = [
    "ATTENTION_BACKENDS",
    "KERNELS",
    "Speed",
    "apply_kernels",
    "attention_backend",
    "compile_layers",
    "decoder_layers",
    "fused_loss_unsupported",
    "install_fused_loss",
    "resolve_speed",
    "teacher_outputs",
]

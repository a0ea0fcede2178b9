"""``gqakit uptrain RECIPE --plan``: the memory each process of a recipe's run needs and the GPU-hours its
token budget costs, from the model's config.json alone (no weights, no data, no training).

The model is built on PyTorch's meta device (shapes, no storage) from its config, with the recipe's
converted K/V heads, so every family is counted as transformers builds it. Memory per process, with N the
processes that shard (FSDP: all of them; DDP: 1) and T the trainable parameters:

- parameters: 4 bytes each (float32 master weights) / N; under FSDP also the units gathered at once (the
  root and two decoder layers, with their gradients); without FSDP under bf16/fp16 autocast the
  half-precision copies of the matrices, kept until backward;
- gradients 4T / N and AdamW's two moments 8T / N;
- activations at the recipe's batch and seq_len (the per-layer bytes in :func:`layer_bytes`), and the
  loss's logits;
- the teacher (objective distill/mix) in the run's precision, / N under FSDP;
- the framework's fixed memory (``FIXED``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from gqakit.checkpoint import read_config
from gqakit.errors import GqakitError
from gqakit.text import read_text_file
from gqakit.uptrain.objectives import CHUNK_ELEMENTS
from gqakit.uptrain.recipe_schema import Recipe
from gqakit.uptrain.schedule import resolve_budget
from gqakit.uptrain.setup import apply_trainable, decoder_layers, resolve_speed

GiB = 2**30


@dataclass(frozen=True)
class Gpu:
    name: str
    memory: int  # bytes the card offers
    peak_flops: float  # dense bf16, per second


# The GPUs docs/gpu.md measured gqakit's uptraining on (memory: nvidia-smi's total).
GPUS = {"h100": Gpu("NVIDIA H100 80GB HBM3", 81_559 * 2**20, 989e12)}

# MFU measured in docs/gpu.md ("Uptrain: speed levers and MFU"): TinyLlama-1.1B's shape on one H100,
# batch 4 x 2048, bf16; 6 FLOPs per parameter and trained token, + 2 per teacher parameter. "compiled":
# speed.compile and the fused loss (auto in one process or DDP); "eager": every lever off, what auto
# runs under FSDP.
MFU = {
    ("compiled", "lm"): 0.367,
    ("compiled", "distill"): 0.400,
    ("eager", "lm"): 0.259,
    ("eager", "distill"): 0.275,
}

# Memory a process holds besides the model: on a CPU Python, torch, transformers, accelerate, the tokenizer
# and the tokenized data, 512 MiB measured (peak RSS of exactly that, SmolLM2-135M's tokenizer and wiki-en:
# docs/uptrain.md#plan); on a GPU the CUDA context, outside torch's allocator (typical size; not measured).
FIXED = {"cpu": 512 * 2**20, "cuda": 512 * 2**20}


@dataclass(frozen=True)
class Launch:
    """What an accelerate config decides for the plan."""

    processes: int
    distributed_type: str  # accelerate's: NO, MULTI_GPU, MULTI_CPU, FSDP
    device: str  # cpu or cuda


def read_launch(config: dict[str, Any] | None, speed_device: str) -> Launch:
    """The processes, distribution and device of an accelerate config (None: one process)."""
    config = config or {}
    processes = int(config.get("num_processes") or 1)
    kind = str(config.get("distributed_type") or "NO").upper()
    cpu = str(config.get("use_cpu", False)).lower() == "true" or speed_device == "cpu"
    if cpu and kind == "MULTI_GPU":
        kind = "MULTI_CPU"
    return Launch(processes, kind if processes > 1 or kind == "FSDP" else "NO", "cpu" if cpu else "cuda")


def read_accelerate_config(path: str) -> dict[str, Any]:
    """An accelerate config file's settings, with a clear error when it is not one."""
    try:
        config = yaml.safe_load(read_text_file(path, "--accelerate-config"))
    except yaml.YAMLError as e:
        raise GqakitError(f"--accelerate-config {path}: cannot be read as YAML ({e}).") from None
    if not isinstance(config, dict):
        raise GqakitError(f"--accelerate-config {path}: is not a mapping of accelerate settings.")
    return config


def model_config(source: str) -> Path:
    """The directory holding ``source``'s config.json: a local directory, or a hub id's config.json alone."""
    local = Path(os.path.expandvars(source)).expanduser()
    if local.is_dir():
        read_config(local)  # a clear error when it has none
        return local
    try:
        # deferred: only a hub id needs the hub client
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(source, "config.json")).parent
    except Exception as e:  # noqa: BLE001 - offline, gated, no such repository: one message
        raise GqakitError(
            f"--plan reads {source}'s config.json and could not ({type(e).__name__}); point model.path at "
            "a directory holding it (nothing else is read)."
        ) from None


def meta_model(path: Path, kv_heads: int | None) -> torch.nn.Module:
    """The model ``path/config.json`` describes, on the meta device, with ``kv_heads`` K/V heads if given."""
    # deferred: transformers takes seconds to import; the plan's arithmetic and its tests need none of it
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    if kv_heads is not None:
        heads = config.num_attention_heads
        if heads % kv_heads:
            raise GqakitError(f"model.convert.groups={kv_heads} does not divide its {heads} query heads.")
        config.num_key_value_heads = kv_heads
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def layer_bytes(config: Any, e: int) -> int:
    """Bytes one llama-style decoder layer saves for backward per token, computing in ``e``-byte floats.

    Fitted to the tensors autograd saves in transformers 5.24's llama (SDPA attention, 10 shapes, exact):
    the residual stream and norms in float32, the projections' inputs and outputs in the compute dtype
    (autocast casts the normed input once more for each matrix product under bf16/fp16).
    """
    h, heads, d = config.hidden_size, config.num_attention_heads, _head_dim(config)
    f32 = 16 * h + 4 * heads + 8
    mixed = e * (2 * heads * d + 2 * config.num_key_value_heads * d + 4 * config.intermediate_size)
    return f32 + mixed + (8 if e == 4 else 10) * h


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def loss_bytes(kind: str, tokens: int, vocab: int, hidden: int, e: int, fused: bool) -> int:
    """The loss's logits: the fused loss's float32 chunks (and its output-projection gradient), or the
    full ``[tokens, vocab]`` logits with their float32 copies, log-probabilities and gradient."""
    if fused:
        chunk = min(tokens, max(1, CHUNK_ELEMENTS // vocab)) * vocab * 4
        return chunk * {"lm": 4, "distill": 8, "mix": 10}[kind] + 4 * hidden * (vocab + tokens)
    up = 4 if e == 2 else 0  # the .float() of half-precision logits
    lm, distill = e + up + 8, 2 * (e + up) + 20  # student (and teacher) logits, log-softmax, KL, gradient
    return tokens * vocab * {"lm": lm, "distill": distill, "mix": lm + distill}[kind]


@dataclass
class Plan:
    rows: list[tuple[str, int]]  # (what, bytes per process)
    device: str
    device_memory: int
    lines: list[str]  # the other checkpointing choice's activations, the budget's compute

    def to_text(self) -> str:
        total = sum(b for _, b in self.rows)
        out = [f"{what:<44}{b / GiB:>10.2f} GiB" for what, b in self.rows]
        out.append(f"{'total per process':<44}{total / GiB:>10.2f} GiB")
        fits = "fits" if total <= self.device_memory else "does NOT fit"
        out.append(f"{'device: ' + self.device:<44}{self.device_memory / GiB:>10.2f} GiB  ({fits})")
        return "\n".join(out + self.lines)


def plan(recipe: Recipe, accelerate: dict[str, Any] | None, gpu: str, tokens: int | None = None) -> Plan:
    """The per-process memory table and the GPU-hours of ``recipe`` launched with ``accelerate``."""
    r, t = recipe, recipe.train
    launch = read_launch(accelerate, r.speed.device)
    convert = r.model.convert
    model = meta_model(model_config(r.model.path), convert.groups if convert else None)
    cfg = model.config
    params = sum(p.numel() for p in model.parameters())
    trainable, _ = apply_trainable(model, t.trainable)
    precision = t.precision if t.precision != "auto" else ("bf16" if launch.device == "cuda" else "fp32")
    e = 4 if precision == "fp32" else 2
    speed, _ = resolve_speed(r.speed, launch.device, launch.distributed_type, model)
    # FSDP shards parameters, gradients, optimizer state and the teacher over every process
    n = launch.processes if launch.distributed_type == "FSDP" else 1
    tok = t.batch_size * r.data.seq_len
    rows = [
        ("parameters (float32 master weights)", 4 * params // n),
        ("gradients (float32)", 4 * trainable // n),
        ("optimizer state (AdamW, 2 x float32)", 8 * trainable // n),
    ]
    layers = decoder_layers(model)
    layer = max((sum(p.numel() for p in m.parameters()) for m in layers), default=0)
    if launch.distributed_type == "FSDP":  # the root unit and two layers gathered, and their gradients
        root = params - layer * len(layers)
        rows.append(("FSDP: units gathered (root + 2 layers)", (root + 2 * layer) * (e + 4)))
    elif e == 2:  # autocast's cached half-precision copies of every matrix, until backward
        linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
        rows.append((f"{precision} copies of the matrices (autocast)", 2 * linear))
    per_layer = layer_bytes(cfg, e)
    act = {
        False: tok * per_layer * cfg.num_hidden_layers,
        # each layer's float32 input kept, one layer's activations recomputed at a time
        True: tok * (4 * cfg.hidden_size * cfg.num_hidden_layers + per_layer),
    }
    ckpt = t.gradient_checkpointing
    what = f"activations ({t.batch_size} x {r.data.seq_len}, {'with' if ckpt else 'without'} checkpointing)"
    rows.append((what, act[ckpt]))
    kind = r.objective.kind
    logits = loss_bytes(kind, tok, cfg.vocab_size, cfg.hidden_size, e, speed.fused_loss)
    rows.append((f"loss ({'fused, chunked' if speed.fused_loss else 'full logits'})", logits))
    teacher = 0
    if kind != "lm" and r.teacher:
        teacher = sum(p.numel() for p in meta_model(model_config(r.teacher), None).parameters())
        rows.append((f"teacher ({precision}, {f'sharded / {n}' if n > 1 else 'whole'})", teacher * e // n))
    rows.append((f"framework ({launch.device}, fixed)", FIXED[launch.device]))
    other = f"{'without' if ckpt else 'with'} checkpointing"
    lines = [f"{'  (' + other + ': activations':<44}{act[not ckpt] / GiB:>10.2f} GiB)"]
    lines += compute_lines(r, launch, model, params, teacher, gpu, tokens)
    device = GPUS[gpu] if launch.device == "cuda" else None
    memory = device.memory if device else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Plan(rows, device.name if device else "this machine's RAM", memory, lines)


def compute_lines(
    r: Recipe, launch: Launch, model: Any, params: int, teacher: int, gpu: str, tokens: int | None
) -> list[str]:
    """The token budget in steps and tokens, and its GPU-hours at the MFU measured for this loop."""
    t = r.train
    per_step = t.batch_size * t.grad_accum * launch.processes * r.data.seq_len
    total = tokens if tokens is not None else resolve_budget(r.budget, per_step).tokens()
    flops = total * (6 * params + 2 * teacher)
    # the loop auto runs on a GPU: compile and the fused loss in one process or DDP, eager under FSDP
    speed, _ = resolve_speed(r.speed, "cuda", launch.distributed_type, model)
    loop = "compiled" if speed.compile else "eager"
    mfu = MFU[(loop, "lm" if r.objective.kind == "lm" else "distill")]
    g = GPUS[gpu]
    hours = flops / (g.peak_flops * mfu) / 3600
    source = "--tokens" if tokens is not None else "the recipe's budget"
    return [
        f"tokens: {total:,} ({source}) = {math.ceil(total / per_step):,} steps of {per_step:,}",
        f"compute: {flops:.3g} FLOPs = {_hours(hours)} GPU-hours on {g.name}",
        f"  at {mfu:.1%} MFU ({loop} loop, measured in docs/gpu.md): {_hours(hours / launch.processes)} h "
        f"on {launch.processes} GPU(s)",
    ]


def _hours(h: float) -> str:
    return f"{h:,.1f}" if h >= 1 else f"{h:.2g}"

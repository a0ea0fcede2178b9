"""``gqakit uptrain RECIPE --plan``: the memory each process of a recipe's run needs and the GPU-hours its
token budget costs, from the model's config.json alone, built on PyTorch's meta device. What each row
counts, and the measurements behind the constants:
docs/uptrain.md#plan-memory-per-process-and-gpu-hours-before-launching."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from gqakit.errors import GqakitError
from gqakit.uptrain.objectives import CHUNK_ELEMENTS
from gqakit.uptrain.recipe_schema import Recipe
from gqakit.uptrain.schedule import resolve_budget
from gqakit.uptrain.setup import apply_trainable, decoder_layers, resolve_speed

GiB = 2**30


# The GPU docs/gpu.md measured gqakit's uptraining on: its memory (nvidia-smi's total) and dense bf16 FLOP/s.
GPU, GPU_MEMORY, GPU_FLOPS = "NVIDIA H100 80GB HBM3", 81_559 * 2**20, 989e12

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


def truthy(value: Any) -> bool:
    """An accelerate config's (or environment variable's) yes."""
    return str(value).strip().lower() in ("true", "1", "yes")


def read_launch(config: dict[str, Any] | None, speed_device: str) -> tuple[int, str, str]:
    """The processes, distribution (accelerate's NO, MULTI_GPU, MULTI_CPU, FSDP) and device (cpu or cuda)
    of an accelerate config (None: one process)."""
    config = config or {}
    try:
        processes = int(n := config.get("num_processes") or 1)
    except (TypeError, ValueError):
        raise GqakitError(f"--accelerate-config: num_processes {n!r} is not a whole number.") from None
    kind = str(config.get("distributed_type") or "NO").upper()
    cpu = truthy(config.get("use_cpu")) or speed_device == "cpu"
    if cpu and kind == "MULTI_GPU":
        kind = "MULTI_CPU"
    return processes, kind if processes > 1 or kind == "FSDP" else "NO", "cpu" if cpu else "cuda"


def meta_model(source: str, kv_heads: int | None) -> torch.nn.Module:
    """The model ``source``'s config.json describes (a directory's, or a hub id's alone), on the meta
    device, with ``kv_heads`` K/V heads if given."""
    # deferred: transformers takes seconds to import; the plan's arithmetic and its tests need none of it
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(os.path.expanduser(os.path.expandvars(source)))
    except Exception as e:  # noqa: BLE001 - no config.json, offline, gated, no such repository: one message
        raise GqakitError(
            f"--plan reads {source}'s config.json and could not ({type(e).__name__}); point model.path at "
            "a directory holding it (nothing else is read)."
        ) from None
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
    (autocast casts the normed input once more for each matrix product under bf16).
    """
    h, heads = config.hidden_size, config.num_attention_heads
    d = getattr(config, "head_dim", None) or h // heads
    f32 = 16 * h + 4 * heads + 8
    mixed = e * (2 * heads * d + 2 * config.num_key_value_heads * d + 4 * config.intermediate_size)
    return f32 + mixed + (8 if e == 4 else 10) * h


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


def plan(recipe: Recipe, accelerate: dict[str, Any] | None, tokens: int | None = None) -> Plan:
    """The per-process memory table and the GPU-hours of ``recipe`` launched with ``accelerate``, for its
    token budget or ``tokens`` (``--tokens``, e.g. a threshold from ``gqakit recovery``)."""
    r, t = recipe, recipe.train
    processes, kind, device = read_launch(accelerate, r.speed.device)
    convert = r.model.convert
    model = meta_model(r.model.path, convert.groups if convert else None)
    cfg = model.config
    params = sum(p.numel() for p in model.parameters())
    trainable, _ = apply_trainable(model, t.trainable)
    precision = t.precision if t.precision != "auto" else ("bf16" if device == "cuda" else "fp32")
    e = 4 if precision == "fp32" else 2
    speed, _ = resolve_speed(r.speed, device, kind, model)
    # FSDP shards parameters, gradients, optimizer state and the teacher over every process
    n = processes if kind == "FSDP" else 1
    tok = t.batch_size * r.data.seq_len
    rows = [
        ("parameters (float32 master weights)", 4 * params // n),
        ("gradients (float32)", 4 * trainable // n),
        ("optimizer state (AdamW, 2 x float32)", 8 * trainable // n),
    ]
    layers = decoder_layers(model)
    layer = max((sum(p.numel() for p in m.parameters()) for m in layers), default=0)
    if kind == "FSDP":  # the root unit and two layers gathered, and their gradients
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
    objective = r.objective.kind
    logits = loss_bytes(objective, tok, cfg.vocab_size, cfg.hidden_size, e, speed.fused_loss)
    rows.append((f"loss ({'fused, chunked' if speed.fused_loss else 'full logits'})", logits))
    teacher = 0
    if objective != "lm" and r.teacher:
        teacher = sum(p.numel() for p in meta_model(r.teacher, None).parameters())
        rows.append((f"teacher ({precision}, {f'sharded / {n}' if n > 1 else 'whole'})", teacher * e // n))
    rows.append((f"framework ({device}, fixed)", FIXED[device]))
    other = f"{'without' if ckpt else 'with'} checkpointing"
    lines = [f"{'  (' + other + ': activations':<44}{act[not ckpt] / GiB:>10.2f} GiB)"]
    lines += compute_lines(r, processes, kind, model, params, teacher, tokens)
    if device == "cuda":
        return Plan(rows, GPU, GPU_MEMORY, lines)
    return Plan(rows, "this machine's RAM", os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), lines)


def compute_lines(
    r: Recipe, processes: int, kind: str, model: Any, params: int, teacher: int, tokens: int | None
) -> list[str]:
    """The budget in steps and tokens (or ``tokens``), and its GPU-hours at the MFU measured for this loop."""
    t = r.train
    budget = resolve_budget(r.budget, t.batch_size * t.grad_accum * processes * r.data.seq_len)
    flops = (budget.tokens() if tokens is None else tokens) * (6 * params + 2 * teacher)
    # the loop auto runs on a GPU: compile and the fused loss in one process or DDP, eager under FSDP
    speed, _ = resolve_speed(r.speed, "cuda", kind, model)
    loop = "compiled" if speed.compile else "eager"
    mfu = MFU[(loop, "lm" if r.objective.kind == "lm" else "distill")]
    hours = flops / (GPU_FLOPS * mfu) / 3600
    return [
        f"budget: {budget.describe()}" if tokens is None else f"tokens: {tokens:,} (--tokens)",
        f"compute: {flops:.3g} FLOPs = {_hours(hours)} GPU-hours on {GPU}",
        f"  at {mfu:.1%} MFU ({loop} loop, measured in docs/gpu.md): {_hours(hours / processes)} h "
        f"on {processes} GPU(s)",
    ]


def _hours(h: float) -> str:
    return f"{h:,.1f}" if h >= 1 else f"{h:.2g}"

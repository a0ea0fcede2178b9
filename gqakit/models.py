"""Loading models and tokenizers for every verb, and the limits their configs state, with errors a person
can act on."""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path
from typing import Any

import torch

from gqakit.checkpoint import open_checkpoint_dir
from gqakit.errors import GqakitError

DTYPES: dict[str, torch.dtype | str] = {
    "auto": "auto",
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def resolve_device(device: str = "auto") -> torch.device:
    """``auto`` -> cuda when available, else cpu; anything else as given, checked."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise GqakitError(
            f"--device {device} was asked for but no CUDA device is available; use --device cpu."
        )
    return dev


def device_name(device: torch.device) -> str:
    """A device by its model: ``cuda: NVIDIA H100 80GB HBM3``, or ``cpu: <model>, <n> CPUs`` (the CPUs this
    process may run on: the threads a decode gets)."""
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{device.type}: {cpu_model()}, {cpus} CPUs"


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, where ``platform.processor()`` is often empty)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_unavailable(device: str) -> str | None:
    """Why this machine cannot run on ``speed.device`` (a CUDA device it does not have), or None."""
    if not device.startswith("cuda"):
        return None
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = int(device.partition(":")[2] or 0)
    if index < count:
        return None
    has = f"{count} CUDA device(s)" if count else "no CUDA device"
    return f"speed.device={device}, but this machine has {has}: set speed.device=cpu or auto."


def max_positions(config) -> int | None:
    """The longest sequence a model's config says it handles, or None when it does not say."""
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_seq_len(config, seq_len: int, what: str = "--seq-len") -> None:
    limit = max_positions(config)
    if limit is not None and seq_len > limit:
        raise GqakitError(
            f"{what} {seq_len} is more than this model's {limit} positions (max_position_embeddings); "
            f"use {what} {limit} or less."
        )


# The class names of models trained to predict the next token; an encoder (BERT, RoBERTa) has a masked-LM
# head instead, and transformers will still wrap it in a "ForCausalLM" class whose perplexity means nothing.
_CAUSAL_ARCHITECTURE = re.compile(r"(ForCausalLM|LMHeadModel|ForConditionalGeneration)$")


def check_causal_lm(config: Any, path: str | Path, what: str = "model") -> None:
    """Refuse a checkpoint whose config names only non-causal architectures (a masked-LM encoder).

    Args:
        config: the checkpoint's config (a dict or a transformers config).
        path: the checkpoint, for the message.
        what: what the checkpoint is for (``model``, ``teacher``...), for the message.
    """
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    archs = list(get("architectures") or [])
    if get("is_encoder_decoder", False) or (archs and not any(_CAUSAL_ARCHITECTURE.search(a) for a in archs)):
        kind = ", ".join(archs) or "an encoder-decoder"
        raise GqakitError(
            f"The {what} {path} is a {get('model_type')!r} checkpoint ({kind}), not a decoder-only causal "
            "language model: it was not trained to predict the next token, so its perplexity (or its "
            "distillation targets) would mean nothing. gqakit works on causal LMs (Llama, Qwen2, Gemma, "
            "Mistral, Phi-3, ...)."
        )


def load_causal_lm(path: str | Path, dtype: str = "auto", device: str = "auto", **kwargs: Any):
    """Load a causal LM from a local checkpoint directory (or a hub id when online).

    Args:
        path: checkpoint directory, or hub id.
        dtype: ``auto`` (the checkpoint's own), ``float32``, ``bfloat16`` or ``float16``.
        device: ``auto``, ``cpu``, ``cuda``, ``cuda:1``...
        kwargs: passed to ``from_pretrained``.

    Returns:
        The model in eval mode on ``device``.
    """
    # deferred: transformers takes seconds to import
    from transformers import AutoConfig, AutoModelForCausalLM

    if dtype not in DTYPES:
        raise GqakitError(f"dtype {dtype!r} is unknown; choose one of {', '.join(DTYPES)}.")
    p = Path(str(path)).expanduser()
    if not p.exists() and (str(path).startswith((".", "/", "~")) or str(path).count("/") != 1):
        raise GqakitError(f"Model path {path} does not exist.")
    if p.is_dir() and not (p / "config.json").is_file():
        raise GqakitError(f"{p} has no config.json: point at a Hugging Face model directory.")
    try:
        config = AutoConfig.from_pretrained(str(path))
    except Exception as e:
        raise GqakitError(f"Could not read a model config from {path}: {e}") from None
    check_causal_lm(config, path)
    if p.is_dir():  # every shard's header checked against its file size: a truncated download says so
        open_checkpoint_dir(p.resolve()).tensor_infos()
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=DTYPES[dtype], **kwargs)
    except ValueError as e:
        if "Unrecognized configuration class" in str(e):
            raise GqakitError(
                f"{path} is a {config.model_type!r} model, not a causal language model (AutoModelForCausalLM "
                "cannot load it)."
            ) from None
        raise GqakitError(f"Could not load {path}: {e}") from None
    except (OSError, RuntimeError) as e:
        raise GqakitError(f"Could not load {path}: {type(e).__name__}: {e}") from None
    return model.to(resolve_device(device)).eval()


def load_tokenizer(path: str | Path):
    """Load the tokenizer saved with a checkpoint, with a clear error when it has none."""
    # deferred: transformers takes seconds to import
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:
        raise GqakitError(
            f"{path} has no usable tokenizer ({type(e).__name__}: {e}). Copy the tokenizer files of the "
            "original model into it."
        ) from None

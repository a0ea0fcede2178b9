"""Loading models and tokenizers for every verb, and the limits their configs state, with errors a person
can act on; devices, and handing freed memory back between the steps of layer-by-layer work."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
import platform
import re
from pathlib import Path
from typing import Any

import torch

from gqakit.checkpoint import model_source, open_checkpoint_dir, read_config
from gqakit.dtypes import torch_dtype
from gqakit.errors import GqakitError
from gqakit.safetensors_io import check_finite


def resolve_device(device: str = "auto") -> torch.device:
    """``auto`` -> cuda when available, else cpu; anything else as given, checked."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    why = device_unavailable(device, "--device")
    if why:
        raise GqakitError(why)
    return torch.device(device)


def device_name(device: torch.device) -> str:
    """A device by its model: ``cuda: NVIDIA H100 80GB HBM3``, or ``cpu: <model>, <n> CPUs`` (the CPUs this
    process may run on: the threads a decode gets)."""
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{device.type}: {cpu_model()}, {cpus} CPUs"


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, where ``platform.processor()`` is often empty)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def device_unavailable(device: str, flag: str = "speed.device") -> str | None:
    """Why this machine cannot run on ``device``, given as ``flag`` (a CUDA device it does not have), or
    None."""
    if not device.startswith("cuda"):
        return None
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if int(device.partition(":")[2] or 0) < count:
        return None
    has = f"{count} CUDA device(s)" if count else "no CUDA device"
    return f"{flag}={device}, but this machine has {has}: set {flag}=cpu or auto."


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


def causal_lm_config(path: str | Path):
    """The transformers config of the causal LM at ``path`` (a directory or a hub id, as
    :func:`gqakit.checkpoint.model_source` returns it), checked without loading weights: a directory
    without ``config.json``, an encoder (:func:`check_causal_lm`) or a model type that
    ``AutoModelForCausalLM`` cannot load is a :class:`GqakitError`."""
    # deferred: transformers takes seconds to import
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if Path(path).is_dir():
        read_config(Path(path), model_type=True)  # a clear error for a directory without one, or a bad one
    try:
        config = AutoConfig.from_pretrained(str(path))
    except Exception as e:
        raise GqakitError(f"Could not read a model config from {path}: {e}") from None
    check_causal_lm(config, path)
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise GqakitError(
            f"{path} is a {config.model_type!r} model, not a causal language model (AutoModelForCausalLM "
            "cannot load it)."
        )
    return config


def load_causal_lm(path: str | Path, dtype: str = "auto", device: str = "auto", **kwargs: Any):
    """Load a causal LM from any SRC :func:`gqakit.checkpoint.model_source` takes.

    Args:
        path: checkpoint directory, ``.gguf`` file, asset name or hub id.
        dtype: ``auto`` (the checkpoint's own), ``float32``, ``bfloat16`` or ``float16``.
        device: ``auto``, ``cpu``, ``cuda``, ``cuda:1``...
        kwargs: passed to ``from_pretrained``.

    Returns:
        The model in eval mode on ``device``.

    Raises:
        GqakitError: a config or weights that cannot be loaded, or weights that hold NaN/Inf.
    """
    # deferred: transformers takes seconds to import
    from transformers import AutoModelForCausalLM

    path = model_source(path)
    causal_lm_config(path)
    # every shard's header checked against its file size: a truncated download says so
    if Path(path).is_dir():
        open_checkpoint_dir(Path(path)).tensor_infos()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype="auto" if dtype == "auto" else torch_dtype(dtype), **kwargs
        )
    except (ValueError, OSError, RuntimeError) as e:
        raise GqakitError(f"Could not load {path}: {type(e).__name__}: {e}") from None
    model = model.to(resolve_device(device)).eval()
    # NaN/Inf (a corrupt checkpoint) refused before anything measures or trains it, as a conversion does
    with torch.no_grad():
        for name, p in model.named_parameters():
            check_finite(name, p, path)
    return model


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


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None where the C library has none (macOS, musl)."""
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    except OSError:
        return None


def release_memory(device: torch.device | None = None) -> None:
    """Return freed heap memory to the OS (and cached blocks on a CUDA ``device`` to the driver).

    torch allocates CPU tensors with ``malloc``; glibc keeps freed blocks under its dynamic mmap
    threshold (up to 32 MiB) in its arenas, so a loop that frees one decoder layer's tensors and
    allocates the next one's grows the resident set layer after layer (measured: a 14-layer model
    peaked 250 MB above a 2-layer one of the same width) unless the arenas are trimmed.
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
    if device is not None and device.type == "cuda":
        torch.cuda.empty_cache()

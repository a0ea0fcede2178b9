"""Loading models and tokenizers for eval and uptrain, with errors a person can act on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

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
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=DTYPES[dtype], **kwargs)
    except ValueError as e:
        if "Unrecognized configuration class" in str(e):
            raise GqakitError(
                f"{path} is a {config.model_type!r} model, not a causal language model (AutoModelForCausalLM "
                "cannot load it)."
            ) from None
        raise GqakitError(f"Could not load {path}: {e}") from None
    except OSError as e:
        raise GqakitError(f"Could not load {path}: {e}") from None
    return model.to(resolve_device(device)).eval()


def load_tokenizer(path: str | Path):
    """Load the tokenizer saved with a checkpoint, with a clear error when it has none."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:
        raise GqakitError(
            f"{path} has no usable tokenizer ({type(e).__name__}: {e}). Copy the tokenizer files of the "
            "original model into it."
        ) from None

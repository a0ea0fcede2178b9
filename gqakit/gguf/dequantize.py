"""GGUF models as ordinary checkpoints: dequantized once, cached, and shared by every command.

transformers reads a ``.gguf`` file and dequantizes its weights on load (with the config fields its
reader loses put back by :mod:`gqakit.gguf.readback`). gqakit writes the result as a safetensors
checkpoint with its tokenizer, under ``$GQAKIT_CACHE/gguf-dequantized/<stem>-<fingerprint>-r<version>``
(the file's name, size and modification time; the version of gqakit's reading), so the first command
that reads a GGUF pays for the dequantization and every later one (``convert``, ``expand``, ``export``,
``probe``, ``eval``) opens the cached directory at once. Changing the file changes its fingerprint, so a
stale copy is never used.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from gqakit.errors import GqakitError
from gqakit.files import cache_root, fingerprint, writable_cache
from gqakit.gguf.readback import gguf_config
from gqakit.locks import one_at_a_time
from gqakit.outputs import atomic_output_dir

if TYPE_CHECKING:
    import torch

CACHE = "gguf-dequantized"  # the folder under the cache root
# Part of every cached copy's name: raised whenever a copy's contents change for the same file, so an
# older gqakit's copy is not reused (2: configs restored by gqakit.gguf.readback).
READER_VERSION = 2
log = logging.getLogger(__name__)


def is_gguf(src: str | Path) -> bool:
    """Whether ``src`` names an existing ``.gguf`` file."""
    path = Path(src).expanduser()
    return path.is_file() and path.suffix.lower() == ".gguf"


def dequantize_gguf(gguf_path: Path, out_dir: Path, dtype: torch.dtype | None = None) -> None:
    """Dequantize a ``.gguf`` model into an ordinary safetensors checkpoint with its tokenizer.

    transformers dequantizes GGUF on load but marks the model as quantized, which makes
    ``save_pretrained`` refuse; the weights are plain tensors by then, so we drop that state.
    """
    # deferred: transformers costs seconds to import, and only GGUF sources need its loader
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    try:
        # transformers' own reading of the config loses facts the model depends on (attention scale,
        # rotary width, biases); gguf_config puts them back, or refuses where the model cannot hold them
        config, warnings = gguf_config(gguf_path)
        for warning in warnings:
            log.warning("%s", warning)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, config=config
        )
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except GqakitError:
        raise
    except Exception as e:
        raise GqakitError(f"{gguf_path} could not be loaded as a GGUF model by transformers: {e}") from None
    model.hf_quantizer = None
    model.is_quantized = False
    model.quantization_method = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)


def cache_name(path: Path) -> str:
    """The cached copy's folder name: the file's stem and fingerprint, and the reader's version."""
    return f"{path.stem}-{fingerprint(path)}-r{READER_VERSION}"


def dequantized_gguf(gguf_path: str | Path) -> Path:
    """A ``.gguf`` model as a checkpoint directory, dequantized once and cached (see the module
    docstring); later calls return the cached directory at once."""
    path = Path(gguf_path).expanduser().resolve()
    out = writable_cache(cache_root() / CACHE) / cache_name(path)
    if (out / "config.json").is_file():
        return out

    def waiting(owner: str) -> None:
        log.warning("waiting for %s, which is dequantizing %s into %s", owner, path.name, out)

    # a second command on the same .gguf waits for the first's copy instead of writing its own over it
    with one_at_a_time(out.parent / f".{out.name}.lock", waiting):
        if not (out / "config.json").is_file():
            with atomic_output_dir(out, force=True) as tmp:
                dequantize_gguf(path, tmp)
    return out


def local_model(src: str) -> str:
    """``src`` as ``from_pretrained`` takes it: a ``.gguf`` file becomes its cached dequantized
    directory (:func:`dequantized_gguf`); a directory or hub id is returned as given."""
    return str(dequantized_gguf(src)) if is_gguf(src) else src


__all__ = ["CACHE", "cache_name", "dequantize_gguf", "dequantized_gguf", "is_gguf", "local_model"]

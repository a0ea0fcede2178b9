"""GGUF models as ordinary checkpoints: dequantized once by transformers (with the config fields its
reader loses put back by :mod:`gqakit.gguf.header`), cached under
``$GQAKIT_CACHE/gguf-dequantized/<name>-<hash>/<stem>-<fingerprint>-r<version>`` and shared by every
command (docs/convert.md); a new copy removes the file's earlier ones (:func:`gqakit.storage.cached_copy`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from gqakit.errors import GqakitError
from gqakit.gguf.header import gguf_config
from gqakit.storage import atomic_output_dir, cached_copy, fingerprint, source_folder

if TYPE_CHECKING:
    import torch

CACHE = "gguf-dequantized"  # the folder under the cache root
# Part of every cached copy's name: raised whenever a copy's contents change for the same file, so an
# older gqakit's copy is not reused (2: configs restored by gqakit.gguf.header; 3: a record per copy).
READER_VERSION = 3
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
        config = gguf_config(gguf_path)
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


def dequantized_gguf(gguf_path: str | Path) -> Path:
    """A ``.gguf`` model as a checkpoint directory, dequantized once and cached
    (:func:`gqakit.storage.cached_copy`). Later calls return the cached directory at once.

    Args:
        gguf_path: the ``.gguf`` file.

    Returns:
        The cached checkpoint directory.
    """
    path = Path(gguf_path).expanduser().resolve()

    def build(out: Path) -> None:
        with atomic_output_dir(out, force=True) as tmp:
            dequantize_gguf(path, tmp)

    name = f"{path.stem}-{fingerprint(path)}-r{READER_VERSION}"
    return cached_copy(
        source_folder(CACHE, path), name, build, f"dequantizing {path.name} into {{copy}}", log
    )

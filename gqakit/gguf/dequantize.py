"""GGUF models as ordinary checkpoints: dequantized once, cached, and shared by every command.

transformers reads a ``.gguf`` file and dequantizes its weights on load (with the config fields its
reader loses put back by :mod:`gqakit.gguf.header`). gqakit writes the result as a safetensors
checkpoint with its tokenizer, under ``$GQAKIT_CACHE/gguf-dequantized/<stem>-<fingerprint>-r<version>``
(the file's name, size and modification time; the version of gqakit's reading), so the first command
that reads a GGUF pays for the dequantization and every later one (``convert``, ``expand``, ``export``,
``probe``, ``eval``) opens the cached directory at once. Changing the file changes its fingerprint, so a
stale copy is never used.

Each copy records the file it was dequantized from (``.gqakit/source.json``: its absolute path,
fingerprint and the reader's version; in a subfolder, which neither a checkpoint's fingerprint nor a
conversion's copy of the small files takes in). Each new copy removes those it supersedes: the same
file's from before it changed or from an older reader (:func:`gqakit.cached_copies.sweep`); one that
another process is dequantizing into holds its lock and is kept.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gqakit import cached_copies
from gqakit.cached_copies import CopyKind, write_record
from gqakit.errors import GqakitError
from gqakit.gguf.header import gguf_config
from gqakit.storage import atomic_output_dir, fingerprint

if TYPE_CHECKING:
    import torch

CACHE = "gguf-dequantized"  # the folder under the cache root
# Part of every cached copy's name: raised whenever a copy's contents change for the same file, so an
# older gqakit's copy is not reused (2: configs restored by gqakit.gguf.header; 3: each copy records
# its source, SOURCE_RECORD, so that a copy without one is always an older reader's).
READER_VERSION = 3
# In each copy, the file it was dequantized from. In a subfolder: a checkpoint's fingerprint counts only
# its top-level files, and a conversion copies only those (a record in a converted model would be wrong).
SOURCE_RECORD = Path(".gqakit") / "source.json"
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
    return cached_copies.copy_name(_COPIES, path, fingerprint(path))


def dequantized_gguf(gguf_path: str | Path) -> Path:
    """A ``.gguf`` model as a checkpoint directory, dequantized once and cached
    (:func:`gqakit.cached_copies.cached_copy`). Later calls return the cached directory at once.

    Args:
        gguf_path: the ``.gguf`` file.

    Returns:
        The cached checkpoint directory.
    """
    path = Path(gguf_path).expanduser().resolve()

    def build(out: Path, record: dict[str, Any]) -> None:
        with atomic_output_dir(out, force=True) as tmp:
            dequantize_gguf(path, tmp)
            write_record(tmp / SOURCE_RECORD, record)

    return cached_copies.cached_copy(_COPIES, path, build, f"dequantizing {path.name} into {{copy}}")


def _remove_copy(copy: Path) -> int | None:
    """Remove one cached copy; the bytes it held, or None when another process removed it first."""
    if not copy.is_dir():
        return None
    size = sum(f.stat().st_size for f in copy.rglob("*") if f.is_file() and not f.is_symlink())
    # first the file every reader looks for: a removal cut short leaves no copy that opens
    (copy / "config.json").unlink(missing_ok=True)
    shutil.rmtree(copy)
    return size


# the cache's copies: how cached_copies names, checks and removes one
_COPIES = CopyKind(
    folder=CACHE,
    name="{stem}-{fp}-r{version}",
    version_key="reader",
    version=lambda: READER_VERSION,
    record=lambda c: c / SOURCE_RECORD,
    complete=lambda c: (c / "config.json").is_file(),
    remove=_remove_copy,
    rm=lambda c: f"rm -rf {c}",
    described="a dequantized copy",
    log=log,
)

"""Reading Hugging Face model checkpoints, shared by convert, uptrain and eval.

Finding a checkpoint (a local directory, a ``.gguf`` file through :mod:`gqakit.gguf.dequantize`'s cache,
or a hub id through :mod:`gqakit.hub`), reading its tensors one at a time from safetensors or legacy
``.bin`` shards, and copying the files that are not weights. Nothing here knows about attention: that
lives in ``gqakit.convert``. (An uptraining run's own checkpoints are :mod:`gqakit.uptrain.run_checkpoints`.)
"""

from __future__ import annotations

import json
import shutil
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import torch

from gqakit.errors import GqakitError
from gqakit.hub import download_from_hub, looks_like_hub_id
from gqakit.safetensors_io import DTYPE_NAMES, SafetensorsFile

SAFE_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
# Files we regenerate or that hold weights; everything else in SRC (tokenizer, generation config,
# chat template, licence) is copied verbatim.
_NOT_COPIED_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5", ".ckpt")
# The records of the run that made a checkpoint (gqakit uptrain's metrics and recipe, HF Trainer's state)
# describe that run, not a model converted or trained from it: a copy would replace the new run's own.
_RUN_RECORDS = {"metrics.jsonl", "recipe.yaml", "trainer_state.json"}
_NOT_COPIED_NAMES = {SAFE_INDEX, BIN_INDEX, "config.json", "gqakit.json", "README.md", *_RUN_RECORDS}


@dataclass
class Shard:
    """One weight file of a checkpoint and the tensor names it holds, in file order."""

    file: str
    names: list[str]


@dataclass
class Checkpoint:
    """A local Hugging Face checkpoint directory, indexed but not loaded.

    Attributes:
        path: the directory.
        config: ``config.json`` as a dict.
        format: ``"safetensors"`` or ``"bin"``.
        shards: weight files in order; one entry for an unsharded checkpoint.
        index_file: the shard index, when the checkpoint is sharded.
        origin: what the user named (a directory, a ``.gguf`` file or a hub id), for provenance.
        derived_from: the checkpoint this one was rewritten from (a retargeted family's MHA rewrite in a
            temporary directory), whose files the provenance hashes; None for the user's own.
    """

    path: Path
    config: dict[str, Any]
    format: str
    shards: list[Shard]
    index_file: Path | None = None
    origin: str = ""
    derived_from: Checkpoint | None = field(default=None, repr=False)
    _infos: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict, repr=False)

    @property
    def model_type(self) -> str:
        return str(self.config.get("model_type", ""))

    def tensor_infos(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Name -> (safetensors dtype name, shape) for every tensor, read from headers only."""
        if not self._infos:
            with self.reader() as reader:
                for shard in self.shards:
                    for name in shard.names:
                        self._infos[name] = reader.info(name)
        return self._infos

    def reader(self) -> TensorReader:
        return TensorReader(self)


class TensorReader:
    """Reads tensors of a :class:`Checkpoint` by name, opening each shard once and lazily."""

    def __init__(self, ckpt: Checkpoint) -> None:
        self.ckpt = ckpt
        self._where = {n: s.file for s in ckpt.shards for n in s.names}
        self._safe: dict[str, SafetensorsFile] = {}
        self._bin: dict[str, dict[str, torch.Tensor]] = {}

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for f in self._safe.values():
            f.close()
        self._safe.clear()
        self._bin.clear()

    def shard_of(self, name: str) -> str:
        return self._where[name]

    def safetensors_file(self, shard_file: str) -> SafetensorsFile:
        if shard_file not in self._safe:
            self._safe[shard_file] = SafetensorsFile(self.ckpt.path / shard_file)
        return self._safe[shard_file]

    def _bin_dict(self, shard_file: str) -> dict[str, torch.Tensor]:
        if shard_file not in self._bin:
            path = self.ckpt.path / shard_file
            try:
                # mmap keeps the shard on disk; weights_only refuses pickled code. torch can mmap only the
                # zip format (torch >= 1.6): a legacy (pre-zip) file is read into memory, as transformers
                # reads it.
                mmap = zipfile.is_zipfile(path)
                self._bin[shard_file] = torch.load(path, map_location="cpu", mmap=mmap, weights_only=True)
            except Exception as e:  # torch raises many types for a bad pickle
                raise GqakitError(f"{path} could not be read as a PyTorch checkpoint: {e}") from None
        return self._bin[shard_file]

    def shard_names(self, shard_file: str) -> list[str]:
        """The names of the tensors stored in ``shard_file``, in file order."""
        if self.ckpt.format == "safetensors":
            return list(self.safetensors_file(shard_file).tensors)
        return list(self._bin_dict(shard_file))

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        shard = self._where[name]
        if self.ckpt.format == "safetensors":
            t = self.safetensors_file(shard).tensors[name]
            return t.dtype, t.shape
        v = self._bin_dict(shard)[name]
        return DTYPE_NAMES[v.dtype], tuple(v.shape)

    def read(self, name: str) -> torch.Tensor:
        shard = self._where[name]
        if self.ckpt.format == "safetensors":
            return self.safetensors_file(shard).read(name)
        return self._bin_dict(shard)[name].clone()

    def copy_raw(self, name: str, out: BinaryIO) -> None:
        """Copy a safetensors tensor's bytes straight into ``out``, without decoding them."""
        self.safetensors_file(self._where[name]).copy_raw(name, out)


def read_config(path: Path) -> dict[str, Any]:
    """Read ``config.json`` of a checkpoint directory, with a clear error when it is missing or bad."""
    cfg = path / "config.json"
    if not cfg.is_file():
        raise GqakitError(f"{path} has no config.json: point at a Hugging Face model directory.")
    try:
        return json.loads(cfg.read_text())
    except json.JSONDecodeError as e:
        raise GqakitError(f"{cfg} is not valid JSON: {e}") from None


def _index_shards(path: Path, index_name: str) -> list[Shard]:
    index_file = path / index_name
    try:
        weight_map: dict[str, str] = json.loads(index_file.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise GqakitError(f"{index_file} is not a valid shard index ({e!r}).") from None
    by_file: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        by_file.setdefault(file, []).append(name)
    missing = [f for f in by_file if not (path / f).is_file()]
    if missing:
        raise GqakitError(
            f"{index_file} names shard(s) that are not in {path}: {', '.join(sorted(missing))}. "
            "The download is incomplete; fetch the missing files."
        )
    return [Shard(f, names) for f, names in sorted(by_file.items())]


def open_checkpoint_dir(path: Path, origin: str | None = None) -> Checkpoint:
    """Index a local checkpoint directory: config, weight format and shards (headers only)."""
    path = Path(path)
    config = read_config(path)
    if (path / SAFE_INDEX).is_file():
        fmt, shards, index = "safetensors", _index_shards(path, SAFE_INDEX), path / SAFE_INDEX
    elif (path / "model.safetensors").is_file():
        fmt, shards, index = "safetensors", [Shard("model.safetensors", [])], None
    elif (path / BIN_INDEX).is_file():
        fmt, shards, index = "bin", _index_shards(path, BIN_INDEX), path / BIN_INDEX
    elif (path / "pytorch_model.bin").is_file():
        fmt, shards, index = "bin", [Shard("pytorch_model.bin", [])], None
    else:
        raise GqakitError(
            f"{path} has a config.json but no weights (model.safetensors, {SAFE_INDEX}, "
            "pytorch_model.bin or its index)."
        )
    ckpt = Checkpoint(path, config, fmt, shards, index, origin or str(path))
    reader = ckpt.reader()
    with reader:
        if fmt == "safetensors":
            for shard in shards:
                found = reader.safetensors_file(shard.file).tensors  # validates the header now
                if index is None:
                    shard.names = list(found)
                else:
                    absent = [n for n in shard.names if n not in found]
                    if absent:
                        raise GqakitError(
                            f"{path / shard.file} lacks {len(absent)} tensor(s) that the index puts there "
                            f"(first: {absent[0]!r}). The shard is corrupt or from another model."
                        )
                    shard.names = [n for n in found if n in set(shard.names)]
        elif index is None:
            shards[0].names = reader.shard_names(shards[0].file)
    return ckpt


@contextmanager
def resolve_checkpoint(src: str | Path) -> Iterator[Checkpoint]:
    """Yield a :class:`Checkpoint` for a directory, a ``.gguf`` file or a hub id.

    A ``.gguf`` file is dequantized once into the cache (:func:`gqakit.gguf.dequantize.dequantized_gguf`)
    and read from there by every later command.
    """
    text = str(src)
    path = Path(text).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        # deferred: importing the gqakit.gguf package loads the gguf library, needed only for GGUF sources
        from gqakit.gguf.dequantize import dequantized_gguf

        yield open_checkpoint_dir(dequantized_gguf(path), origin=str(path.resolve()))
        return
    if path.is_dir():
        yield open_checkpoint_dir(path.resolve(), origin=str(path.resolve()))
        return
    if path.exists():
        raise GqakitError(f"{path} is a file; give a model directory or a .gguf file.")
    if looks_like_hub_id(text):
        yield open_checkpoint_dir(download_from_hub(text), origin=text)
        return
    raise GqakitError(f"{text} does not exist. Give a model directory, a .gguf file or a hub id (org/name).")


def copy_non_weight_files(src: Path, dst: Path) -> list[str]:
    """Copy tokenizer, generation config and other small files; return their names."""
    copied = []
    for item in sorted(src.iterdir()):
        if (
            item.is_file()
            and item.name not in _NOT_COPIED_NAMES
            and not item.name.endswith(_NOT_COPIED_SUFFIXES)
        ):
            shutil.copy2(item, dst / item.name)
            copied.append(item.name)
    return copied

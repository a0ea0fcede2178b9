"""Reading Hugging Face model checkpoints, shared by every command: naming a model (:func:`model_source`),
reading its tensors one at a time from safetensors or legacy ``.bin`` shards, and copying the files that
are not weights.
Nothing here knows about attention: that lives in ``gqakit.convert``.
"""

from __future__ import annotations

import json
import os
import shutil
import zipfile
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import torch

from gqakit.assets import ASSETS, BUILT, MODEL_ASSETS, fetch_asset, read_manifest
from gqakit.dtypes import safetensors_name
from gqakit.errors import GqakitError, did_you_mean
from gqakit.safetensors_io import SafetensorsFile, check_finite
from gqakit.text import read_text_file

SAFE_INDEX = "model.safetensors.index.json"
# Files we regenerate or that hold weights; everything else in SRC (tokenizer, generation config,
# chat template, licence) is copied verbatim.
_NOT_COPIED_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5", ".ckpt")
# The records of the run that made a checkpoint (gqakit uptrain's metrics and recipe, HF Trainer's state)
# describe that run, not a model converted or trained from it: a copy would replace the new run's own.
_RUN_RECORDS = {"metrics.jsonl", "recipe.yaml", "trainer_state.json"}
BIN_INDEX = "pytorch_model.bin.index.json"
_NOT_COPIED_NAMES = {SAFE_INDEX, BIN_INDEX, "config.json", "gqakit.json", "README.md", *_RUN_RECORDS}


@dataclass
class Shard:
    """One weight file of a checkpoint and the tensor names it holds, in file order."""

    file: str
    names: list[str]


@dataclass
class Checkpoint:
    """A local Hugging Face checkpoint directory, indexed but not loaded."""

    path: Path
    config: dict[str, Any]  # config.json
    shards: list[Shard]  # weight files in order; one entry for an unsharded checkpoint
    index_file: Path | None = None  # the shard index, when the checkpoint is sharded
    origin: str = ""  # what the user named (a directory, a .gguf file, a hub id, an asset), for provenance
    # the checkpoint this one was rewritten from (a retargeted family's MHA rewrite in a temporary
    # directory), whose files the provenance hashes; None for the user's own
    derived_from: Checkpoint | None = field(default=None, repr=False)
    _infos: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict, repr=False)
    format: str = "safetensors"  # the weights' format: "safetensors" or "bin"

    @property
    def model_type(self) -> str:
        return str(self.config.get("model_type", ""))

    def tensor_infos(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Name -> (safetensors dtype name, shape) for every tensor, read from headers only."""
        if not self._infos:
            with self.reader() as reader:
                self._infos = {name: reader.info(name) for shard in self.shards for name in shard.names}
        return self._infos

    def reader(self) -> closing[TensorReader]:
        return closing(TensorReader(self))  # a with block closes its files


class TensorReader:
    """Reads tensors of a :class:`Checkpoint` by name, opening each shard once and lazily."""

    def __init__(self, ckpt: Checkpoint) -> None:
        self.ckpt = ckpt
        self._where = {n: s.file for s in ckpt.shards for n in s.names}
        self._safe: dict[str, SafetensorsFile] = {}
        self._bin: dict[str, dict[str, torch.Tensor]] = {}

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

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        shard = self._where[name]
        if self.ckpt.format == "safetensors":
            t = self.safetensors_file(shard).tensors[name]
            return t.dtype, t.shape
        v = self._bin_dict(shard)[name]
        return safetensors_name(v.dtype), tuple(v.shape)

    def read(self, name: str) -> torch.Tensor:
        """One tensor, decoded; a floating one that holds NaN/Inf is refused with its name."""
        shard = self._where[name]
        if self.ckpt.format == "safetensors":
            return self.safetensors_file(shard).read(name)
        return check_finite(name, self._bin_dict(shard)[name].clone(), self.ckpt.path / shard)

    def copy_raw(self, name: str, out: BinaryIO) -> None:
        """Copy a safetensors tensor's bytes straight into ``out`` unchanged (a floating one checked for
        NaN/Inf in the same read)."""
        self.safetensors_file(self._where[name]).copy_raw(name, out)


def read_config(path: Path, model_type: bool = False) -> dict[str, Any]:
    """``config.json`` of a checkpoint directory, a JSON object (naming its ``model_type`` when
    ``model_type``); one message when it is missing, not UTF-8 text or not JSON, or lacks that key."""
    cfg = path / "config.json"
    if not cfg.is_file():
        raise GqakitError(f"{path} has no config.json: point at a Hugging Face model directory.")
    config = _read_json(cfg, "a model config")
    if model_type and not config.get("model_type"):
        raise GqakitError(
            f'{cfg} has no model_type key: a Hugging Face config names its family there ("model_type": '
            '"llama"); add it, or point at the model\'s own directory.'
        )
    return config


def _read_json(file: Path, what: str) -> dict[str, Any]:
    """The JSON object in ``file`` (``what`` it should be, for the message)."""
    try:
        data = json.loads(read_text_file(file))
    except json.JSONDecodeError as e:
        raise GqakitError(f"{file} is not valid JSON ({e}): it should be {what}.") from None
    if not isinstance(data, dict):
        raise GqakitError(f"{file} holds a JSON {type(data).__name__}, not {what} (an object).")
    return data


def _index_shards(path: Path, index_name: str) -> list[Shard]:
    index_file = path / index_name
    weight_map = _read_json(index_file, "a shard index").get("weight_map")
    if not isinstance(weight_map, dict):
        raise GqakitError(f"{index_file} is not a valid shard index: it has no weight_map object.")
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
    config = read_config(path, model_type=True)
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
    ckpt = Checkpoint(path, config, shards, index, origin or str(path), format=fmt)
    with ckpt.reader() as reader:
        if fmt == "bin":
            if index is None:
                shards[0].names = list(reader._bin_dict(shards[0].file))  # the file's order
            return ckpt
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
                listed = set(shard.names)  # once, not per tensor
                shard.names = [n for n in found if n in listed]
    return ckpt


# What a conversion needs of a hub repository: config, weights (safetensors only) and tokenizer files.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*"]
FORMS = "a model directory, a .gguf file, a hub id (org/name) or an asset name (gqakit assets list)"


def _text_asset(name: str) -> GqakitError:
    models = ", ".join(MODEL_ASSETS)
    return GqakitError(f"The asset {name} holds text, not a model; the model assets are {models}.")


def _asset_model(name: str, root: Path, manifest: dict[str, Any]) -> Path:
    """The model directory of the asset ``name`` in ``root``; a text asset is refused."""
    files = manifest.get("files") or {}
    if "model" not in files:
        raise _text_asset(name)
    return root / files["model"]


def model_source(src: str | Path, cache_dir: str | Path | None = None) -> str:
    """SRC as ``from_pretrained`` and :func:`open_checkpoint_dir` take it: the one way every command that
    reads a model names it.

    * a model directory: itself; an asset's directory, as ``gqakit assets list`` prints it: its model;
    * a ``.gguf`` file: its copy dequantized once into the cache
      (:func:`gqakit.gguf.dequantize.dequantized_gguf`);
    * an asset name (``smollm2-135m``, ``replicate-mha``): the asset's model, fetched (or built) once;
    * a hub id (``org/name``): returned as given (downloaded by whoever opens it).

    Args:
        src: what the user named.
        cache_dir: where assets are cached (``gqakit assets fetch``).

    Raises:
        GqakitError: a file that is neither a directory nor a ``.gguf``; a name that is no path, no hub id
            and no asset, with the closest asset name.
    """
    text = str(src)
    path = Path(text).expanduser()
    if path.is_dir():
        manifest = None if (path / "config.json").is_file() else read_manifest(path)
        if manifest is not None:  # an asset's directory
            return str(_asset_model(path.name, path.resolve(), manifest))
        return str(path.resolve())
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise GqakitError(f"{path} is a file; give {FORMS}.")
        # deferred: importing the gqakit.gguf package loads the gguf library, needed only for GGUF sources
        from gqakit.gguf.dequantize import dequantized_gguf

        return str(dequantized_gguf(path))
    if text in ASSETS or text in BUILT:
        if text not in MODEL_ASSETS:
            raise _text_asset(text)
        asset = fetch_asset(text, cache_dir)
        return str(_asset_model(text, asset.root, asset.manifest))
    parts = text.split("/")
    if len(parts) == 2 and all(parts) and not text.startswith((".", "~")) and os.sep == "/":  # org/name
        return text
    hint = "" if "/" in text else did_you_mean(text, [*ASSETS, *BUILT])
    raise GqakitError(f"Model path {text} does not exist: give {FORMS}.{hint}")


def download_from_hub(repo_id: str) -> Path:
    """The local snapshot of ``repo_id`` (huggingface_hub's cache), or one message saying what to do
    offline."""
    try:
        # deferred: huggingface_hub is needed only for a hub id, and it is slow to import
        from huggingface_hub import snapshot_download

        local = snapshot_download(repo_id, allow_patterns=HUB_PATTERNS)
    except Exception as e:
        raise GqakitError(
            f"{repo_id!r} is not a local path, and fetching it from the Hugging Face Hub failed "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). If you are offline, "
            "download the model elsewhere and pass its local directory."
        ) from None
    return Path(local)


@contextmanager
def resolve_checkpoint(src: str | Path) -> Iterator[Checkpoint]:
    """Yield a :class:`Checkpoint` for any SRC :func:`model_source` takes (a hub id is downloaded)."""
    local = model_source(src)
    given = Path(str(src)).expanduser()
    path = Path(local) if Path(local).is_dir() else download_from_hub(local)
    yield open_checkpoint_dir(path, origin=str(given.resolve()) if given.exists() else str(src))


def copy_non_weight_files(src: Path, dst: Path) -> list[str]:
    """Copy tokenizer, generation config and other small files; return their names."""
    names = [f.name for f in sorted(src.iterdir()) if f.is_file() and f.name not in _NOT_COPIED_NAMES]
    copied = [name for name in names if not name.endswith(_NOT_COPIED_SUFFIXES)]
    for name in copied:
        shutil.copy2(src / name, dst / name)
    return copied

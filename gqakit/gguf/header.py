"""A GGUF file's geometry from its header alone: metadata and tensor infos, no weight is touched.

The header is parsed here rather than with ``gguf.GGUFReader``, which builds a numpy view for every
element of every array (the token list, the merges) and takes seconds on a 50k-token vocabulary; this
parser keeps scalars and short arrays, skips long arrays by their lengths, and finishes in
milliseconds. The layout is the GGUF spec's (version 2 and 3): magic, version, tensor count, key/value
count, the key/value pairs, then one info per tensor (name, dimensions, type, offset).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, Keys

from gqakit.errors import GqakitError
from gqakit.families import model_type_of_gguf
from gqakit.geometry import AttentionGeometry

# GGUF's scalar types, little-endian, as gguf-py's reader maps them.
_SCALARS = {t: np.dtype(n).newbyteorder("<") for t, n in GGUFReader.gguf_scalar_to_np.items()}
# Arrays longer than this (token lists, merges, scores) are skipped: only their length is kept.
_KEEP_ARRAY = 4096


@dataclass(frozen=True)
class SkippedArray:
    """A long array left unread: its element type and length."""

    type: str
    length: int


@dataclass
class GgufHeader:
    """What a GGUF header says about the model, in Hugging Face terms.

    Attributes:
        path: the file.
        version: GGUF version.
        arch: ``general.architecture`` (llama.cpp's name).
        name: ``general.name``, or ''.
        geometry: the attention geometry, its ``model_type`` the Hugging Face family the arch corresponds
            to (the arch name when unknown).
        intermediate_size: the MLP's width.
        context_length: trained context length.
        vocab_size: token count (``{arch}.vocab_size``, else the token list's length).
        parameters: elements over all tensors.
        dtypes: tensor type name (``F16``, ``Q8_0``...) -> elements stored in it.
        tensors: name -> (type name, shape in numpy order).
        metadata: every key/value; arrays over 4096 entries appear as :class:`SkippedArray`.
    """

    path: Path
    version: int
    arch: str
    name: str
    geometry: AttentionGeometry
    intermediate_size: int | None
    context_length: int | None
    vocab_size: int | None
    parameters: int
    dtypes: dict[str, int]
    tensors: dict[str, tuple[str, tuple[int, ...]]] = field(repr=False)
    metadata: dict[str, Any] = field(repr=False)


class _Cursor:
    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def unpack(self, fmt: str) -> Any:
        try:
            (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        except struct.error:
            raise GqakitError(f"{self.path} ends inside its GGUF header: the file is truncated.") from None
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        return self.unpack(f"<{n}s").decode("utf-8", errors="replace")

    def value(self, vtype: GGUFValueType) -> Any:
        if vtype in _SCALARS:
            dtype = _SCALARS[vtype]
            if self.pos + dtype.itemsize > len(self.buf):
                raise GqakitError(f"{self.path} ends inside its GGUF header: the file is truncated.")
            self.pos += dtype.itemsize
            return np.frombuffer(self.buf, dtype, 1, self.pos - dtype.itemsize)[0].item()
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            etype, n = GGUFValueType(self.unpack("<I")), self.unpack("<Q")
            if n <= _KEEP_ARRAY:
                return [self.value(etype) for _ in range(n)]
            if etype == GGUFValueType.STRING:
                for _ in range(n):
                    length = self.unpack("<Q")
                    self.pos += length
            elif etype in _SCALARS:
                self.pos += n * _SCALARS[etype].itemsize
            else:  # arrays of arrays: walk them
                for _ in range(n):
                    self.value(etype)
            return SkippedArray(etype.name, n)
        raise GqakitError(f"{self.path} has a metadata value of unknown type {vtype}: is it a GGUF file?")


def _first(value: Any) -> Any:
    # per-layer arrays (head counts of some architectures): the first layer's value stands for all
    return value[0] if isinstance(value, list) else value


def read_gguf_header(path: str | Path) -> GgufHeader:
    """Read the geometry, dtypes and parameter count of a ``.gguf`` file from its header.

    Raises:
        GqakitError: the file is missing, is not GGUF, is truncated, or lacks the geometry keys.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise GqakitError(f"{path} does not exist or is not a file.")
    with open(path, "rb") as fh:
        try:
            buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:
            raise GqakitError(f"{path} is empty, not a GGUF file.") from None
        with buf:
            return _parse(_Cursor(buf, path), path)


def _parse(cur: _Cursor, path: Path) -> GgufHeader:
    if cur.buf[:4] != b"GGUF":
        raise GqakitError(f"{path} is not a GGUF file (its first bytes are {bytes(cur.buf[:4])!r}).")
    cur.pos = 4
    version = cur.unpack("<I")
    if version not in (2, 3):
        raise GqakitError(f"{path} is GGUF version {version}; gqakit reads versions 2 and 3.")
    n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        meta[key] = cur.value(GGUFValueType(cur.unpack("<I")))
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    dtypes: dict[str, int] = {}
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.unpack("<Q") for _ in range(cur.unpack("<I"))]
        ttype = cur.unpack("<I")
        cur.unpack("<Q")  # offset into the data section
        try:
            tname = GGMLQuantizationType(ttype).name
        except ValueError:
            tname = f"type{ttype}"
        n = 1
        for d in dims:
            n *= d
        tensors[name] = (tname, tuple(reversed(dims)))  # GGUF lists ne (fastest first); numpy order
        dtypes[tname] = dtypes.get(tname, 0) + n
    arch = str(meta.get(Keys.General.ARCHITECTURE, ""))

    def key(template: str) -> Any:
        return _first(meta.get(template.format(arch=arch)))

    layers = key(Keys.LLM.BLOCK_COUNT)
    hidden = key(Keys.LLM.EMBEDDING_LENGTH)
    heads = key(Keys.Attention.HEAD_COUNT)
    stated = {"block_count": layers, "embedding_length": hidden, "attention.head_count": heads}
    missing = [k for k, v in stated.items() if v is None]
    if missing:
        raise GqakitError(
            f"{path} (architecture {arch!r}) has no {', '.join(f'{arch}.{m}' for m in missing)}: "
            "it does not describe a transformer gqakit can read."
        )
    tokens = meta.get(Keys.Tokenizer.LIST)
    vocab = key(Keys.LLM.VOCAB_SIZE)
    if vocab is None and tokens is not None:
        vocab = tokens.length if isinstance(tokens, SkippedArray) else len(tokens)
    return GgufHeader(
        path=path,
        version=version,
        arch=arch,
        name=str(meta.get(Keys.General.NAME, "")),
        geometry=AttentionGeometry(
            model_type=model_type_of_gguf(arch),
            num_layers=int(layers),
            hidden_size=int(hidden),
            num_heads=int(heads),
            num_kv_heads=int(key(Keys.Attention.HEAD_COUNT_KV) or heads),
            head_dim=int(key(Keys.Attention.KEY_LENGTH) or hidden // heads),
        ),
        intermediate_size=key(Keys.LLM.FEED_FORWARD_LENGTH),
        context_length=key(Keys.LLM.CONTEXT_LENGTH),
        vocab_size=vocab,
        parameters=sum(dtypes.values()),
        dtypes=dtypes,
        tensors=tensors,
        metadata=meta,
    )

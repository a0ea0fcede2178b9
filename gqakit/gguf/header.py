"""Reading a GGUF file: its geometry from the header alone, and its Hugging Face config.

The header is parsed here rather than with ``gguf.GGUFReader``, which builds a numpy view for every
element of every array (the token list, the merges) and takes seconds on a 50k-token vocabulary; this
parser keeps scalars and short arrays, skips long arrays by their lengths, and finishes in milliseconds.

The Hugging Face config (:func:`gguf_config`) is transformers' reading of the file with what that reading
loses put back.
"""

from __future__ import annotations

import json
import math
import mmap
import struct
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gguf import GGMLQuantizationType, GGUFValueType, Keys

from gqakit.errors import GqakitError
from gqakit.families import family_of, model_type_of_gguf
from gqakit.geometry import AttentionGeometry

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# GGUF's scalar types as little-endian ``struct`` formats (numpy, a call per value, is 6x slower).
_SCALARS = {
    GGUFValueType.UINT8: struct.Struct("<B"),
    GGUFValueType.INT8: struct.Struct("<b"),
    GGUFValueType.UINT16: struct.Struct("<H"),
    GGUFValueType.INT16: struct.Struct("<h"),
    GGUFValueType.UINT32: struct.Struct("<I"),
    GGUFValueType.INT32: struct.Struct("<i"),
    GGUFValueType.UINT64: struct.Struct("<Q"),
    GGUFValueType.INT64: struct.Struct("<q"),
    GGUFValueType.FLOAT32: struct.Struct("<f"),
    GGUFValueType.FLOAT64: struct.Struct("<d"),
    GGUFValueType.BOOL: struct.Struct("<?"),
}
_U32, _U64 = _SCALARS[GGUFValueType.UINT32], _SCALARS[GGUFValueType.UINT64]
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
        arch: ``general.architecture`` (llama.cpp's name).
        tensors: name -> (type name such as ``F16`` or ``Q8_0``, shape in numpy order).
        metadata: every key/value; arrays over 4096 entries appear as :class:`SkippedArray`.
        geometry: the attention geometry, its ``model_type`` the Hugging Face family the arch corresponds
            to (the arch name when unknown).
    """

    path: Path
    arch: str
    tensors: dict[str, tuple[str, tuple[int, ...]]] = field(repr=False)
    metadata: dict[str, Any] = field(repr=False)
    geometry: AttentionGeometry = field(init=False)

    def __post_init__(self) -> None:
        self.geometry = self._geometry()

    def key(self, name: str) -> Any:
        """The architecture's key ``{arch}.{name}`` (``block_count``...), None when absent; of a per-layer
        array (head counts of some architectures), the first layer's value, which stands for all."""
        value = self.metadata.get(f"{self.arch}.{name}")
        return value[0] if isinstance(value, list) else value

    def _geometry(self) -> AttentionGeometry:
        stated = {k: self.key(k) for k in ("block_count", "embedding_length", "attention.head_count")}
        missing = [f"{self.arch}.{k}" for k, v in stated.items() if v is None]
        if missing:
            raise GqakitError(
                f"{self.path} (architecture {self.arch!r}) has no {', '.join(missing)}: it does not describe "
                "a transformer gqakit can read."
            )
        layers, hidden, heads = (int(v) for v in stated.values())
        return AttentionGeometry(
            model_type=model_type_of_gguf(self.arch),
            num_layers=layers,
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(self.key("attention.head_count_kv") or heads),
            head_dim=int(self.key("attention.key_length") or hidden // heads),
        )

    @cached_property
    def dtypes(self) -> dict[str, int]:
        """Tensor type name -> elements stored in it."""
        out: dict[str, int] = {}
        for tname, shape in self.tensors.values():
            out[tname] = out.get(tname, 0) + math.prod(shape)
        return out

    @property
    def parameters(self) -> int:
        """Elements over all tensors."""
        return sum(self.dtypes.values())


class _Cursor:
    """The header's values read in order; reading past the end of the file (or a value of no known type)
    raises ``struct.error`` (``ValueError``), which :func:`read_gguf_header` reports."""

    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf, self.pos, self.end, self.path = buf, 0, len(buf), path

    def take(self, n: int) -> int:
        """Step over ``n`` bytes; where they start."""
        start, self.pos = self.pos, self.pos + n
        if self.pos > self.end:
            raise struct.error("past the end")
        return start

    def scalar(self, fmt: struct.Struct = _U64) -> Any:
        return fmt.unpack_from(self.buf, self.take(fmt.size))[0]

    def string(self) -> str:
        start = self.take(self.scalar())
        return self.buf[start : self.pos].decode("utf-8", errors="replace")

    def value(self, vtype: GGUFValueType) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == GGUFValueType.STRING:
            return self.string()
        etype, n = GGUFValueType(self.scalar(_U32)), self.scalar()  # an array
        if n <= _KEEP_ARRAY:
            return [self.value(etype) for _ in range(n)]
        if etype in _SCALARS:
            self.take(n * _SCALARS[etype].size)
        elif etype == GGUFValueType.STRING:
            length, pos = _U64.unpack_from, self.pos
            for _ in range(n):  # a vocabulary's 50k tokens: one call each, or this loop is the header's cost
                pos += 8 + length(self.buf, pos)[0]
            self.take(pos - self.pos)  # refused past the end
        else:  # arrays of arrays: walk them
            for _ in range(n):
                self.value(etype)
        return SkippedArray(etype.name, n)


def read_gguf_header(path: str | Path) -> GgufHeader:
    """Read the metadata and tensor infos of a ``.gguf`` file from its header.

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
        try:
            return _parse(_Cursor(buf, path))
        except (struct.error, ValueError):  # past the end, or a value type GGUF does not have
            raise GqakitError(
                f"{path} is truncated or corrupt: its GGUF header ends early or holds an unknown value type."
            ) from None


def _parse(cur: _Cursor) -> GgufHeader:
    if cur.buf[:4] != b"GGUF":
        raise GqakitError(f"{cur.path} is not a GGUF file (its first bytes are {bytes(cur.buf[:4])!r}).")
    cur.pos = 4
    version = cur.scalar(_U32)
    if version not in (2, 3):
        raise GqakitError(f"{cur.path} is GGUF version {version}; gqakit reads versions 2 and 3.")
    n_tensors, n_kv = cur.scalar(), cur.scalar()
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        meta[key] = cur.value(GGUFValueType(cur.scalar(_U32)))
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.scalar() for _ in range(cur.scalar(_U32))]
        ttype = cur.scalar(_U32)
        cur.take(8)  # the offset into the data section
        try:
            tname = GGMLQuantizationType(ttype).name
        except ValueError:
            tname = f"type{ttype}"
        tensors[name] = (tname, tuple(reversed(dims)))  # GGUF lists ne (fastest first); numpy order
    return GgufHeader(cur.path, str(meta.get(Keys.General.ARCHITECTURE, "")), tensors, meta)


RECORDED_CONFIG = "gqakit.hf_config"  # the metadata key: the source's config.json, as JSON
# Never taken from the record: what the file itself decides (which class reads it, the dtype it holds,
# whether it has an output tensor) and where the record came from.
_FILE_DECIDES = frozenset(
    {"model_type", "architectures", "tie_word_embeddings", "dtype", "torch_dtype", "quantization_config",
     "transformers_version", "auto_map"}
)  # fmt: skip
# Bias flags of a config -> the GGUF tensors they give a bias: transformers builds all of them or none.
_BIASES = {
    "attention_bias": ("attn_q", "attn_k", "attn_v", "attn_output"),
    "mlp_bias": ("ffn_gate", "ffn_up", "ffn_down"),
}


def gguf_config(path: str | Path) -> PretrainedConfig:
    """The Hugging Face config of a ``.gguf`` model, as faithful as the file allows: transformers' reading,
    with what llama.cpp's keys and tensors say that it loses (:func:`_derived`), and over that the config
    gqakit's export recorded (:data:`RECORDED_CONFIG`), where the file has one.

    Args:
        path: the GGUF file.

    Returns:
        The config to build the model from (pass it to ``from_pretrained(..., gguf_file=, config=)``).

    Raises:
        GqakitError: the file has bias tensors that transformers' model of its family cannot hold.
    """
    # deferred: transformers takes seconds to import
    from transformers import AutoConfig

    path = Path(path)
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    header = read_gguf_header(path)
    fields = config.to_dict()
    updates = _derived(header, fields, config.__class__.__name__)
    record = json.loads(header.metadata.get(RECORDED_CONFIG) or "{}")
    # only the fields transformers' class for this file has (a mistral record read as llama keeps llama's
    # fields): anything else would be carried along as a stray attribute
    updates.update({k: v for k, v in record.items() if k in fields and k not in _FILE_DECIDES})
    return config.__class__.from_dict({**fields, **updates})


def _derived(header: GgufHeader, fields: dict[str, Any], cls: str) -> dict[str, Any]:
    """What llama.cpp's keys and tensors say, for the fields transformers' class has."""
    tensors, key = header.tensors, header.key
    updates: dict[str, Any] = {}
    if "query_pre_attn_scalar" in fields:
        # the scale llama.cpp applies is the only one a file made for it can mean (GgufArch.wide_layers)
        g, arch = header.geometry, family_of(header.geometry.model_type).gguf
        wide = arch is not None and g.num_layers == arch.wide_layers
        updates["query_pre_attn_scalar"] = g.hidden_size // g.num_heads if wide else g.head_dim
    rope, dims = fields.get("rope_parameters"), key("rope.dimension_count")
    if isinstance(rope, dict) and "partial_rotary_factor" in rope and dims:
        updates["rope_parameters"] = {**rope, "partial_rotary_factor": int(dims) / header.geometry.head_dim}
    for flag, kinds in _BIASES.items():
        if flag not in fields:
            continue
        kinds = tuple(k for k in kinds if f"blk.0.{k}.weight" in tensors)  # phi3 fuses some of them
        biased = [k for k in kinds if f"blk.0.{k}.bias" in tensors]
        if biased and len(biased) < len(kinds):
            raise GqakitError(
                f"{header.path} has biases on {', '.join(biased)} but not on the rest of "
                f"{', '.join(kinds)}; transformers' {cls} has {flag} for all of them or none, so it cannot "
                "hold this model."
            )
        updates[flag] = bool(biased)
    return updates

"""Reading a GGUF file: its geometry from the header alone, and its Hugging Face config.

The header is parsed here rather than with ``gguf.GGUFReader``, which builds a numpy view for every
element of every array (the token list, the merges) and takes seconds on a 50k-token vocabulary; this
parser keeps scalars and short arrays, skips long arrays by their lengths, and finishes in
milliseconds. The layout is the GGUF spec's (version 2 and 3): magic, version, tensor count, key/value
count, the key/value pairs, then one info per tensor (name, dimensions, type, offset).

The Hugging Face config (:func:`gguf_config`) is transformers' reading of the file, with what that
reading leaves out put back. transformers rebuilds a config from a GGUF's llama.cpp keys
(``integrations/ggml.py``) and takes every other field from the config class's defaults, which are one
released checkpoint's values. Facts an export carries are lost that way, and each changes the logits:

* Gemma's ``query_pre_attn_scalar`` (the attention scale): llama.cpp has no key for it; transformers
  takes 256, whatever the model's head size.
* Phi-3's ``partial_rotary_factor``: llama.cpp states the rotary width as ``rope.dimension_count``,
  which transformers' phi3 reader drops, so every channel rotates.
* Llama's ``attention_bias`` and ``mlp_bias``: the bias tensors are in the file, but the config says
  there are none, so transformers builds a model without them and skips them without a word.

So gqakit's export records the config it wrote the file from (:data:`RECORDED_CONFIG`) and
:func:`gguf_config` restores it. A GGUF without that record (from llama.cpp's converter, or an older
gqakit) gets those facts derived from what llama.cpp itself reads (the rotary width, the bias tensors,
llama.cpp's attention scale rule), and a warning for each one it knows transformers ignores.
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
from gqakit.gguf.arch import llama_cpp_query_scalar

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
        path: the file.
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

    @property
    def vocab_size(self) -> int | None:
        """Token count: ``{arch}.vocab_size``, else the token list's length."""
        tokens = self.metadata.get(Keys.Tokenizer.LIST)
        if self.key("vocab_size") is not None or tokens is None:
            return self.key("vocab_size")
        return tokens.length if isinstance(tokens, SkippedArray) else len(tokens)

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
    """The header's values read in order, never past the end of the file."""

    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf, self.pos, self.end, self.path = buf, 0, len(buf), path

    def take(self, n: int) -> int:
        """Step over ``n`` bytes; where they start."""
        start, self.pos = self.pos, self.pos + n
        if self.pos > self.end:
            raise GqakitError(f"{self.path} ends inside its GGUF header: the file is truncated.")
        return start

    def scalar(self, fmt: struct.Struct = _U64) -> Any:
        return fmt.unpack_from(self.buf, self.take(fmt.size))[0]

    def string(self) -> str:
        start = self.take(self.scalar())
        return self.buf[start : self.pos].decode("utf-8", errors="replace")

    def vtype(self) -> GGUFValueType:
        code = self.scalar(_U32)
        try:
            return GGUFValueType(code)
        except ValueError:
            raise GqakitError(f"{self.path} has a value of unknown type {code}: is it a GGUF file?") from None

    def value(self, vtype: GGUFValueType) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == GGUFValueType.STRING:
            return self.string()
        etype, n = self.vtype(), self.scalar()  # an array
        if n <= _KEEP_ARRAY:
            return [self.value(etype) for _ in range(n)]
        if etype in _SCALARS:
            self.take(n * _SCALARS[etype].size)
        elif etype == GGUFValueType.STRING:
            length, pos = _U64.unpack_from, self.pos
            try:
                for _ in range(
                    n
                ):  # a vocabulary's 50k tokens: one call each, or this loop is the header's cost
                    pos += 8 + length(self.buf, pos)[0]
            except struct.error:
                pos = self.end + 1
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
        return _parse(_Cursor(buf, path))


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
        meta[key] = cur.value(cur.vtype())
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


Config = dict[str, Any]
RECORDED_CONFIG = "gqakit.hf_config"  # the metadata key: the source's config.json, as JSON
# Never taken from the record: what the file itself decides (which class reads it, the dtype it holds,
# whether it has an output tensor) and where the record came from.
_FILE_DECIDES = frozenset(
    {"model_type", "architectures", "tie_word_embeddings", "dtype", "torch_dtype", "quantization_config",
     "transformers_version", "auto_map"}
)  # fmt: skip
# Not recorded: a local path (``general.source.url`` states it), and the name transformers' GGUF reader
# gives a config (``general.name``).
_WHERE_FROM = ("_name_or_path", "_model_name_or_path")
# The geometry a record must share with its file: AttentionGeometry's names -> config.json's.
_GEOMETRY = {
    "num_layers": "num_hidden_layers",
    "hidden_size": "hidden_size",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
}
# Bias flags of a config -> the GGUF tensors they give a bias: transformers builds all of them or none.
_BIASES = {
    "attention_bias": ("attn_q", "attn_k", "attn_v", "attn_output"),
    "mlp_bias": ("ffn_gate", "ffn_up", "ffn_down"),
}


def recorded_config(cfg: Config) -> str:
    """What an export records under :data:`RECORDED_CONFIG`: ``cfg`` as JSON, without the names of where
    it was read from (``general.name`` and ``general.source.url`` say that)."""
    kept = {k: v for k, v in cfg.items() if k not in _WHERE_FROM}
    return json.dumps(kept, sort_keys=True, default=str)


def gguf_config(path: str | Path) -> tuple[PretrainedConfig, list[str]]:
    """The Hugging Face config of a ``.gguf`` model, as faithful as the file allows.

    Args:
        path: the GGUF file.

    Returns:
        The config to build the model from (pass it to ``from_pretrained(..., gguf_file=, config=)``),
        and warnings naming what the file states that the model built from it will not compute.

    Raises:
        GqakitError: the file has bias tensors that transformers' model of its family cannot hold.
    """
    # deferred: transformers takes seconds to import
    from transformers import AutoConfig

    path = Path(path)
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    header = read_gguf_header(path)
    fields = config.to_dict()
    record, warnings = _record(header)
    if record is not None:
        record = _current_names(record, config.__class__)
        # only the fields transformers' class for this file has (a mistral record read as llama keeps
        # llama's fields): anything else would be carried along as a stray attribute
        updates = {k: v for k, v in record.items() if k in fields and k not in _FILE_DECIDES}
    else:
        updates, ignored = _derived(header, fields, config.__class__.__name__)
        warnings += ignored
    return config.__class__.from_dict({**fields, **updates}), warnings


def _current_names(record: Config, cls: type[PretrainedConfig]) -> Config:
    """``record`` with transformers 4's names read as the class reads them today: a Hub config.json often
    still states ``rope_theta``, ``rope_scaling`` or ``partial_rotary_factor`` at the top level, which
    transformers 5 keeps inside ``rope_parameters``. The class's own reading converts them; the fields it
    fills from its defaults (those the record does not state) are left to the file."""
    try:
        read = cls.from_dict(dict(record)).to_dict()
        default = cls().to_dict()
    except Exception:  # a record this class cannot read (another family's): as recorded
        return record
    return {k: v for k, v in read.items() if k in record or default.get(k) != v}


def _record(header: GgufHeader) -> tuple[Config | None, list[str]]:
    """The recorded config, if any and if it describes this file's model."""
    text = header.metadata.get(RECORDED_CONFIG)
    if not isinstance(text, str):
        return None, []
    try:
        record = json.loads(text)
    except ValueError:
        record = None
    if not isinstance(record, dict):
        return None, [f"{header.path}'s {RECORDED_CONFIG} is not a JSON object: it is ignored."]
    stated = header.geometry
    try:
        recorded = AttentionGeometry.from_config(record)
    except (GqakitError, TypeError, ValueError, ZeroDivisionError):  # a record without the geometry
        recorded = None
    differ = [
        f"{name} {getattr(recorded, n, None)} (file: {getattr(stated, n)})"
        for n, name in _GEOMETRY.items()
        if getattr(recorded, n, None) != getattr(stated, n)
    ]
    if differ:
        # the file was rewritten after the export (or the record copied into another): its own keys win
        return None, [
            f"{header.path} records a config that is not this file's ({', '.join(differ)}): it is ignored, "
            "and the config is rebuilt from the file's own keys."
        ]
    return record, []


def _derived(header: GgufHeader, fields: Config, cls: str) -> tuple[Config, list[str]]:
    """Without a record: what llama.cpp's keys and tensors say, for the fields transformers' class has."""
    tensors, key = header.tensors, header.key
    updates: Config = {}
    if "query_pre_attn_scalar" in fields:
        # the scale llama.cpp applies is the only one a file made for it can mean
        g = header.geometry
        arch = family_of(g.model_type).gguf
        updates["query_pre_attn_scalar"] = llama_cpp_query_scalar(
            arch, g.num_layers, g.hidden_size, g.num_heads, g.head_dim
        )
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
    return updates, _ignored(header, fields)


def _ignored(header: GgufHeader, fields: Config) -> list[str]:
    """What the file states that no field of the transformers config takes (so the model ignores it)."""
    key, found = header.key, []
    if "rope_freqs.weight" in header.tensors:
        found.append("per-frequency rotary scaling (the rope_freqs tensor, llama3-style)")
    scaling = key("rope.scaling.type")
    if scaling not in (None, "none"):
        found.append(f"rotary scaling {scaling!r} ({header.arch}.rope.scaling.*)")
    rope = fields.get("rope_parameters") or {}
    swa_base = key("rope.freq_base_swa")
    sliding = rope.get("sliding_attention") if isinstance(rope.get("sliding_attention"), dict) else None
    if swa_base is not None and sliding and float(sliding.get("rope_theta", 0)) != float(swa_base):
        found.append(f"the sliding layers' rotary base {swa_base} (the config keeps {sliding['rope_theta']})")
    if key("attention.sliding_window_pattern") is not None:
        found.append("the per-layer sliding window pattern")
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if key(name) is not None and fields.get(name) != key(name):
            found.append(f"{name}={key(name)} (the config keeps {fields.get(name)})")
    if not found:
        return []
    return [
        f"{header.path} has no config recorded by gqakit's export, and transformers' GGUF reader ignores "
        f"{'; '.join(found)}: the model read from it differs from the one llama.cpp computes."
    ]

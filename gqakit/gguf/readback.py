"""A GGUF's Hugging Face config: transformers' reading of it, with what that reading leaves out put back.

transformers rebuilds a config from a GGUF's llama.cpp keys (``integrations/ggml.py``) and takes every
other field from the config class's defaults, which are one released checkpoint's values. Facts an
export carries are lost that way, and each changes the logits:

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
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gqakit.errors import GqakitError
from gqakit.families import family_of
from gqakit.geometry import AttentionGeometry
from gqakit.gguf.arch import llama_cpp_query_scalar
from gqakit.gguf.header import GgufHeader, read_gguf_header

if TYPE_CHECKING:
    from transformers import PretrainedConfig

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
    meta, tensors = header.metadata, header.tensors

    def key(name: str) -> Any:
        return meta.get(f"{header.arch}.{name}")

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
    return updates, _ignored(header, fields, key)


def _ignored(header: GgufHeader, fields: Config, key: Callable[[str], Any]) -> list[str]:
    """What the file states that no field of the transformers config takes (so the model ignores it)."""
    found = []
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

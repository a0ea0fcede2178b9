"""The Gemma families of the GGUF architecture table: how llama.cpp scales and windows their attention,
and Gemma 3's config in every form it ships in.

Gemma 3 configs come three ways, all of which describe the same text model:

* ``gemma3_text`` as transformers 5 writes it: ``rope_parameters`` per layer kind and ``layer_types``;
* ``gemma3_text`` as transformers 4.50-4.52 wrote it (the released 1B checkpoints): ``rope_theta``,
  ``rope_local_base_freq`` (the sliding layers' base), ``rope_scaling`` (full-attention layers only)
  and ``sliding_window_pattern`` in place of ``layer_types``;
* ``gemma3``, the multimodal model (4B and up): the text model's config under ``text_config``, often
  sparse (the 4B states six fields and takes the rest from ``Gemma3TextConfig``'s defaults), and its
  weights under ``language_model.model.*`` beside a vision tower.

:func:`gemma3_text_view` reads each through transformers' own ``Gemma3TextConfig``, which converts the
old names and fills the defaults exactly as the Hugging Face model does when it loads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gqakit.errors import GqakitError

Config = dict[str, Any]

# The layer counts of the 27B gemma2 / gemma3 models, which llama.cpp recognises by them.
_WIDTH_SCALED_LAYERS = {"gemma2": 46, "gemma3_text": 62}
# The multimodal Gemma 3's text weights, under the names the text model has (transformers 4.5x saves
# ``language_model.model.*``; 5.x loads ``model.language_model.*`` as well), and what is not text.
GEMMA3_TEXT_RENAMES: tuple[tuple[str, str], ...] = (
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
GEMMA3_NOT_TEXT: tuple[str, ...] = (
    "vision_tower.",
    "model.vision_tower.",
    "multi_modal_projector.",
    "model.multi_modal_projector.",
)


def llama_cpp_query_scalar(model_type: str, layers: int, hidden: int, heads: int, head_dim: int) -> int:
    """The ``query_pre_attn_scalar`` llama.cpp applies to a gemma2 / gemma3 model, whatever it states.

    llama.cpp scales queries by 1/sqrt(head_dim), or by 1/sqrt(hidden/heads) when the layer count is the
    27B model's (``llama_model::load_hparams``): right for every released Gemma, not for other shapes.
    """
    wide = layers == _WIDTH_SCALED_LAYERS.get(model_type)
    return hidden // heads if wide else head_dim


def attention_scale_check(cfg: Config) -> str | None:
    """A warning when llama.cpp will scale attention otherwise than ``query_pre_attn_scalar`` says."""
    scalar = cfg.get("query_pre_attn_scalar")
    if scalar is None:
        return None
    layers, hidden, heads = int(cfg["num_hidden_layers"]), cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    used = llama_cpp_query_scalar(str(cfg.get("model_type")), layers, hidden, heads, head_dim)
    if int(scalar) != used:
        wide = layers == _WIDTH_SCALED_LAYERS.get(str(cfg.get("model_type")))
        return (
            f"query_pre_attn_scalar={scalar}, but llama.cpp scales attention of this {layers}-layer model by "
            f"1/sqrt({used}) ({'hidden/heads' if wide else 'head_dim'}), so its logits will differ from "
            "transformers'."
        )
    return None


def softcap_check(cfg: Config) -> str | None:
    """A warning for a gemma2 without soft-caps: llama.cpp caps anyway, at its defaults."""
    # llama.cpp's gemma2 caps attention and final logits unconditionally, at 50 and 30 when the GGUF
    # states no value (llama_hparams defaults); transformers caps only when the config says so.
    absent = [k for k in ("attn_logit_softcapping", "final_logit_softcapping") if cfg.get(k) is None]
    if absent:
        return (
            f"{' and '.join(absent)} is None, but llama.cpp's gemma2 always soft-caps (at its defaults): "
            "its logits will differ from transformers'."
        )
    return None


def swa_pattern(default_period: int) -> Callable[[Config], list[bool] | None]:
    """Per-layer sliding flags, written only when they differ from the period llama.cpp assumes.

    llama.cpp marks layer ``i`` sliding when ``i % n < n - 1`` (``llama_hparams::set_swa_pattern``), n = 2
    for gemma2 and 6 for gemma3; an explicit bool array under ``attention.sliding_window_pattern``
    overrides it. Writing the array only when needed keeps older readers, which expect no array, working.
    """

    def get(cfg: Config) -> list[bool] | None:
        kinds = cfg.get("layer_types")
        if not kinds:
            return None
        flags = [k == "sliding_attention" for k in kinds]
        implied = [i % default_period < default_period - 1 for i in range(len(flags))]
        return None if flags == implied else flags

    return get


def gemma3_text_view(cfg: Config) -> Config:
    """A Gemma 3 config (any form in the module docstring) as the text model's, in transformers 5's names.

    Without this a legacy config exported its sliding layers with the full-attention base (1M instead of
    10k: ``rope_local_base_freq`` was not read), refused its linear scaling as if it applied to sliding
    layers too, and lost a ``sliding_window_pattern`` other than llama.cpp's 6; a multimodal one was not
    exported at all.
    """
    # deferred: transformers takes seconds to import, and only gemma3 exports need its config class
    from transformers import Gemma3TextConfig

    multimodal = cfg.get("model_type") == "gemma3"
    text = dict((cfg.get("text_config") or {}) if multimodal else cfg)
    text.pop("model_type", None)
    try:
        out = Gemma3TextConfig.from_dict(text).to_dict()
    except Exception as e:  # transformers' validation: ValueError, TypeError, huggingface_hub's strict errors
        reason = " ".join(str(e).split())  # one line: the strict validators' messages span several
        raise GqakitError(f"This Gemma 3 config is not one transformers can load: {reason}") from None
    if multimodal:
        # the multimodal model ties its lm_head by its own flag (Gemma3Config's default: tied), not the
        # text config's
        out["tie_word_embeddings"] = bool(cfg.get("tie_word_embeddings", True))
    return out


def gemma3_rename(hf_name: str) -> str | None:
    """A multimodal Gemma 3 tensor under the text model's name; None for the vision tower's tensors."""
    if hf_name.startswith(GEMMA3_NOT_TEXT):
        return None
    for old, new in GEMMA3_TEXT_RENAMES:
        if hf_name.startswith(old):
            return new + hf_name[len(old) :]
    return hf_name

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

from gguf import MODEL_ARCH, GGUFValueType, Keys

from gqakit.errors import GqakitError
from gqakit.gguf.arch import GgufArch, HParam, field_of, rope

Config = dict[str, Any]

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
    """A Gemma 3 text config (either form in the module docstring) in transformers 5's names.

    Without this a legacy config exported its sliding layers with the full-attention base (1M instead of
    10k: ``rope_local_base_freq`` was not read), refused its linear scaling as if it applied to sliding
    layers too, and lost a ``sliding_window_pattern`` other than llama.cpp's 6.
    """
    # deferred: transformers takes seconds to import, and only gemma3 exports need its config class
    from transformers import Gemma3TextConfig

    text = {k: v for k, v in cfg.items() if k != "model_type"}
    try:
        return Gemma3TextConfig.from_dict(text).to_dict()
    except Exception as e:  # transformers' validation: ValueError, TypeError, huggingface_hub's strict errors
        reason = " ".join(str(e).split())  # one line: the strict validators' messages span several
        raise GqakitError(f"This Gemma 3 config is not one transformers can load: {reason}") from None


def gemma3_multimodal_view(cfg: Config) -> Config:
    """The multimodal Gemma 3's text model config (its ``text_config``, often sparse)."""
    out = gemma3_text_view(cfg.get("text_config") or {})
    # the multimodal model ties its lm_head by its own flag (Gemma3Config's default: tied), not the text
    # config's
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


_U32, _F32, _BOOL = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.BOOL
_WINDOW = HParam(
    Keys.Attention.SLIDING_WINDOW, _U32, field_of("sliding_window"), config_name="sliding_window"
)
GEMMA2 = GgufArch(
    MODEL_ARCH.GEMMA2,
    norm_plus_one=True,
    has_output=False,  # llama.cpp's gemma and gemma2 always project with token_embd
    wide_layers=46,
    hparams=(
        HParam(Keys.LLM.ATTN_LOGIT_SOFTCAPPING, _F32, field_of("attn_logit_softcapping")),
        HParam(Keys.LLM.FINAL_LOGIT_SOFTCAPPING, _F32, field_of("final_logit_softcapping")),
        _WINDOW,
        HParam(Keys.Attention.SLIDING_WINDOW_PATTERN, _BOOL, swa_pattern(2)),
    ),
    checks=(softcap_check,),
)
# Every form of Gemma 3 config (legacy names; the multimodal one with its own view) is read as
# transformers 5's text config.
GEMMA3 = GgufArch(
    MODEL_ARCH.GEMMA3,
    norm_plus_one=True,
    hparams=(
        _WINDOW,
        HParam(Keys.Attention.SLIDING_WINDOW_PATTERN, _BOOL, swa_pattern(6)),
        # local layers rotate with their own base (10k), global ones with rope_theta (1M)
        HParam(Keys.Rope.FREQ_BASE_SWA, _F32, lambda c: rope(c, "sliding_attention").get("rope_theta")),
        HParam(Keys.LLM.FINAL_LOGIT_SOFTCAPPING, _F32, field_of("final_logit_softcapping")),
    ),
    layer_kinds=("full_attention", "sliding_attention"),
    wide_layers=62,
    view=gemma3_text_view,
)

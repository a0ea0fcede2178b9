"""How a Hugging Face family is laid out in GGUF, and the metadata llama.cpp reads for it.

Each family's :class:`GgufArch` is part of its entry in :data:`gqakit.families.FAMILIES`. The key names are
gguf-py's ``gguf.Keys`` templates (the GGUF spec as llama.cpp ships it), and what each family needs beyond
the common keys follows what llama.cpp's loader reads for that architecture (``src/models/<arch>.cpp``:
``load_arch_hparams``) and what its ``convert_hf_to_gguf.py`` writes.

The Gemma families' rules are here too (how llama.cpp scales and windows their attention), with Gemma 3's
config in every form it ships in, all of which describe the same text model:

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
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from gguf import MODEL_ARCH, MODEL_ARCH_NAMES, GGUFValueType, Keys

from gqakit.errors import GqakitError

_U32, _F32, _BOOL = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.BOOL
Config = dict[str, Any]


def head_dim(cfg: Config) -> int:
    """Channels per head: ``head_dim`` when stated (gemma: 256 regardless of width), else hidden / heads."""
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def kv_heads(cfg: Config) -> int:
    """K/V heads: ``num_key_value_heads``, or the query heads when absent (MHA, as in transformers)."""
    return int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])


def rope(cfg: Config, layer_kind: str = "full_attention") -> dict[str, Any]:
    """The rotary parameters of one kind of layer, whichever way the config spells them.

    transformers 5 keeps them in ``rope_parameters`` (nested per layer kind for gemma3); older configs
    have ``rope_theta`` and ``rope_scaling`` at the top level.
    """
    params = dict(cfg.get("rope_parameters") or {})
    if isinstance(params.get(layer_kind), dict):
        params = dict(params[layer_kind])
    legacy = cfg.get("rope_scaling") or {}
    out = {**legacy, **params}
    if "rope_theta" not in out and "rope_theta" in cfg:
        out["rope_theta"] = cfg["rope_theta"]
    out["rope_type"] = out.get("rope_type") or out.get("type") or "default"
    return out


@dataclass(frozen=True)
class HParam:
    """One GGUF metadata key and how to read its value from ``config.json``.

    Attributes:
        key: a ``gguf.Keys`` template with ``{arch}``.
        vtype: the GGUF value type (arrays: the element type).
        get: the config's field, or config -> value; a value of ``None`` means the config does not state
            it and the key is not written.
        required: a config without it (a field, named in the error) cannot be exported; every missing one
            is reported at once.
    """

    key: str
    vtype: GGUFValueType
    get: str | Callable[[Config], Any]
    required: bool = False

    def value(self, cfg: Config) -> Any:
        return cfg.get(self.get) if isinstance(self.get, str) else self.get(cfg)


# Every family: the keys llama.cpp's common loader (llama_model::load_hparams) reads for a transformer.
COMMON: tuple[HParam, ...] = (
    HParam(Keys.LLM.CONTEXT_LENGTH, _U32, "max_position_embeddings", required=True),
    HParam(Keys.LLM.EMBEDDING_LENGTH, _U32, "hidden_size", required=True),
    HParam(Keys.LLM.BLOCK_COUNT, _U32, "num_hidden_layers", required=True),
    HParam(Keys.LLM.FEED_FORWARD_LENGTH, _U32, "intermediate_size", required=True),
    HParam(Keys.Attention.HEAD_COUNT, _U32, "num_attention_heads", required=True),
    HParam(Keys.Attention.HEAD_COUNT_KV, _U32, kv_heads),
    # stated explicitly: llama.cpp otherwise derives hidden / heads, wrong for gemma's head_dim 256
    HParam(Keys.Attention.KEY_LENGTH, _U32, head_dim),
    HParam(Keys.Attention.VALUE_LENGTH, _U32, head_dim),
    # Keys.Rope.DIMENSION_COUNT: from the family's rotary width (gqakit.families.rotary_dims), see metadata
    HParam(Keys.Rope.FREQ_BASE, _F32, lambda c: rope(c).get("rope_theta")),
    HParam(Keys.Attention.LAYERNORM_RMS_EPS, _F32, "rms_norm_eps", required=True),
)
# Families with LayerNorm (phi): the same keys, with LayerNorm's epsilon in place of RMSNorm's.
COMMON_LAYERNORM: tuple[HParam, ...] = (
    *COMMON[:-1],
    HParam(Keys.Attention.LAYERNORM_EPS, _F32, "layer_norm_eps", required=True),
)


@dataclass(frozen=True)
class GgufArch:
    """How one Hugging Face family is laid out in GGUF.

    Attributes:
        arch: the gguf-py architecture; its name is ``general.architecture``.
        permute_qk: llama.cpp applies "normal" rotary to this architecture (pairs of adjacent channels,
            ``llama_model_rope_type``), while Hugging Face's checkpoints are laid out for ``rotate_half``
            (channel i paired with i + d/2), so Q and K rows must be reordered. NeoX-rotary
            architectures (qwen2, gemma*, phi3) use the Hugging Face order as it is.
        norm_plus_one: the family's RMSNorm computes ``x * (1 + w)``; llama.cpp multiplies by the stored
            weight, so ``w + 1`` is stored (convert_hf_to_gguf.py's gemma classes do the same).
        has_output: the architecture has an ``output.weight`` tensor. gemma and gemma2 in llama.cpp always
            reuse ``token_embd`` as the output projection.
        output_required: llama.cpp's loader requires ``output.weight`` (phi2 has no fallback to
            ``token_embd``), so a tied checkpoint writes a copy of the embedding there.
        hparams: keys beyond :data:`COMMON`.
        layer_kinds: kinds of layer with their own rotary parameters (gemma3's sliding layers rotate
            with a 10k base and no scaling; llama.cpp scales only the full-attention ones).
        checks: config -> a warning when llama.cpp will compute something transformers does not.
        layer_norm: the family normalises with LayerNorm (weight and bias), so its epsilon goes under
            llama.cpp's ``layer_norm_epsilon`` key (:data:`COMMON_LAYERNORM`).
        view: config -> the config under the common names (``hidden_size``, ``num_key_value_heads``...)
            for families that spell them their own way (gpt_bigcode: ``n_embd``, ``multi_query``).
        problems: config -> why llama.cpp's graph cannot compute this checkpoint at all (refused).
        qkv_per_head: the fused ``c_attn`` holds rows per head (``q_h k_h v_h``) when there is one K/V
            head per query head (gpt_bigcode without ``multi_query``); llama.cpp reads ``q | k | v``.
        rename: a checkpoint tensor name -> the name the text model has, or None for a tensor the GGUF
            leaves out (the multimodal Gemma 3's vision tower, which llama.cpp reads from an mmproj file).
        wide_layers: the layer count at which llama.cpp scales queries by 1/sqrt(hidden / heads) instead
            of 1/sqrt(head_dim) (gemma2 and gemma3: their 27B model's, which it recognises by it).
    """

    arch: MODEL_ARCH
    permute_qk: bool = False
    norm_plus_one: bool = False
    has_output: bool = True
    output_required: bool = False
    hparams: tuple[HParam, ...] = ()
    layer_kinds: tuple[str, ...] = ("full_attention",)
    checks: tuple[Callable[[Config], str | None], ...] = ()
    layer_norm: bool = False
    view: Callable[[Config], Config] | None = None
    qkv_per_head: bool = False
    problems: tuple[Callable[[Config], str | None], ...] = ()
    rename: Callable[[str], str | None] | None = None
    wide_layers: int | None = None

    def config(self, cfg: Config) -> Config:
        """``cfg`` under the names the common keys read."""
        return self.view(cfg) if self.view else cfg

    def text_name(self, name: str) -> str | None:
        """A checkpoint tensor under the text model's name (:attr:`rename`); None: not in the GGUF."""
        return self.rename(name) if self.rename else name

    @property
    def name(self) -> str:
        return MODEL_ARCH_NAMES[self.arch]

    @property
    def common(self) -> tuple[HParam, ...]:
        """The keys every architecture of this norm kind has."""
        return COMMON_LAYERNORM if self.layer_norm else COMMON


def sliding_window_check(cfg: Config) -> str | None:
    """A warning for a sliding window llama.cpp's llama architecture does not apply (mistral v0.1's)."""
    window, ctx = cfg.get("sliding_window"), cfg.get("max_position_embeddings") or 0
    if window and window < ctx:
        return (
            f"sliding_window={window} is smaller than the context ({ctx}): llama.cpp's llama architecture "
            f"attends to all tokens, so outputs differ from transformers' beyond {window} tokens."
        )
    return None


PHI3_KEYS = (
    HParam(Keys.Rope.SCALING_ORIG_CTX_LEN, _U32, "original_max_position_embeddings"),
    # llama.cpp reads 0 as "no window" (phi-4); phi-3's window is read but disabled by llama.cpp
    HParam(Keys.Attention.SLIDING_WINDOW, _U32, lambda c: c.get("sliding_window") or 0),
)


# The rotary scalings that have a GGUF form; another is refused rather than exported with the wrong
# positions. linear is stated in metadata; llama3 has no metadata form: llama.cpp reads per-frequency
# divisors from a ``rope_freqs`` tensor instead (see :func:`gqakit.gguf.tensors.rope_freqs_tensor`).
ROPE_TYPES = ("default", "llama3", "linear")


def metadata(
    arch: GgufArch, cfg: Config, rotary_dims: int
) -> tuple[list[tuple[str, GGUFValueType, Any]], list[str]]:
    """The architecture's metadata as ``(key, type, value)``, and warnings; every problem raised at once.
    ``rotary_dims``: the rotary channels of a head, which the family decides
    (:func:`gqakit.families.rotary_dims`)."""
    missing = [p.get for p in arch.common + arch.hparams if p.required and p.value(cfg) is None]
    problems = [f"config.json lacks {name!r}" for name in missing]
    problems += [p for problem in arch.problems if (p := problem(cfg))]
    rotary = [rope(cfg, kind) for kind in arch.layer_kinds]
    supported = ", ".join(ROPE_TYPES)
    for r in rotary:
        if r["rope_type"] not in ROPE_TYPES:
            problems.append(
                f"rope_type {r['rope_type']!r} has no GGUF form in gqakit (supported: {supported})"
            )
    if any(r["rope_type"] != "default" for r in rotary[1:]):
        problems.append("sliding layers must use default rotary: llama.cpp scales only full-attention ones")
    if problems:
        what = cfg.get("model_type")
        raise GqakitError(f"Cannot export this {what} checkpoint to GGUF: {'; '.join(problems)}.")
    out = [(Keys.Rope.DIMENSION_COUNT.format(arch=arch.name), _U32, rotary_dims)]
    for p in arch.common + arch.hparams:
        value = p.value(cfg)
        if value is not None:
            out.append((p.key.format(arch=arch.name), p.vtype, value))
    if rotary[0]["rope_type"] == "linear":
        out.append((Keys.Rope.SCALING_TYPE.format(arch=arch.name), GGUFValueType.STRING, "linear"))
        out.append((Keys.Rope.SCALING_FACTOR.format(arch=arch.name), _F32, float(rotary[0]["factor"])))
    # the query scale is checked where llama.cpp has a rule of its own (gemma2, gemma3)
    scale = (partial(attention_scale_check, arch),) if arch.wide_layers else ()
    warnings = [w for check in (*arch.checks, *scale) if (w := check(cfg))]
    return out, warnings


def llama_cpp_query_scalar(arch: GgufArch | None, layers: int, hidden: int, heads: int, head_dim: int) -> int:
    """The ``query_pre_attn_scalar`` llama.cpp applies to a model of ``arch`` (gemma2 / gemma3), whatever
    it states.

    llama.cpp scales queries by 1/sqrt(head_dim), or by 1/sqrt(hidden/heads) when the layer count is the
    27B model's (``llama_model::load_hparams``; :attr:`GgufArch.wide_layers`): right for every released
    Gemma, not for other shapes.
    """
    wide = arch is not None and layers == arch.wide_layers
    return hidden // heads if wide else head_dim


def attention_scale_check(arch: GgufArch, cfg: Config) -> str | None:
    """A warning when llama.cpp will scale attention otherwise than ``query_pre_attn_scalar`` says."""
    scalar = cfg.get("query_pre_attn_scalar")
    if scalar is None:
        return None
    layers, hidden, heads = int(cfg["num_hidden_layers"]), cfg["hidden_size"], cfg["num_attention_heads"]
    used = llama_cpp_query_scalar(arch, layers, hidden, heads, head_dim(cfg))
    if int(scalar) != used:
        rule = "hidden/heads" if layers == arch.wide_layers else "head_dim"
        return (
            f"query_pre_attn_scalar={scalar}, but llama.cpp scales attention of this {layers}-layer model by "
            f"1/sqrt({used}) ({rule}), so its logits will differ from transformers'."
        )
    return None


# The multimodal Gemma 3's text weights, under the names the text model has (transformers 4.5x saves
# ``language_model.model.*``; 5.x loads ``model.language_model.*`` as well), and what is not text.
GEMMA3_TEXT_RENAMES = (
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
GEMMA3_NOT_TEXT = (
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


_WINDOW = HParam(Keys.Attention.SLIDING_WINDOW, _U32, "sliding_window")
GEMMA2 = GgufArch(
    MODEL_ARCH.GEMMA2,
    norm_plus_one=True,
    has_output=False,  # llama.cpp's gemma and gemma2 always project with token_embd
    wide_layers=46,
    hparams=(
        HParam(Keys.LLM.ATTN_LOGIT_SOFTCAPPING, _F32, "attn_logit_softcapping"),
        HParam(Keys.LLM.FINAL_LOGIT_SOFTCAPPING, _F32, "final_logit_softcapping"),
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
        HParam(Keys.LLM.FINAL_LOGIT_SOFTCAPPING, _F32, "final_logit_softcapping"),
    ),
    layer_kinds=("full_attention", "sliding_attention"),
    wide_layers=62,
    view=gemma3_text_view,
)
# the multimodal Gemma 3 (``gemma3``): its text model, with the text config and weight names
GEMMA3_MM = replace(GEMMA3, view=gemma3_multimodal_view, rename=gemma3_rename)

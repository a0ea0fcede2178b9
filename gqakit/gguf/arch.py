"""How a Hugging Face family is laid out in GGUF, and the metadata llama.cpp reads for it.

Each family's :class:`GgufArch` is part of its entry in :data:`gqakit.families.FAMILIES`. The key names are
gguf-py's ``gguf.Keys`` templates (the GGUF spec as llama.cpp ships it), and what each family needs beyond
the common keys follows what llama.cpp's loader reads for that architecture (``src/models/<arch>.cpp``:
``load_arch_hparams``) and what its ``convert_hf_to_gguf.py`` writes. Gemma 3 is read in transformers 5's
``gemma3_text`` form (``rope_parameters`` per layer kind, ``layer_types``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gguf import MODEL_ARCH, MODEL_ARCH_NAMES, MODEL_TENSOR, MODEL_TENSORS, GGUFValueType, Keys

from gqakit.errors import GqakitError

_U32, _F32, _BOOL = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.BOOL
Config = dict[str, Any]
# One metadata key: (``gguf.Keys`` template with ``{arch}``, GGUF value type (arrays: the element type),
# the config's field of that name or config -> value). A value of None is not stated and not written.
Key = tuple[str, GGUFValueType, str | Callable[[Config], Any]]


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
    out = {"rope_theta": cfg.get("rope_theta"), **(cfg.get("rope_scaling") or {}), **params}
    out["rope_type"] = out.get("rope_type") or out.get("type") or "default"
    return out


# Every family: the keys llama.cpp's common loader (llama_model::load_hparams) reads for a transformer.
# Those read from a field by name are required: every one a config lacks is reported at once.
COMMON: tuple[Key, ...] = (
    (Keys.LLM.CONTEXT_LENGTH, _U32, "max_position_embeddings"),
    (Keys.LLM.EMBEDDING_LENGTH, _U32, "hidden_size"),
    (Keys.LLM.BLOCK_COUNT, _U32, "num_hidden_layers"),
    (Keys.LLM.FEED_FORWARD_LENGTH, _U32, "intermediate_size"),
    (Keys.Attention.HEAD_COUNT, _U32, "num_attention_heads"),
    (Keys.Attention.HEAD_COUNT_KV, _U32, kv_heads),
    # stated explicitly: llama.cpp otherwise derives hidden / heads, wrong for gemma's head_dim 256
    (Keys.Attention.KEY_LENGTH, _U32, head_dim),
    (Keys.Attention.VALUE_LENGTH, _U32, head_dim),
    # Keys.Rope.DIMENSION_COUNT: from the family's rotary width (gqakit.families.rotary_dims), see metadata
    (Keys.Rope.FREQ_BASE, _F32, lambda c: rope(c).get("rope_theta")),
)
_RMS_EPS: Key = (Keys.Attention.LAYERNORM_RMS_EPS, _F32, "rms_norm_eps")
_LAYERNORM_EPS: Key = (Keys.Attention.LAYERNORM_EPS, _F32, "layer_norm_eps")


@dataclass(frozen=True)
class GgufArch:
    """How one Hugging Face family is laid out in GGUF.

    Attributes:
        arch: the gguf-py architecture; its name is ``general.architecture``. Whether it has an
            ``output.weight`` is gguf-py's tensor list for it (gemma and gemma2 always reuse ``token_embd``).
        permute_qk: llama.cpp rotates pairs of adjacent channels in this architecture ("normal" rotary,
            ``llama_model_rope_type``), Hugging Face's checkpoints channel i with i + d/2 (``rotate_half``),
            so Q and K rows are reordered; NeoX-rotary ones (qwen2, gemma*, phi3) take HF's order.
        norm_plus_one: the family's RMSNorm computes ``x * (1 + w)``; llama.cpp multiplies by the stored
            weight, so ``w + 1`` is stored (convert_hf_to_gguf.py's gemma classes do the same).
        output_required: llama.cpp's loader requires ``output.weight`` (phi2 has no fallback to
            ``token_embd``), so a tied checkpoint writes a copy of the embedding there.
        hparams: keys beyond :data:`COMMON`.
        layer_kinds: kinds of layer with their own rotary parameters (gemma3's sliding layers rotate
            with a 10k base and no scaling; llama.cpp scales only the full-attention ones).
        layer_norm: the family normalises with LayerNorm: its epsilon goes under ``layer_norm_epsilon``.
        view: config -> the config under the common names (``hidden_size``, ``num_key_value_heads``...)
            for families that spell them their own way (gpt_bigcode: ``n_embd``, ``multi_query``).
        problems: config -> why llama.cpp's graph cannot compute this checkpoint at all (refused).
        qkv_per_head: the fused ``c_attn`` holds rows per head (``q_h k_h v_h``) when there is one K/V
            head per query head (gpt_bigcode without ``multi_query``); llama.cpp reads ``q | k | v``.
        wide_layers: the layer count at which llama.cpp scales queries by 1/sqrt(hidden / heads) instead
            of 1/sqrt(head_dim), whatever ``query_pre_attn_scalar`` says (gemma2 and gemma3: their 27B
            model's, which it recognises by it; ``llama_model::load_hparams``).
    """

    arch: MODEL_ARCH
    permute_qk: bool = False
    norm_plus_one: bool = False
    output_required: bool = False
    hparams: tuple[Key, ...] = ()
    layer_kinds: tuple[str, ...] = ("full_attention",)
    layer_norm: bool = False
    view: Callable[[Config], Config] = dict
    qkv_per_head: bool = False
    problems: tuple[Callable[[Config], str | None], ...] = ()
    wide_layers: int | None = None

    @property
    def name(self) -> str:
        return MODEL_ARCH_NAMES[self.arch]

    @property
    def has_output(self) -> bool:
        return MODEL_TENSOR.OUTPUT in MODEL_TENSORS[self.arch]


PHI3_KEYS: tuple[Key, ...] = (
    (Keys.Rope.SCALING_ORIG_CTX_LEN, _U32, "original_max_position_embeddings"),
    # llama.cpp reads 0 as "no window" (phi-4); phi-3's window is read but disabled by llama.cpp
    (Keys.Attention.SLIDING_WINDOW, _U32, lambda c: c.get("sliding_window") or 0),
)


# The rotary scalings that have a GGUF form; another is refused rather than exported with the wrong
# positions. linear is stated in metadata; llama3 has no metadata form: llama.cpp reads per-frequency
# divisors from a ``rope_freqs`` tensor instead (see :func:`gqakit.gguf.export._rope_freqs`).
ROPE_TYPES = ("default", "llama3", "linear")


def metadata(arch: GgufArch, cfg: Config, rotary_dims: int) -> list[tuple[str, GGUFValueType, Any]]:
    """The architecture's metadata as ``(key, type, value)``; every problem raised at once.
    ``rotary_dims``: the rotary channels of a head, which the family decides
    (:func:`gqakit.families.rotary_dims`)."""
    common = (*COMMON, _LAYERNORM_EPS if arch.layer_norm else _RMS_EPS)
    problems = [
        f"config.json lacks {get!r}" for _, _, get in common if isinstance(get, str) and cfg.get(get) is None
    ]
    problems += [p for problem in arch.problems if (p := problem(cfg))]
    rotary = [rope(cfg, kind) for kind in arch.layer_kinds]
    supported = ", ".join(ROPE_TYPES)
    unknown = [r["rope_type"] for r in rotary if r["rope_type"] not in ROPE_TYPES]
    problems += [f"rope_type {t!r} has no GGUF form in gqakit (supported: {supported})" for t in unknown]
    if any(r["rope_type"] != "default" for r in rotary[1:]):
        problems.append("sliding layers must use default rotary: llama.cpp scales only full-attention ones")
    if problems:
        what = cfg.get("model_type")
        raise GqakitError(f"Cannot export this {what} checkpoint to GGUF: {'; '.join(problems)}.")
    out = [(Keys.Rope.DIMENSION_COUNT.format(arch=arch.name), _U32, rotary_dims)]
    for key, vtype, get in (*common, *arch.hparams):
        value = cfg.get(get) if isinstance(get, str) else get(cfg)
        if value is not None:
            out.append((key.format(arch=arch.name), vtype, value))
    if rotary[0]["rope_type"] == "linear":
        out.append((Keys.Rope.SCALING_TYPE.format(arch=arch.name), GGUFValueType.STRING, "linear"))
        out.append((Keys.Rope.SCALING_FACTOR.format(arch=arch.name), _F32, float(rotary[0]["factor"])))
    return out


def swa_pattern(cfg: Config, n: int) -> list[bool] | None:
    """Per-layer sliding flags, only when they differ from the period ``n`` llama.cpp assumes.

    llama.cpp marks layer ``i`` sliding when ``i % n < n - 1`` (``llama_hparams::set_swa_pattern``), n = 2
    for gemma2 and 6 for gemma3; an explicit bool array under ``attention.sliding_window_pattern``
    overrides it. Writing the array only when needed keeps older readers, which expect no array, working.
    """
    flags = [k == "sliding_attention" for k in cfg.get("layer_types") or ()]
    return None if flags == [i % n < n - 1 for i in range(len(flags))] else flags  # no layer_types: none


def _transformers_4_form(cfg: Config) -> str | None:
    """Why a config in transformers 4.50-4.52's form is refused: its sliding layers' base
    (``rope_local_base_freq``) has no place in the names this layout reads."""
    if "rope_local_base_freq" in cfg:
        return "the config is in transformers 4's form: load and save it with transformers 5 first"
    return None


_WINDOW: Key = (Keys.Attention.SLIDING_WINDOW, _U32, "sliding_window")
GEMMA2 = GgufArch(
    MODEL_ARCH.GEMMA2,
    norm_plus_one=True,
    wide_layers=46,
    hparams=(
        (Keys.LLM.ATTN_LOGIT_SOFTCAPPING, _F32, "attn_logit_softcapping"),
        (Keys.LLM.FINAL_LOGIT_SOFTCAPPING, _F32, "final_logit_softcapping"),
        _WINDOW,
        (Keys.Attention.SLIDING_WINDOW_PATTERN, _BOOL, lambda c: swa_pattern(c, 2)),
    ),
)
GEMMA3 = GgufArch(
    MODEL_ARCH.GEMMA3,
    norm_plus_one=True,
    hparams=(
        _WINDOW,
        (Keys.Attention.SLIDING_WINDOW_PATTERN, _BOOL, lambda c: swa_pattern(c, 6)),
        # local layers rotate with their own base (10k), global ones with rope_theta (1M)
        (Keys.Rope.FREQ_BASE_SWA, _F32, lambda c: rope(c, "sliding_attention").get("rope_theta")),
        (Keys.LLM.FINAL_LOGIT_SOFTCAPPING, _F32, "final_logit_softcapping"),
    ),
    layer_kinds=("full_attention", "sliding_attention"),
    wide_layers=62,
    problems=(_transformers_4_form,),
)

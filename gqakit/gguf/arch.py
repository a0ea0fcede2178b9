"""How a Hugging Face family is laid out in GGUF, and the metadata llama.cpp reads for it.

Each family's :class:`GgufArch` is part of its entry in :data:`gqakit.families.FAMILIES`. The key names are
gguf-py's ``gguf.Keys`` templates (the GGUF spec as llama.cpp ships it), and what each family needs beyond
the common keys follows what llama.cpp's loader reads for that architecture (``src/models/<arch>.cpp``:
``load_arch_hparams``) and what its ``convert_hf_to_gguf.py`` writes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from gguf import MODEL_ARCH, MODEL_ARCH_NAMES, GGUFValueType, Keys

from gqakit.errors import GqakitError

if TYPE_CHECKING:
    import torch

_U32, _F32, _BOOL = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.BOOL
Config = dict[str, Any]


def head_dim(cfg: Config) -> int:
    """Channels per head: ``head_dim`` when stated (gemma: 256 regardless of width), else hidden / heads."""
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


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
        get: config -> value; ``None`` means the config does not state it and the key is not written.
        required: a config without it cannot be exported (every missing one is reported at once).
        config_name: the Hugging Face field, named in errors.
    """

    key: str
    vtype: GGUFValueType
    get: Callable[[Config], Any]
    required: bool = False
    config_name: str = ""


def field_of(name: str) -> Callable[[Config], Any]:
    return lambda cfg: cfg.get(name)


def _required(key: str, vtype: GGUFValueType, name: str) -> HParam:
    return HParam(key, vtype, field_of(name), required=True, config_name=name)


# Every family: the keys llama.cpp's common loader (llama_model::load_hparams) reads for a transformer.
COMMON: tuple[HParam, ...] = (
    _required(Keys.LLM.CONTEXT_LENGTH, _U32, "max_position_embeddings"),
    _required(Keys.LLM.EMBEDDING_LENGTH, _U32, "hidden_size"),
    _required(Keys.LLM.BLOCK_COUNT, _U32, "num_hidden_layers"),
    _required(Keys.LLM.FEED_FORWARD_LENGTH, _U32, "intermediate_size"),
    _required(Keys.Attention.HEAD_COUNT, _U32, "num_attention_heads"),
    # absent in a config means MHA, as in transformers
    HParam(
        Keys.Attention.HEAD_COUNT_KV,
        _U32,
        lambda c: c.get("num_key_value_heads") or c.get("num_attention_heads"),
        config_name="num_key_value_heads",
    ),
    # stated explicitly: llama.cpp otherwise derives hidden / heads, wrong for gemma's head_dim 256
    HParam(Keys.Attention.KEY_LENGTH, _U32, head_dim, config_name="head_dim"),
    HParam(Keys.Attention.VALUE_LENGTH, _U32, head_dim, config_name="head_dim"),
    # Keys.Rope.DIMENSION_COUNT: from the family's rotary width (gqakit.families.rotary_dims), see metadata
    HParam(Keys.Rope.FREQ_BASE, _F32, lambda c: rope(c).get("rope_theta"), config_name="rope_theta"),
    _required(Keys.Attention.LAYERNORM_RMS_EPS, _F32, "rms_norm_eps"),
)
# Families with LayerNorm (phi): the same keys, with LayerNorm's epsilon in place of RMSNorm's.
COMMON_LAYERNORM: tuple[HParam, ...] = (
    *COMMON[:-1],
    _required(Keys.Attention.LAYERNORM_EPS, _F32, "layer_norm_eps"),
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
    HParam(Keys.Rope.SCALING_ORIG_CTX_LEN, _U32, field_of("original_max_position_embeddings")),
    # llama.cpp reads 0 as "no window" (phi-4); phi-3's window is read but disabled by llama.cpp
    HParam(Keys.Attention.SLIDING_WINDOW, _U32, lambda c: c.get("sliding_window") or 0),
)


# Rotary scaling: rope_type -> the metadata it needs. A type missing here is refused rather than
# exported with the wrong positions. llama3 has no metadata form: llama.cpp reads per-frequency divisors
# from a ``rope_freqs`` tensor instead (see :func:`rope_freq_factors`).
ROPE_KEYS: dict[str, Callable[[dict[str, Any]], list[tuple[str, GGUFValueType, Any]]]] = {
    "default": lambda r: [],
    "llama3": lambda r: [],
    "linear": lambda r: [
        (Keys.Rope.SCALING_TYPE, GGUFValueType.STRING, "linear"),
        (Keys.Rope.SCALING_FACTOR, _F32, float(r["factor"])),
    ],
}


def rope_freq_factors(cfg: Config, dims: int) -> torch.Tensor | None:
    """For llama3 rotary scaling, the ``rope_freqs`` tensor: plain inverse frequency / scaled one (``dims``:
    the rotary channels of a head).

    llama.cpp divides each rotary frequency by this factor. The scaled frequencies come from transformers'
    own llama3 rule, so the GGUF rotates exactly as the Hugging Face model does.
    """
    if rope(cfg)["rope_type"] != "llama3":
        return None
    # deferred: transformers takes seconds to import
    import torch
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kw = {k: v for k, v in cfg.items() if k != "model_type"}
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](AutoConfig.for_model(cfg["model_type"], **kw), "cpu")
    theta = float(rope(cfg)["rope_theta"])
    plain = 1.0 / theta ** (torch.arange(0, dims, 2, dtype=torch.float64) / dims)
    return (plain / scaled.double()).float()


def metadata(
    arch: GgufArch, cfg: Config, rotary_dims: int
) -> tuple[list[tuple[str, GGUFValueType, Any]], list[str]]:
    """The architecture's metadata as ``(key, type, value)``, and warnings; every problem raised at once.
    ``rotary_dims``: the rotary channels of a head, which the family decides
    (:func:`gqakit.families.rotary_dims`)."""
    missing = [p.config_name for p in arch.common + arch.hparams if p.required and p.get(cfg) is None]
    problems = [f"config.json lacks {name!r}" for name in missing]
    problems += [p for problem in arch.problems if (p := problem(cfg))]
    rotary = [rope(cfg, kind) for kind in arch.layer_kinds]
    for r in rotary:
        if r["rope_type"] not in ROPE_KEYS:
            problems.append(
                f"rope_type {r['rope_type']!r} has no GGUF form in gqakit (supported: {', '.join(ROPE_KEYS)})"
            )
    if any(r["rope_type"] != "default" for r in rotary[1:]):
        problems.append("sliding layers must use default rotary: llama.cpp scales only full-attention ones")
    if problems:
        what = cfg.get("model_type")
        raise GqakitError(f"Cannot export this {what} checkpoint to GGUF: {'; '.join(problems)}.")
    out = [(Keys.Rope.DIMENSION_COUNT.format(arch=arch.name), _U32, rotary_dims)]
    for p in arch.common + arch.hparams:
        value = p.get(cfg)
        if value is not None:
            out.append((p.key.format(arch=arch.name), p.vtype, value))
    out += [(k.format(arch=arch.name), t, v) for k, t, v in ROPE_KEYS[rotary[0]["rope_type"]](rotary[0])]
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

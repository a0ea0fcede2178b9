"""Which GGUF architecture each Hugging Face family becomes, and the metadata llama.cpp reads for it.

One :class:`GgufArch` per ``config.model_type``; adding a family is adding an entry to :data:`ARCHS`.
The key names are gguf-py's ``gguf.Keys`` templates (the GGUF spec as llama.cpp ships it), and what each
family needs beyond the common keys follows what llama.cpp's loader reads for that architecture
(``src/models/<arch>.cpp``: ``load_arch_hparams``) and what its ``convert_hf_to_gguf.py`` writes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gguf import MODEL_ARCH, MODEL_ARCH_NAMES, GGUFValueType, Keys

from gqakit.errors import GqakitError, did_you_mean
from gqakit.gguf.arch_gemma import (
    attention_scale_check,
    gemma3_rename,
    gemma3_text_view,
    softcap_check,
    swa_pattern,
)
from gqakit.gguf.arch_layernorm import bigcode_view, gelu_only, gelu_problem

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


def rotary_dims(cfg: Config) -> int:
    frac = cfg.get("partial_rotary_factor") or rope(cfg).get("partial_rotary_factor") or 1.0
    return int(head_dim(cfg) * float(frac))


@dataclass(frozen=True)
class HParam:
    """One GGUF metadata key and how to read its value from ``config.json``.

    Attributes:
        key: a ``gguf.Keys`` template with ``{arch}``.
        vtype: the GGUF value type (arrays: the element type).
        get: config -> value; ``None`` means the config does not state it and the key is not written.
        required: a config without it cannot be exported (every missing one is reported at once).
        config_name: the Hugging Face field, named in errors and used by the header reader to map back.
    """

    key: str
    vtype: GGUFValueType
    get: Callable[[Config], Any]
    required: bool = False
    config_name: str = ""


def _field(name: str) -> Callable[[Config], Any]:
    return lambda cfg: cfg.get(name)


def _required(key: str, vtype: GGUFValueType, name: str) -> HParam:
    return HParam(key, vtype, _field(name), required=True, config_name=name)


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
    HParam(Keys.Rope.DIMENSION_COUNT, _U32, rotary_dims),
    HParam(Keys.Rope.FREQ_BASE, _F32, lambda c: rope(c).get("rope_theta"), config_name="rope_theta"),
    _required(Keys.Attention.LAYERNORM_RMS_EPS, _F32, "rms_norm_eps"),
)
# Families with LayerNorm (phi): the same keys, with LayerNorm's epsilon in place of RMSNorm's.
COMMON_LAYERNORM: tuple[HParam, ...] = (
    *COMMON[:-1],
    _required(Keys.Attention.LAYERNORM_EPS, _F32, "layer_norm_eps"),
)


def _sliding_window_check(cfg: Config) -> str | None:
    # llama.cpp's llama architecture has no sliding window: mistral v0.1's 4096-token window is not applied.
    window, ctx = cfg.get("sliding_window"), cfg.get("max_position_embeddings") or 0
    if window and window < ctx:
        return (
            f"sliding_window={window} is smaller than the context ({ctx}): llama.cpp's llama architecture "
            f"attends to all tokens, so outputs differ from transformers' beyond {window} tokens."
        )
    return None


@dataclass(frozen=True)
class GgufArch:
    """How one Hugging Face family is laid out in GGUF.

    Attributes:
        model_type: ``config.model_type``.
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
    """

    model_type: str
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


_GEMMA2_KEYS = (
    HParam(Keys.LLM.ATTN_LOGIT_SOFTCAPPING, _F32, _field("attn_logit_softcapping")),
    HParam(Keys.LLM.FINAL_LOGIT_SOFTCAPPING, _F32, _field("final_logit_softcapping")),
    HParam(Keys.Attention.SLIDING_WINDOW, _U32, _field("sliding_window"), config_name="sliding_window"),
    HParam(Keys.Attention.SLIDING_WINDOW_PATTERN, _BOOL, swa_pattern(2)),
)
_GEMMA3_KEYS = (
    HParam(Keys.Attention.SLIDING_WINDOW, _U32, _field("sliding_window"), config_name="sliding_window"),
    HParam(Keys.Attention.SLIDING_WINDOW_PATTERN, _BOOL, swa_pattern(6)),
    # local layers rotate with their own base (10k), global ones with rope_theta (1M)
    HParam(Keys.Rope.FREQ_BASE_SWA, _F32, lambda c: rope(c, "sliding_attention").get("rope_theta")),
    HParam(Keys.LLM.FINAL_LOGIT_SOFTCAPPING, _F32, _field("final_logit_softcapping")),
)
# Every form of Gemma 3 config (legacy names, multimodal) is read as transformers 5's text config.
_GEMMA3: dict[str, Any] = dict(
    arch=MODEL_ARCH.GEMMA3,
    norm_plus_one=True,
    hparams=_GEMMA3_KEYS,
    layer_kinds=("full_attention", "sliding_attention"),
    checks=(attention_scale_check,),
    view=gemma3_text_view,
)
_PHI3_KEYS = (
    HParam(Keys.Rope.SCALING_ORIG_CTX_LEN, _U32, _field("original_max_position_embeddings")),
    # llama.cpp reads 0 as "no window" (phi-4); phi-3's window is read but disabled by llama.cpp
    HParam(Keys.Attention.SLIDING_WINDOW, _U32, lambda c: c.get("sliding_window") or 0),
)


ARCHS: dict[str, GgufArch] = {
    a.model_type: a
    for a in (
        GgufArch("llama", MODEL_ARCH.LLAMA, permute_qk=True),
        # convert_hf_to_gguf.py writes MistralForCausalLM as the llama architecture
        GgufArch("mistral", MODEL_ARCH.LLAMA, permute_qk=True, checks=(_sliding_window_check,)),
        GgufArch("qwen2", MODEL_ARCH.QWEN2),
        GgufArch("gemma", MODEL_ARCH.GEMMA, norm_plus_one=True, has_output=False),
        GgufArch(
            "gemma2",
            MODEL_ARCH.GEMMA2,
            norm_plus_one=True,
            has_output=False,
            hparams=_GEMMA2_KEYS,
            checks=(attention_scale_check, softcap_check),
        ),
        # registered before gemma3 so that a gemma3 GGUF reads back as this text model
        GgufArch("gemma3_text", **_GEMMA3),
        # the multimodal Gemma 3 (4B and up): its text model, as convert_hf_to_gguf.py writes it
        GgufArch("gemma3", **_GEMMA3, rename=gemma3_rename),
        GgufArch("phi3", MODEL_ARCH.PHI3, hparams=_PHI3_KEYS),
        # phi (and GPT-NeoX / Pythia, which convert into phi): LayerNorm, biases, partial NeoX-style
        # rotary, lm_head with a bias; llama.cpp's phi2 graph reads n_head_kv (GQA/MQA) and takes q/k/v
        # as separate tensors or fused.
        GgufArch(
            "phi",
            MODEL_ARCH.PHI2,
            layer_norm=True,
            output_required=True,  # a tied phi (e.g. from a tied GPT-NeoX) gets output.weight written
            checks=(gelu_only("hidden_act"),),
            problems=(gelu_problem("hidden_act"),),
        ),
        # gpt_bigcode (and GPT-2 / OPT, which convert into it): learned positions, LayerNorm, fused c_attn;
        # llama.cpp's starcoder graph reads n_head_kv, so MQA keeps its one K/V head.
        GgufArch(
            "gpt_bigcode",
            MODEL_ARCH.STARCODER,
            layer_norm=True,
            view=bigcode_view,
            qkv_per_head=True,
            checks=(gelu_only("activation_function"),),
            problems=(gelu_problem("activation_function"),),
        ),
    )
}

# GGUF architecture name -> Hugging Face model_type, for reading a header back. The first family
# registered for an architecture wins (a mistral exports as llama and reads back as llama); a few
# architectures outside the export table are named here so that inspect can still name them.
ARCH_TO_MODEL_TYPE: dict[str, str] = {
    "command-r": "cohere",
    "gptneox": "gpt_neox",
}
for _a in ARCHS.values():
    ARCH_TO_MODEL_TYPE.setdefault(_a.name, _a.model_type)


def get_arch(model_type: str) -> GgufArch:
    """The export rules for ``model_type``, or a :class:`GqakitError` naming the supported families."""
    if model_type in ARCHS:
        return ARCHS[model_type]
    hint = did_you_mean(model_type, list(ARCHS))
    raise GqakitError(
        f"model_type {model_type!r} cannot be exported to GGUF: gqakit does not know llama.cpp's layout "
        f"for it.{hint} Supported families: {', '.join(sorted(ARCHS))}."
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


def rope_freq_factors(cfg: Config) -> torch.Tensor | None:
    """For llama3 rotary scaling, the ``rope_freqs`` tensor: plain inverse frequency / scaled one.

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
    dims = rotary_dims(cfg)
    theta = float(rope(cfg)["rope_theta"])
    plain = 1.0 / theta ** (torch.arange(0, dims, 2, dtype=torch.float64) / dims)
    return (plain / scaled.double()).float()


def metadata(arch: GgufArch, cfg: Config) -> tuple[list[tuple[str, GGUFValueType, Any]], list[str]]:
    """The architecture's metadata as ``(key, type, value)``, and warnings; every problem raised at once."""
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
        raise GqakitError(f"Cannot export this {arch.model_type} checkpoint to GGUF: {'; '.join(problems)}.")
    out = []
    for p in arch.common + arch.hparams:
        value = p.get(cfg)
        if value is not None:
            out.append((p.key.format(arch=arch.name), p.vtype, value))
    out += [(k.format(arch=arch.name), t, v) for k, t, v in ROPE_KEYS[rotary[0]["rope_type"]](rotary[0])]
    warnings = [w for check in arch.checks if (w := check(cfg))]
    return out, warnings

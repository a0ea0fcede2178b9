"""Everything gqakit knows of each model family, one :class:`Family` per ``config.model_type``
(docs/architecture.md, "a model family"): its attention tensors, or the rewrite into a stock class that
holds fewer K/V heads, or why it is refused; its llama.cpp layout; its K/V-head facts. Every command reads
it through :func:`family_of`, so no code outside this table asks which family it holds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gguf import MODEL_ARCH

from gqakit.errors import GqakitError, did_you_mean
from gqakit.family_parts import _ATTN, ArchAdapter, Config, Retarget
from gqakit.gguf.arch import GEMMA2, GEMMA3, PHI3_KEYS, GgufArch, rope
from gqakit.gguf.arch import head_dim as head_dim_of


@dataclass(frozen=True)
class Family:
    """Everything gqakit knows of one ``config.model_type`` (see the module docstring).

    Attributes:
        attention: where its attention tensors are, when ``convert`` converts it as it is.
        retarget: the rewrite into a stock class that holds fewer K/V heads, when that is how it converts.
        unsupported: why gqakit cannot convert it, when it is known not to.
        gguf: its llama.cpp layout, when ``export`` writes it.
        kv_heads: (config, query heads) -> the K/V heads of the weights: ``num_key_value_heads``, H when
            it states none (MHA), unless the family states them otherwise.
        cache_kv_heads: (config, the weights' K/V heads, query heads) -> the K/V heads each layer of
            transformers' KV cache holds: the weights', unless the family's attention broadcasts them first.
    """

    model_type: str
    attention: ArchAdapter | None = None
    retarget: Retarget | None = None
    unsupported: str | None = None
    gguf: GgufArch | None = None
    kv_heads: Callable[[Config, int], int] = lambda c, heads: int(c.get("num_key_value_heads") or heads)
    cache_kv_heads: Callable[[Config, int, int], int] = lambda c, kv_heads, heads: kv_heads

    def weight_kv_heads(self, config: Mapping[str, Any], heads: int) -> int:
        """The K/V heads of the weights ``config`` describes (H when it states none: MHA)."""
        return self.kv_heads(dict(config), heads)

    def cached_kv_heads(self, config: Mapping[str, Any], kv_heads: int, heads: int) -> int:
        """The K/V heads per layer of transformers' KV cache for this config: the weights', except where
        the family's attention broadcasts them first."""
        return self.cache_kv_heads(dict(config), kv_heads, heads)


def _family(model_type: str, roles: dict[str, Any] | None = None, **facts: Any) -> Family:
    """A family entry; ``roles`` (``{}``: the llama layout) makes it one ``convert`` converts as it is."""
    attention = None if roles is None else ArchAdapter(model_type, **roles)
    return Family(model_type, attention, **facts)


def _gpt2_problems(config: Config) -> list[str]:
    problems = []
    if config.get("scale_attn_by_inverse_layer_idx"):
        problems.append("scale_attn_by_inverse_layer_idx is set: gpt_bigcode scales every layer alike")
    if config.get("reorder_and_upcast_attn"):
        problems.append("reorder_and_upcast_attn is set: gpt_bigcode has no such attention path")
    if config.get("scale_attn_weights") is False:
        problems.append("scale_attn_weights is false: gpt_bigcode's flag of that name is not read by sdpa")
    return problems


def _opt_problems(config: Config) -> list[str]:
    problems = []
    if not config.get("do_layer_norm_before", True):
        problems.append("do_layer_norm_before is false (post-LN, as OPT-350m): gpt_bigcode is pre-LN")
    proj = config.get("word_embed_proj_dim")
    if proj is not None and proj != config["hidden_size"]:
        problems.append(
            f"word_embed_proj_dim {proj} != hidden_size {config['hidden_size']} (projected embeddings, as "
            "OPT-350m): gpt_bigcode has no embedding projection"
        )
    if config.get("_remove_final_layer_norm"):
        problems.append("_remove_final_layer_norm is set: gpt_bigcode always has its final LayerNorm")
    return problems


def _neox_problems(config: Config) -> list[str]:
    if not config.get("use_parallel_residual", True):
        return ["use_parallel_residual is false: its MLP reads the attention output, phi's block is parallel"]
    return []


def _falcon_kv_heads(config: Config, heads: int) -> int:
    # Falcon names them num_kv_heads, and its multi_query flag (on unless the config says otherwise,
    # FalconConfig's default) applies to the old decoder layout only; transformers' FalconAttention
    # reads num_kv_heads under new_decoder_architecture whatever multi_query says.
    if config.get("new_decoder_architecture"):
        return int(config.get("num_kv_heads") or heads)
    return 1 if config.get("multi_query", True) else heads


def _layernorm(arch: MODEL_ARCH, field: str, **kw: Any) -> GgufArch:
    """A LayerNorm architecture's GGUF rules (phi -> ``phi2``, gpt_bigcode -> ``starcoder``), whose graph
    applies GELU whatever the config's ``field`` says: another activation is refused (exact GELU is
    allowed, though llama.cpp computes its tanh approximation)."""

    def problem(cfg: Config) -> str | None:
        if cfg.get(field) not in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu"):  # tanh, exact
            return f"{field}={cfg.get(field)!r}: llama.cpp's graph for this family applies GELU instead"
        return None

    return GgufArch(arch, layer_norm=True, problems=(problem,), **kw)


def _bigcode_kv_heads(cfg: Config, heads: int) -> int:
    return 1 if cfg.get("multi_query") else heads  # gpt_bigcode states MQA as a flag


# GPT-2-style configs (gpt2, gpt_bigcode) store these under their own names (transformers' attribute_map).
_GPT2_NAMES = {"num_attention_heads": "n_head", "hidden_size": "n_embd", "num_hidden_layers": "n_layer"}


def common_names(cfg: Mapping[str, Any]) -> Config:
    """``cfg`` with the heads, width and layers also under their common names where a GPT-2-style config
    states them under its own."""
    return {**cfg, **{k: cfg[v] for k, v in _GPT2_NAMES.items() if k not in cfg and v in cfg}}


def _bigcode_view(cfg: Config) -> Config:
    """gpt_bigcode's config under the names the common GGUF keys read (``n_embd`` -> ``hidden_size``...)."""
    cfg = common_names(cfg)
    return {
        **cfg,
        "num_key_value_heads": _bigcode_kv_heads(cfg, cfg["num_attention_heads"]),
        "intermediate_size": cfg.get("n_inner") or 4 * cfg["hidden_size"],
        "max_position_embeddings": cfg["n_positions"],
        "layer_norm_eps": cfg.get("layer_norm_epsilon", 1e-5),
    }


_LLAMA: dict[str, Any] = {}  # q/k/v/o_proj under model.layers.{layer}.self_attn, full rotary
_LLAMA_GGUF = GgufArch(MODEL_ARCH.LLAMA, permute_qk=True)
_QK_NORM = dict(k_norm=f"{_ATTN}.k_norm", q_norm=f"{_ATTN}.q_norm")  # over head_dim, shared by heads

FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        _family("llama", _LLAMA, gguf=_LLAMA_GGUF),
        # convert_hf_to_gguf.py writes MistralForCausalLM as the llama architecture
        _family("mistral", _LLAMA, gguf=_LLAMA_GGUF),
        _family("qwen2", _LLAMA, gguf=GgufArch(MODEL_ARCH.QWEN2)),  # q/k/v biases: picked up as .bias
        _family("qwen3", _QK_NORM),
        _family("gemma", _LLAMA, gguf=GgufArch(MODEL_ARCH.GEMMA, norm_plus_one=True)),
        _family("gemma2", _LLAMA, gguf=GEMMA2),
        _family("gemma3_text", _QK_NORM, gguf=GEMMA3),
        # Phi3Config's partial_rotary_factor (default 1) limits rotary to the first channels of each head.
        _family(
            "phi3",
            dict(q=None, k=None, v=None, qkv=f"{_ATTN}.qkv_proj", partial_rotary=True),
            gguf=GgufArch(MODEL_ARCH.PHI3, hparams=PHI3_KEYS),
        ),
        # With qk_layernorm, one LayerNorm over head_dim, shared by the heads, on queries and on keys.
        # llama.cpp's phi2 graph (LayerNorm, biases, partial NeoX-style rotary, lm_head with a bias) reads
        # n_head_kv and takes q/k/v as separate tensors or fused; it has no fallback to token_embd, so a
        # tied phi (e.g. from a tied GPT-NeoX) gets output.weight written.
        _family(
            "phi",
            dict(o=f"{_ATTN}.dense", k_norm=f"{_ATTN}.k_layernorm", q_norm=f"{_ATTN}.q_layernorm",
                 partial_rotary=True),
            gguf=_layernorm(MODEL_ARCH.PHI2, "hidden_act", output_required=True),
        ),  # fmt: skip
        _family("olmo", _LLAMA),
        _family("olmo2", dict(k_norm_flat=f"{_ATTN}.k_norm", q_norm_flat=f"{_ATTN}.q_norm")),
        _family("granite", _LLAMA),
        _family("starcoder2", _LLAMA),
        _family(
            "stablelm",
            dict(
                k_norm_per_head=f"{_ATTN}.k_layernorm.norms.{{head}}",
                q_norm_per_head=f"{_ATTN}.q_layernorm.norms.{{head}}",
                partial_rotary=True,
            ),
        ),
        # The stock classes the retargeted families convert into hold fewer K/V heads: gpt_bigcode states
        # MQA as a flag; llama.cpp's starcoder graph reads n_head_kv, so MQA keeps its one K/V head.
        _family(
            "gpt_bigcode",
            gguf=_layernorm(
                MODEL_ARCH.STARCODER, "activation_function", view=_bigcode_view, qkv_per_head=True
            ),
            kv_heads=_bigcode_kv_heads,
        ),
        _family(
            "gpt2",
            retarget=Retarget(
                "gpt_bigcode",
                "GPTBigCode is GPT-2's block (learned positions, LayerNorm, GELU MLP, fused c_attn) with "
                "multi_query: one K/V head for all query heads",
                False, _gpt2_problems, "gqakit.convert.retarget_rewrites:GPT2",
            ),
        ),  # fmt: skip
        _family(
            "opt",
            retarget=Retarget(
                "gpt_bigcode",
                "pre-LN OPT is GPT-2's block with ReLU and learned positions at an offset of 2; GPTBigCode "
                "holds it with multi_query: one K/V head for all query heads",
                False, _opt_problems, "gqakit.convert.retarget_rewrites:OPT",
            ),
        ),  # fmt: skip
        _family(
            "gpt_neox",
            retarget=Retarget(
                "phi",
                "Phi is GPT-NeoX's parallel attention + MLP block (LayerNorm, biases, partial rotary) with "
                "num_key_value_heads; NeoX's second LayerNorm folds into fc1",
                True, _neox_problems, "gqakit.convert.retarget_rewrites:NEOX",
            ),
        ),  # fmt: skip
        # Families whose transformers attention has one K/V head per query head and no
        # num_key_value_heads: a checkpoint with fewer K/V heads would not load in them.
        _family("bloom", unsupported="BLOOM's fused query_key_value has one K/V head per query head"),
        _family("gptj", unsupported="GPT-J attention has one K/V head per query head"),
        _family(
            "falcon",
            unsupported="Falcon's transformers attention ties K/V heads to its own multi_query and "
            "new_decoder_architecture flags, not to num_key_value_heads",
            kv_heads=_falcon_kv_heads,
            # the new decoder architecture (Falcon-40B/180B) broadcasts its K/V heads to every query head
            # before it caches them, so transformers' cache holds H per layer (vLLM and llama.cpp hold G)
            cache_kv_heads=lambda c, kv, h: h if c.get("new_decoder_architecture") else kv,
        ),
        _family("t5", unsupported="T5 is an encoder-decoder whose attention has one K/V head per query head"),
        _family("bert", unsupported="BERT is an encoder whose attention has one K/V head per query head"),
    )
}  # fmt: skip

# The families convert converts as they are, by model_type (a view of FAMILIES, for listing them).
ADAPTERS: dict[str, ArchAdapter] = {t: f.attention for t, f in FAMILIES.items() if f.attention is not None}


def family_of(model: str | Mapping[str, Any] | Any) -> Family:
    """The entry of a ``model_type``, or of a config (a ``config.json`` dict or a transformers config); a
    family gqakit knows nothing of gets an empty entry (standard K/V heads, nothing to convert or export)."""
    if isinstance(model, Mapping):
        model = model.get("model_type")
    elif not isinstance(model, str):
        model = getattr(model, "model_type", None)
    return FAMILIES.get(str(model)) or Family(str(model))


def rotary_dims(config: Mapping[str, Any], head_dim: int | None = None) -> int:
    """Channels of each head that get rotary embeddings (an even number), for the key merge and for
    llama.cpp's ``rope.dimension_count``: transformers rotates the first ``head_dim *
    partial_rotary_factor`` (in ``rope_parameters``, or at the top level of an older config) in the
    families that read that factor, and all of ``head_dim`` in the others (``head_dim``: the config's)."""
    attention = family_of(config).attention
    factor = 1.0
    if attention is None or attention.partial_rotary:
        factor = rope(dict(config)).get("partial_rotary_factor") or config.get("partial_rotary_factor") or 1.0
    dim = int((head_dim or head_dim_of(dict(config))) * float(factor))
    return dim - dim % 2


def get_adapter(model_type: str) -> ArchAdapter:
    """The attention tensors of ``model_type``, or a :class:`GqakitError` that says what to do."""
    family = family_of(model_type)
    if family.attention is not None:
        return family.attention
    why = f"cannot run with fewer K/V heads in transformers: {family.unsupported}"
    raise _refused(model_type, why if family.unsupported else "is not supported", ADAPTERS)


def get_arch(model_type: str) -> GgufArch:
    """The llama.cpp layout of ``model_type``, or a :class:`GqakitError` naming the families that have one."""
    arch = family_of(model_type).gguf
    if arch is not None:
        return arch
    exported = [t for t, f in FAMILIES.items() if f.gguf is not None]
    why = "cannot be exported to GGUF: gqakit does not know llama.cpp's layout for it"
    raise _refused(model_type, why, exported)


def _refused(model_type: str, why: str, known: Iterable[str]) -> GqakitError:
    """``model_type`` refused for ``why``, naming the families that have what it lacks (and the nearest)."""
    known = sorted(known)
    hint = did_you_mean(model_type, known)
    return GqakitError(f"model_type {model_type!r} {why}.{hint} Supported families: {', '.join(known)}.")


def model_type_of_gguf(arch_name: str) -> str:
    """The ``model_type`` a ``.gguf`` of llama.cpp architecture ``arch_name`` reads back as: the first
    family exported under that name (a mistral exports as llama and reads back as llama); the name when
    none is."""
    return next((t for t, f in FAMILIES.items() if f.gguf and f.gguf.name == arch_name), arch_name)

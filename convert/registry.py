"""Architecture adapters: where each family keeps its attention tensors, as data.

An adapter names module paths with a ``{layer}`` placeholder (and ``{head}`` for per-head modules);
``.weight`` / ``.bias`` are appended when tensors are looked up, and a bias that a checkpoint does not
have is simply not there. Adding a family is adding one entry to :data:`ADAPTERS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gqakit.errors import GqakitError, did_you_mean

_ATTN = "model.layers.{layer}.self_attn"

# The module roles an adapter names; ArchAdapter.module/tensor take one of these.
Role = Literal[
    "q",
    "k",
    "v",
    "o",
    "qkv",
    "k_norm",
    "q_norm",
    "k_norm_flat",
    "q_norm_flat",
    "k_norm_per_head",
    "q_norm_per_head",
]
# The roles whose modules normalise keys after projection: a linear key merge is then not exact.
_KEY_NORM_ROLES: tuple[Role, ...] = ("k_norm", "k_norm_flat", "k_norm_per_head")


@dataclass(frozen=True)
class ArchAdapter:
    """Where one family keeps its attention tensors, and what its attention does with them.

    Attributes:
        model_type: ``config.model_type`` this adapter serves.
        q, k, v, o: module paths of the query, key, value and output projections. ``k``/``v`` are
            None when the family fuses them into ``qkv``.
        qkv: module path of a fused projection whose rows are ``q | k | v`` (phi3).
        k_norm_flat: a norm over all KV heads' channels at once, weight ``[kv_heads * head_dim]``
            (olmo2), which must be regrouped like a bias.
        q_norm_flat: the query-side counterpart, ``[heads * head_dim]`` (olmo2); only head
            permutations touch it.
        k_norm: one norm over ``head_dim`` shared by every key head (qwen3, gemma3, phi with
            ``qk_layernorm``); its weight is ``[head_dim]`` and no regrouping touches it.
        q_norm: its query-side counterpart. Nothing in a conversion touches it; it is named so that
            query/key-side refinement (``--refine-qk-lr``) trains it.
        k_norm_per_head / q_norm_per_head: one norm module per head, ``{head}`` in the path (stablelm
            with ``qk_layernorm``).
        rotary: keys get rotary embeddings.
        partial_rotary: the family may rotate only the first ``partial_rotary_factor`` of each head
            (read from the config's ``rope_parameters`` or top level); otherwise all of head_dim rotates.

    Whether keys are normalised after projection (which makes a linear key merge inexact) follows from
    the key-norm roles: :meth:`key_norm_modules` names them, and a checkpoint has them or not (stablelm's
    ``qk_layernorm`` is a config switch).
    """

    model_type: str
    q: str | None = f"{_ATTN}.q_proj"
    k: str | None = f"{_ATTN}.k_proj"
    v: str | None = f"{_ATTN}.v_proj"
    o: str = f"{_ATTN}.o_proj"
    qkv: str | None = None
    k_norm_flat: str | None = None
    q_norm_flat: str | None = None
    k_norm: str | None = None
    q_norm: str | None = None
    k_norm_per_head: str | None = None
    q_norm_per_head: str | None = None
    rotary: bool = True
    partial_rotary: bool = False

    def module(self, role: Role, layer: int, **kw: int) -> str | None:
        """Module path of ``role`` in ``layer`` (``head=`` for per-head roles), or None when this family
        has no such module."""
        template: str | None = getattr(self, role)
        return None if template is None else template.format(layer=layer, **kw)

    def tensor(self, role: Role, layer: int, part: str = "weight", **kw: int) -> str:
        """The tensor name of ``part`` (``weight``/``bias``) of ``role`` in ``layer``.

        Raises:
            GqakitError: naming the role and the family when the family has no such module.
        """
        module = self.module(role, layer, **kw)
        if module is None:
            raise GqakitError(f"the {self.model_type} adapter has no {role!r} module (layer {layer}).")
        return f"{module}.{part}"

    def key_input(self, layer: int) -> str:
        """The module whose input is the layer's K/V projection input: the key or the fused qkv projection."""
        return self.tensor("k" if self.k is not None else "qkv", layer).rsplit(".", 1)[0]

    def key_norm_modules(self, layer: int) -> list[str]:
        """The modules that normalise ``layer``'s keys after projection, as this family would name them
        (per-head ones for head 0); a checkpoint holds them or not."""
        found = (self.module(role, layer, head=0) for role in _KEY_NORM_ROLES)
        return [m for m in found if m is not None]

    def attention_module(self, layer: int) -> str:
        """Module path of ``layer``'s attention block (the parent of its output projection)."""
        return self.o.format(layer=layer).rsplit(".", 1)[0]


def _adapter(model_type: str, **kw: object) -> ArchAdapter:
    return ArchAdapter(model_type=model_type, **kw)  # type: ignore[arg-type]


ADAPTERS: dict[str, ArchAdapter] = {
    a.model_type: a
    for a in (
        _adapter("llama"),
        _adapter("mistral"),
        _adapter("qwen2"),  # q/k/v biases: picked up as .bias tensors
        # q_norm/k_norm over head_dim, shared by heads
        _adapter("qwen3", k_norm=f"{_ATTN}.k_norm", q_norm=f"{_ATTN}.q_norm"),
        _adapter("gemma"),
        _adapter("gemma2"),
        _adapter("gemma3_text", k_norm=f"{_ATTN}.k_norm", q_norm=f"{_ATTN}.q_norm"),
        # Phi3Config's partial_rotary_factor (default 1) limits rotary to the first channels of each head.
        _adapter("phi3", q=None, k=None, v=None, qkv=f"{_ATTN}.qkv_proj", partial_rotary=True),
        # With qk_layernorm, one LayerNorm over head_dim, shared by the heads, on queries and on keys.
        _adapter(
            "phi",
            o=f"{_ATTN}.dense",
            k_norm=f"{_ATTN}.k_layernorm",
            q_norm=f"{_ATTN}.q_layernorm",
            partial_rotary=True,
        ),
        _adapter("olmo"),
        _adapter(
            "olmo2",
            k_norm_flat=f"{_ATTN}.k_norm",
            q_norm_flat=f"{_ATTN}.q_norm",
        ),
        _adapter("granite"),
        _adapter("starcoder2"),
        _adapter(
            "stablelm",
            k_norm_per_head=f"{_ATTN}.k_layernorm.norms.{{head}}",
            q_norm_per_head=f"{_ATTN}.q_layernorm.norms.{{head}}",
            partial_rotary=True,
        ),
    )
}

# Families whose transformers attention has one K/V head per query head and no num_key_value_heads:
# a checkpoint with fewer K/V heads would not load in them, so converting would produce nothing usable.
# (GPT-2, OPT and GPT-NeoX are not here: they convert into a stock class that holds fewer, see
# gqakit.convert.retarget.)
UNSUPPORTED: dict[str, str] = {
    "bloom": "BLOOM attention has a fused query_key_value with one K/V head per query head",
    "gptj": "GPT-J attention has one K/V head per query head",
    "falcon": "Falcon's transformers attention ties K/V heads to its own multi_query and "
    "new_decoder_architecture flags, not to num_key_value_heads",
    "t5": "T5 is an encoder-decoder whose attention has one K/V head per query head",
    "bert": "BERT is an encoder whose attention has one K/V head per query head",
}


def get_adapter(model_type: str) -> ArchAdapter:
    """Return the adapter for ``model_type`` or raise a :class:`GqakitError` that says what to do."""
    if model_type in ADAPTERS:
        return ADAPTERS[model_type]
    supported = ", ".join(sorted(ADAPTERS))
    if model_type in UNSUPPORTED:
        raise GqakitError(
            f"model_type {model_type!r} cannot run with fewer K/V heads in transformers: "
            f"{UNSUPPORTED[model_type]}. Supported families: {supported}."
        )
    hint = did_you_mean(model_type, list(ADAPTERS))
    raise GqakitError(f"model_type {model_type!r} is not supported.{hint} Supported families: {supported}.")

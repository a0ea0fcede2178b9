"""The parts of a :class:`~gqakit.families.Family` entry that describe its tensors: where its attention
tensors are (:class:`ArchAdapter`, with the module :data:`Role` names), and the rewrite into a stock class
that holds fewer K/V heads (:class:`Retarget`, whose tensor half is a :class:`Rewrite`).

Module paths name ``{layer}`` (and ``{head}`` for per-head modules); ``.weight`` / ``.bias`` are
appended when tensors are looked up, and a bias that a checkpoint does not have is simply not there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, get_args

from gqakit.errors import GqakitError

Config = dict[str, Any]
_ATTN = "model.layers.{layer}.self_attn"

# The module roles an adapter names (ArchAdapter.module/tensor take one of these); those whose modules
# normalise keys after projection make a linear key merge inexact.
KeyNormRole = Literal["k_norm", "k_norm_flat", "k_norm_per_head"]
Role = Literal["q", "k", "v", "o", "qkv", "q_norm", "q_norm_flat", "q_norm_per_head"] | KeyNormRole
_KEY_NORM_ROLES: tuple[KeyNormRole, ...] = get_args(KeyNormRole)


@dataclass(frozen=True)
class ArchAdapter:
    """Where one family keeps its attention tensors, and what its attention does with them.

    Attributes:
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
            query/key-side refinement (``refine_qk_lr``) trains it.
        k_norm_per_head / q_norm_per_head: one norm module per head, ``{head}`` in the path (stablelm
            with ``qk_layernorm``).
        partial_rotary: the family may rotate only the first ``partial_rotary_factor`` of each head
            (:func:`rotary_dims`); otherwise all of head_dim rotates.
        rotary: the family rotates its keys at all (not gpt_bigcode's learned positions).
        qkv_per_head: the fused ``qkv`` rows go head by head, ``q_h | k_h | v_h`` (gpt_bigcode's MHA
            ``c_attn``), while every query head has its own K/V head; ``q | k | v`` once fewer.
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
    partial_rotary: bool = False
    rotary: bool = True
    qkv_per_head: bool = False

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


@dataclass(frozen=True)
class Retarget:
    """How a family whose transformers class has one K/V head per query head is re-expressed exactly in
    a stock class that holds fewer: its tensors are rewritten as the target's MHA checkpoint (the same
    logits), which then converts as any checkpoint of the target family.

    Attributes:
        target: the target ``config.model_type``.
        why: why this target, for ``gqakit inspect``.
        any_groups: the target holds any G dividing H (``phi``); else only 1 and H (``gpt_bigcode``'s
            ``multi_query``), and only the pooling methods, the calibrated merge and attention-output
            refinement at G = 1 reach it.
        problems: config -> the reasons this checkpoint cannot be held exactly (empty when it can).
        rewrite: ``module:attribute`` of its :class:`Rewrite` in the convert layer, which this shared
            layer may not import (:mod:`gqakit.convert.retarget` resolves it).
    """

    target: str
    why: str
    any_groups: bool
    problems: Callable[[Config], list[str]]
    rewrite: str

    def valid_groups(self, heads: int) -> list[int]:
        """The G the target class can hold for ``heads`` query heads."""
        if self.any_groups:
            return [g for g in range(1, heads + 1) if heads % g == 0]
        return [1, heads] if heads > 1 else [1]


@dataclass(frozen=True)
class Rewrite:
    """The tensor half of a :class:`Retarget`, which names it: pure functions in the convert layer
    (:mod:`gqakit.convert.retarget_rewrites`).

    Attributes:
        config: source config -> target MHA config.
        state: (source state dict, source config) -> target MHA state dict.
        weight_problems: (a function reading one source tensor by name, source config) -> the reasons
            found in the weights themselves (a zero LayerNorm gain that a fold divides by); it reads
            only the tensors it checks.
        attention: the target's attention tensors, where the registry converts no checkpoint of the
            target class as it is (gpt_bigcode); None: the target family's own.
    """

    config: Callable[[Config], Config]
    state: Callable[[dict[str, Any], Config], dict[str, Any]]
    weight_problems: Callable[[Callable[[str], Any], Config], list[str]] = lambda read, config: []
    attention: ArchAdapter | None = None

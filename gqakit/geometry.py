"""Attention geometry read from a Hugging Face ``config.json``, and what it implies for the KV cache:
keys and values for every layer, K/V head and token, ``2 * layers * G * head_dim * bytes`` per token, so
G sets the cache size directly (the groups themselves: docs/convert.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gqakit.errors import GqakitError
from gqakit.families import common_names, family_of

# The tensor-parallel degrees ``gqakit inspect`` shows: one node's GPUs, 1 to 8.
TP_DEGREES: tuple[int, ...] = (1, 2, 4, 8)


@dataclass(frozen=True)
class TensorParallelKV:
    """One GPU's share of the KV cache when a model is served with tensor parallelism of degree ``tp``."""

    tp: int
    kv_heads_per_gpu: int
    kv_bytes_per_gpu: int  # per token, over all layers
    # G < TP: each GPU still holds one whole K/V head (vLLM copies each head to TP / G GPUs), so the
    # per-GPU cache stops shrinking as TP grows
    replicated: bool
    # why transformers' own TP (tp_plan) refuses the model at this degree, or "": it splits the query and
    # the K/V projections by head, so TP must divide H and G (TP > G fails: transformers #48307)
    transformers_refuses: str = ""


@dataclass(frozen=True)
class AttentionGeometry:
    """The shape facts of a decoder's attention, as its config states them."""

    model_type: str
    num_layers: int
    hidden_size: int  # the model's width
    num_heads: int  # query heads H
    # key/value heads G (H for MHA, 1 for MQA) in the weights. A cache may hold more: transformers' Falcon
    # with new_decoder_architecture caches H (gqakit.families.Family.cached_kv_heads)
    num_kv_heads: int
    head_dim: int  # channels per head (not always hidden_size / H: gemma)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> AttentionGeometry:
        """Read the geometry from a config dict, applying transformers' own defaults."""
        common = common_names(config)  # gpt2 and gpt_bigcode name them their way
        try:
            heads = int(common["num_attention_heads"])
            hidden = int(common["hidden_size"])
            layers = int(common["num_hidden_layers"])
        except KeyError as e:
            raise GqakitError(
                f"config.json has no {e.args[0]!r}: is this a decoder-only causal LM?"
            ) from None
        kv = family_of(config).weight_kv_heads(config, heads)  # Falcon and gpt_bigcode state them their way
        head_dim = config.get("head_dim") or hidden // heads
        return cls(str(config.get("model_type")), layers, hidden, heads, int(kv), int(head_dim))

    @property
    def queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def valid_groups(self) -> list[int]:
        """The G that mean-pooling can reach from here: the divisors of the current KV heads."""
        return [g for g in range(1, self.num_kv_heads + 1) if self.num_kv_heads % g == 0]

    def kv_bytes_per_token(self, groups: int | None = None, dtype_bytes: int = 2) -> int:
        """KV-cache bytes one token costs over all layers, for ``groups`` KV heads (default: current)."""
        g = self.num_kv_heads if groups is None else groups
        return 2 * self.num_layers * g * self.head_dim * dtype_bytes

    def tensor_parallel_kv(self) -> list[TensorParallelKV]:
        """bf16 KV-cache bytes per GPU per token at each of :data:`TP_DEGREES`: each GPU holds G / TP K/V
        heads (at least one: with G < TP vLLM replicates each head on TP / G GPUs), and whether
        transformers' own TP refuses the model there."""
        h, g = self.num_heads, self.num_kv_heads
        out = []
        for tp in TP_DEGREES:
            heads = max(1, -(-g // tp))  # G / TP, rounded up; one whole head at least
            if tp > g:
                why = f"TP {tp} > {g} K/V heads"
            elif g % tp or h % tp:
                counts = [f"{n} {what}" for n, what in ((h, "query heads"), (g, "K/V heads")) if n % tp]
                why = f"TP {tp} does not divide {' or '.join(counts)}"
            else:
                why = ""
            out.append(TensorParallelKV(tp, heads, self.kv_bytes_per_token(heads), g < tp, why))
        return out

"""The bytes model of a decode step: KV-cache bytes (predicted and measured) and weight bytes read.

At small batch a decode step's memory traffic, not its arithmetic, sets the pace: it reads every weight
once and the whole KV cache once, so the speedup of fewer KV heads is bounded by the ratio of bytes moved
per step (:func:`bytes_moved_per_step`; the input embedding counts only when it doubles as the output
layer, since a lookup reads ``batch`` rows, not the table). These functions time nothing.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from gqakit.dtypes import torch_dtype
from gqakit.errors import GqakitError
from gqakit.families import family_of
from gqakit.geometry import AttentionGeometry


def _decoder_config(config) -> dict:
    as_dict = config if isinstance(config, dict) else config.to_dict()
    # Multimodal wrappers keep the decoder's numbers in text_config.
    if "num_attention_heads" not in as_dict and isinstance(as_dict.get("text_config"), dict):
        as_dict = as_dict["text_config"]
    return as_dict


def config_geometry(config) -> AttentionGeometry:
    """The attention geometry of a transformers config or a ``config.json`` dict."""
    return AttentionGeometry.from_config(_decoder_config(config))


def cache_geometry(config) -> AttentionGeometry:
    """The attention geometry of ``config`` as transformers' KV cache holds it: :func:`config_geometry`,
    with ``num_kv_heads`` the K/V heads each layer caches: the weights', except where the family's
    attention broadcasts them first (:meth:`gqakit.families.Family.cached_kv_heads`: Falcon's new decoder
    architecture caches H)."""
    c = _decoder_config(config)
    g = AttentionGeometry.from_config(c)
    return replace(g, num_kv_heads=family_of(c).cached_kv_heads(c, g.num_kv_heads, g.num_heads))


def layer_windows(config) -> list[int | None]:
    """Per decoder layer, the sliding window its attention (and so its KV cache) is limited to, or None
    for a layer that attends to every token: ``layer_types`` where the config has them (Gemma 2/3,
    Qwen 2/3 ...), else every layer when ``sliding_window`` is set and not switched off (Mistral)."""
    c = _decoder_config(config)
    n = AttentionGeometry.from_config(c).num_layers
    window = c.get("sliding_window")
    if not window or c.get("use_sliding_window") is False:
        return [None] * n
    types = c.get("layer_types")
    if types:
        return [window if t == "sliding_attention" else None for t in types]
    return [window] * n


def predicted_kv_bytes(
    config, batch: int, tokens: int, dtype: torch.dtype | str | int, static_cache: bool = False
) -> int:
    """KV-cache bytes for ``batch`` sequences of ``tokens`` in transformers' cache: 2 (K and V) * batch *
    the K/V heads it caches (G, but H for Falcon's new decoder architecture: :func:`cache_geometry`) *
    head_dim * bytes per element * the tokens each layer holds, which is ``tokens`` on a global layer and
    at most its window on a sliding-window layer (``window`` in a static cache, ``window - 1`` in the
    dynamic one, which drops the oldest token once the step has read it). ``config`` is a transformers
    config or a ``config.json`` dict."""
    c = _decoder_config(config)  # a transformers config turned into a dict once
    g = cache_geometry(c)
    held = sum(tokens if w is None else min(tokens, w if static_cache else w - 1) for w in layer_windows(c))
    element = dtype if isinstance(dtype, int) else torch_dtype(dtype).itemsize  # a byte count, or a dtype's
    return 2 * batch * g.num_kv_heads * held * g.head_dim * element


def measured_kv_bytes(cache) -> int:
    """Bytes of every key and value tensor a transformers ``Cache`` holds (transformers 5 has no legacy
    tuple caches)."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise GqakitError(f"Cannot measure a cache of type {type(cache).__name__}.")
    tensors = [t for layer in layers for t in (getattr(layer, "keys", None), getattr(layer, "values", None))]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def weight_bytes_per_step(model) -> int:
    """Weight bytes one decode step reads: every parameter once, except an input embedding table that
    is not also the output layer (a lookup reads only the rows of the current tokens)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    emb_in, emb_out = model.get_input_embeddings(), model.get_output_embeddings()
    if emb_in is not None and (emb_out is None or emb_out.weight is not emb_in.weight):
        total -= emb_in.weight.numel() * emb_in.weight.element_size()
    return total


def bytes_moved_per_step(model, batch: int, tokens: int) -> int:
    """Bytes one decode step moves: :func:`weight_bytes_per_step` + the KV cache at ``tokens``."""
    dtype = next(model.parameters()).dtype
    return weight_bytes_per_step(model) + predicted_kv_bytes(model.config, batch, tokens, dtype)

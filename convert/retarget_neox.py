"""GPT-NeoX (Pythia) re-expressed, exactly, as transformers' ``phi``, which holds fewer K/V heads.

Both are parallel-residual blocks (attention and MLP read the same ``x``) with LayerNorm, biases and
partial rotary in the rotate-half layout. Phi applies one LayerNorm to both branches where NeoX has two;
both normalise the same ``x``, so NeoX's second LayerNorm folds into ``fc1``:
``LN2(x) = (g2 / g1) * (LN1(x) - b1) + b2``, hence ``W1' = W1 diag(g2 / g1)`` and
``b1' = W1 (b2 - (g2 / g1) * b1) + c1``. Pure functions: config dict / state dict in, out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gqakit.convert.retarget_bigcode import carried
from gqakit.family_parts import Rewrite

Config = dict[str, Any]
StateDict = dict[str, torch.Tensor]


def neox_gain_problems(read: Callable[[str], torch.Tensor], config: Config) -> list[str]:
    """The layers whose first LayerNorm gain has a zero, which the LayerNorm fold divides by (``read``:
    one source tensor by name)."""
    layers = range(config["num_hidden_layers"])
    bad = [i for i in layers if (read(f"gpt_neox.layers.{i}.input_layernorm.weight") == 0).any()]
    if not bad:
        return []
    return [
        f"input_layernorm.weight has a zero in layer(s) {bad}: the second LayerNorm cannot be folded into "
        "fc1 (it divides by that gain)"
    ]


def neox_to_phi_config(config: Config) -> Config:
    """The phi config (MHA) that computes what ``config``'s GPT-NeoX computes."""
    # A config saved before transformers 5 names its scaling ``rope_scaling`` (with ``type``); transformers
    # reads it in place of ``rope_parameters`` (GPTNeoXConfig.convert_rope_params_to_dict), so do the same.
    rope = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
    legacy_type = rope.pop("type", None)
    rope.setdefault("rope_type", legacy_type or "default")
    rope.setdefault("rope_theta", config.get("rotary_emb_base", 10000.0))
    rope.setdefault("partial_rotary_factor", config.get("rotary_pct", 0.25))
    heads = config["num_attention_heads"]
    out = {
        "model_type": "phi",
        "architectures": ["PhiForCausalLM"],
        "vocab_size": config["vocab_size"],
        "hidden_size": config["hidden_size"],
        "intermediate_size": config["intermediate_size"],
        "num_hidden_layers": config["num_hidden_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "hidden_act": config.get("hidden_act", "gelu"),
        "max_position_embeddings": config.get("max_position_embeddings", 2048),
        "layer_norm_eps": config.get("layer_norm_eps", 1e-5),
        "rope_parameters": rope,
        "qk_layernorm": False,
        # phi ties lm_head.weight to the embedding as GPT-NeoX does (its lm_head bias stays its own)
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", False)),
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attention_dropout": 0.0,
    }
    return {**out, **carried(config)}


def neox_to_phi_state(state: StateDict, config: Config) -> StateDict:
    """GPT-NeoX tensors as phi tensors (MHA): q/k/v split from the per-head interleaved
    ``query_key_value``, the second LayerNorm folded into ``fc1``, ``embed_out`` as a biased ``lm_head``
    (the embedding itself when ``config`` ties them)."""
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    d = hidden // heads
    embed = state["gpt_neox.embed_in.weight"]
    out: StateDict = {
        "model.embed_tokens.weight": embed,
        "model.final_layernorm.weight": state["gpt_neox.final_layer_norm.weight"],
        "model.final_layernorm.bias": state["gpt_neox.final_layer_norm.bias"],
        "lm_head.bias": torch.zeros(embed.shape[0], dtype=embed.dtype),
    }
    # Tied (neox_to_phi_config keeps the tie): transformers' GPT-NeoX reads the embedding as its output
    # projection, whatever embed_out a checkpoint also holds, and so will phi; no lm_head.weight is written
    # (one tensor stored under two names is what safetensors refuses to save).
    if not config.get("tie_word_embeddings", False):
        # an untied checkpoint that lacks embed_out: the embedding is the best guess, as its own copy
        out["lm_head.weight"] = state["embed_out.weight"] if "embed_out.weight" in state else embed.clone()
    for i in range(config["num_hidden_layers"]):
        src, dst = f"gpt_neox.layers.{i}", f"model.layers.{i}"
        g1, b1 = state[f"{src}.input_layernorm.weight"], state[f"{src}.input_layernorm.bias"]
        g2, b2 = (
            state[f"{src}.post_attention_layernorm.weight"],
            state[f"{src}.post_attention_layernorm.bias"],
        )
        out[f"{dst}.input_layernorm.weight"], out[f"{dst}.input_layernorm.bias"] = g1, b1
        # [heads * 3 * d, hidden], rows per head: q_h, k_h, v_h
        w = state[f"{src}.attention.query_key_value.weight"].reshape(heads, 3, d, hidden)
        bias = state.get(f"{src}.attention.query_key_value.bias")
        b = (torch.zeros(heads * 3 * d, dtype=w.dtype) if bias is None else bias).reshape(heads, 3, d)
        for j, name in enumerate(("q_proj", "k_proj", "v_proj")):
            out[f"{dst}.self_attn.{name}.weight"] = w[:, j].reshape(heads * d, hidden).contiguous()
            out[f"{dst}.self_attn.{name}.bias"] = b[:, j].reshape(heads * d).contiguous()
        dense_w = state[f"{src}.attention.dense.weight"]
        dense_b = state.get(f"{src}.attention.dense.bias", torch.zeros(hidden, dtype=dense_w.dtype))
        out[f"{dst}.self_attn.dense.weight"], out[f"{dst}.self_attn.dense.bias"] = dense_w, dense_b
        # the fold is computed in float64: it divides by g1
        w1 = state[f"{src}.mlp.dense_h_to_4h.weight"].double()
        c1 = state[f"{src}.mlp.dense_h_to_4h.bias"].double()
        ratio = g2.double() / g1.double()
        out[f"{dst}.mlp.fc1.weight"] = (w1 * ratio).to(w.dtype)
        out[f"{dst}.mlp.fc1.bias"] = (w1 @ (b2.double() - ratio * b1.double()) + c1).to(w.dtype)
        out[f"{dst}.mlp.fc2.weight"] = state[f"{src}.mlp.dense_4h_to_h.weight"]
        out[f"{dst}.mlp.fc2.bias"] = state[f"{src}.mlp.dense_4h_to_h.bias"]
    return out


# The rewrite gqakit.families' gpt_neox entry names.
NEOX = Rewrite(neox_to_phi_config, neox_to_phi_state, neox_gain_problems)

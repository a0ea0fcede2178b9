"""The exact MHA rewrites that :data:`gqakit.families.FAMILIES` names for the families whose transformers
class has one K/V head per query head. Pure functions: config / state dict in, out.

* GPT-2 and pre-LN OPT as transformers' ``gpt_bigcode`` (GPT-2's block with an optional single K/V head,
  ``multi_query``). The mapping (transposed ``Conv1D`` weights, ``c_attn`` rows per head, OPT's query
  scale) is docs/convert.md's table.
* GPT-NeoX (Pythia) as transformers' ``phi``, which holds fewer K/V heads. Phi applies one LayerNorm to
  both parallel branches where NeoX has two; both normalise the same ``x``, so NeoX's second LayerNorm
  folds into ``fc1`` (docs/convert.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gqakit.family_parts import ArchAdapter, Rewrite

Config = dict[str, Any]
StateDict = dict[str, torch.Tensor]


def carried(config: Config) -> Config:
    """What a rewritten config keeps of its source's: the special tokens and the dtype it states."""
    keys = ("bos_token_id", "eos_token_id", "pad_token_id", "dtype", "torch_dtype")
    return {k: config[k] for k in keys if config.get(k) is not None}


def _bigcode_config(config: Config, **sizes: Any) -> Config:
    """A gpt_bigcode config (MHA) of ``sizes``, with what it keeps of the source ``config``."""
    return {
        "model_type": "gpt_bigcode",
        "architectures": ["GPTBigCodeForCausalLM"],
        **sizes,
        "scale_attn_weights": True,
        "multi_query": False,
        "tie_word_embeddings": config.get("tie_word_embeddings", True),
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        **carried(config),
    }


def gpt2_to_bigcode_config(config: Config) -> Config:
    """The gpt_bigcode config (MHA) that computes what ``config``'s GPT-2 computes."""
    hidden = config.get("n_embd", config.get("hidden_size"))
    return _bigcode_config(
        config,
        vocab_size=config["vocab_size"],
        n_positions=config.get("n_positions", 1024),
        n_embd=hidden,
        n_layer=config.get("n_layer"),
        n_head=config.get("n_head"),
        n_inner=config.get("n_inner") or 4 * hidden,
        activation_function=config.get("activation_function", "gelu_new"),
        layer_norm_epsilon=config.get("layer_norm_epsilon", 1e-5),
    )


def opt_to_bigcode_config(config: Config) -> Config:
    """The gpt_bigcode config (MHA) that computes what ``config``'s pre-LN OPT computes."""
    return _bigcode_config(
        config,
        vocab_size=config["vocab_size"],
        n_positions=config["max_position_embeddings"],
        n_embd=config["hidden_size"],
        n_layer=config["num_hidden_layers"],
        n_head=config["num_attention_heads"],
        n_inner=config["ffn_dim"],
        activation_function=config.get("activation_function", "relu"),
        layer_norm_epsilon=1e-5,  # OPT's nn.LayerNorm default eps
    )


def _per_head(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows ``q | k | v`` (each ``[heads * d, ...]``) as gpt_bigcode's MHA rows ``q_h | k_h | v_h``."""
    rest = q.shape[1:]
    stacked = torch.stack([t.reshape(heads, -1, *rest) for t in (q, k, v)], dim=1)
    return stacked.reshape(-1, *rest).contiguous()


def _strip(state: StateDict, prefix: str) -> StateDict:
    """Keys without ``prefix`` (hub checkpoints of both families exist with and without it)."""
    return {k.removeprefix(prefix): t for k, t in state.items()}


def gpt2_to_bigcode_state(state: StateDict, config: Config) -> StateDict:
    """GPT-2 tensors as gpt_bigcode tensors (MHA)."""
    s = _strip(state, "transformer.")
    heads = config.get("n_head")
    out: StateDict = {
        f"transformer.{n}": s[n] for n in ("wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias")
    }
    for i in range(config.get("n_layer")):
        h, o = f"h.{i}", f"transformer.h.{i}"
        for n in ("ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias", "attn.c_proj.bias"):
            out[f"{o}.{n}"] = s[f"{h}.{n}"]
        q, k, v = s[f"{h}.attn.c_attn.weight"].t().chunk(3, dim=0)
        out[f"{o}.attn.c_attn.weight"] = _per_head(q, k, v, heads)
        out[f"{o}.attn.c_attn.bias"] = _per_head(*s[f"{h}.attn.c_attn.bias"].chunk(3), heads)
        out[f"{o}.attn.c_proj.weight"] = s[f"{h}.attn.c_proj.weight"].t().contiguous()
        for n in ("c_fc", "c_proj"):
            out[f"{o}.mlp.{n}.weight"] = s[f"{h}.mlp.{n}.weight"].t().contiguous()
            out[f"{o}.mlp.{n}.bias"] = s[f"{h}.mlp.{n}.bias"]
    return _lm_head(state, out)


def _lm_head(state: StateDict, out: StateDict) -> StateDict:
    """An untied output projection carries over (a tied one is the embedding, which is already there)."""
    if "lm_head.weight" in state:
        out["lm_head.weight"] = state["lm_head.weight"]
    return out


def opt_to_bigcode_state(state: StateDict, config: Config) -> StateDict:
    """Pre-LN OPT tensors as gpt_bigcode tensors (MHA); positions from OPT's table past its offset of 2."""
    s = _strip(_strip(state, "model."), "decoder.")
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    dtype = s["embed_tokens.weight"].dtype

    def get(name: str, size: int, fill: float) -> torch.Tensor:
        # OPT without biases (enable_bias false) or affine LayerNorms: the identity values
        return s[name] if name in s else torch.full((size,), fill, dtype=dtype)

    out: StateDict = {
        "transformer.wte.weight": s["embed_tokens.weight"],
        "transformer.wpe.weight": s["embed_positions.weight"][2:].contiguous(),
        "transformer.ln_f.weight": get("final_layer_norm.weight", hidden, 1.0),
        "transformer.ln_f.bias": get("final_layer_norm.bias", hidden, 0.0),
    }
    for i in range(config["num_hidden_layers"]):
        h, o = f"layers.{i}", f"transformer.h.{i}"
        for src, dst in (("self_attn_layer_norm", "ln_1"), ("final_layer_norm", "ln_2")):
            out[f"{o}.{dst}.weight"] = get(f"{h}.{src}.weight", hidden, 1.0)
            out[f"{o}.{dst}.bias"] = get(f"{h}.{src}.bias", hidden, 0.0)
        qkv = [s[f"{h}.self_attn.{p}_proj.weight"] for p in "qkv"]
        out[f"{o}.attn.c_attn.weight"] = _per_head(*qkv, heads)
        out[f"{o}.attn.c_attn.bias"] = _per_head(
            *(get(f"{h}.self_attn.{p}_proj.bias", hidden, 0.0) for p in "qkv"), heads
        )
        out[f"{o}.attn.c_proj.weight"] = s[f"{h}.self_attn.out_proj.weight"]
        out[f"{o}.attn.c_proj.bias"] = get(f"{h}.self_attn.out_proj.bias", hidden, 0.0)
        for src, dst in (("fc1", "c_fc"), ("fc2", "c_proj")):
            w = s[f"{h}.{src}.weight"]
            out[f"{o}.mlp.{dst}.weight"] = w
            out[f"{o}.mlp.{dst}.bias"] = get(f"{h}.{src}.bias", w.shape[0], 0.0)
    return _lm_head(state, out)


# gpt_bigcode's attention as convert reads it: one fused c_attn, per head while it is MHA, and learned
# positions (keys merge like values). Only the rewrites below produce checkpoints of it to convert.
_BIGCODE_ATTN = "transformer.h.{layer}.attn"
BIGCODE = ArchAdapter(
    "gpt_bigcode",
    q=None,
    k=None,
    v=None,
    qkv=f"{_BIGCODE_ATTN}.c_attn",
    o=f"{_BIGCODE_ATTN}.c_proj",
    rotary=False,
    qkv_per_head=True,
)

# The rewrites gqakit.families' gpt2 and opt entries name.
GPT2 = Rewrite(gpt2_to_bigcode_config, gpt2_to_bigcode_state, attention=BIGCODE)
OPT = Rewrite(opt_to_bigcode_config, opt_to_bigcode_state, attention=BIGCODE)


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
        g1, b1 = (state[f"{src}.input_layernorm.{p}"] for p in ("weight", "bias"))
        g2, b2 = (state[f"{src}.post_attention_layernorm.{p}"] for p in ("weight", "bias"))
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

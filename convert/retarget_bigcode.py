"""GPT-2 and pre-LN OPT re-expressed, exactly, as transformers' ``gpt_bigcode`` (GPT-2's block with an
optional single K/V head, ``multi_query``), and the MQA step on it.

``gpt_bigcode`` holds either one K/V head per query head (its fused ``c_attn`` rows per head:
``q_h | k_h | v_h``) or one K/V head for all (``multi_query=True``: rows ``q | k | v``). GPT-2's ``Conv1D``
weights are ``[in, out]`` and transpose into ``nn.Linear``'s ``[out, in]``. OPT scales its query
projection (bias included) by ``head_dim ** -0.5``; ``gpt_bigcode`` scales the scores by the same factor
(``scale_attn_weights``), which is the same product. Pure functions: config / state dict in, out; what
a config must not ask for is in the families' entries (:data:`gqakit.families.FAMILIES`).
"""

from __future__ import annotations

from typing import Any

import torch

from gqakit.convert.pooling import regroup
from gqakit.family_parts import Rewrite

Config = dict[str, Any]
StateDict = dict[str, torch.Tensor]


def _bigcode_config(
    vocab: int, positions: int, hidden: int, layers: int, heads: int, inner: int, act: str, eps: float
) -> Config:
    return {
        "model_type": "gpt_bigcode",
        "architectures": ["GPTBigCodeForCausalLM"],
        "vocab_size": vocab,
        "n_positions": positions,
        "n_embd": hidden,
        "n_layer": layers,
        "n_head": heads,
        "n_inner": inner,
        "activation_function": act,
        "layer_norm_epsilon": eps,
        "scale_attn_weights": True,
        "multi_query": False,
        "tie_word_embeddings": True,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
    }


def carried(config: Config) -> Config:
    """What a rewritten config keeps of its source's: the special tokens and the dtype it states."""
    keys = ("bos_token_id", "eos_token_id", "pad_token_id", "dtype", "torch_dtype")
    return {k: config[k] for k in keys if config.get(k) is not None}


def _carry(config: Config, out: Config) -> Config:
    return {**out, "tie_word_embeddings": config.get("tie_word_embeddings", True), **carried(config)}


def gpt2_to_bigcode_config(config: Config) -> Config:
    """The gpt_bigcode config (MHA) that computes what ``config``'s GPT-2 computes."""
    hidden = config.get("n_embd", config.get("hidden_size"))
    inner = config.get("n_inner") or 4 * hidden
    out = _bigcode_config(
        config["vocab_size"], config.get("n_positions", 1024), hidden, config.get("n_layer"),
        config.get("n_head"), inner, config.get("activation_function", "gelu_new"),
        config.get("layer_norm_epsilon", 1e-5),
    )  # fmt: skip
    return _carry(config, out)


def opt_to_bigcode_config(config: Config) -> Config:
    """The gpt_bigcode config (MHA) that computes what ``config``'s pre-LN OPT computes."""
    out = _bigcode_config(
        config["vocab_size"], config["max_position_embeddings"], config["hidden_size"],
        config["num_hidden_layers"], config["num_attention_heads"], config["ffn_dim"],
        config.get("activation_function", "relu"), 1e-5,  # OPT's nn.LayerNorm default eps
    )  # fmt: skip
    return _carry(config, out)


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


# The rewrites gqakit.families' gpt2 and opt entries name.
GPT2 = Rewrite(gpt2_to_bigcode_config, gpt2_to_bigcode_state)
OPT = Rewrite(opt_to_bigcode_config, opt_to_bigcode_state)


def bigcode_to_mqa(state: StateDict, config: Config, method: str, seed: int = 0) -> StateDict:
    """gpt_bigcode MHA -> MQA: each layer's K and V heads pooled into one (``method``: mean, first or
    random, as :func:`gqakit.convert.pooling.regroup`), rows reordered to ``q | k | v``."""
    heads, hidden = config["n_head"], config["n_embd"]
    d = hidden // heads
    out = dict(state)
    gen = torch.Generator().manual_seed(seed)
    for i in range(config["n_layer"]):
        for part in ("weight", "bias"):
            name = f"transformer.h.{i}.attn.c_attn.{part}"
            t = state[name]
            rows = t.reshape(heads, 3, d, *t.shape[1:])
            init = "zeros" if part == "bias" else "normal"
            std = float(config.get("initializer_range", 0.02))
            k = regroup(rows[:, 1], 1, method, init=init, std=std, generator=gen)
            v = regroup(rows[:, 2], 1, method, init=init, std=std, generator=gen)
            q = rows[:, 0].reshape(hidden, *t.shape[1:])
            out[name] = torch.cat([q, k.reshape(d, *t.shape[1:]), v.reshape(d, *t.shape[1:])]).to(t.dtype)
    return out

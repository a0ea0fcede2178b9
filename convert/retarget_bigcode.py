"""GPT-2 and pre-LN OPT re-expressed, exactly, as transformers' ``gpt_bigcode`` (GPT-2's block with an
optional single K/V head, ``multi_query``), and where convert finds that class's attention tensors.

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

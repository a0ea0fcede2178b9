"""The LayerNorm families of the GGUF architecture table (phi -> llama.cpp ``phi2``, gpt_bigcode ->
``starcoder``): their activation checks and gpt_bigcode's config under the common names."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Config = dict[str, Any]

# llama.cpp's phi2 and starcoder graphs apply GELU in its tanh form, whatever the config says.
_GELU_TANH = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


def gelu_only(field: str) -> Callable[[Config], str | None]:
    """A check that warns when the config's ``field`` asks for exact GELU (llama.cpp uses the tanh form)."""

    def check(cfg: Config) -> str | None:
        act = cfg.get(field)
        if act == "gelu":
            return (
                f"{field}='gelu' (exact) but llama.cpp computes GELU's tanh approximation: logits differ "
                "slightly from transformers'."
            )
        return None

    return check


def gelu_problem(field: str) -> Callable[[Config], str | None]:
    """A problem (export refused) when the config's ``field`` names an activation other than GELU."""

    def problem(cfg: Config) -> str | None:
        act = cfg.get(field)
        if act not in (*_GELU_TANH, "gelu"):
            return f"{field}={act!r}: llama.cpp's graph for this family applies GELU (another model)"
        return None

    return problem


def bigcode_view(cfg: Config) -> Config:
    """gpt_bigcode's config under the names the common keys read (``n_embd`` -> ``hidden_size``...)."""
    hidden, heads = cfg["n_embd"], cfg["n_head"]
    return {
        **cfg,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_hidden_layers": cfg["n_layer"],
        "num_key_value_heads": 1 if cfg.get("multi_query") else heads,
        "intermediate_size": cfg.get("n_inner") or 4 * hidden,
        "max_position_embeddings": cfg["n_positions"],
        "layer_norm_eps": cfg.get("layer_norm_epsilon", 1e-5),
    }

"""Tiny random checkpoints and a tiny tokenizer, built in code, for the tests and benchmarks (``from
tiny_models import ...``: tests/conftest.py puts tests/ on the path). Nothing here touches the network.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

# Our own filler text: enough distinct words to train a small byte-level BPE and fill a few windows.
TINY_TEXT = (
    "Grouped-query attention lets several query heads share one key and value head. "
    "A converted checkpoint keeps every other weight and only pools the key and value projections. "
    "The cache that stores keys and values shrinks by the number of query heads per group, "
    "so decoding long sequences moves fewer bytes from memory on every step. "
    "Uptraining for a small fraction of the original steps recovers most of the lost quality. "
    "Rivers carry sand to the sea, where waves sort it into beaches of fine grains. "
    "In spring the orchard blooms white and pink, and bees work from dawn until dusk. "
    "The old library kept maps of coasts that no longer exist, drawn by hand in faded ink. "
)


def tiny_tokenizer(vocab_size: int = 384):
    """A byte-level BPE tokenizer trained on :data:`TINY_TEXT` in milliseconds.

    Special tokens: ``<pad>`` = 0, ``<s>`` = 1, ``</s>`` = 2. Like SmolLM2, it adds no BOS by default.
    """
    # deferred: transformers takes seconds to import
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        [TINY_TEXT] * 4,
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=["<pad>", "<s>", "</s>"],
        show_progress=False,
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        model_max_length=256,
    )


# Per-family config keys beyond the common ones (names differ between families).
_FAMILY_KW: dict[str, dict[str, Any]] = {
    "phi": {"partial_rotary_factor": 0.5},
    "stablelm": {"partial_rotary_factor": 0.25, "use_qkv_bias": True},
    "starcoder2": {"use_bias": True},
    "gemma2": {"query_pre_attn_scalar": 16, "sliding_window": 64},
    "gemma3_text": {"query_pre_attn_scalar": 16, "sliding_window": 64},
}


def tiny_config(
    model_type: str = "llama",
    *,
    heads: int = 4,
    kv_heads: int | None = None,
    layers: int = 2,
    hidden: int = 64,
    head_dim: int | None = None,
    vocab_size: int = 384,
    **overrides: Any,
):
    """A small config of ``model_type`` (any family in the registry)."""
    # deferred: transformers takes seconds to import
    from transformers import AutoConfig

    kw: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads or heads,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    if head_dim is not None:
        kw["head_dim"] = head_dim
    kw.update(_FAMILY_KW.get(model_type, {}))
    kw.update(overrides)
    return AutoConfig.for_model(model_type, **kw)


def tiny_model(
    model_type: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32, **config_kw: Any
):
    """A randomly initialised causal LM of ``model_type`` in eval mode."""
    # deferred: transformers takes seconds to import
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **config_kw))
    # Random init leaves some weights at exactly 1/0 (norms, biases); perturb them so tests that
    # compare logits also exercise those tensors.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model.to(dtype).eval()


def save_tiny_model(
    path: str | Path,
    model_type: str = "llama",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    tokenizer: bool = True,
    max_shard_size: str | None = None,
    **config_kw: Any,
) -> Path:
    """Build :func:`tiny_model` and save it (with :func:`tiny_tokenizer`) as a Hugging Face checkpoint."""
    path = Path(path)
    model = tiny_model(model_type, seed, dtype, **config_kw)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    if tokenizer:
        tiny_tokenizer(model.config.vocab_size).save_pretrained(path)
    return path


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors checkpoint directory ``path``, by name, across its shards."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(f))
    return out

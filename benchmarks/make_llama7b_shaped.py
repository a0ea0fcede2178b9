"""Build a synthetic Llama-2-7B-shaped MHA checkpoint: random bfloat16 weights, sharded, with a tokenizer.

The shape of Llama-2-7B (32 layers, hidden 4096, 32 query heads and 32 K/V heads, intermediate 11008,
vocabulary 32000, 6.74 B parameters, 13.5 GB in bfloat16), written tensor by tensor through gqakit's
streaming safetensors writer into ``--shards`` files with an index, so building it needs one tensor of
memory. The tokenizer is a byte-level BPE of 32,000 tokens trained on the wiki-en train split, so
calibration text maps onto the whole vocabulary. Weights are N(0, 0.02) like ``initializer_range``
(norm weights 1): a random model, for memory and time, not quality.

    python benchmarks/make_llama7b_shaped.py /tmp/llama7b-mha                # the full 7B shape
    python benchmarks/make_llama7b_shaped.py /tmp/llama-l8 --layers 8        # fewer layers, same widths
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from gqakit.safetensors_io import SafetensorsWriter, TensorSpec

SHAPE = {"hidden": 4096, "heads": 32, "intermediate": 11008, "vocab": 32000, "layers": 32}


def llama_config(layers: int, kv_heads: int | None = None) -> dict:
    """config.json of the Llama-2-7B shape with ``layers`` decoder layers."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": SHAPE["hidden"],
        "intermediate_size": SHAPE["intermediate"],
        "num_attention_heads": SHAPE["heads"],
        "num_key_value_heads": kv_heads or SHAPE["heads"],
        "num_hidden_layers": layers,
        "vocab_size": SHAPE["vocab"],
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "dtype": "bfloat16",
    }


def tensor_specs(layers: int) -> list[TensorSpec]:
    """Every tensor of the model, in the order save_pretrained writes layers (embedding first)."""
    h, i, v = SHAPE["hidden"], SHAPE["intermediate"], SHAPE["vocab"]
    specs = [TensorSpec("model.embed_tokens.weight", "BF16", (v, h))]
    for n in range(layers):
        p = f"model.layers.{n}"
        specs += [
            TensorSpec(f"{p}.input_layernorm.weight", "BF16", (h,)),
            TensorSpec(f"{p}.self_attn.q_proj.weight", "BF16", (h, h)),
            TensorSpec(f"{p}.self_attn.k_proj.weight", "BF16", (h, h)),
            TensorSpec(f"{p}.self_attn.v_proj.weight", "BF16", (h, h)),
            TensorSpec(f"{p}.self_attn.o_proj.weight", "BF16", (h, h)),
            TensorSpec(f"{p}.post_attention_layernorm.weight", "BF16", (h,)),
            TensorSpec(f"{p}.mlp.gate_proj.weight", "BF16", (i, h)),
            TensorSpec(f"{p}.mlp.up_proj.weight", "BF16", (i, h)),
            TensorSpec(f"{p}.mlp.down_proj.weight", "BF16", (h, i)),
        ]
    specs += [TensorSpec("model.norm.weight", "BF16", (h,)), TensorSpec("lm_head.weight", "BF16", (v, h))]
    return specs


def split_shards(specs: list[TensorSpec], shards: int) -> list[list[TensorSpec]]:
    """Consecutive runs of about equal bytes (a layer may straddle two shards, as in real checkpoints)."""
    total = sum(s.nbytes for s in specs)
    out: list[list[TensorSpec]] = [[]]
    done = 0
    for spec in specs:
        if done >= total * len(out) / shards and len(out) < shards:
            out.append([])
        out[-1].append(spec)
        done += spec.nbytes
    return out


def write_tokenizer(out: Path, train_text: Path) -> None:
    """A 32,000-token byte-level BPE trained on ``train_text``, saved as a transformers tokenizer."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    lines = train_text.read_text(encoding="utf-8").splitlines()
    bpe.train_from_iterator(
        lines, vocab_size=SHAPE["vocab"], special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    tok.save_pretrained(out)


def build(out: Path, layers: int, shards: int, train_text: Path, seed: int = 0) -> dict:
    """Write the checkpoint into ``out`` (created); return a summary."""
    start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=False)
    gen = torch.Generator().manual_seed(seed)
    groups = split_shards(tensor_specs(layers), shards)
    weight_map: dict[str, str] = {}
    for k, group in enumerate(groups):
        name = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        writer = SafetensorsWriter(out / name, group)
        for spec in group:
            if len(spec.shape) == 1:
                t = torch.ones(spec.shape, dtype=torch.bfloat16)
            else:
                t = torch.empty(spec.shape, dtype=torch.float32).normal_(0.0, 0.02, generator=gen)
                t = t.to(torch.bfloat16)
            writer.write_tensor(spec.name, t)
            weight_map[spec.name] = name
            del t
        writer.close()
    total = sum(s.nbytes for g in groups for s in g)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(llama_config(layers), indent=2) + "\n")
    write_tokenizer(out, train_text)
    return {
        "path": str(out),
        "layers": layers,
        "shards": len(groups),
        "bytes": total,
        "params": total // 2,
        "elapsed_s": round(time.perf_counter() - start, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="the checkpoint directory to create (must not exist)")
    ap.add_argument("--layers", type=int, default=SHAPE["layers"])
    ap.add_argument("--shards", type=int, default=3)
    ap.add_argument(
        "--train-text",
        type=Path,
        default=Path.home() / ".cache/gqakit/wiki-en/train.txt",
        help="text the tokenizer is trained on (`gqakit assets fetch wiki-en`)",
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(json.dumps(build(args.out, args.layers, args.shards, args.train_text, args.seed), indent=2))


if __name__ == "__main__":
    main()

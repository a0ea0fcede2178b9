"""Model shapes, data and FLOP counts for benchmarks/bench_uptrain.py."""

from __future__ import annotations

import sys
from pathlib import Path

# Random-weight llamas to train: "small" for a CPU; the others are real models' shapes, for a GPU
# (MFU is only meaningful when the matrices are big enough to fill it).
SHAPES = {
    "small": dict(heads=8, kv_heads=2, layers=4, hidden=256, vocab_size=8192, intermediate_size=768),
    "smollm2-135m": dict(
        heads=9, kv_heads=3, layers=30, hidden=576, head_dim=64, vocab_size=49152,
        intermediate_size=1536, tie_word_embeddings=True,
    ),
    "tinyllama-1.1b": dict(
        heads=32, kv_heads=4, layers=22, hidden=2048, head_dim=64, vocab_size=32000,
        intermediate_size=5632,
    ),
}  # fmt: skip


def make_model(path: Path, shape: str, seq_len: int, seed: int) -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/tiny_models.py
    from tiny_models import save_tiny_model

    positions = max(seq_len, 256)
    model = save_tiny_model(path, "llama", seed=seed, max_position_embeddings=positions, **SHAPES[shape])
    return str(model)


def make_text(root: Path, text_dir: str | None) -> str:
    if text_dir and (Path(text_dir) / "train.txt").is_file():
        return str(Path(text_dir) / "train.txt")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/tiny_models.py
    from tiny_models import TINY_TEXT

    path = root / "train.txt"
    sentences = [s for s in TINY_TEXT.split(". ") if s]
    path.write_text("\n".join(". ".join(sentences[i % 5 :] + sentences[: i % 5]) for i in range(2000)))
    return str(path)


def flops_per_token(config, seq_len: int, n_params: int, distill: bool) -> tuple[float, float]:
    """Training FLOPs per token: (6N, PaLM's 6N + 12 L H Q T), plus the teacher's forward when distilling."""
    layers, heads = config.num_hidden_layers, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    attn = 12 * layers * heads * head_dim * seq_len
    six_n, palm = 6 * n_params, 6 * n_params + attn
    if distill:  # the teacher (same shape) runs forward only: a third of the training FLOPs
        six_n, palm = six_n + 2 * n_params, palm + 2 * n_params + attn / 3
    return six_n, palm

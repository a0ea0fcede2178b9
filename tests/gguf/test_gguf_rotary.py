"""The Q/K row reordering for llama.cpp's llama architecture, checked by hand and by its purpose."""

from __future__ import annotations

import torch
from gguf_helpers import ggml_to_hf_rotary

from gqakit.gguf.export import hf_to_ggml_rotary, plus_one


def test_one_head_by_hand() -> None:
    # head_dim 4: HF rows (x0, x1 | y0, y1) rotate x_i with y_i; llama.cpp wants (x0, y0, x1, y1)
    w = torch.tensor([[10.0], [11.0], [20.0], [21.0]])
    assert hf_to_ggml_rotary(w, 1).flatten().tolist() == [10.0, 20.0, 11.0, 21.0]


def test_heads_are_reordered_independently() -> None:
    # 2 heads of dim 4: each head's rows are interleaved on their own, heads stay in place
    w = torch.arange(8.0)
    assert hf_to_ggml_rotary(w, 2).tolist() == [0.0, 2.0, 1.0, 3.0, 4.0, 6.0, 5.0, 7.0]


def test_inverse_round_trips() -> None:
    w = torch.randn(3 * 8, 5)
    assert torch.equal(ggml_to_hf_rotary(hf_to_ggml_rotary(w, 3), 3), w)
    assert torch.equal(hf_to_ggml_rotary(ggml_to_hf_rotary(w, 3), 3), w)


def _rotate_half_rope(q: torch.Tensor, pos: int, theta: float = 10000.0) -> torch.Tensor:
    d = q.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.cat([pos * inv, pos * inv])
    x1, x2 = q[..., : d // 2], q[..., d // 2 :]
    return q * ang.cos() + torch.cat([-x2, x1], -1) * ang.sin()


def _pairwise_rope(q: torch.Tensor, pos: int, theta: float = 10000.0) -> torch.Tensor:
    d = q.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    c, s = (pos * inv).cos(), (pos * inv).sin()
    a, b = q[..., 0::2], q[..., 1::2]
    return torch.stack([a * c - b * s, a * s + b * c], -1).flatten(-2)


def test_permuted_rows_under_pairwise_rope_give_the_same_scores() -> None:
    """What the permutation is for: q.k after llama.cpp's rope on permuted rows equals q.k after HF's
    rope on the original rows, for every head, including a K with fewer heads (GQA)."""
    torch.manual_seed(0)
    hidden, d, heads, kv_heads = 12, 8, 4, 2
    wq = torch.randn(heads * d, hidden, dtype=torch.float64)
    wk = torch.randn(kv_heads * d, hidden, dtype=torch.float64)
    x_q, x_k = torch.randn(hidden, dtype=torch.float64), torch.randn(hidden, dtype=torch.float64)
    q_hf, k_hf = (wq @ x_q).view(heads, d), (wk @ x_k).view(kv_heads, d)
    q_gg = (hf_to_ggml_rotary(wq, heads) @ x_q).view(heads, d)
    k_gg = (hf_to_ggml_rotary(wk, kv_heads) @ x_k).view(kv_heads, d)
    for h in range(heads):
        g = h // (heads // kv_heads)
        hf = _rotate_half_rope(q_hf[h], 7) @ _rotate_half_rope(k_hf[g], 3)
        gg = _pairwise_rope(q_gg[h], 7) @ _pairwise_rope(k_gg[g], 3)
        torch.testing.assert_close(gg, hf)
    # and without the permutation they would not agree
    assert not torch.allclose(_pairwise_rope(q_hf[0], 7) @ _pairwise_rope(k_hf[0], 3),
                              _rotate_half_rope(q_hf[0], 7) @ _rotate_half_rope(k_hf[0], 3))  # fmt: skip


def test_plus_one_is_float32() -> None:
    w = torch.tensor([0.5, -1.0], dtype=torch.bfloat16)
    out = plus_one(w)
    assert out.dtype == torch.float32 and out.tolist() == [1.5, 0.0]

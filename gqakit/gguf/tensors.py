"""Hugging Face tensors -> GGUF tensors: names, the per-family rewrites, and the stored type.

The rewrites are pure functions (tensor in, tensor out); :func:`plan_tensors` decides, from names and
shapes alone, which applies to each tensor, so the file's layout is known before any weight is read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

from gqakit.errors import GqakitError, did_you_mean
from gqakit.gguf.arch import Config, GgufArch, kv_heads, rope

# --out-type -> (tensor type of matrices, general.file_type). Vectors (norms, biases) stay F32 in every
# type, as convert_hf_to_gguf.py keeps them: llama.cpp's kernels expect F32 norms and they are tiny.
OUT_TYPES: dict[str, tuple[QT, gguf.LlamaFileType]] = {
    "f32": (QT.F32, gguf.LlamaFileType.ALL_F32),
    "f16": (QT.F16, gguf.LlamaFileType.MOSTLY_F16),
    "q8_0": (QT.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
}
Infos = dict[str, tuple[str, tuple[int, ...]]]  # a checkpoint's tensors: name -> (dtype, shape)
# Tensors a checkpoint may hold that are not weights llama.cpp reads (old llama checkpoints saved
# their rotary tables).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def check_out_type(out_type: str) -> None:
    if out_type not in OUT_TYPES:
        raise GqakitError(
            f"GGUF type {out_type!r} is unknown.{did_you_mean(out_type, list(OUT_TYPES))} "
            f"Choose one of {', '.join(OUT_TYPES)}."
        )


def hf_to_ggml_rotary(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder Q or K projection rows from Hugging Face's rotary layout to llama.cpp's "normal" one.

    Inside each head, Hugging Face's ``rotate_half`` pairs channel ``i`` with ``i + d/2``; llama.cpp's
    normal rope (llama architecture) pairs channels ``2i`` and ``2i + 1``. So output row ``2i`` of a head
    is input row ``i`` and row ``2i + 1`` is input row ``i + d/2``. For K, ``n_heads`` is the number of
    K/V heads: this is where a GQA/MQA checkpoint differs from MHA. Works for weights and biases.
    """
    d = w.shape[0] // n_heads
    halves = w.reshape(n_heads, 2, d // 2, *w.shape[1:])  # [head, which half, i, ...]
    return halves.transpose(1, 2).reshape(w.shape)  # [head, i, which half, ...] = interleaved


def plus_one(w: torch.Tensor) -> torch.Tensor:
    """Gemma's RMSNorm multiplies by ``1 + w``: store ``w + 1`` (computed in float32)."""
    return w.float() + 1.0


@dataclass
class GgufTensor:
    """One tensor of the output file, planned before any weight is read.

    Attributes:
        name: the GGUF name (``blk.0.attn_q.weight``).
        source: the Hugging Face tensor it comes from (None for a tensor computed from the config).
        shape: the numpy shape (GGUF stores it reversed, as ``ne``).
        qtype: the stored tensor type.
        transforms: rewrites applied in order (:func:`plan_tensors` says why each exists).
        data: the tensor itself when it is computed rather than read (``rope_freqs``).
    """

    name: str
    source: str | None
    shape: tuple[int, ...]
    qtype: QT
    transforms: list[Callable[[torch.Tensor], torch.Tensor]] = field(default_factory=list)
    data: torch.Tensor | None = None

    def byte_shape(self) -> tuple[int, ...]:
        """The shape of the bytes handed to the writer (each row's bytes, for every type)."""
        return tuple(gguf.quant_shape_to_byte_shape(self.shape, self.qtype))

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.byte_shape()))

    def encode(self, t: torch.Tensor) -> np.ndarray:
        """Apply the rewrites and store as :attr:`qtype` (f16 by round-to-nearest-even, like torch)."""
        for fn in self.transforms:
            t = fn(t)
        return gguf.quants.quantize(t.detach().to(torch.float32).contiguous().numpy(), self.qtype)


def _stored_type(shape: tuple[int, ...], matrix_type: QT) -> QT:
    if len(shape) < 2:
        return QT.F32
    if matrix_type == QT.Q8_0 and shape[-1] % gguf.GGML_QUANT_SIZES[QT.Q8_0][0] != 0:
        # rows that are not whole 32-value blocks cannot be Q8_0; llama.cpp's converter falls back too
        return QT.F16
    return matrix_type


def plan_tensors(
    arch: GgufArch,
    cfg: Config,
    infos: Infos,
    out_type: str,
    lm_head_is_embedding: Callable[[], bool],
) -> list[GgufTensor]:
    """Name, shape, type and rewrites of every output tensor, from the checkpoint's tensor headers.

    Args:
        arch: the family's export rules.
        cfg: ``config.json``.
        infos: Hugging Face name -> (dtype, shape), in checkpoint order (the names ``arch.rename`` reads).
        out_type: a key of :data:`OUT_TYPES`.
        lm_head_is_embedding: called only when an architecture without an output tensor meets an untied
            ``lm_head``: True when its values equal the embedding's, so it may be dropped.

    Raises:
        GqakitError: naming every tensor llama.cpp's layout has no place for.
    """
    heads, kv = int(cfg["num_attention_heads"]), kv_heads(cfg)
    names = gguf.get_tensor_name_map(arch.arch, int(cfg["num_hidden_layers"]))
    matrix_type = OUT_TYPES[out_type][0]
    tied = bool(cfg.get("tie_word_embeddings", False))
    plan: list[GgufTensor] = []
    unknown: list[str] = []
    for source, (_, shape) in infos.items():
        # the name in the text model's terms (a multimodal checkpoint nests it); None: not in the GGUF
        hf_name = arch.text_name(source)
        if hf_name is None or hf_name.endswith(_IGNORED_SUFFIXES):
            continue
        if hf_name == "lm_head.weight" and (tied or not arch.has_output):
            # tied: llama.cpp uses token_embd when output.weight is absent (TENSOR_DUPLICATED in its loader)
            if not tied and not lm_head_is_embedding():
                raise GqakitError(
                    f"This {cfg.get('model_type')} checkpoint has its own lm_head, but llama.cpp's "
                    f"{arch.name} architecture always projects with the token embedding; it cannot be "
                    "exported faithfully."
                )
            continue
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            unknown.append(source)
            continue
        t = GgufTensor(gguf_name, source, tuple(shape), _stored_type(tuple(shape), matrix_type))
        module = hf_name.rsplit(".", 1)[0]
        if arch.permute_qk and module.endswith(("self_attn.q_proj", "self_attn.k_proj")):
            # rotary rows -> llama.cpp's pairwise order, over the heads of Q or K
            n = heads if module.endswith("q_proj") else kv
            t.transforms.append(partial(hf_to_ggml_rotary, n_heads=n))
        if arch.qkv_per_head and kv == heads and module.endswith("attn.c_attn"):
            t.transforms.append(partial(per_head_to_blocks, n_heads=heads))  # q|k|v per head -> in blocks
        if arch.norm_plus_one and hf_name.endswith("norm.weight"):
            t.transforms.append(plus_one)  # gemma's RMSNorm weight stored as 1 + w
        plan.append(t)
    if unknown:
        raise GqakitError(
            f"{len(unknown)} tensor(s) have no place in llama.cpp's {arch.name} layout (first: "
            f"{', '.join(unknown[:5])}). Is this checkpoint really a plain {cfg.get('model_type')} causal LM?"
        )
    output = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.OUTPUT] + ".weight"
    embedding = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.TOKEN_EMBD] + ".weight"
    if tied and arch.output_required and all(t.name != output for t in plan):
        # llama.cpp would refuse the file without it: the tied projection, written out
        embed = next(t for t in plan if t.name == embedding)
        plan.append(GgufTensor(output, embed.source, embed.shape, _stored_type(embed.shape, matrix_type)))
    return plan


def per_head_to_blocks(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Fused rows ``q_0 k_0 v_0 q_1 k_1 v_1 ...`` (gpt_bigcode MHA) as ``q_0 q_1 ... | k_0 ... | v_0 ...``."""
    rest = tuple(w.shape[1:])
    return w.reshape(n_heads, 3, -1, *rest).transpose(0, 1).reshape(w.shape).contiguous()


def rope_freqs_tensor(cfg: Config, dims: int) -> GgufTensor | None:
    """For llama3 rotary scaling, the ``rope_freqs.weight`` tensor (computed, not read): plain inverse
    frequency / scaled one (``dims``: the rotary channels of a head); None for any other rotary.

    llama.cpp divides each rotary frequency by this factor. The scaled frequencies come from transformers'
    own llama3 rule, so the GGUF rotates exactly as the Hugging Face model does.
    """
    if rope(cfg)["rope_type"] != "llama3":
        return None
    # deferred: transformers takes seconds to import
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kw = {k: v for k, v in cfg.items() if k != "model_type"}
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](AutoConfig.for_model(cfg["model_type"], **kw), "cpu")
    theta = float(rope(cfg)["rope_theta"])
    plain = 1.0 / theta ** (torch.arange(0, dims, 2, dtype=torch.float64) / dims)
    factors = (plain / scaled.double()).float()
    name = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight"
    return GgufTensor(name, None, tuple(factors.shape), QT.F32, data=factors)

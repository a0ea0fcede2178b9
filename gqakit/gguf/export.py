"""``export_gguf``: a gqakit checkpoint (MHA, GQA or MQA) as a GGUF file that llama.cpp loads.

The layout (metadata, every tensor's name, shape and type) is planned from the checkpoint's headers
(:func:`_plan_tensors`, which decides which of the pure tensor rewrites applies to each tensor) and written
first; then each tensor is read, rewritten and appended before the next is read, so memory stays near one
tensor. The file appears under its name only when complete.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

from gqakit.checkpoint import Checkpoint, resolve_checkpoint
from gqakit.console import progress as progress_bar
from gqakit.errors import GqakitError, did_you_mean
from gqakit.families import get_arch, rotary_dims
from gqakit.gguf.arch import Config, GgufArch, kv_heads, metadata, rope
from gqakit.gguf.header import RECORDED_CONFIG
from gqakit.gguf.vocab import load_vocab
from gqakit.storage import atomic_write, make_dirs, writable_dir

# --out-type -> (tensor type of matrices, general.file_type). Vectors (norms, biases) stay F32 in every
# type, as convert_hf_to_gguf.py keeps them: llama.cpp's kernels expect F32 norms and they are tiny.
OUT_TYPES: dict[str, tuple[QT, gguf.LlamaFileType]] = {
    "f32": (QT.F32, gguf.LlamaFileType.ALL_F32),
    "f16": (QT.F16, gguf.LlamaFileType.MOSTLY_F16),
    "q8_0": (QT.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
}
# Tensors a checkpoint may hold that are not weights llama.cpp reads (old llama checkpoints saved
# their rotary tables).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


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
        transforms: rewrites applied in order (:func:`_plan_tensors` says why each exists).
        data: the tensor itself when it is computed rather than read (``rope_freqs``).
    """

    name: str
    source: str | None
    shape: tuple[int, ...]
    qtype: QT
    transforms: list[Callable[[torch.Tensor], torch.Tensor]] = field(default_factory=list)
    data: torch.Tensor | None = None

    @property
    def byte_shape(self) -> tuple[int, ...]:
        """The shape of the bytes handed to the writer (each row's bytes, for every type)."""
        return tuple(gguf.quant_shape_to_byte_shape(self.shape, self.qtype))

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.byte_shape))

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


def _plan_tensors(
    arch: GgufArch, cfg: Config, ckpt: Checkpoint, out_type: str, dims: int
) -> list[GgufTensor]:
    """Name, shape, type and rewrites of every output tensor (``dims``: the rotary channels of a head),
    from the checkpoint's tensor headers; only an untied ``lm_head`` that the architecture has no place
    for is read, to drop it where it equals the embedding. Raises naming every tensor llama.cpp's layout
    has no place for."""
    heads, kv = int(cfg["num_attention_heads"]), kv_heads(cfg)
    names = gguf.get_tensor_name_map(arch.arch, int(cfg["num_hidden_layers"]))
    matrix_type = OUT_TYPES[out_type][0]
    tied = bool(cfg.get("tie_word_embeddings", False))
    plan: list[GgufTensor] = []
    unknown: list[str] = []
    for hf_name, (_, shape) in ckpt.tensor_infos().items():
        if hf_name.endswith(_IGNORED_SUFFIXES):
            continue
        if hf_name == "lm_head.weight" and (tied or not arch.has_output):
            # tied: llama.cpp uses token_embd when output.weight is absent (TENSOR_DUPLICATED in its loader);
            # untied, only a copy of the embedding may be left out
            with ckpt.reader() as r:
                if not (tied or torch.equal(r.read(hf_name), r.read("model.embed_tokens.weight"))):
                    raise GqakitError(
                        f"This {cfg.get('model_type')} checkpoint has its own lm_head, but llama.cpp's "
                        f"{arch.name} architecture always projects with the token embedding; it cannot be "
                        "exported faithfully."
                    )
            continue
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            unknown.append(hf_name)
            continue
        t = GgufTensor(gguf_name, hf_name, tuple(shape), _stored_type(tuple(shape), matrix_type))
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
    if tied and arch.output_required and all(t.name != "output.weight" for t in plan):
        # llama.cpp would refuse the file without it: the tied projection, written out
        embed = next(t for t in plan if t.name == "token_embd.weight")
        plan.append(GgufTensor("output.weight", embed.source, embed.shape, embed.qtype))
    return plan + _rope_freqs(cfg, dims)


def per_head_to_blocks(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Fused rows ``q_0 k_0 v_0 q_1 k_1 v_1 ...`` (gpt_bigcode MHA) as ``q_0 q_1 ... | k_0 ... | v_0 ...``."""
    rest = tuple(w.shape[1:])
    return w.reshape(n_heads, 3, -1, *rest).transpose(0, 1).reshape(w.shape).contiguous()


def _rope_freqs(cfg: Config, dims: int) -> list[GgufTensor]:
    """For llama3 rotary scaling, the ``rope_freqs.weight`` tensor (computed, not read): plain inverse
    frequency / scaled one (``dims``: the rotary channels of a head); none for any other rotary.

    llama.cpp divides each rotary frequency by this factor. The scaled frequencies come from transformers'
    own llama3 rule, so the GGUF rotates exactly as the Hugging Face model does.
    """
    if rope(cfg)["rope_type"] != "llama3":
        return []
    # deferred: transformers takes seconds to import
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kw = {k: v for k, v in cfg.items() if k != "model_type"}
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](AutoConfig.for_model(cfg["model_type"], **kw), "cpu")
    theta = float(rope(cfg)["rope_theta"])
    plain = 1.0 / theta ** (torch.arange(0, dims, 2, dtype=torch.float64) / dims)
    factors = (plain / scaled.double()).float()
    return [GgufTensor("rope_freqs.weight", None, tuple(factors.shape), QT.F32, data=factors)]


# Raised whenever the file written for the same checkpoint changes, so caches of exports (the llama.cpp
# engine's) do not serve an older gqakit's file (4: no general.source.url, gqakit.version or
# gqakit.converted_from, which nothing reads).
EXPORT_VERSION = 4


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_gguf` wrote.

    Attributes:
        model_type, arch: the source's ``config.model_type``, and the file's ``general.architecture``.
        num_heads, num_kv_heads: query and K/V heads (H and G).
        tensors, bytes, seconds: tensors written, size of the file, wall time of the export.
        tokenizer: ``tokenizer.ggml.model`` and ``tokenizer.ggml.pre``, e.g. ``gpt2/smollm``.
    """

    path: Path
    model_type: str
    arch: str
    out_type: str
    num_heads: int
    num_kv_heads: int
    tensors: int
    bytes: int
    seconds: float
    tokenizer: str


def export_gguf(
    src: str | Path, dst: str | Path, out_type: str = "f16", force: bool = False, progress: bool = True
) -> ExportResult:
    """Write a checkpoint as a GGUF file that llama.cpp loads, tokenizer included.

    Args:
        src: a checkpoint directory gqakit reads (MHA, GQA or MQA), a ``.gguf`` file, or a hub id.
        dst: the ``.gguf`` file to write.
        out_type: ``f32``, ``f16`` or ``q8_0`` for matrices; vectors are always F32.
        force: replace ``dst`` if it exists.
        progress: a progress bar over the tensor bytes written, the part that grows with the model.

    Returns:
        An :class:`ExportResult`.

    Raises:
        GqakitError: an unknown ``out_type``, an existing ``dst`` without ``force``, a family whose GGUF
            layout gqakit does not know, a tokenizer it cannot embed, or a config that lacks what the
            layout needs. Nothing is left at ``dst`` (or beside it) after an error or Ctrl-C.
    """
    start = time.perf_counter()
    logging.getLogger("gguf").setLevel(logging.ERROR)  # gguf's own chatter about chat templates
    if out_type not in OUT_TYPES:
        raise GqakitError(
            f"GGUF type {out_type!r} is unknown.{did_you_mean(out_type, list(OUT_TYPES))} "
            f"Choose one of {', '.join(OUT_TYPES)}."
        )
    dst = Path(dst).expanduser().resolve()  # checked before any work: a file, new unless force, writable
    if dst.is_dir():
        raise GqakitError(f"Output {dst} is a directory: give a file path ending in .gguf.")
    if dst.exists() and not force:
        raise GqakitError(f"Output {dst} exists: pass --force to replace it, or choose another path.")
    writable_dir(
        dst.parent, "Output directory", fix=f"choose a path for {dst.name} in a directory you can write to"
    )
    with resolve_checkpoint(src) as ckpt:
        arch = get_arch(ckpt.model_type)
        cfg = arch.view(ckpt.config)
        dims = rotary_dims(cfg)
        kv = metadata(arch, cfg, dims)
        plan = _plan_tensors(arch, cfg, ckpt, out_type, dims)
        rows = next((t.shape[0] for t in plan if t.name == "token_embd.weight"), cfg["vocab_size"])
        vocab = load_vocab(ckpt.path, int(rows))  # the token list fills the embedding's rows
        make_dirs(dst.parent)
        with atomic_write(dst) as tmp, closing(gguf.GGUFWriter(tmp, arch.name)) as writer:
            writer.add_type(gguf.GGUFType.MODEL)
            writer.add_file_type(int(OUT_TYPES[out_type][1]))
            if out_type == "q8_0":
                writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
            # llama.cpp reads general.name (transformers' GGUF reader gives it back as _model_name_or_path)
            name = cfg.get("_name_or_path") or cfg.get("_model_name_or_path") or Path(ckpt.origin).name
            writer.add_name(str(name))
            # the whole config, for what transformers' GGUF reader cannot rebuild from llama.cpp's keys
            # (gqakit.gguf.header puts it back when gqakit reads the file), without where it was read from
            record = {k: v for k, v in cfg.items() if k not in ("_name_or_path", "_model_name_or_path")}
            writer.add_string(RECORDED_CONFIG, json.dumps(record, sort_keys=True, default=str))
            for key, vtype, value in kv:  # a list (per-layer flags): an array
                array = gguf.GGUFValueType.ARRAY if isinstance(value, list) else vtype
                writer.add_key_value(key, value, array, sub_type=vtype)
            writer.add_vocab_size(len(vocab.tokens))
            vocab.add_to(writer)
            for t in plan:
                writer.add_tensor_info(t.name, t.byte_shape, np.dtype(np.uint8), t.nbytes, raw_dtype=t.qtype)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            total = sum(t.nbytes for t in plan)
            bar = progress_bar(desc=f"export -> {out_type}", total=total, enabled=progress, unit="B")
            with ckpt.reader() as reader, bar:
                for t in plan:  # one tensor in memory at a time
                    writer.write_tensor_data(t.encode(t.data if t.source is None else reader.read(t.source)))
                    bar.update(t.nbytes)
    return ExportResult(
        path=dst,
        model_type=ckpt.model_type,
        arch=arch.name,
        out_type=out_type,
        num_heads=int(cfg["num_attention_heads"]),
        num_kv_heads=kv_heads(cfg),
        tensors=len(plan),
        bytes=dst.stat().st_size,
        seconds=round(time.perf_counter() - start, 3),
        tokenizer=f"{vocab.model}/{vocab.pre}",
    )

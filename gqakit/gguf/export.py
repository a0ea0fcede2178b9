"""``export_gguf``: a gqakit checkpoint (MHA, GQA or MQA) as a GGUF file that llama.cpp loads.

The file is written in two passes over the checkpoint's headers and one over its weights: the
layout (metadata and every tensor's name, shape and type) is planned from headers alone and written
first, then each tensor is read, rewritten and appended before the next is read, so memory stays
near one tensor. The file appears under its name only when complete.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from gqakit import __version__
from gqakit.checkpoint import Checkpoint, resolve_checkpoint
from gqakit.console import progress as progress_bar
from gqakit.errors import GqakitError
from gqakit.families import get_arch, rotary_dims
from gqakit.gguf.arch import GgufArch, kv_heads, metadata
from gqakit.gguf.header import RECORDED_CONFIG, recorded_config
from gqakit.gguf.tensors import OUT_TYPES, GgufTensor, Infos, check_out_type, plan_tensors, rope_freqs_tensor
from gqakit.gguf.vocab import Vocab, load_vocab
from gqakit.storage import atomic_write, make_dirs, writable_dir

# Raised whenever the file written for the same checkpoint changes, so caches of exports (the llama.cpp
# engine's) do not serve an older gqakit's file (2: the recorded config, Gemma 3's legacy configs).
EXPORT_VERSION = 2


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_gguf` wrote.

    Attributes:
        path: the GGUF file.
        model_type: the source's ``config.model_type``.
        arch: the GGUF architecture (``general.architecture``).
        out_type: ``f32``, ``f16`` or ``q8_0``.
        num_heads, num_kv_heads: query and K/V heads (H and G).
        tensors: tensors written.
        parameters: elements over all tensors.
        bytes: size of the file.
        seconds: wall time of the export.
        tokenizer: ``tokenizer.ggml.model`` and ``tokenizer.ggml.pre``, e.g. ``gpt2/smollm``.
        warnings: where llama.cpp will not compute exactly what transformers does, or a tokenizer detail
            gqakit could not map; empty for a faithful export.
    """

    path: Path
    model_type: str
    arch: str
    out_type: str
    num_heads: int
    num_kv_heads: int
    tensors: int
    parameters: int
    bytes: int
    seconds: float
    tokenizer: str
    warnings: list[str] = field(default_factory=list)


def _check_destination(dst: Path, force: bool) -> Path:
    """``dst``, resolved, once checked before any work: not a directory, not an existing file unless
    ``force``, in a directory that can be written (or created)."""
    dst = Path(dst).expanduser().resolve()
    if dst.is_dir():
        raise GqakitError(f"Output {dst} is a directory: give a file path ending in .gguf.")
    if dst.exists() and not force:
        raise GqakitError(f"Output {dst} exists: pass --force to replace it, or choose another path.")
    writable_dir(
        dst.parent, "Output directory", fix=f"choose a path for {dst.name} in a directory you can write to"
    )
    return dst


def _provenance(ckpt: Checkpoint, cfg: dict[str, Any]) -> list[tuple[str, gguf.GGUFValueType, Any]]:
    """general.* and gqakit.* keys: where the weights came from and which tool wrote them (``cfg``: the
    config under the common names)."""
    S, U = gguf.GGUFValueType.STRING, gguf.GGUFValueType.UINT32
    origin = ckpt.origin
    url = Path(origin).as_uri() if Path(origin).is_absolute() else f"https://huggingface.co/{origin}"
    name = cfg.get("_name_or_path") or cfg.get("_model_name_or_path") or Path(origin).name
    out = [
        (gguf.Keys.General.NAME, S, str(name)),
        (gguf.Keys.General.SOURCE_URL, S, url),
        ("gqakit.version", S, __version__),
        ("gqakit.source", S, origin),
        ("gqakit.query_heads", U, int(cfg["num_attention_heads"])),
        ("gqakit.kv_heads", U, kv_heads(cfg)),
        # the whole config, for what transformers' GGUF reader cannot rebuild from llama.cpp's keys
        # (gqakit.gguf.header puts it back when gqakit reads the file)
        (RECORDED_CONFIG, S, recorded_config(cfg)),
    ]
    record = ckpt.path / "gqakit.json"
    if record.is_file():  # a converted checkpoint: name what it was converted from
        try:
            converted_from = json.loads(record.read_text()).get("source")
        except ValueError:
            converted_from = None
        if converted_from:
            out.append(("gqakit.converted_from", S, str(converted_from)))
    return out


def _left_out(arch: GgufArch, infos: Infos) -> list[str]:
    """A warning naming the tensors of a multimodal checkpoint that the text GGUF does not hold."""
    left = [name for name in infos if arch.text_name(name) is None]
    if not left:
        return []
    return [
        f"{len(left)} tensor(s) outside the text model (first: {left[0]}) are not exported: the GGUF "
        "holds the language model only, as llama.cpp's own converter writes it (the vision tower goes "
        "into a separate mmproj file, which gqakit does not write)."
    ]


def _write(
    ckpt: Checkpoint,
    arch: GgufArch,
    out_type: str,
    kv: list[tuple[str, gguf.GGUFValueType, Any]],
    vocab: Vocab,
    plan: list[GgufTensor],
    path: Path,
    progress: bool = True,
) -> None:
    writer = gguf.GGUFWriter(path, arch.name)
    try:
        writer.add_type(gguf.GGUFType.MODEL)
        writer.add_file_type(int(OUT_TYPES[out_type][1]))
        if out_type == "q8_0":
            writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        for key, vtype, value in kv:  # a list (per-layer flags) is an array of vtype
            array = isinstance(value, list)
            writer.add_key_value(key, value, gguf.GGUFValueType.ARRAY if array else vtype, sub_type=vtype)
        writer.add_vocab_size(len(vocab.tokens))
        vocab.add_to(writer)
        for t in plan:
            writer.add_tensor_info(t.name, t.byte_shape(), np.dtype(np.uint8), t.nbytes, raw_dtype=t.qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        total = sum(t.nbytes for t in plan)
        bar = progress_bar(desc=f"export -> {out_type}", total=total, enabled=progress, unit="B")
        with ckpt.reader() as reader, bar:
            for t in plan:
                source = t.data if t.source is None else reader.read(t.source)
                writer.write_tensor_data(t.encode(source))
                del source
                bar.update(t.nbytes)
    finally:
        writer.close()


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
        An :class:`ExportResult`; its ``warnings`` name anything llama.cpp will compute differently.

    Raises:
        GqakitError: an unknown ``out_type``, an existing ``dst`` without ``force``, a family whose GGUF
            layout gqakit does not know, a tokenizer it cannot embed, or a config that lacks what the
            layout needs. Nothing is left at ``dst`` (or beside it) after an error or Ctrl-C.
    """
    start = time.perf_counter()
    logging.getLogger("gguf").setLevel(logging.ERROR)  # gguf's own chatter about chat templates
    check_out_type(out_type)
    dst = _check_destination(Path(dst), force)
    with resolve_checkpoint(src) as ckpt:
        arch = get_arch(ckpt.model_type)
        cfg = arch.config(ckpt.config)
        dims = rotary_dims(cfg)
        kv, warnings = metadata(arch, cfg, dims)
        infos = ckpt.tensor_infos()

        def lm_head_is_embedding() -> bool:
            with ckpt.reader() as r:
                return torch.equal(r.read("lm_head.weight"), r.read("model.embed_tokens.weight"))

        plan = plan_tensors(arch, cfg, infos, out_type, lm_head_is_embedding)
        rope_freqs = rope_freqs_tensor(cfg, dims)
        plan += [rope_freqs] if rope_freqs else []
        rows = next((t.shape[0] for t in plan if t.name == "token_embd.weight"), cfg["vocab_size"])
        vocab = load_vocab(ckpt.path, int(rows))  # the token list fills the embedding's rows
        warnings = warnings + _left_out(arch, infos) + vocab.warnings
        make_dirs(dst.parent)
        with atomic_write(dst) as tmp:
            _write(ckpt, arch, out_type, kv + _provenance(ckpt, cfg), vocab, plan, tmp, progress)
    return ExportResult(
        path=dst,
        model_type=ckpt.model_type,
        arch=arch.name,
        out_type=out_type,
        num_heads=int(cfg["num_attention_heads"]),
        num_kv_heads=kv_heads(cfg),
        tensors=len(plan),
        parameters=sum(math.prod(t.shape) for t in plan),
        bytes=dst.stat().st_size,
        seconds=round(time.perf_counter() - start, 3),
        tokenizer=f"{vocab.model}/{vocab.pre}",
        warnings=warnings,
    )

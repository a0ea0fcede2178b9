"""The llama.cpp engine of ``gqakit eval --engine llamacpp``: measure a checkpoint where GQA's gains are
real.

transformers repeats each shared K/V head for every query head (``repeat_kv``), so its attention reads
as many bytes as MHA; llama.cpp's kernels read a shared head once. This engine exports the checkpoint
to GGUF once (:func:`gqakit.gguf.export_gguf`, cached under ``$GQAKIT_CACHE/gguf`` by the checkpoint's
files, the weight type and the exporter's version; a new export replaces the checkpoint's earlier ones
of that type, see :func:`gguf_for`), loads it with llama.cpp's Python binding, and fills the same
:class:`~gqakit.eval.results.ModelResult` as the transformers engine:

* perplexity over exactly the transformers engine's windows: the stream is tokenized by the checkpoint's
  own tokenizer (:func:`~gqakit.eval.perplexity.encode_stream`) and cut by
  :func:`~gqakit.eval.perplexity.sliding_windows`; each window's token ids go to llama.cpp, whose
  logits score them. With ``--gguf-type f32`` the KV cache is float32 too, so the two engines compute
  the same function;
* decode at each context, batch 1 (the binding's ``Llama`` decodes one sequence): prompt processing
  tokens/s over the context, then the median latency of single-token steps;
* KV-cache bytes as llama.cpp allocates them (its ``llama_kv_cache: size = ...`` log line), beside the
  formula ``2 * layers * kv_heads * head_dim * bytes * cells``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from gqakit import cache_copies
from gqakit.cache_copies import CopyKind, superseded_by_record, write_record
from gqakit.errors import GqakitError
from gqakit.eval.decode import DecodePoint
from gqakit.eval.options import EvalOptions
from gqakit.eval.perplexity import PerplexityResult, encode_stream, sliding_windows
from gqakit.eval.results import ModelResult
from gqakit.files import cache_root, fingerprint, writable_cache
from gqakit.geometry import AttentionGeometry
from gqakit.gguf import export_gguf, read_gguf_header
from gqakit.gguf.export import EXPORT_VERSION
from gqakit.locks import one_at_a_time
from gqakit.models import load_tokenizer

log = logging.getLogger(__name__)

INSTALL = (
    'pip install -e ".[llamacpp]" (it builds llama.cpp from source with the compiler and cmake on the '
    "machine: 5-20 minutes on 2 CPU cores)"
)
GGML_TYPE_F32 = 0  # ggml_type of a float32 KV cache
# llama.cpp logs the cache it allocates: "llama_kv_cache: size =   90.00 MiB (  4096 cells, ...". It
# rounds the cells up (to a multiple of 256), so the cells come from the line, not from n_ctx.
_KV_LINE = re.compile(r"llama_kv_cache: size =\s*([\d.]+) MiB \(\s*(\d+) cells")
CACHE = "gguf"  # the exports' folder under the cache root
# Beside each export, the checkpoint it was exported from: ``<export>.gguf`` + this. Not a ``.gguf`` name,
# so that a listing of the exports leaves it out.
RECORD_SUFFIX = ".source.json"


def require_llama_cpp(_options: Any = None):
    """The ``llama_cpp`` module, or one message with the command that installs it."""
    try:
        # deferred: llama.cpp's binding is optional
        import llama_cpp
    except ImportError:
        raise GqakitError(
            f"--engine llamacpp needs llama.cpp's Python binding, which is not installed: {INSTALL}."
        ) from None
    return llama_cpp


def gguf_for(path: str, out_type: str) -> Path:
    """``path`` exported to GGUF with ``out_type`` weights, once, into the cache.

    The export is named by the checkpoint directory's name and fingerprint, the weight type and the
    exporter's version (another gqakit's export of the same checkpoint may differ), and records its source
    beside it (``<export>.source.json``, written before the export appears). A second process that asks
    for the same export while the first writes it waits for it and reuses it. Each call, writing the export
    or reusing it, then removes the exports it supersedes (:func:`superseded_export`) that no other process
    holds; failing to remove one only logs a warning. This process holds the export it gets until it exits
    (:func:`gqakit.cache_copies.in_use`).

    Args:
        path: a checkpoint directory (or a ``.gguf`` file) gqakit reads.
        out_type: the weight type, ``f32``, ``f16`` or ``q8_0``.

    Returns:
        The cached ``.gguf`` file.
    """
    return cache_copies.in_use(lambda: _export(path, out_type), Path.is_file)


def _export(path: str, out_type: str) -> Path:
    src = Path(path).expanduser().resolve()
    fp = fingerprint(src)
    dst = writable_cache(cache_root() / CACHE) / _export_name(src, fp, out_type, EXPORT_VERSION)
    if not (dst.is_file() and _record_path(dst).is_file()):

        def waiting(owner: str) -> None:
            log.warning("waiting for %s, which is exporting %s to %s", owner, src, dst)

        # export_gguf writes a temporary file and renames it, so a reader never opens half an export; the
        # lock spares a second process the same minutes of work (it reuses the first one's file)
        with one_at_a_time(dst.parent / f".{dst.name}.lock", waiting):
            # the record first: an export on disk always has one, so one without is an older gqakit's. One
            # of this version is this checkpoint's (its name's fingerprint): recorded under its lock (no
            # removal meanwhile), the export that replaces it removes it (see superseded_export)
            if not (dst.is_file() and _record_path(dst).is_file()):
                write_record(_record_path(dst), _record(src, fp, out_type))
            if not dst.is_file():
                try:
                    logging.getLogger("gguf").setLevel(logging.ERROR)
                    res = export_gguf(src, dst, out_type=out_type, force=True)
                except BaseException:
                    _record_path(dst).unlink(missing_ok=True)
                    raise
                for warning in res.warnings:
                    log.warning("%s: %s", src, warning)
    remove_superseded_exports(src, out_type, dst)  # on reuse too: one kept while held goes once free
    return dst


def _export_name(src: Path, fp: str, out_type: str, version: int) -> str:
    return f"{src.name}-{fp}-{out_type}-e{version}.gguf"


def _record_path(export: Path) -> Path:
    return export.with_name(export.name + RECORD_SUFFIX)


def _record(src: Path, fp: str, out_type: str) -> dict[str, Any]:
    """The record of the export of ``src`` (resolved) at fingerprint ``fp`` with ``out_type`` weights."""
    return {"source": str(src), "fingerprint": fp, "out_type": out_type, "export": EXPORT_VERSION}


def superseded_export(src: Path, fp: str, out_type: str, export: Path) -> bool:
    """Whether ``export``, a ``.gguf`` in the cache, is superseded by the current export of ``src``.

    An export with a record is superseded when it records ``src`` (resolved) and ``out_type``, and either
    another fingerprint (the checkpoint has changed since) or an older exporter. So is an orphan of any
    source: one whose recorded checkpoint no longer exists (:func:`gqakit.cache_copies.orphaned`), as an
    export of a dequantized ``.gguf`` copy once that copy is replaced. An export of the same checkpoint
    with another weight type is another export, and one that a newer gqakit wrote (a later exporter) is
    left to that gqakit. An unreadable record keeps its export.

    An export without a record (from a gqakit before records) can be matched to its checkpoint only by
    the directory's name: it is superseded when its name is exactly ``<name>-<16 hex>-<out_type>.gguf``
    (before the exporter's version was in the name) or ``<name>-<16 hex>-<out_type>-e<N>.gguf`` with N
    older than this exporter. This gqakit never opens such a file, so removing it costs no later
    command an export, even where it came from another directory of the same name (``final``, ``model``).
    One without a record named with this exporter's version or a newer one is kept, whatever its
    fingerprint: this gqakit reuses it when a checkpoint's name and fingerprint match (and records it
    then, :func:`gguf_for`), and it cannot tell an earlier state of ``src`` from another directory of the
    same name.

    Args:
        src: the checkpoint, resolved.
        fp: its fingerprint now.
        out_type: the weight type of the current export.
        export: a ``.gguf`` in the cache other than the current export.
    """

    def legacy() -> bool:
        pattern = rf"{re.escape(src.name)}-[0-9a-f]{{16}}-{re.escape(out_type)}(?:-e(\d+))?\.gguf"
        match = re.fullmatch(pattern, export.name)
        return match is not None and int(match.group(1) or 1) < EXPORT_VERSION

    return superseded_by_record(_record_path(export), _record(src, fp, out_type), "export", legacy)


def remove_superseded_exports(src: Path, out_type: str, current: Path) -> list[Path]:
    """Remove the exports in ``current``'s cache folder that it supersedes (:func:`superseded_export`).

    Nothing is removed when ``src`` has changed again since ``current`` was exported (the export of its
    new contents removes the others). An export that another process is writing (its lock), or holds in
    use, is kept. Each removal is logged with its size; a failure is logged as a warning, never raised.

    Args:
        src: the checkpoint, resolved.
        out_type: ``current``'s weight type.
        current: its export, just written or reused.

    Returns:
        The exports removed.
    """

    def candidates() -> list[Path]:
        fp = fingerprint(src)
        if _export_name(src, fp, out_type, EXPORT_VERSION) != current.name:
            return []
        others = cache_copies.siblings(current, "*.gguf", Path.is_file)
        return [p for p in others if superseded_export(src, fp, out_type, p)]

    return cache_copies.remove_superseded(_EXPORTS, src.name, current, candidates)


def _remove_export(export: Path) -> int | None:
    """Remove one cached export and its record; the bytes they held, or None when already gone."""
    if not export.is_file():  # another process removed it first
        return None
    record = _record_path(export)
    size = export.stat().st_size + (record.stat().st_size if record.is_file() else 0)
    # the export first: a removal cut short leaves a record without a file, which nothing opens
    export.unlink()
    record.unlink(missing_ok=True)
    return size


# how cache_copies.remove_superseded names the exports in messages and removes one (and its record)
_EXPORTS = CopyKind(
    ("export", "exports"),
    "a GGUF export for llama.cpp",
    log,
    _remove_export,
    lambda e: f"rm -f {e} {_record_path(e)}",
    _record_path,
)


@contextmanager
def _llama_log() -> Iterator[list[str]]:
    """Collect llama.cpp's log lines (it logs the KV cache it allocates) while the block runs; drop them
    afterwards (the per-call lines would flood the terminal)."""
    llama_cpp = require_llama_cpp()
    lines: list[str] = []

    def collect(_level, text, _user_data) -> None:
        lines.append(text.decode(errors="replace"))

    callbacks = [llama_cpp.llama_log_callback(collect), llama_cpp.llama_log_callback(lambda *_: None)]
    _KEEP.extend(callbacks)  # ctypes callbacks must outlive their registration
    llama_cpp.llama_log_set(callbacks[0], ctypes.c_void_p(0))
    try:
        yield lines
    finally:
        llama_cpp.llama_log_set(callbacks[1], ctypes.c_void_p(0))


_KEEP: list[Any] = []


def _open(gguf: Path, n_ctx: int, f32_kv: bool, logits_all: bool):
    """A ``llama_cpp.Llama`` on ``gguf``, the KV-cache bytes llama.cpp allocated for it (to its log's
    0.01 MiB; None when it did not log them) and the cells they hold."""
    llama_cpp = require_llama_cpp()
    kv = {"type_k": GGML_TYPE_F32, "type_v": GGML_TYPE_F32} if f32_kv else {}
    with _llama_log() as lines:
        llm = llama_cpp.Llama(
            model_path=str(gguf),
            n_ctx=n_ctx,
            n_batch=min(n_ctx, 512),
            n_threads=os.cpu_count() or 1,
            logits_all=logits_all,
            verbose=False,
            **kv,
        )
    found = [m for line in "".join(lines).splitlines() if (m := _KV_LINE.search(line))]
    if not found:
        return llm, None, n_ctx
    return llm, int(round(float(found[-1].group(1)) * 2**20)), int(found[-1].group(2))


def llamacpp_perplexity(gguf: Path, tokenizer, texts: list[str], options: EvalOptions) -> PerplexityResult:
    """Perplexity and bits per byte of the GGUF model over the transformers engine's windows."""
    stride = options.stride or options.seq_len
    stream, n_bytes = encode_stream(tokenizer, texts, options.max_tokens)
    windows = sliding_windows(len(stream), options.seq_len, stride)
    llm, _, _ = _open(gguf, options.seq_len, f32_kv=True, logits_all=True)
    start, nll_sum = time.perf_counter(), 0.0
    try:
        for w in windows:
            llm.reset()
            llm.eval(stream[w.start : w.end])
            logits = np.asarray(llm.scores[w.end - w.start - w.scored : w.end - w.start], dtype=np.float64)
            targets = np.asarray(stream[w.end + 1 - w.scored : w.end + 1])
            peak = logits.max(axis=1, keepdims=True)
            logz = np.log(np.exp(logits - peak).sum(axis=1)) + peak[:, 0]
            nll_sum += float((logz - logits[np.arange(len(targets)), targets]).sum())
    finally:
        llm.close()
    return PerplexityResult.from_sum(
        nll_sum, len(stream) - 1, n_bytes, seq_len=options.seq_len, stride=stride, windows=len(windows),
        documents=len(texts), elapsed_s=time.perf_counter() - start,
    )  # fmt: skip


def llamacpp_decode(
    gguf: Path, geom: AttentionGeometry, contexts: list[int], new_tokens: int, f32_kv: bool, seed: int = 0
) -> tuple[list[DecodePoint], int | None]:
    """One decode point per context, batch 1: prompt processing (random token ids), then ``new_tokens``
    greedy single-token steps, timed one by one. Returns the points and the KV bytes llama.cpp allocated
    (for at least ``max(contexts) + new_tokens`` cells)."""
    n_ctx = max(contexts) + new_tokens
    llm, kv_bytes, cells = _open(gguf, n_ctx, f32_kv=f32_kv, logits_all=False)
    per_token = geom.kv_bytes_per_token(dtype_bytes=4 if f32_kv else 2)
    rng = np.random.default_rng(seed)
    points = []
    try:
        vocab = llm.n_vocab()
        llm.reset()
        llm.eval(rng.integers(3, vocab, 8).tolist())  # warm-up: first-call and allocation costs
        for context in contexts:
            llm.reset()
            t0 = time.perf_counter()
            llm.eval(rng.integers(3, vocab, context).tolist())
            prefill_s = time.perf_counter() - t0
            token, steps = _greedy(llm), []
            for _ in range(new_tokens - 1):
                t0 = time.perf_counter()
                llm.eval([token])
                steps.append(time.perf_counter() - t0)
                token = _greedy(llm)
            ms = 1000 * statistics.median(steps)
            points.append(
                DecodePoint(
                    batch=1,
                    context=context,
                    new_tokens=new_tokens,
                    prefill_s=prefill_s,
                    decode_ms=ms,
                    tokens_per_s=1000 / ms,
                    kv_bytes=kv_bytes,
                    kv_bytes_predicted=per_token * cells,
                    kv_tokens=cells,
                )
            )
    finally:
        llm.close()
    return points, kv_bytes


def _greedy(llm) -> int:
    """The argmax of the last evaluated token's logits (the binding keeps no copy of them unless it was
    opened with ``logits_all``)."""
    return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))


def measure_llamacpp_model(
    label: str, path: str, *, config: Any, options: EvalOptions, texts: list[str] | None, contexts: list[int]
) -> ModelResult:
    """Export ``path`` to GGUF (cached), measure it in llama.cpp, and return its
    :class:`~gqakit.eval.results.ModelResult` (see the module docstring)."""
    require_llama_cpp()
    start = time.perf_counter()
    gguf = gguf_for(path, options.gguf_type)
    geom = AttentionGeometry.from_config(config.to_dict())
    f32_kv = options.gguf_type == "f32"
    weight_bytes = gguf.stat().st_size

    res = ModelResult.of(
        label, path, geom, parameters=read_gguf_header(gguf).parameters, dtype=f"gguf {options.gguf_type}",
        kv_dtype_bytes=4 if f32_kv else 2, weight_bytes=weight_bytes, load_s=time.perf_counter() - start,
    )  # fmt: skip
    if texts is not None:
        res.perplexity = llamacpp_perplexity(gguf, load_tokenizer(path), texts, options)
        log.info(
            "[%s] llama.cpp perplexity %.4f over %d tokens", label, res.perplexity.ppl, res.perplexity.tokens
        )
    if options.bench:
        points, kv_bytes = llamacpp_decode(gguf, geom, contexts, options.new_tokens, f32_kv, options.seed)
        for p in points:
            p.bytes_per_step = weight_bytes + res.kv_bytes_per_token * (p.context + options.new_tokens // 2)
        res.decode = points
        log.info(
            "[%s] llama.cpp KV cache %s bytes for %d cells",
            label,
            kv_bytes,
            points[0].kv_tokens if points else 0,
        )
    return res


__all__ = [
    "CACHE",
    "INSTALL",
    "RECORD_SUFFIX",
    "gguf_for",
    "llamacpp_decode",
    "llamacpp_perplexity",
    "measure_llamacpp_model",
    "remove_superseded_exports",
    "require_llama_cpp",
    "superseded_export",
]

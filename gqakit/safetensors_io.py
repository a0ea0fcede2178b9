"""Streaming safetensors: read one tensor at a time, write one tensor at a time.

The format is an 8-byte little-endian header length, a JSON header mapping each tensor name to its
dtype, shape and byte range, then the raw bytes. Because the header states every offset up front, we
can (a) validate a file without reading its data, (b) copy an unchanged tensor byte-for-byte from one
file to another without ever decoding it, and (c) write an output shard tensor by tensor, so peak
memory is one tensor rather than one shard (``safetensors.torch.save_file`` holds a copy of the whole
shard as ``bytes``).

Every floating tensor is checked for NaN/Inf as it passes through, read or copied (:func:`check_finite`):
a corrupt checkpoint is refused with the tensor's name instead of being written on.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from gqakit.dtypes import SAFETENSORS_DTYPES, dtype_size, safetensors_name, torch_dtype
from gqakit.errors import GqakitError

_MAX_HEADER = 100 * 1024 * 1024  # the reference implementation's own limit
_COPY_CHUNK = 64 * 1024 * 1024


# float8 has no aminmax/isfinite kernel on CPU: it is widened first (its NaN and Inf stay NaN and Inf)
_WIDEN = {torch.float8_e4m3fn: torch.float16, torch.float8_e5m2: torch.float16}


def nonfinite_count(tensor: torch.Tensor) -> int:
    """How many values of ``tensor`` are NaN or +-Inf (0 for integer and bool tensors).

    The common, finite case is one vectorised min/max reduction (NaN propagates through both, an Inf is
    the min or the max), several times faster than ``isfinite`` and without its temporary; the count is
    taken only when that finds something.
    """
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return 0
    if tensor.dtype in _WIDEN:
        tensor = tensor.to(_WIDEN[tensor.dtype])
    lo, hi = torch.aminmax(tensor)
    if math.isfinite(lo.item()) and math.isfinite(hi.item()):
        return 0
    return tensor.numel() - int(torch.isfinite(tensor).sum())


def nonfinite_error(name: str, bad: int, total: int, where: str | Path | None = None) -> GqakitError:
    """The one refusal of a tensor that holds NaN/Inf (convert, expand, export, eval)."""
    place = f" (in {where})" if where else ""
    return GqakitError(
        f"{name}{place} holds {bad} NaN/Inf values of {total}: the checkpoint is corrupt; "
        "re-download or re-export it."
    )


def check_finite(name: str, tensor: torch.Tensor, where: str | Path | None = None) -> torch.Tensor:
    """``tensor`` itself when every value is finite; else the :func:`nonfinite_error` naming ``name``."""
    bad = nonfinite_count(tensor)
    if bad:
        raise nonfinite_error(name, bad, tensor.numel(), where)
    return tensor


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: dtype name, shape and absolute byte range in its file."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


class SafetensorsFile:
    """A validated safetensors file whose tensors are read on demand.

    Opening parses and checks the header only: every dtype is known, every byte range matches its
    shape and lies inside the file. A truncated or corrupt file raises :class:`GqakitError`, and so does a
    floating tensor holding NaN/Inf, when :meth:`read` decodes it or :meth:`copy_raw` / :meth:`copy_bytes`
    pass its bytes on.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.tensors, self.metadata = _read_header(self.path)
        self._fh: BinaryIO | None = None
        self._starts: list[tuple[int, str]] | None = None  # (start, name) in file order, for copies

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def _handle(self) -> BinaryIO:
        if self._fh is None:
            self._fh = open(self.path, "rb")  # noqa: SIM115 - kept open across reads, closed in close()
        return self._fh

    def read(self, name: str) -> torch.Tensor:
        """Read one tensor into memory (a fresh, writable CPU tensor)."""
        info = self.tensors[name]
        fh = self._handle()
        fh.seek(info.start)
        buf = bytearray(info.nbytes)
        got = fh.readinto(buf)
        if got != info.nbytes:
            raise GqakitError(f"{self.path}: tensor {name!r} is truncated ({got} of {info.nbytes} bytes).")
        if info.nbytes == 0:
            return torch.empty(info.shape, dtype=torch_dtype(info.dtype))
        tensor = torch.frombuffer(buf, dtype=torch.uint8).view(torch_dtype(info.dtype)).reshape(info.shape)
        return check_finite(name, tensor, self.path)

    def copy_raw(self, name: str, out: BinaryIO) -> None:
        """Copy one tensor's bytes into ``out`` unchanged (a floating one checked for NaN/Inf on the way)."""
        info = self.tensors[name]
        self.copy_bytes(info.start, info.nbytes, out)

    def copy_bytes(self, start: int, length: int, out: BinaryIO) -> None:
        """Copy the byte range ``[start, start + length)`` of this file into ``out`` (several tensors
        stored back to back are copied in one call).

        The floating tensors in the range are read chunk by chunk and checked for NaN/Inf in the same read
        that copies them (no second pass over the file; back-to-back tensors of one dtype are checked
        together, chunk by chunk); the others (integers, bool) and any bytes between tensors are copied
        inside the kernel, undecoded. A refusal names the first tensor that holds NaN/Inf.
        """
        fh, end, pos = self._handle(), start + length, start
        for first, last, dtype in self._float_spans(start, end):
            if first > pos:
                _copy_range(fh, pos, first - pos, out)
            if not self._copy_checked(first, last, dtype, out):
                self._refuse(first, last)
            pos = last
        if end > pos:
            _copy_range(fh, pos, end - pos, out)

    def _float_spans(self, start: int, end: int) -> list[tuple[int, int, torch.dtype]]:
        """The byte spans of back-to-back non-empty floating tensors of one dtype lying wholly inside
        ``[start, end)``, in file order: (first byte, end, dtype)."""
        if self._starts is None:
            self._starts = sorted((info.start, name) for name, info in self.tensors.items())
        spans: list[tuple[int, int, torch.dtype]] = []
        for at in range(bisect.bisect_left(self._starts, (start, "")), len(self._starts)):
            info = self.tensors[self._starts[at][1]]
            if info.start >= end:
                break
            dtype = torch_dtype(info.dtype)
            if info.end > end or not info.nbytes or not dtype.is_floating_point:
                continue
            if spans and spans[-1][1] == info.start and spans[-1][2] == dtype:
                spans[-1] = (spans[-1][0], info.end, dtype)
            else:
                spans.append((info.start, info.end, dtype))
        return spans

    def _copy_checked(self, first: int, last: int, dtype: torch.dtype, out: BinaryIO) -> bool:
        """Copy bytes ``[first, last)`` (floating values of ``dtype``) into ``out`` through memory; whether
        every value is finite."""
        fh, length = self._handle(), last - first
        buf = bytearray(min(_COPY_CHUNK, length))  # _COPY_CHUNK is a multiple of every element size
        view = memoryview(buf)
        out.flush()  # a kernel copy may have moved the descriptor: write at the object's position
        fh.seek(first)
        done, finite = 0, True
        while done < length:
            n = min(len(buf), length - done)
            if fh.readinto(view[:n]) != n:
                raise GqakitError(f"{self.path}: unexpected end of file while copying.")
            finite = finite and not nonfinite_count(
                torch.frombuffer(buf, dtype=torch.uint8, count=n).view(dtype)
            )
            out.write(view[:n])
            done += n
        return finite

    def _refuse(self, first: int, last: int) -> None:
        """Raise the refusal of the first tensor in ``[first, last)`` that holds NaN/Inf (read again: this
        is the failure path)."""
        for start, name in self._starts or []:
            if first <= start < last:
                self.read(name)  # raises, naming the tensor and its count
        raise GqakitError(f"{self.path}: bytes {first}..{last} hold NaN/Inf values.")  # not reached


def _read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    size = path.stat().st_size
    bad = f"{path} is not a valid safetensors file"
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise GqakitError(f"{bad}: it is {size} bytes long (truncated or empty). Re-download it.")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER or 8 + n > size:
            raise GqakitError(f"{bad}: its header claims {n} bytes but the file has {size}. Re-download it.")
        try:
            header = json.loads(fh.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise GqakitError(f"{bad}: its header is not JSON ({e}). Re-download it.") from None
    if not isinstance(header, dict):
        raise GqakitError(f"{bad}: its header is not a JSON object. Re-download it.")
    metadata = header.pop("__metadata__", None) or {}
    data_start = 8 + n
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise GqakitError(f"{bad}: the header entry for {name!r} is malformed. Re-download it.") from None
        if dtype not in SAFETENSORS_DTYPES:
            raise GqakitError(f"{bad}: tensor {name!r} has unsupported dtype {dtype!r}.")
        info = TensorInfo(dtype, shape, data_start + begin, data_start + end)
        if info.nbytes != math.prod(shape) * dtype_size(dtype) or info.end > size:
            raise GqakitError(
                f"{bad}: tensor {name!r} needs bytes up to {info.end} but the file has {size} "
                "(truncated download?). Re-download it."
            )
        tensors[name] = info
    return tensors, metadata


def _copy_range(src: BinaryIO, offset: int, length: int, out: BinaryIO) -> None:
    """Copy bytes between files at ``out``'s current position, inside the kernel where the platform allows
    it; ``out`` is left just past the copied bytes."""
    out.flush()
    pos = out.tell()
    done = 0
    if hasattr(os, "copy_file_range"):
        try:
            while done < length:
                n = os.copy_file_range(src.fileno(), out.fileno(), length - done, offset + done)
                if n == 0:
                    break
                done += n
        except OSError:
            pass  # e.g. across filesystems on old kernels: the read/write loop below finishes the job
        out.seek(pos + done)  # copy_file_range moved the descriptor; resync the buffered object
    src.seek(offset + done)
    while done < length:
        chunk = src.read(min(_COPY_CHUNK, length - done))
        if not chunk:
            raise GqakitError(f"{getattr(src, 'name', 'input')}: unexpected end of file while copying.")
        out.write(chunk)
        done += len(chunk)


@dataclass(frozen=True)
class TensorSpec:
    """What the writer needs to lay out one output tensor before any data exists."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return dtype_size(self.dtype) * math.prod(self.shape)


class SafetensorsWriter:
    """Write a safetensors file tensor by tensor, in any order.

    The header is written first (all offsets are known from the specs); each call to
    :meth:`write_tensor` or :meth:`copy_from` then writes one tensor's bytes at its planned offset, so a
    conversion that finishes tensors out of file order (layer by layer) still streams. :meth:`close`
    checks that every tensor was written exactly once.
    """

    def __init__(self, path: str | Path, specs: list[TensorSpec], metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self.specs = specs
        header: dict[str, object] = {"__metadata__": {"format": "pt", **(metadata or {})}}
        offset = 0
        self._offsets: dict[str, int] = {}
        for spec in specs:
            header[spec.name] = {
                "dtype": spec.dtype,
                "shape": list(spec.shape),
                "data_offsets": [offset, offset + spec.nbytes],
            }
            self._offsets[spec.name] = offset
            offset += spec.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # keep the data 8-byte aligned, as the reference writer does
        self._fh = open(self.path, "wb")  # noqa: SIM115 - closed in close()
        self._fh.write(struct.pack("<Q", len(raw)) + raw)
        self._data_start = self._fh.tell()
        self._fh.truncate(self._data_start + offset)  # the final size; tensors fill it in
        self._by_name = {spec.name: spec for spec in specs}
        self._written: set[str] = set()

    def _expect(self, name: str) -> TensorSpec:
        """Position the file at ``name``'s bytes; each tensor is written once."""
        if name not in self._by_name:
            raise RuntimeError(f"writer has no tensor {name!r} in its plan")
        if name in self._written:
            raise RuntimeError(f"writer got {name!r} twice")
        self._written.add(name)
        self._fh.seek(self._data_start + self._offsets[name])
        return self._by_name[name]

    def write_tensor(self, name: str, tensor: torch.Tensor) -> None:
        spec = self._expect(name)
        if tuple(tensor.shape) != spec.shape or safetensors_name(tensor.dtype) != spec.dtype:
            raise RuntimeError(
                f"{name}: got {tuple(tensor.shape)} {tensor.dtype}, planned {spec.shape} {spec.dtype}"
            )
        data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        self._fh.write(memoryview(data))

    def copy_from(self, name: str, write_into: Callable[[BinaryIO], object]) -> None:
        """Let ``write_into`` write the tensor's raw bytes (already in the planned layout) at the file's
        current position, which is the tensor's offset."""
        self.copy_run([name], write_into)

    def follows(self, a: str, b: str) -> bool:
        """Whether tensor ``b`` is laid out right after tensor ``a``."""
        return self._offsets[b] == self._offsets[a] + self._by_name[a].nbytes

    def copy_run(self, names: list[str], write_into: Callable[[BinaryIO], object]) -> None:
        """Like :meth:`copy_from` for several tensors laid out back to back (in this order): one copy of
        their bytes, which ``write_into`` writes in one go."""
        for a, b in zip(names, names[1:], strict=False):
            if not self.follows(a, b):
                raise RuntimeError(f"{a!r} and {b!r} are not adjacent in {self.path}")
        for name in names:
            self._expect(name)
        self._fh.seek(self._data_start + self._offsets[names[0]])
        want = sum(self._by_name[n].nbytes for n in names)
        before = self._fh.tell()
        write_into(self._fh)
        if self._fh.tell() - before != want:
            run = names[0] + ("..." if len(names) > 1 else "")
            raise RuntimeError(f"{run}: copied {self._fh.tell() - before} bytes, planned {want}")

    def abort(self) -> None:
        """Close the file after a failure, unchecked (its directory is about to be removed)."""
        self._fh.close()

    def close(self) -> None:
        missing = len(self.specs) - len(self._written)
        self._fh.close()
        if missing:
            raise RuntimeError(f"{self.path}: {missing} tensors were never written")


def save_state_dict(
    tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None
) -> None:
    """Write an in-memory state dict (tests, small models) with the streaming writer."""
    specs = [TensorSpec(k, safetensors_name(v.dtype), tuple(v.shape)) for k, v in tensors.items()]
    writer = SafetensorsWriter(path, specs, metadata)
    for k, v in tensors.items():
        writer.write_tensor(k, v)
    writer.close()

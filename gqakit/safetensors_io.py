"""Streaming safetensors: read one tensor at a time, write one tensor at a time.

The header states every tensor's byte range up front, so a file is validated without reading its data
(by the ``safetensors`` library), an unchanged tensor is copied byte for byte without being decoded, and an
output shard is written tensor by tensor in any order, so peak memory is one tensor rather than one shard
(``safetensors.torch.save_file`` holds a copy of the whole shard as ``bytes``). Every floating tensor is
checked for NaN/Inf as it passes through, read or copied (:func:`check_finite`).
"""

from __future__ import annotations

import bisect
import json
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from gqakit.dtypes import safetensors_name, torch_dtype
from gqakit.errors import GqakitError

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


def check_finite(name: str, tensor: torch.Tensor, where: str | Path | None = None) -> torch.Tensor:
    """``tensor`` itself when every value is finite; else the one refusal of a tensor that holds NaN/Inf
    (convert, expand, export, eval), naming ``name`` and ``where`` it is."""
    bad = nonfinite_count(tensor)
    if bad:
        place = f" (in {where})" if where else ""
        raise GqakitError(
            f"{name}{place} holds {bad} NaN/Inf values of {tensor.numel()}: the checkpoint is corrupt; "
            "re-download or re-export it."
        )
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
        self.tensors = _read_header(self.path)
        self._fh = open(self.path, "rb")  # noqa: SIM115 - kept open across copies, closed in close()
        # (start, end, name) of every tensor in file order, for copies
        self._order = sorted((info.start, info.end, name) for name, info in self.tensors.items())

    def close(self) -> None:
        self._fh.close()

    def read(self, name: str) -> torch.Tensor:
        """Read one tensor into memory (a fresh, writable CPU tensor, by the safetensors library)."""
        with safe_open(str(self.path), framework="pt") as f:
            return check_finite(name, f.get_tensor(name), self.path)

    def copy_raw(self, name: str, out: BinaryIO) -> None:
        """Copy one tensor's bytes into ``out`` unchanged (a floating one checked for NaN/Inf on the way)."""
        info = self.tensors[name]
        self.copy_bytes(info.start, info.nbytes, out)

    def copy_bytes(self, start: int, length: int, out: BinaryIO) -> None:
        """Copy the byte range ``[start, start + length)`` of this file into ``out`` (several tensors
        stored back to back are copied in one call).

        The bytes pass through memory in chunks, and the floating tensors among them are checked for
        NaN/Inf in the same read that copies them (no second pass over the file); back-to-back tensors of
        one dtype are checked together, chunk by chunk (bf16 on 2 CPU cores: 64 MiB chunks check 2-3x
        faster than one 8 MiB tensor at a time). Integer and bool tensors and any bytes between tensors
        are copied as they are. A refusal names the first tensor that holds NaN/Inf.
        """
        end, pos = start + length, start
        buf = memoryview(bytearray(min(_COPY_CHUNK, length)))  # a multiple of every element size
        self._fh.seek(start)
        for first, last, dtype, names in self._float_spans(start, end):
            self._pipe(first - pos, out, buf)
            if self._pipe(last - first, out, buf, dtype):
                for name in names:  # the failure path: read again, to name the tensor and its count
                    self.read(name)
            pos = last
        self._pipe(end - pos, out, buf)

    def _float_spans(self, start: int, end: int) -> list[list]:
        """The runs of back-to-back non-empty floating tensors of one dtype lying wholly inside ``[start,
        end)``, in file order: [first byte, end, dtype, names]."""
        spans: list[list] = []
        for first, last, name in self._order[bisect.bisect_left(self._order, (start,)) :]:
            if last > end:
                break
            dtype = torch_dtype(self.tensors[name].dtype)
            if first == last or not dtype.is_floating_point:
                continue
            if spans and spans[-1][1] == first and spans[-1][2] == dtype:
                spans[-1][1] = last
                spans[-1][3].append(name)
            else:
                spans.append([first, last, dtype, [name]])
        return spans

    def _pipe(self, n: int, out: BinaryIO, buf: memoryview, dtype: torch.dtype | None = None) -> int:
        """Copy the next ``n`` bytes of this file into ``out`` through ``buf``; how many NaN/Inf values of
        ``dtype`` they hold (None: not looked at)."""
        bad = 0
        while n > 0:
            chunk = buf[: min(len(buf), n)]
            if self._fh.readinto(chunk) != len(chunk):
                raise GqakitError(f"{self.path}: unexpected end of file while copying.")
            if dtype is not None:
                bad += nonfinite_count(torch.frombuffer(chunk, dtype=torch.uint8).view(dtype))
            out.write(chunk)
            n -= len(chunk)
        return bad


def _read_header(path: Path) -> dict[str, TensorInfo]:
    try:  # the library checks the header: JSON, dtypes, every range matching its shape, the file's size
        with safe_open(str(path), framework="pt"):
            pass
    except Exception as e:  # SafetensorError, or an OSError for a file too short to hold a header
        reason = " ".join(str(e).split()) or type(e).__name__
        raise GqakitError(
            f"{path} is not a valid safetensors file (truncated or corrupt: {reason}). Re-download it."
        ) from None
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
    header.pop("__metadata__", None)
    return {
        name: TensorInfo(
            e["dtype"], tuple(e["shape"]), 8 + n + e["data_offsets"][0], 8 + n + e["data_offsets"][1]
        )
        for name, e in header.items()
    }


@dataclass(frozen=True)
class TensorSpec:
    """What the writer needs to lay out one output tensor before any data exists."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return torch_dtype(self.dtype).itemsize * math.prod(self.shape)


class SafetensorsWriter:
    """Write a safetensors file tensor by tensor, in any order.

    The header is written first (all offsets are known from the specs); each call to
    :meth:`write_tensor` or :meth:`copy_run` then writes one tensor's bytes (or a run's) at its planned
    offset, so a conversion that finishes tensors out of file order (layer by layer) still streams.
    :meth:`close` checks that every tensor was written exactly once.
    """

    def __init__(self, path: str | Path, specs: list[TensorSpec]):
        self.path = Path(path)
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        self._at: dict[str, tuple[int, TensorSpec]] = {}  # name -> (offset in the data, spec)
        offset = 0
        for spec in specs:
            header[spec.name] = {
                "dtype": spec.dtype,
                "shape": list(spec.shape),
                "data_offsets": [offset, offset + spec.nbytes],
            }
            self._at[spec.name] = (offset, spec)
            offset += spec.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # keep the data 8-byte aligned, as the reference writer does
        self._fh = open(self.path, "wb")  # noqa: SIM115 - closed in close()
        self._fh.write(struct.pack("<Q", len(raw)) + raw)
        self._data_start = self._fh.tell()
        self._fh.truncate(self._data_start + offset)  # the final size; tensors fill it in
        self._written: set[str] = set()

    def _expect(self, name: str) -> TensorSpec:
        """Position the file at ``name``'s bytes; each tensor is written once."""
        if name in self._written:
            raise RuntimeError(f"writer got {name!r} twice")
        self._written.add(name)
        offset, spec = self._at[name]
        self._fh.seek(self._data_start + offset)
        return spec

    def write_tensor(self, name: str, tensor: torch.Tensor) -> None:
        spec = self._expect(name)
        if tuple(tensor.shape) != spec.shape or safetensors_name(tensor.dtype) != spec.dtype:
            raise RuntimeError(
                f"{name}: got {tuple(tensor.shape)} {tensor.dtype}, planned {spec.shape} {spec.dtype}"
            )
        data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        self._fh.write(memoryview(data))

    def follows(self, a: str, b: str) -> bool:
        """Whether tensor ``b`` is laid out right after tensor ``a``."""
        return self._at[b][0] == self._at[a][0] + self._at[a][1].nbytes

    def copy_run(self, names: list[str], write_into: Callable[[BinaryIO], object]) -> None:
        """Let ``write_into`` write the raw bytes (already in the planned layout) of tensors laid out back to
        back (in this order), at the file's current position, which is the first one's offset."""
        for name in names:
            self._expect(name)
        self._fh.seek(self._data_start + self._at[names[0]][0])
        want = sum(self._at[n][1].nbytes for n in names)
        before = self._fh.tell()
        write_into(self._fh)
        if self._fh.tell() - before != want:
            run = names[0] + ("..." if len(names) > 1 else "")
            raise RuntimeError(f"{run}: copied {self._fh.tell() - before} bytes, planned {want}")

    def abort(self) -> None:
        """Close the file after a failure, unchecked (its directory is about to be removed)."""
        self._fh.close()

    def close(self) -> None:
        missing = len(self._at) - len(self._written)
        self._fh.close()
        if missing:
            raise RuntimeError(f"{self.path}: {missing} tensors were never written")


def save_state_dict(tensors: dict[str, torch.Tensor], path: str | Path) -> None:
    """Write an in-memory state dict (tests, small models), NaN/Inf and all."""
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})

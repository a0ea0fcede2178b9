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
        self.tensors = _read_header(self.path)
        self._fh: BinaryIO | None = None
        # (start, end, name) of every tensor in file order, for copies
        self._order = sorted((info.start, info.end, name) for name, info in self.tensors.items())

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

        The bytes pass through memory in chunks, and the floating tensors among them are checked for
        NaN/Inf in the same read that copies them (no second pass over the file); back-to-back tensors of
        one dtype are checked together, chunk by chunk (bf16 on 2 CPU cores: 64 MiB chunks check 2-3x
        faster than one 8 MiB tensor at a time). Integer and bool tensors and any bytes between tensors
        are copied as they are. A refusal names the first tensor that holds NaN/Inf.
        """
        end, pos = start + length, start
        buf = memoryview(bytearray(min(_COPY_CHUNK, length)))  # a multiple of every element size
        self._handle().seek(start)
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
            if self._handle().readinto(chunk) != len(chunk):
                raise GqakitError(f"{self.path}: unexpected end of file while copying.")
            if dtype is not None:
                bad += nonfinite_count(torch.frombuffer(chunk, dtype=torch.uint8).view(dtype))
            out.write(chunk)
            n -= len(chunk)
        return bad


def _read_header(path: Path) -> dict[str, TensorInfo]:
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
    header.pop("__metadata__", None)
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
    return tensors


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
        if name not in self._at:
            raise RuntimeError(f"writer has no tensor {name!r} in its plan")
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
        for a, b in zip(names, names[1:], strict=False):
            if not self.follows(a, b):
                raise RuntimeError(f"{a!r} and {b!r} are not adjacent in {self.path}")
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
    """Write an in-memory state dict (tests, small models) with the streaming writer."""
    specs = [TensorSpec(k, safetensors_name(v.dtype), tuple(v.shape)) for k, v in tensors.items()]
    writer = SafetensorsWriter(path, specs)
    for k, v in tensors.items():
        writer.write_tensor(k, v)
    writer.close()

"""Execute a conversion plan shard by shard, tensor by tensor.

Output shards mirror the input shards (``pytorch_model*.bin`` become ``model*.safetensors``). Unchanged
tensors are copied as bytes; a changed one is computed and written before the next is touched, so peak
memory is one tensor. Every output file is laid out from the plan first, so tensors can be written in
any order (the layer-wise path writes each layer as soon as it is done).
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import torch

from gqakit.checkpoint import SAFE_INDEX, Checkpoint, TensorReader
from gqakit.console import progress as progress_bar
from gqakit.convert.plan import OutputTensor, execute
from gqakit.safetensors_io import SafetensorsWriter, TensorSpec


def output_shard_name(input_name: str) -> str:
    """``pytorch_model-00001-of-00002.bin`` -> ``model-00001-of-00002.safetensors``; others unchanged."""
    if input_name.endswith(".bin"):
        return input_name.replace("pytorch_model", "model", 1)[: -len(".bin")] + ".safetensors"
    return input_name


class PlanWriter:
    """The output shards of a plan, open for writing in any order.

    Args:
        ckpt: the source checkpoint.
        plan: every output tensor.
        out_dir: where the shards (and the index, for more than one) go.
        reader: an open reader of ``ckpt``.
        desc: the progress bar's label (bytes written).
        progress: show that bar (off where the caller shows progress in its own unit, e.g. layers).
    """

    def __init__(
        self,
        ckpt: Checkpoint,
        plan: list[OutputTensor],
        out_dir: Path,
        reader: TensorReader,
        desc: str,
        progress: bool = True,
    ) -> None:
        self.ckpt, self.reader, self.out_dir = ckpt, reader, out_dir
        by_shard: dict[str, list[OutputTensor]] = {s.file: [] for s in ckpt.shards}
        for out in plan:
            by_shard[reader.shard_of(out.sources[0])].append(out)
        self.total = sum(TensorSpec(o.name, o.dtype, o.shape).nbytes for o in plan)
        by_file = {output_shard_name(f): outs for f, outs in by_shard.items() if outs}
        self.files = list(by_file)
        self._file_of = {o.name: f for f, outs in by_file.items() for o in outs}
        self._writers = {
            f: SafetensorsWriter(out_dir / f, [TensorSpec(o.name, o.dtype, o.shape) for o in outs])
            for f, outs in by_file.items()
        }
        self._bar = progress_bar(desc=desc, total=self.total, enabled=progress, unit="B")

    def write(self, out: OutputTensor, value: torch.Tensor | None = None) -> None:
        """Write ``out``: ``value`` when given, else computed from the source (or copied raw when the plan
        leaves it unchanged)."""
        writer = self._writers[self._file_of[out.name]]
        if value is not None:
            writer.write_tensor(out.name, value)
        elif self._raw(out):
            writer.copy_run([out.name], partial(self.reader.copy_raw, out.sources[0]))
        else:
            writer.write_tensor(out.name, execute(out, self.reader.read))
        self._bar.update(TensorSpec(out.name, out.dtype, out.shape).nbytes)

    def _raw(self, out: OutputTensor) -> bool:
        """Whether ``out`` is its source's bytes: unchanged, from safetensors, in its own dtype."""
        src = out.sources[0]
        return out.fn is None and self.ckpt.format == "safetensors" and self.reader.info(src)[0] == out.dtype

    def _source_range(self, out: OutputTensor) -> tuple[str, int, int]:
        shard = self.reader.shard_of(out.sources[0])
        info = self.reader.safetensors_file(shard).tensors[out.sources[0]]
        return shard, info.start, info.end

    def write_all(self, outs: list[OutputTensor]) -> None:
        """Write ``outs`` in order; a run of unchanged tensors stored back to back in the source and in the
        output is copied as one byte range (one kernel copy instead of one per tensor)."""
        run: list[OutputTensor] = []
        for out in outs:
            if run and self._raw(out) and self._adjacent(run[-1], out):
                run.append(out)
                continue
            self._copy_run(run)
            run = [out] if self._raw(out) else []
            if not run:
                self.write(out)
        self._copy_run(run)

    def _adjacent(self, a: OutputTensor, b: OutputTensor) -> bool:
        if self._file_of[a.name] != self._file_of[b.name]:
            return False
        (sa, _, end), (sb, start, _) = self._source_range(a), self._source_range(b)
        writer = self._writers[self._file_of[a.name]]
        return sa == sb and end == start and writer.follows(a.name, b.name)

    def _copy_run(self, run: list[OutputTensor]) -> None:
        if len(run) <= 1:
            for out in run:
                self.write(out)
            return
        shard, start, _ = self._source_range(run[0])
        end = self._source_range(run[-1])[2]
        copy = partial(self.reader.safetensors_file(shard).copy_bytes, start, end - start)
        self._writers[self._file_of[run[0].name]].copy_run([o.name for o in run], copy)
        self._bar.update(end - start)

    def close(self) -> list[str]:
        """Close every shard (each must be complete), write the index; return the shard names."""
        self._bar.close()
        for writer in self._writers.values():
            writer.close()
        if len(self.files) > 1 or self.ckpt.index_file is not None:
            weight_map = dict(sorted(self._file_of.items()))
            index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
            (self.out_dir / SAFE_INDEX).write_text(json.dumps(index, indent=2) + "\n")
        return self.files

    def abort(self) -> None:
        """Close the files after a failure (the caller's temporary directory is removed with them)."""
        self._bar.close()
        for writer in self._writers.values():
            writer.abort()


def write_plan(
    ckpt: Checkpoint, plan: list[OutputTensor], out_dir: Path, desc: str = "converting", progress: bool = True
) -> list[str]:
    """Write the planned tensors of ``ckpt`` into ``out_dir`` as safetensors shards (+ index), with a
    progress bar in bytes unless ``progress`` is False; return the output shard file names."""
    with ckpt.reader() as reader:
        writer = PlanWriter(ckpt, plan, out_dir, reader, desc, progress=progress)
        try:
            writer.write_all(plan)
        except BaseException:
            writer.abort()
            raise
        return writer.close()

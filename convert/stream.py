"""Execute a conversion plan shard by shard, tensor by tensor.

Output shards mirror the input shards (same names for safetensors; ``pytorch_model*.bin`` become
``model*.safetensors``). A tensor the plan leaves unchanged is copied byte for byte without decoding;
a changed one is read, computed and written before the next is touched, so peak memory is one tensor,
not one shard.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

from tqdm.auto import tqdm

from gqakit.checkpoint import SAFE_INDEX, Checkpoint
from gqakit.convert.plan import OutputTensor, execute
from gqakit.safetensors_io import SafetensorsWriter, TensorSpec


def output_shard_name(input_name: str) -> str:
    """``pytorch_model-00001-of-00002.bin`` -> ``model-00001-of-00002.safetensors``; others unchanged."""
    if input_name.endswith(".bin"):
        return input_name.replace("pytorch_model", "model", 1)[: -len(".bin")] + ".safetensors"
    return input_name


def write_plan(
    ckpt: Checkpoint, plan: list[OutputTensor], out_dir: Path, desc: str = "converting"
) -> list[str]:
    """Write the planned tensors of ``ckpt`` into ``out_dir`` as safetensors shards (+ index).

    Returns:
        The output shard file names.
    """
    with ckpt.reader() as reader:
        by_shard: dict[str, list[OutputTensor]] = {s.file: [] for s in ckpt.shards}
        for out in plan:
            by_shard[reader.shard_of(out.sources[0])].append(out)
        total = sum(TensorSpec(o.name, o.dtype, o.shape).nbytes for o in plan)
        weight_map: dict[str, str] = {}
        files = []
        with tqdm(total=total, unit="B", unit_scale=True, desc=desc, leave=False) as bar:
            for shard_file, outs in by_shard.items():
                if not outs:
                    continue
                name = output_shard_name(shard_file)
                writer = SafetensorsWriter(
                    out_dir / name, [TensorSpec(o.name, o.dtype, o.shape) for o in outs]
                )
                for out in outs:
                    src = out.sources[0]
                    if out.fn is None and ckpt.format == "safetensors" and reader.info(src)[0] == out.dtype:
                        writer.copy_from(out.name, partial(reader.copy_raw, src))
                    else:
                        writer.write_tensor(out.name, execute(out, reader.read))
                    weight_map[out.name] = name
                    bar.update(TensorSpec(out.name, out.dtype, out.shape).nbytes)
                writer.close()
                files.append(name)
    if len(files) > 1 or ckpt.index_file is not None:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out_dir / SAFE_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return files

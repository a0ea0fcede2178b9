"""Our streaming safetensors reader and writer agree with the reference library, byte for byte; the one
dtype table spells each dtype as torch, config.json, safetensors and a recipe do."""

from __future__ import annotations

from contextlib import closing

import pytest
import torch
from safetensors.torch import load_file, save_file

from gqakit.dtypes import config_dtype, dtype_name, safetensors_name, short_name, torch_dtype
from gqakit.errors import GqakitError
from gqakit.safetensors_io import SafetensorsFile, SafetensorsWriter, TensorSpec, save_state_dict

TENSORS = {
    "a": torch.randn(3, 5),
    "b": torch.randn(7).to(torch.bfloat16),
    "c": torch.arange(6, dtype=torch.int64).reshape(2, 3),
    "d": torch.randn(2, 2).to(torch.float16),
    "empty": torch.zeros(0, 4),
}


def test_written_file_loads_with_reference_library(tmp_path):
    save_state_dict(TENSORS, tmp_path / "x.safetensors")
    back = load_file(tmp_path / "x.safetensors")
    assert set(back) == set(TENSORS)
    for k, v in TENSORS.items():
        assert torch.equal(back[k], v) and back[k].dtype == v.dtype


def test_reader_reads_reference_files(tmp_path):
    save_file(TENSORS, tmp_path / "ref.safetensors")
    with closing(SafetensorsFile(tmp_path / "ref.safetensors")) as f:
        for k, v in TENSORS.items():
            assert torch.equal(f.read(k), v)
            assert f.tensors[k].shape == tuple(v.shape)


def test_raw_copy_is_byte_identical(tmp_path):
    save_file(TENSORS, tmp_path / "ref.safetensors")
    src = SafetensorsFile(tmp_path / "ref.safetensors")
    specs = [TensorSpec(k, src.tensors[k].dtype, src.tensors[k].shape) for k in TENSORS]
    w = SafetensorsWriter(tmp_path / "copy.safetensors", specs)
    for k in TENSORS:
        w.copy_run([k], lambda out, k=k: src.copy_raw(k, out))
    w.close()
    copy = SafetensorsFile(tmp_path / "copy.safetensors")
    for k in TENSORS:
        assert torch.equal(copy.read(k).view(-1).view(torch.uint8), src.read(k).view(-1).view(torch.uint8))


def test_writer_refuses_unplanned_tensor(tmp_path):
    w = SafetensorsWriter(tmp_path / "x.safetensors", [TensorSpec("a", "F32", (2,))])
    with pytest.raises(RuntimeError, match="planned"):
        w.write_tensor("a", torch.zeros(3))


@pytest.mark.parametrize("cut", [4, 20, -3])
def test_truncated_files_are_reported(tmp_path, cut):
    save_file(TENSORS, tmp_path / "x.safetensors")
    data = (tmp_path / "x.safetensors").read_bytes()
    (tmp_path / "x.safetensors").write_bytes(data[:cut])
    with pytest.raises(GqakitError, match="not a valid safetensors file"):
        SafetensorsFile(tmp_path / "x.safetensors")


def test_one_table_spells_each_dtype_every_way():
    for spelling in ("bfloat16", "torch.bfloat16", "BF16", "bf16", torch.bfloat16):
        assert torch_dtype(spelling) is torch.bfloat16
        names = (dtype_name(spelling), safetensors_name(spelling), short_name(spelling))
        assert names == ("bfloat16", "BF16", "bf16")
    assert config_dtype({"torch_dtype": "float16"}) is torch.float16 and config_dtype({}) is torch.float32
    assert config_dtype({"dtype": "int8"}) is torch.float32  # not a dtype a model is loaded in
    with pytest.raises(GqakitError, match="dtype 'bf32' is unknown; choose one of float32, bfloat16"):
        torch_dtype("bf32")

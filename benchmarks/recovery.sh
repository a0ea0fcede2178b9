#!/usr/bin/env bash
# The CPU recovery curves of docs/recovery.md, on this machine (2 CPU cores: about 1.5 h for SmolLM2's three
# starts, 45 min for its second seed, 1.5 h for each 32k-start run, 55 min for the 48k start and 30 min
# for its 409,600-token run, 2 h for the `best` start, 40 min for the replicate model's two G). Each
# command is cached and resumable in its --work-dir, so a killed run continues where it stopped when the
# same command is run again.
#
#   bash benchmarks/recovery.sh [WORK_ROOT]      # default WORK_ROOT: ./recovery-work
#
# The figures in docs/recovery.md were measured with gqakit 0.1.0, whose options named the refined start
# `refined` and took its settings as flags; these are the same runs in today's options (the `fast` start
# is 0.1.0's default `refined` one). Results (report.md, recovery.png, results.json) go to
# benchmarks/results/recovery/<name>/.
set -euo pipefail
cd "$(dirname "$0")/.."
WORK="${1:-recovery-work}"
RESULTS=benchmarks/results/recovery
# SmolLM2-135M-Instruct (9 query heads, 3 K/V heads) -> MQA, 204,800 tokens per start; then seed 1.
gqakit recovery smollm2-135m --groups 1 --tokens 204800 --starts mean,fast,calibrated \
    --out "$RESULTS/smollm2-mqa" --work-dir "$WORK/smollm2-mqa" --no-progress
gqakit recovery smollm2-135m --groups 1 --tokens 204800 --starts mean,fast --seed 1 \
    --out "$RESULTS/smollm2-mqa-seed1" --work-dir "$WORK/smollm2-mqa-seed1" --no-progress

# A stronger refined start (32,768 calibration tokens x 800 steps, a 27-minute conversion here), at the
# shared learning rate and alone at 5e-5.
gqakit recovery smollm2-135m --groups 1 --tokens 204800 --starts mean,fast \
    --set model.convert.calib_tokens=32768 --set model.convert.refine_steps=800 \
    --out "$RESULTS/smollm2-mqa-32k" --work-dir "$WORK/smollm2-mqa-32k" --no-progress
gqakit recovery smollm2-135m --groups 1 --tokens 204800 --starts fast --lr 5e-5 \
    --set model.convert.calib_tokens=32768 --set model.convert.refine_steps=800 \
    --out "$RESULTS/smollm2-mqa-32k-lr5e-5" --work-dir "$WORK/smollm2-mqa-32k-lr5e-5" --no-progress

# Nearly all of wiki-en validation as calibration text (49,152 tokens) x 1,600 steps, a 40-minute
# conversion here, at 5e-5; then for twice the tokens.
gqakit recovery smollm2-135m --groups 1 --tokens 204800 --starts fast --lr 5e-5 \
    --set model.convert.calib_tokens=49152 --set model.convert.refine_steps=1600 \
    --out "$RESULTS/smollm2-mqa-48k-lr5e-5" --work-dir "$WORK/smollm2-mqa-48k-lr5e-5" --no-progress
gqakit recovery smollm2-135m --groups 1 --tokens 409600 --starts fast --lr 5e-5 \
    --set model.convert.calib_tokens=49152 --set model.convert.refine_steps=1600 \
    --out "$RESULTS/smollm2-mqa-48k-lr5e-5-410k" --work-dir "$WORK/smollm2-mqa-48k-lr5e-5-410k" --no-progress

# The `best` preset (the same budget, each whole decoder layer fitted), at 5e-5.
gqakit recovery smollm2-135m --groups 1 --tokens 204800 --starts best --lr 5e-5 \
    --out "$RESULTS/smollm2-mqa-48k-lcpt-lr5e-5" --work-dir "$WORK/smollm2-mqa-48k-lcpt-lr5e-5" --no-progress

# The replicate model (Llama, 8 heads, pretrained on 1,024,000 tokens by `gqakit replicate --pretrain-only`)
# -> MQA (8:1) and GQA-2, to 1,024,000 tokens: ten times its alpha 0.1 budget. Its context is 128 tokens;
# batch, learning rate and refinement steps are replicate's.
gqakit replicate --pretrain-only --work-dir "$WORK/replicate" --no-progress
gqakit recovery replicate-mha --groups 1 --tokens 1024000 --lr 5e-4 --starts mean,calibrated,fast \
    --set data.seq_len=128 --set train.batch_size=16 --set model.convert.refine_steps=100 \
    --out "$RESULTS/replicate-g1" --work-dir "$WORK/replicate-g1" --no-progress
gqakit recovery replicate-mha --groups 2 --tokens 1024000 --lr 5e-4 --starts mean,fast \
    --set data.seq_len=128 --set train.batch_size=16 --set model.convert.refine_steps=100 \
    --out "$RESULTS/replicate-g2" --work-dir "$WORK/replicate-g2" --no-progress
gqakit recovery replicate-mha --groups 1 --tokens 1024000 --lr 5e-4 --starts mean,calibrated,fast --seed 1 \
    --set data.seq_len=128 --set train.batch_size=16 --set model.convert.refine_steps=100 \
    --out "$RESULTS/replicate-g1-seed1" --work-dir "$WORK/replicate-g1-s1" --no-progress

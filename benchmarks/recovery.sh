#!/usr/bin/env bash
# The recovery curves of docs/recovery.md, on this machine (2 CPU cores: about 1.5 h for SmolLM2's three
# starts, 45 min for its second seed, 1.5 h for each 32k-start run, 55 min for the 48k start and 30 min
# for its 409,600-token run, 40 min for the replicate model's two G): each command is cached and
# resumable in its --work-dir,
# so a killed run continues where it stopped when the same command is run again.
#
#   bash benchmarks/recovery.sh [WORK_ROOT]      # default WORK_ROOT: ./recovery-work
#
# Results (report.md, recovery.png, results.json) go to benchmarks/results/recovery/<name>/.
set -euo pipefail
cd "$(dirname "$0")/.."
WORK="${1:-recovery-work}"
RESULTS=benchmarks/results/recovery

# SmolLM2-135M-Instruct (9 query heads, 3 K/V heads) -> MQA, 204,800 tokens per start.
gqakit recovery smollm2-135m --groups 1 --tokens 204800 --starts mean,refined,calibrated \
  --out "$RESULTS/smollm2-mqa" --work-dir "$WORK/smollm2-mqa" --no-progress

# Seed 1 (data order and refinement batches) for the spread of mean pooling and the refined start.
gqakit recovery smollm2-135m --groups 1 --tokens 204800 --starts mean,refined --seed 1 \
  --out "$RESULTS/smollm2-mqa-seed1" --work-dir "$WORK/smollm2-mqa-seed1" --no-progress

# A stronger refined start (32,768 calibration tokens x 800 steps, a 27-minute conversion here), at the
# shared learning rate and at its own 5e-5. Each work dir converts it once.
gqakit recovery smollm2-135m --groups 1 --tokens 204800 --starts mean,refined --calib-tokens 32768 \
  --refine-steps 800 --out "$RESULTS/smollm2-mqa-32k" --work-dir "$WORK/smollm2-mqa-32k" --no-progress
gqakit recovery smollm2-135m --groups 1 --tokens 204800 --starts mean,refined --calib-tokens 32768 \
  --refine-steps 800 --start-lr refined=5e-5 --out "$RESULTS/smollm2-mqa-32k-lr5e-5" \
  --work-dir "$WORK/smollm2-mqa-32k-lr5e-5" --no-progress

# Nearly all of wiki-en validation as calibration text (49,152 tokens) x 1,600 steps, a 40-minute
# conversion here, uptrained at 5e-5; then the same start alone for twice the tokens (its work dir
# converts it again unless the first one's models/start-refined is copied in).
gqakit recovery smollm2-135m --groups 1 --tokens 204800 --starts mean,refined --calib-tokens 49152 \
  --refine-steps 1600 --start-lr refined=5e-5 --out "$RESULTS/smollm2-mqa-48k-lr5e-5" \
  --work-dir "$WORK/smollm2-mqa-48k-lr5e-5" --no-progress
gqakit recovery smollm2-135m --groups 1 --tokens 409600 --starts refined --calib-tokens 49152 \
  --refine-steps 1600 --start-lr refined=5e-5 --out "$RESULTS/smollm2-mqa-48k-lr5e-5-410k" \
  --work-dir "$WORK/smollm2-mqa-48k-lr5e-5-410k" --no-progress

# The replicate model (Llama, 8 heads, pretrained on 1,024,000 tokens by `gqakit replicate --pretrain-only`)
# -> MQA (8:1) and GQA-2, to 1,024,000 tokens: ten times its alpha 0.1 budget. Its context is 128 tokens;
# batch and learning rate are replicate's.
gqakit replicate --pretrain-only --work-dir "$WORK/replicate" --no-progress
gqakit recovery replicate-mha --groups 1 --tokens 1024000 --seq-len 128 --batch-size 16 --lr 5e-4 \
  --refine-steps 100 --out "$RESULTS/replicate-g1" --work-dir "$WORK/replicate-g1" --no-progress
gqakit recovery replicate-mha --groups 2 --tokens 1024000 --seq-len 128 --batch-size 16 --lr 5e-4 \
  --refine-steps 100 --starts mean,refined --out "$RESULTS/replicate-g2" --work-dir "$WORK/replicate-g2" \
  --no-progress
gqakit recovery replicate-mha --groups 1 --tokens 1024000 --seq-len 128 --batch-size 16 --lr 5e-4 \
  --refine-steps 100 --seed 1 --out "$RESULTS/replicate-g1-seed1" --work-dir "$WORK/replicate-g1-s1" --no-progress

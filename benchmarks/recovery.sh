#!/usr/bin/env bash
# The recovery curves of docs/recovery.md, on this machine (2 CPU cores: about 1.5 h for SmolLM2's three
# starts, 40 min for the replicate model's two G): each command is cached and resumable in its --work-dir,
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

# The replicate model (Llama, 8 heads, pretrained on 1,024,000 tokens by `gqakit replicate --pretrain-only`)
# -> MQA (8:1) and GQA-2, to 1,024,000 tokens: ten times its alpha 0.1 budget. Its context is 128 tokens;
# batch and learning rate are replicate's.
gqakit replicate --pretrain-only --work-dir "$WORK/replicate" --no-progress
for G in 1 2; do
  gqakit recovery replicate-mha --groups "$G" --tokens 1024000 --seq-len 128 --batch-size 16 --lr 5e-4 \
    --refine-steps 100 --out "$RESULTS/replicate-g$G" --work-dir "$WORK/replicate-g$G" --no-progress
done

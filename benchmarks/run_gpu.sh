#!/usr/bin/env bash
# The GPU figures of docs/gpu.md, on one CUDA GPU. Name the steps to run (each takes 1 to 5 minutes on
# an H100; all of them by default):
#
#   bash benchmarks/run_gpu.sh OUT_DIR                      # tests perplexity decode-eager uptrain
#   bash benchmarks/run_gpu.sh OUT_DIR tests perplexity     # some of them
#
# Every step writes OUT_DIR/<step>.log; a failed step is reported and the next one still runs.
set -u
out=${1:?usage: run_gpu.sh OUT_DIR [STEP ...]}
shift
steps=${*:-tests perplexity decode-eager uptrain}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to OUT_DIR/NAME.log
    local name=$1 limit=$2
    shift 2
    echo "=== $name: $*"
    local t0=$SECONDS
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "=== $name: exit $rc after $((SECONDS - t0)) s"
    grep -v -e '^Running loglikelihood' -e 'it/s]' "$out/$name.log" | tail -n 30
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
for s in $steps; do
    case $s in
    tests) step tests 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests ;;
    perplexity) step perplexity 150 python3 benchmarks/bench_perplexity.py --device cuda --dtype bfloat16 \
        --shape smollm2-135m --tokens 400000 --seq-len 2048 --batch-size 16 --rounds 3 ;;
    decode-eager) step decode-eager 200 python3 benchmarks/bench_decode.py --device cuda --dtype bfloat16 \
        --batch-sizes 1,8,32 --contexts 512,2048,8192 --new-tokens 64 --rounds 2 --json "$out/decode-eager.json" ;;
    uptrain) step uptrain 240 python3 benchmarks/bench_uptrain.py --shape tinyllama-1.1b --seq-len 2048 \
        --batch-size 4 --steps 30 --warmup 5 --repeats 2 --threads 0 ;;
    *) echo "unknown step $s (tests perplexity decode-eager uptrain)"; exit 2 ;;
    esac
done

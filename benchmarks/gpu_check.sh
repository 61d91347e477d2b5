#!/usr/bin/env bash
# The engine's CUDA checks and GPU benchmarks, for a machine with an NVIDIA GPU
# and a python3 that holds a CUDA build of torch (plus numpy, pyyaml, rich,
# matplotlib, safetensors, tokenizers, transformers, pytest, hypothesis).
# No install: the project runs from src/. Writes its logs and CSV/JSON to $1
# (default results/gpu). Usage: bash benchmarks/gpu_check.sh [OUT] [quick]
set -u
OUT=${1:-results/gpu}
QUICK=${2:-}
RUNS=3; [ -n "$QUICK" ] && RUNS=1
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PY:-python3}
FS=(-c 'import sys; from fleetserve.cli.main import main; sys.exit(main(sys.argv[1:]))')
rc=0
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name())'
} 2>&1 | tee "$OUT/machine.txt"
stamp "== CUDA tests"
# every test that needs CUDA: the gpu marker, and those that skip themselves without it
timeout 300 "$PY" -m pytest -p no:cacheprovider -o addopts="--strict-markers" -q -rs \
  tests/test_engine.py tests/test_engine_layers.py tests/test_engine_migration.py \
  tests/test_engine_profiler.py tests/test_engine_flex.py tests/test_decode_graphs.py \
  tests/test_engine_bf16.py \
  -k "cuda or gpu or across_devices or bf16" \
  2>&1 | tee "$OUT/cuda_tests.log"
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
stamp "== engine vs HF generate on CUDA (decode steps as CUDA graphs or eager)"
for dt in float32 bfloat16; do
  for run in "gather capture" "gather off" "flex off"; do
    set -- $run
    att=$1 graphs=$2
    # TORCH_LOGS=recompiles: how often the compiled kernel is rebuilt as shapes change
    TORCH_LOGS=recompiles timeout 240 "$PY" benchmarks/engine_decode.py --device cuda \
      --dtype $dt --attention $att --decode-graphs $graphs --models tiny-llama-b --runs "$RUNS" \
      --out "$OUT/decode_${dt}_${att}_$graphs.json" > "$OUT/decode_${dt}_${att}_$graphs.log" 2>&1 || rc=1
    stamp "$dt $att graphs=$graphs"
    grep -E "^tiny|^engine vs" "$OUT/decode_${dt}_${att}_$graphs.log"
    echo "recompiles: $(grep -c 'Recompiling' "$OUT/decode_${dt}_${att}_$graphs.log"), failed captures: $(grep -c 'capture failed' "$OUT/decode_${dt}_${att}_$graphs.log")"
  done
done
stamp "== the first prefill of a new prompt length (cuDNN attention's per-length plans)"
timeout 120 "$PY" benchmarks/cuda_new_lengths.py --dtype bfloat16 2>&1 | tee "$OUT/new_lengths.log" | grep -v Warn || rc=1
stamp "== FlexAttention over the arena vs gather (one decode step)"
timeout 240 "$PY" benchmarks/flex_probe.py 2>&1 | tee "$OUT/flex_probe.log" | grep -v "^  " || rc=1
if [ -z "$QUICK" ]; then
  stamp "== profile-engine on CUDA (small-llama, bfloat16)"
  timeout 120 "$PY" "${FS[@]}" profile-engine --model small-llama --device cuda --dtype bfloat16 \
    --no-progress --out "$OUT/profile_small_llama_bf16.csv" 2>&1 | tail -3 || rc=1
fi
stamp "done (rc $rc)"
exit $rc

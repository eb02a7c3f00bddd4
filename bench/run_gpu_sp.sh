#!/usr/bin/env bash
# Issue 18 on two GPUs (nvidia-h200-x2): the SP 2 vs SP 1 equality test on CUDA, the length sweeps of
# bench/bench_sp_length.py (1.5B Qwen2 shape; ZeRO-3 without and with Ulysses SP 2, FSDP2 without and with
# context parallelism 2; checkpointing off), and train_ppo.py end to end under deepspeed_zero3_sp2.yaml and
# fsdp2_cp2.yaml with vLLM colocated (0.5B shape, bench_sizes.py). CONFIGS / TRAIN_CONFIGS narrow them.
# Needs, copied to the machine one run call per part: the ../shared/gpu bundle (groups vllm, model) in
# /tmp/gpu and the deepspeed group (bundle.sh .gpu-ds deepspeed) in /tmp/ds.
# Usage: bash bench/run_gpu_sp.sh [tests] [length] [train]     (default: all three)
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/rft_out}; mkdir -p "$OUT"
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0
. bench/need_vllm.sh
[ -d /tmp/site/deepspeed ] || bash /tmp/ds/install.sh /tmp/ds /tmp/site 2>&1 | tail -1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for mode in ${@:-tests length train}; do
  case $mode in
    tests) timeout 240 python -m pytest -q -p no:cacheprovider tests/test_sequence_parallel.py -k cuda 2>&1 \
             | tail -15 | tee "$OUT/tests.txt";;
    length)
      for config in ${CONFIGS:-deepspeed_zero3 deepspeed_zero3_sp2 fsdp2 fsdp2_cp2}; do
        timeout ${LIMIT:-200} accelerate launch --config_file accelerate_configs/$config.yaml \
          bench/bench_sp_length.py --lengths ${LENGTHS:-8192 16384 32768 49152 65536 98304 131072} \
          --out "$OUT/length_$config.json" 2>&1 | grep -v Warning | tail -12 | tee "$OUT/length_$config.txt"
      done;;
    train)
      for config in ${TRAIN_CONFIGS:-deepspeed_zero3_sp2 fsdp2_cp2}; do
        python bench/bench_sizes.py 0.5b --steps 4 --skip 2 --timeout 240 --gpus 2 --tag=-${config#*_} \
          --config accelerate_configs/$config.yaml -- --engine_enforce_eager --generate_max_len 1024
      done;;
  esac
done

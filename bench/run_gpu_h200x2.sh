#!/usr/bin/env bash
# Issue 15 on two H200s (nvidia-h200-x2): the 7B shape, full fine-tuning, 5 steps under DeepSpeed ZeRO-3 and
# FSDP2 with vLLM colocated at TP 1 and 2 (32 x 8 x 128, bench/bench_sizes.py's workload and JSON).
# Needs, copied to the machine one run call per part: the ../shared/gpu bundle (groups vllm, model) in /tmp/gpu
# and the deepspeed group (bundle.sh .gpu-ds deepspeed) in /tmp/ds. One device call per mode (each < 600 s).
# Usage: [EXTRA="train_ppo.py flags"] [LAUNCH="accelerate launch flags, e.g. --zero3_init_flag true"]
#        bash bench/run_gpu_h200x2.sh zero3|fsdp2 [TP...]   (TP default: 1 2)
# Also on two H100s (80 GB each, nvidia-h100-x2): the bf16 7B weights take 15 GB of a TP 1 engine, so TP 1
# needs --engine_mem_util ~0.25 there, TP 2 fits 0.15; the runs' JSON has loaded_*_gib (what the trainer
# held after loading: a ZeRO-3 run on two H200s left only 25-36 GiB free) to read before trying ZeRO-3.
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/rft_out}; mkdir -p "$OUT"
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0
. bench/need_vllm.sh
[ -d /tmp/site/deepspeed ] || bash /tmp/ds/install.sh /tmp/ds /tmp/site 2>&1 | tail -1
case "$1" in
  zero3) config=accelerate_configs/deepspeed_zero3.yaml;;
  fsdp2) config=accelerate_configs/fsdp2.yaml;;
  *) echo "usage: $0 zero3|fsdp2 [TP...]"; exit 2;;
esac
backend=$1; shift
# the engine runs eager: a compiled start costs ~90 s per run of the 30 device minutes
for tp in ${@:-1 2}; do
  python bench/bench_sizes.py 7b --steps 5 --skip 2 --timeout 280 --config $config --gpus 2 \
    --launch_flags "$LAUNCH" --tag=-$backend-tp$tp -- --engine_tp_size $tp --engine_enforce_eager $EXTRA
done
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for f in "$OUT"/*.log; do grep -h "\[memory\]\|error:\|Error" "$f" | head -5; done

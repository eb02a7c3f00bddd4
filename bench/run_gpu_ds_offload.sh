#!/usr/bin/env bash
# --optimizer_offload under DeepSpeed ZeRO-3 on one GPU (issue 15), vLLM colocated (eager):
#   test: the GPU tests (the embedded model; moments on the CPU in the checkpoint, resume, logprob diff;
#     and the pinned buffers' reuse); pinned: the latter alone
#   auto | on | off: the 3B shape, 32 x 8 x 128, 5 steps, --optimizer_offload left to auto / true / false
#     (bench_sizes.py's JSON and logs in $OUT)
# Needs, copied to the machine one run call per part: the ../shared/gpu bundle (groups vllm, model) in
# /tmp/gpu and the deepspeed group (bundle.sh .gpu-ds deepspeed) in /tmp/ds.
# Usage: bash bench/run_gpu_ds_offload.sh test auto off   (each mode < 600 s; a device call may run several)
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/rft_out}; mkdir -p "$OUT"
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0
. bench/need_vllm.sh
[ -d /tmp/site/deepspeed ] || bash /tmp/ds/install.sh /tmp/ds /tmp/site 2>&1 | tail -1
config=accelerate_configs/deepspeed_zero3.yaml
for mode in "$@"; do
  case $mode in
    test) python -m pytest -q -x tests/test_distributed.py -k "one_gpu or pinned" -p no:cacheprovider 2>&1 \
            | tail -30 | tee "$OUT/test.log";;
    pinned) python -m pytest -q tests/test_distributed.py -k pinned -p no:cacheprovider 2>&1 | tail -3;;
    auto|on|off)
      flags=(--engine_enforce_eager)
      [ "$mode" = on ] && flags+=(--optimizer_offload true)
      [ "$mode" = off ] && flags+=(--optimizer_offload false)
      python bench/bench_sizes.py 3b --steps 5 --skip 2 --timeout "${TIMEOUT:-330}" \
        --config $config --gpus 1 --tag="-zero3-offload-$mode" -- "${flags[@]}" $EXTRA
      grep -h "\[memory\]\|error:\|Error" "$OUT/3b-128-zero3-offload-$mode.log" | head -8;;
    *) echo "usage: $0 test|pinned|auto|on|off ..."; exit 2;;
  esac
done

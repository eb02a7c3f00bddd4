#!/usr/bin/env bash
# Issue 15 on one H100: the GPU tests, then bench/bench_sizes.py at real sizes (one device call per mode).
# Needs the ../shared/gpu bundle (groups vllm, model) copied to /tmp/gpu. Results: $OUT/sizes.jsonl and logs.
# Usage: bash bench/run_gpu_sizes.sh tests|small|large|lora|long|long3b|lora_long|speed|profile|compile135|
#        compile_mid|fused
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/rft_out}; mkdir -p "$OUT"
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0
. bench/need_vllm.sh
B="python bench/bench_sizes.py"
case "$1" in
  tests)  # the vLLM engine's GPU tests, the 0.4B wake crash among them
    timeout 590 python -m pytest -q tests/test_vllm_engine.py tests/test_engine_vl.py -p no:cacheprovider \
      > "$OUT/gpu_tests.log" 2>&1
    echo "gpu tests rc=$?"; tail -5 "$OUT/gpu_tests.log";;
  small)  # SmolLM2-135M and the 0.5B shape at 32 x 8 x 128, default flags
    $B 135m 0.5b --steps 12 --timeout 280;;
  large)  # 1.5B and 3B full fine-tuning
    $B 1.5b 3b --steps 10 --timeout 290;;
  lora)  # 7B with LoRA rank 64
    $B 7b --steps 10 --timeout 580 --tag=-lora64 -- --lora_rank 64;;
  long)  # 1.5B and 3B with --generate_max_len 1024
    $B 1.5b 3b --steps 10 --generate_max_len 1024 --timeout 290;;
  long3b)  # 3B alone with --generate_max_len 1024 (one call's time)
    $B 3b --steps 10 --generate_max_len 1024 --timeout 570;;
  lora_long)
    $B 7b --steps 10 --generate_max_len 1024 --timeout 580 --tag=-lora64 -- --lora_rank 64;;
  speed)  # where the small models' step goes: generate variants, then the update with bigger / packed micro-batches
    python bench/bench_generate.py 135m > "$OUT/generate.jsonl" 2> "$OUT/generate_135m.log"
    python bench/bench_generate.py 0.5b >> "$OUT/generate.jsonl" 2> "$OUT/generate_0.5b.log"
    cat "$OUT/generate.jsonl"
    $B 135m --steps 10 --timeout 200 --tag=-32k -- --max_tokens_per_micro_batch 32768
    $B 135m --steps 10 --timeout 200 --tag=-packed -- --packing_samples;;
  profile)  # generate variants of the 0.5B shape and SmolLM2-135M, each profiled: GPU-bound or host-bound?
    for size in 0.5b 135m; do
      python bench/bench_generate.py $size --profile "$OUT/profile-$size" >> "$OUT/generate.jsonl" \
        2> "$OUT/generate_$size.log"
    done
    grep '^{' "$OUT/generate.jsonl";;
  compile135)  # the per-layer compile now on by default: SmolLM2-135M with it and without it, one session
    $B 135m --steps 12 --timeout 280
    $B 135m --steps 12 --timeout 280 --tag=-eager -- --torch_compile false;;
  compile_mid)  # the 0.5B and 1.5B shapes, default flags (compiled)
    $B 0.5b 1.5b --steps 10 --timeout 280;;
  fused)  # the plain logits path against --fused_linear_logprob (default on), 0.5B shape
    $B 0.5b --steps 8 --timeout 280 --tag=-plain -- --fused_linear_logprob false;;
esac
for f in "$OUT"/*.log; do grep -h "\[memory\]\|error:\|Error" "$f" | head -5; done

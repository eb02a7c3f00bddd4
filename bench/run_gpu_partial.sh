#!/usr/bin/env bash
# Issue 16 on one H100: partial rollout against the synchronous loop on the heavy-tailed counting task
# (bench/bench_partial.py), as many seeds and arms as fit in a device call (~170 s a run). Needs the
# ../shared/gpu bundle (groups vllm, model, data) copied to /tmp/gpu.
# Results: $OUT/partial.jsonl and a log per run.
# Usage: [TIMEOUT=s per run] bash bench/run_gpu_partial.sh "SEEDS" [STEPS [bench_partial.py flags, e.g.
#        --warm_steps 12]]
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/rft_out}; mkdir -p "$OUT"
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0
. bench/need_vllm.sh
# shellcheck disable=SC2086  # SEEDS: one or several, "0 1 2"
OUT=$OUT python bench/bench_partial.py --seeds ${1:-0} --steps "${2:-20}" --timeout "${TIMEOUT:-285}" "${@:3}"

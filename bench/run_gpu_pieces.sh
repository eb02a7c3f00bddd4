#!/usr/bin/env bash
# bench/pieces_check.py on one GPU with vLLM: whole answers against answers generated in pieces, fixed weights.
# MODEL=base (default): the embedded SmolLM2-135M; MODEL=warm: bench_partial.py's 12-step warm-up model (the
# learning runs' start), trained here first. Needs the ../shared/gpu bundle in /tmp/gpu. Results in $OUT.
# Usage: [MODEL=warm] bash bench/run_gpu_pieces.sh [pieces_check.py flags]
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/rft_out}; mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0
. bench/need_vllm.sh
FLAGS=()
if [ "${MODEL:-base}" = warm ]; then
  WARM=$(python bench/bench_partial.py --root /tmp/rp --warm_steps 12 --warm_max_len 512 --max_len 2048 \
    --warm_only 2>"$OUT/warm.log" | tail -1)
  FLAGS=(--model "$WARM")
fi
OUT=$OUT python bench/pieces_check.py "${FLAGS[@]}" "$@" 2>&1 | grep -v "it/s\]" | tail -20

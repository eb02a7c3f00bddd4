#!/usr/bin/env bash
# bench/partial_pairs.py on a machine of several GPUs (vLLM): seed pairs of partial rollout against the
# synchronous loop at once, one run per GPU. Needs the ../shared/gpu bundle in /tmp/gpu. The runs' folders
# (and the warm-up model) stay in /tmp/rft_partial for the next call on the same machine.
# Results: $OUT/partial.jsonl, $OUT/partial_pairs.log and $OUT/pairs.tgz (every run's log and step metrics).
# Usage: [LIMIT=seconds] bash bench/run_gpu_partial_pairs.sh [partial_pairs.py flags]
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/rft_out}; mkdir -p "$OUT"
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0
. bench/need_vllm.sh
RES=/tmp/rft_pairs_out; rm -rf "$RES"; mkdir -p "$RES"; touch "$RES/.start"
# the step metrics of this call's runs not (yet) finished, as NAME.cut.metrics.jsonl (a finished run's own
# file replaces its cut one); every 20 s too, so a job whose machine goes back mid-run has them in RES
snapshot() {
  for f in $(find /tmp/rft_partial/runs -name metrics.jsonl -newer "$RES/.start" 2>/dev/null); do
    n=$(basename "$(dirname "$f")")
    if [ -e "$RES/$n.metrics.jsonl" ]; then rm -f "$RES/$n.cut.metrics.jsonl"
    else cp "$f" "$RES/$n.cut.metrics.jsonl"; fi
  done
}
(while sleep 20; do snapshot; done) & SNAP=$!
# stopped before the device call's own limit, so what ran comes back; rounds that would not fit don't start
LIMIT=${LIMIT:-540}
OUT=$RES timeout "$LIMIT" python bench/partial_pairs.py --time_limit "$LIMIT" "$@" 2>&1 \
  | tee "$OUT/partial_pairs.log"
kill $SNAP 2>/dev/null
cp "$RES/partial.jsonl" "$OUT/" 2>/dev/null
snapshot  # the runs the limit stopped (no summary line)
tar -C "$RES" -czf "$OUT/pairs.tgz" .

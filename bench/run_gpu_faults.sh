#!/usr/bin/env bash
# One H100 (issue 14): the faults that need a real model or the vLLM engine. A learning rate that wrecks
# SmolLM2 (the health guard must stop before a checkpoint of the wreck), SIGTERM with --save_on_sigterm while vLLM
# is colocated, a reward that always fails, and the default job with checkpoints (the guard must stay quiet).
# Needs the ../shared/gpu bundle (groups vllm, model) in /tmp/gpu. Usage: bash bench/run_gpu_faults.sh [wreck rwfail
# term text]; logs under $OUT.
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/rft_out}; mkdir -p "$OUT"
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0
. bench/need_vllm.sh
EAGER="--engine_enforce_eager"
for part in ${@:-wreck rwfail term text}; do case $part in
wreck)
python train_ppo.py $EAGER --actor_learning_rate 0.5 --max_steps 4 --save_steps 1 --output_dir /tmp/wreck \
  > "$OUT/wreck.log" 2>&1; echo "wreck rc=$?"; grep -E "^(error|stopped)|^step" "$OUT/wreck.log" | cut -c1-300
ls /tmp/wreck;;
rwfail)
printf 'def raises(p, c, l, **kw):\n    raise RuntimeError("reward server down")\n' > /tmp/rw.py
python train_ppo.py $EAGER --reward_fn /tmp/rw.py:raises --max_steps 3 --output_dir /tmp/rwfail \
  > "$OUT/rwfail.log" 2>&1; echo "reward failure rc=$?"; grep -E "^(error|\[reward\])" "$OUT/rwfail.log" | cut -c1-300;;
term)
python train_ppo.py $EAGER --max_steps 40 --save_on_sigterm --output_dir /tmp/term > "$OUT/term.log" 2>&1 &
pid=$!
while ! grep -q "step 3 |" "$OUT/term.log" 2>/dev/null; do sleep 1; kill -0 $pid 2>/dev/null || break; done
kill -TERM $pid; wait $pid; echo "sigterm rc=$?"; grep -E "^(error|stopped|\[stop\])" "$OUT/term.log"
ls /tmp/term; cat /tmp/term/latest; echo;;
text)
python train_ppo.py --save_steps 5 --output_dir /tmp/text > "$OUT/text.log" 2>&1; echo "text rc=$?"
grep -E "\[done\]|^error" "$OUT/text.log"; ls /tmp/text; cp /tmp/text/metrics.jsonl "$OUT/text.metrics.jsonl";;
esac; done

#!/usr/bin/env bash
# one H100: where the update's time goes (issue 7), and --optimizer_offload's memory effect (issue 6)
# Run on the GPU machine after the bundle of ../shared/gpu is copied to /tmp/gpu (see that README); $OUT collects results.
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0
cd "$(dirname "$0")/.."
bash /tmp/gpu/install.sh /tmp/gpu /tmp/site 2>&1 | tail -1
nvidia-smi -L
timeout 100 python bench/profile_update.py --steps 4 --top 12 > $OUT/prof.json 2> $OUT/prof.err; echo "prof rc=$?"; tail -c 2500 $OUT/prof.json
timeout 80 python bench/profile_update.py --steps 4 --top 12 --no_item_syncs > $OUT/prof_nosync.json 2>> $OUT/prof.err; echo "nosync rc=$?"; python -c "import json; d=json.load(open('$OUT/prof_nosync.json')); print({k: v for k, v in d.items() if k != 'top_ops'})"
for off in 0 1; do
  timeout 110 python train_ppo.py --engine_type vllm --engine_enforce_eager --max_steps 3 --enable_engine_sleep \
    --output_dir /tmp/off$off $( [ $off = 1 ] && echo --optimizer_offload ) > $OUT/off$off.log 2>&1
  echo "offload=$off rc=$?"; cp /tmp/off$off/metrics.jsonl $OUT/off$off.metrics.jsonl
  python -c "
import json; rs=[json.loads(l) for l in open('/tmp/off$off/metrics.jsonl') if 'perf/step_time_s' in l]
print([{k: round(r[k], 3) for k in ('perf/mem_generate_gb', 'perf/mem_update_gb', 'perf/update_s', 'perf/step_time_s', 'rollout/logprob_diff_mean')} for r in rs])"
done

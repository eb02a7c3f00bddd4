#!/usr/bin/env bash
# One H100, session 4: the GRPO step target (issue 7) and vLLM image rollouts (issue 5); results in bench/results/step_h100.json
# and profile_update_h100_compile_*.json. Needs the ../shared/gpu bundle installed in /tmp/site. Usage: bash bench/run_h100_step_vl.sh
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/rft_out}; mkdir -p $OUT

# ---- session 4, call F: install, VL vLLM tests, VL sync breakdown with the capped KV cache, the default VL run with vLLM
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0
. bench/need_vllm.sh
timeout 150 python -m pytest -q -x -s tests/test_engine_vl.py -p no:cacheprovider > $OUT/vl_tests.log 2>&1; echo "vl tests rc=$?"; grep -E "logprob diff|passed|failed|Error" $OUT/vl_tests.log | tail -5
timeout 100 python bench/vl_sync_breakdown.py 2>&1 | grep -E "^iter|Error" | tail -3
timeout 250 python train_ppo_vl.py --engine_type vllm --output_dir /tmp/vl_vllm > $OUT/vl_vllm.log 2>&1; echo "vl vllm rc=$?"
grep -E "\[done\]|Error" $OUT/vl_vllm.log | tail -3; cp /tmp/vl_vllm/metrics.jsonl $OUT/vl_vllm.metrics.jsonl
python - <<PY
import json, statistics as st
rs = [json.loads(l) for l in open("/tmp/vl_vllm/metrics.jsonl") if "perf/step_time_s" in l][5:]
print({k: round(st.median(r[k] for r in rs), 4) for k in rs[0] if k.startswith("perf/") and "mem" not in k or k.startswith("rollout/logprob")})
PY

# ---- session 4, call E (issue 7): the update with per-layer torch.compile, then the 32x8 GRPO job with it and micro-batch 128
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0
for mb in 64 128; do
  timeout 150 python bench/profile_update.py --steps 4 --top 8 --no_item_syncs --compile --micro_batch $mb > $OUT/profc$mb.json 2>> $OUT/prof.err; echo "profc$mb rc=$?"
  python -c "import json; d=json.load(open('$OUT/profc$mb.json')); print({k: v for k, v in d.items() if k not in ('top_ops_ms',)}); print([(k[:40], v) for k, v in d['top_ops_ms'].items()][:6])"
done
timeout 300 python train_ppo.py --engine_type vllm --rollout_batch_size 32 --n_samples_per_prompt 8 --generate_max_len 128 --micro_train_batch_size 64 --micro_rollout_batch_size 256 --max_steps 20 --output_dir /tmp/s32 > $OUT/s32.log 2>&1  # micro-batch 64, eager
timeout 330 python train_ppo.py --engine_type vllm --rollout_batch_size 32 --n_samples_per_prompt 8 --generate_max_len 128 \
  --micro_train_batch_size 128 --micro_rollout_batch_size 256 --max_steps 25 --torch_compile --output_dir /tmp/s32c > $OUT/s32c.log 2>&1; echo "s32c rc=$?"
cp /tmp/s32c/metrics.jsonl $OUT/s32c.metrics.jsonl; grep -E "\[done\]|Error" $OUT/s32c.log | tail -3
python - <<'PY'
import json, statistics as st
rs = [json.loads(l) for l in open("/tmp/s32c/metrics.jsonl") if "perf/step_time_s" in l]
print([round(r["perf/step_time_s"], 3) for r in rs])
rs = rs[10:]
print({k: round(st.median(r[k] for r in rs), 4) for k in rs[0] if k.startswith("perf/") or k.startswith("rollout/logprob")})
PY

# ---- session 4, call G: the text engine's GPU tests (create_engine changed), and the 32x8 job at micro-batch 128 without compile
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0
timeout 200 python -m pytest -q -x tests/test_vllm_engine.py -p no:cacheprovider > $OUT/text_tests.log 2>&1; echo "text gpu tests rc=$?"; tail -2 $OUT/text_tests.log
timeout 250 python train_ppo.py --engine_type vllm --rollout_batch_size 32 --n_samples_per_prompt 8 --generate_max_len 128 \
  --micro_train_batch_size 128 --micro_rollout_batch_size 256 --max_steps 20 --output_dir /tmp/s32m > $OUT/s32m.log 2>&1; echo "s32m rc=$?"
cp /tmp/s32m/metrics.jsonl $OUT/s32m.metrics.jsonl
python - <<'PY'
import json, statistics as st
rs = [json.loads(l) for l in open("/tmp/s32m/metrics.jsonl") if "perf/step_time_s" in l][5:]
print({k: round(st.median(r[k] for r in rs), 4) for k in rs[0] if k.startswith("perf/") or k.startswith("rollout/logprob")})
PY

# ---- session 4, call H: VL on vLLM with a frozen vision tower (synced once) and with gae (critic), 30 steps each
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0
for extra in "--freeze_prefix model.visual" "--advantage_estimator gae"; do
  d=/tmp/vl_$(echo $extra | tr -dc a-z | head -c 20)
  timeout 200 python train_ppo_vl.py --engine_type vllm --engine_enforce_eager --max_steps 40 $extra --output_dir $d > $d.log 2>&1; echo "$extra rc=$?"
  grep -E "\[done\]|Error" $d.log | tail -2
  python - <<PY
import json, statistics as st
rs = [json.loads(l) for l in open("$d/metrics.jsonl") if "perf/step_time_s" in l][5:]
print({k: round(st.median(r[k] for r in rs), 4) for k in ("perf/step_time_s", "perf/weight_sync_s", "rollout/logprob_diff_mean", "rollout/reward_mean")})
PY
done

# ---- session 4, call V: video inputs: the video processor test, the VL vLLM tests (a video among the prompts), a video task run
timeout 100 python -m pytest -q tests/test_vision.py -p no:cacheprovider 2>&1 | tail -2
timeout 200 python -m pytest -q -x -s tests/test_engine_vl.py -p no:cacheprovider > $OUT/vl_tests.log 2>&1; echo "vl tests rc=$?"; grep -E "logprob diff|passed|failed|Error" $OUT/vl_tests.log | tail -8
python bench/make_video_task.py /tmp/vid
timeout 240 python train_ppo_vl.py --engine_type vllm --engine_enforce_eager --prompt_data /tmp/vid/train.jsonl --eval_data /tmp/vid/eval.jsonl \
  --max_steps 30 --output_dir /tmp/vid_run > $OUT/vid.log 2>&1; echo "video run rc=$?"; grep -E "\[done\]|\[data\]|Error" $OUT/vid.log | tail -4
cp /tmp/vid_run/metrics.jsonl $OUT/vid.metrics.jsonl 2>/dev/null
python - <<'PY'
import json, statistics as st
rs = [json.loads(l) for l in open("/tmp/vid_run/metrics.jsonl") if "perf/step_time_s" in l]
print("reward by 10 steps", [round(st.mean(r["rollout/reward_mean"] for r in rs[i:i + 10]), 3) for i in range(0, len(rs), 10)])
print({k: round(st.median(r[k] for r in rs[5:]), 4) for k in ("perf/step_time_s", "perf/generate_s", "perf/weight_sync_s", "rollout/logprob_diff_mean", "rollout/logprob_diff_max")})
PY

# ---- session 4, call Q: Qwen2.5-VL: the VL vLLM tests on a tiny Qwen2.5-VL, and train_ppo_vl.py --pretrain on a saved one
RFT_TEST_VL_ARCH=qwen2_5_vl timeout 200 python -m pytest -q -x -s tests/test_engine_vl.py -p no:cacheprovider > $OUT/vl25_tests.log 2>&1; echo "vl 2.5 tests rc=$?"; grep -E "logprob diff|passed|failed|Error" $OUT/vl25_tests.log | tail -8
python bench/save_tiny_vl.py /tmp/tiny25 --arch qwen2_5_vl > /dev/null 2>&1
timeout 200 python train_ppo_vl.py --pretrain /tmp/tiny25 --actor_learning_rate 3e-3 --engine_type vllm --engine_enforce_eager --max_steps 60 \
  --output_dir /tmp/r25 > $OUT/r25.log 2>&1; echo "qwen2.5-vl --pretrain run rc=$?"; grep -E "\[done\]|Error" $OUT/r25.log | tail -3
python - <<'PY'
import json, statistics as st
rs = [json.loads(l) for l in open("/tmp/r25/metrics.jsonl") if "perf/step_time_s" in l]
print({k: round(st.median(r[k] for r in rs[5:]), 4) for k in ("perf/step_time_s", "perf/weight_sync_s", "rollout/logprob_diff_mean", "rollout/logprob_diff_max")})
PY

#!/usr/bin/env bash
# The non-finite gradient of session 18's 1.5B synchronous run (bench_partial.py --size 1.5b, seed 0, step 1).
# ARMS (default "asis nocompile"): asis, the run as it was; nocompile, without torch.compile; nocompile8k /
# compile12k, each with the other's micro-batch size; shapes, bench/nan_probe.py's RFT_PROBE=shapes (the
# micro-batch that first gives a non-finite gradient, saved and replayed by bench/nan_replay.py); anomaly,
# autograd's anomaly mode. Needs the ../shared/gpu bundle installed in /tmp/site. Logs in $OUT.
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/rft_out}; mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0
python -c "import sys, json; sys.path.insert(0, 'bench'); import bench_partial as b
open('/tmp/count.jsonl', 'w').writelines(json.dumps(r) + '\n' for r in b.task_rows(4000, 0))"
MODEL=$(python -c "import sys; sys.path.insert(0, 'bench'); import bench_sizes; print(bench_sizes.make_model('1.5b', '/tmp/rp'))" 2>/dev/null | tail -1)
RUN="bench/scripted_lengths.py train_ppo.py --prompt_data /tmp/count.jsonl --reward_fn bench/bench_sizes.py:reward
  --rollout_batch_size 32 --n_samples_per_prompt 8 --generate_max_len 2048 --max_steps ${STEPS:-2} --eval_steps 10
  --seed 0 --no_resume --tis_cap 2 --pretrain $MODEL --actor_learning_rate 1e-12"
# shellcheck disable=SC2086
for arm in ${ARMS:-asis nocompile}; do
  case $arm in
    asis) timeout 200 python $RUN --output_dir /tmp/rp/runs/asis > "$OUT/nan-$arm.log" 2>&1;;
    nocompile) timeout 200 python $RUN --output_dir /tmp/rp/runs/nocompile --torch_compile false \
      > "$OUT/nan-$arm.log" 2>&1;;
    nocompile8k) timeout 200 python $RUN --output_dir /tmp/rp/runs/nc8 --torch_compile false \
      --max_tokens_per_micro_batch 8192 > "$OUT/nan-$arm.log" 2>&1;;
    compile12k) timeout 200 python $RUN --output_dir /tmp/rp/runs/c12 --max_tokens_per_micro_batch 12288 \
      > "$OUT/nan-$arm.log" 2>&1;;
    shapes) RFT_PROBE=shapes timeout 200 python bench/nan_probe.py $RUN --output_dir /tmp/rp/runs/shapes \
      > "$OUT/nan-$arm.log" 2>&1; grep -h "\[probe\]" "$OUT/nan-$arm.log" | cut -c1-400 | head -20
      [ -f "$OUT/nan_batch.pt" ] && timeout 250 python bench/nan_replay.py "$MODEL" "$OUT/nan_batch.pt";;
    anomaly) timeout 250 python bench/nan_probe.py $RUN --output_dir /tmp/rp/runs/anomaly --torch_compile false \
      > "$OUT/nan-$arm.log" 2>&1;;
  esac
  echo "$arm rc=$?"; grep -h "error\|Error\|nan" "$OUT/nan-$arm.log" | grep -v "^INFO\|WARNING" | head -5
done

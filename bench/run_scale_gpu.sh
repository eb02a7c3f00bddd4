#!/usr/bin/env bash
# 2 x H200: the scale-out table. Phase A installs and measures 1 vs 2 GPUs; B and C run the configs.
# Run on the GPU machine after the bundle of ../shared/gpu is copied to /tmp/gpu (see that README); $OUT collects results.
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0
cd "$(dirname "$0")/.."
phase=$1
COMMON="--pretrain /tmp/qwen05 --engine_type vllm --engine_enforce_eager --use_kl_loss --n_samples_per_prompt 8 --generate_max_len 64 --micro_train_batch_size 32 --micro_rollout_batch_size 128"
if [ "$phase" = A ]; then
  bash /tmp/gpu/install.sh /tmp/gpu /tmp/site 2>&1 | tail -1
  mkdir -p /tmp/gpuds && tar -C /tmp/gpuds -xf .gpu/ds/part00/bundle.tar.00 && python3 -m pip install -q --no-index --no-deps --target /tmp/site /tmp/gpuds/*.whl 2>&1 | tail -1
  python -c "import deepspeed, vllm; print('ds', deepspeed.__version__, 'vllm', vllm.__version__)"
  nvidia-smi -L
  python - <<'PY'
import sys; sys.path.insert(0, "bench"); sys.argv = ["x"]
import bench_vllm
model, tok = bench_vllm.build("qwen0.5b")
model.config.architectures = [type(model).__name__]
model.save_pretrained("/tmp/qwen05"); tok.save_pretrained("/tmp/qwen05")
print("saved /tmp/qwen05")
PY
  python bench/bench_scale.py --configs single_gpu --tp 1 --out_dir /tmp/bs --timeout 200 -- $COMMON --max_steps 6 --rollout_batch_size 16 > $OUT/A1.json
  python bench/bench_scale.py --configs multi_gpu --tp 1 --out_dir /tmp/bs --timeout 200 -- $COMMON --max_steps 6 --rollout_batch_size 32 > $OUT/A2.json
  python bench/bench_scale.py --configs multi_gpu --tp 2 --out_dir /tmp/bs --timeout 150 -- $COMMON --max_steps 3 --rollout_batch_size 32 > $OUT/A3.json
  cat $OUT/A1.json $OUT/A2.json $OUT/A3.json
else
  [ "$phase" = B ] && configs="deepspeed_zero1 deepspeed_zero2 deepspeed_zero3" || configs="fsdp2 fsdp2_offload deepspeed_zero3_offload"
  python bench/bench_scale.py --configs $configs --tp ${TPS:-1 2} --out_dir /tmp/bs --timeout 150 -- $COMMON --max_steps 3 --rollout_batch_size 32 > $OUT/$phase.json
  cat $OUT/$phase.json | python -c "import json,sys; [print({k: v for k, v in r.items() if k != 'log_tail'}, *(r.get('log_tail') or [])[-4:], sep='\n  ') for r in json.load(sys.stdin)]"
fi
tar -C /tmp/bs -czf $OUT/logs_$phase.tgz --exclude='*.safetensors' --exclude='checkpoint-*' --exclude='model' . 2>/dev/null

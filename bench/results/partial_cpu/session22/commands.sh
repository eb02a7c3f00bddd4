# session 22: one version of delay through the synchronous loop with sequence-level importance weights, on the
# CPU task of sessions 12 and 21 (the same warm-up model, /tmp/pcpu/runs/warm-6, kept on this machine)
cd /work/main
C="--root /tmp/pcpu --steps 10 --max_len 128 --staleness 1 --warm_steps 6 --skip 2 --timeout 3000"
H="-- --engine_type hf --rollout_batch_size 8 --n_samples_per_prompt 4 --eval_steps 100"
export OUT=/tmp/pcpu/out22
python bench/bench_partial.py $C --seeds 0 --tag lag1seq --engine_lag 1 --modes sync_tis \
    --arm_flags "--tis_level sequence" $H
python bench/bench_partial.py $C --seeds 1 --tag lag1seq --engine_lag 1 --modes sync_tis \
    --arm_flags "--tis_level sequence" $H

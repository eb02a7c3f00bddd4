# session 22: seeds 2 and 3 of the CPU task for the synchronous loop, the lagged loop and the lagged loop with
# sample-level weights (seeds 0-1: sessions 12, 21 and commands.sh here)
cd /work/main
C="--root /tmp/pcpu --steps 10 --max_len 128 --staleness 1 --warm_steps 6 --skip 2 --timeout 3000"
H="-- --engine_type hf --rollout_batch_size 8 --n_samples_per_prompt 4 --eval_steps 100"
export OUT=/tmp/pcpu/out22b
for seed in 2 3; do
    python bench/bench_partial.py $C --seeds $seed --modes sync $H
    python bench/bench_partial.py $C --seeds $seed --tag lag1 --engine_lag 1 --modes sync_tis $H
    python bench/bench_partial.py $C --seeds $seed --tag lag1seq --engine_lag 1 --modes sync_tis \
        --arm_flags "--tis_level sequence" $H
done
